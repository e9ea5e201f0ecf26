"""Per-request sampling of the continuous batcher: each request's parameters and its own
``torch.Generator`` (``Sampling``), and one token per request from its row of a step's
logits (``sample``).  Greedy is argmax, as ``generate()``; a sampled request's tokens depend
on its seed only, not on what else is in the batch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch


@dataclass(eq=False)
class Sampling:
    """How one request picks its tokens (``generator`` is None for greedy)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: Optional[torch.Generator] = None

    @classmethod
    def of(cls, do_sample: bool, temperature, top_k, top_p, seed) -> "Sampling":
        """Checked parameters of ``add_request`` (ValueError for bad ones when sampling; they
        are ignored for greedy), with the request's generator seeded by ``seed`` (None: from
        the system's entropy)."""
        if not do_sample:
            return cls(False, float(temperature), int(top_k), float(top_p))
        if not isinstance(temperature, (int, float, np.number)) or \
                not math.isfinite(float(temperature)) or float(temperature) <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
        if not isinstance(top_p, (int, float, np.number)) or not 0 < float(top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or
                                 not isinstance(seed, (int, np.integer))):
            raise ValueError(f"seed must be None or an int, got {seed!r}")
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
        return cls(True, float(temperature), int(top_k), float(top_p), generator)


def sample(logits: "torch.Tensor", params: Sequence[Sampling]) -> List[int]:
    """One token per row of `logits` [n, vocab], row i by ``params[i]``."""
    if not params:
        return []
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.do_sample:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1 - p.top_p
            drop[-1] = False  # keep at least the most likely token
            row = row.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        probs = row.softmax(dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=p.generator))
    return out
