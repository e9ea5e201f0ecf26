"""The model's linear layers on pagedkv's row-batch kernel during a batcher step.

A decode step multiplies a few rows (one per running request) by every weight matrix of the
model.  torch's float32 matrix product is built for many rows; with a handful it runs far
below the CPU's arithmetic rate (measured in docs/performance.md), and the vocabulary
projection of a step can take longer than all the layers under it.  ``pagedkv.linear``
(include/pagedkv/linear.h) reads each weight once for all rows and folds them with
register-tiled FMAs.

``RowLinears(model)`` is a context: inside it, every plain ``torch.nn.Linear`` of the model
whose weight is a contiguous float32 / float64 CPU tensor computes inputs of at most
``max_rows`` rows (all leading dimensions together) with ``pagedkv.linear``; larger inputs,
other dtypes, and calls with autograd recording go to torch as before.  Leaving the context
restores every module.  The results agree with torch's to the dtype's rounding (another
summation order), not bit for bit.
"""
from __future__ import annotations

from typing import List

import pagedkv

#: inputs of at most this many rows take the kernel; above it torch's blocked matrix product
#: is as fast or faster (docs/performance.md, "Linear layers of a batcher step")
MAX_ROWS = 64


class RowLinears:
    """Route the model's small-batch linear layers to ``pagedkv.linear`` while entered."""

    def __init__(self, model, max_rows: int = MAX_ROWS):
        import torch

        self._torch = torch
        self.max_rows = int(max_rows)
        self.modules: List[torch.nn.Linear] = [
            m for m in model.modules()
            if type(m) is torch.nn.Linear and "forward" not in vars(m)
            and m.weight.device.type == "cpu" and m.weight.is_contiguous()
            and m.weight.dtype in (torch.float32, torch.float64)
            and (m.bias is None or m.bias.dtype == m.weight.dtype)]

    def __enter__(self) -> "RowLinears":
        for m in self.modules:
            m.forward = self._forward_of(m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.modules:
            vars(m).pop("forward", None)

    def _forward_of(self, module):
        torch = self._torch
        linear = torch.nn.functional.linear
        max_rows = self.max_rows

        def forward(x):
            w, b = module.weight, module.bias
            k = x.shape[-1] if x.dim() else 0
            rows = x.numel() // k if k else 0
            if (not 0 < rows <= max_rows or x.dtype != w.dtype or x.device.type != "cpu"
                    or torch.is_grad_enabled() or w.shape[1] != k):
                return linear(x, w, b)
            out = torch.empty(x.shape[:-1] + (w.shape[0],), dtype=w.dtype)
            pagedkv.linear(x.reshape(rows, k).contiguous().numpy(), w.detach().numpy(),
                         None if b is None else b.detach().numpy(),
                         out=out.view(rows, w.shape[0]).numpy())
            return out

        return forward
