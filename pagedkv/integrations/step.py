"""One step of the continuous batcher as the ``"pagedkv"`` attention function gets it: the
plan of the packed row (``StepPlan``, passed as the keyword argument ``STEP_KWARG``) and the
kernels' options of a layer (``kernel_options``, which ``paged_cache``'s layers use too)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from pagedkv.integrations.pools import Group

STEP_KWARG = "pagedkv_step"


def kernel_options(layer_idx: int, window: Optional[int], kwargs) -> Dict[str, object]:
    """The kernels' ``window`` / ``softcap`` / ``sinks`` from the keyword arguments a model's
    attention module passes (``sliding_window``, ``softcap``, ``s_aux``), for a layer whose
    group was built for ``window`` (None: full attention).  Raises NotImplementedError for
    another window or an option pagedkv lacks, and for dropout."""
    got = kwargs.get("sliding_window")
    if got is not None and got != window:
        raise NotImplementedError(
            f"layer {layer_idx} attends with sliding_window={got} but its pagedkv group was "
            f"built for {window}; pass the model whose config made the cache")
    if got is None and window is not None:
        raise NotImplementedError(
            f"layer {layer_idx} attends without a sliding window but the config names it a "
            "sliding-window layer")
    for name in ("attention_chunk_size", "alibi_slopes"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the pagedkv attention does not support {name}")
    if kwargs.get("dropout"):
        raise NotImplementedError("the pagedkv attention is for inference: dropout must be 0 "
                                  "(call model.eval())")
    s_aux = kwargs.get("s_aux")
    sinks = None if s_aux is None else s_aux.detach().to(torch.float64).reshape(-1).numpy()
    return dict(window=window, softcap=kwargs.get("softcap"), sinks=sinks)


# ---------------------------------------------------------------------------
# what one step hands to the attention function


def numpy_view(t) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy; strides kept); 16-bit floats as their uint16
    bits."""
    t = t.detach() if t.requires_grad else t
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@dataclass(eq=False)
class StepPlan:
    """One step's packed row, as the attention function needs it.

    Rows ``[0, num_decode)`` are one token of each decoding request; then ``chunks`` lists
    ``(first row, n)`` of each prefill chunk.  Per layer group g, ``decode_sids[g]`` and
    ``chunk_sids[g]`` are the requests' sequences in that group's cache.  ``layer_of`` maps a
    model layer to (group index, layer index in the group's cache).  ``decode_ids`` are the
    decode tokens' ids (for prefix caching, else None).
    """

    groups: List[Group]
    layer_of: List[Tuple[int, int]]
    decode_sids: List[np.ndarray]
    decode_ids: Optional[List[int]]
    chunks: List[Tuple[int, int]]
    chunk_sids: List[List[int]]
    num_tokens: int
    #: the model layers whose attention ran this step (the batcher checks that all did)
    attended: Set[int] = field(default_factory=set)

    def attend(self, module, query, key, value, scaling, kwargs) -> "torch.Tensor":
        """Write this layer's new K/V into the pages of its group and attend; query
        [1, Hq, T, D] -> [1, T, Hq, D]."""
        g, layer = self.layer_of[module.layer_idx]
        self.attended.add(module.layer_idx)
        group = self.groups[g]
        opts = kernel_options(module.layer_idx, group.window, kwargs)
        _, hq, T, D = query.shape
        if query.shape[0] != 1 or T != self.num_tokens or key.shape[2] != T:
            raise ValueError(f"ContinuousBatcher planned one row of {self.num_tokens} tokens; "
                             f"the attention got queries {tuple(query.shape)} and keys "
                             f"{tuple(key.shape)}")
        cache = group.cache
        q = numpy_view(query[0].transpose(0, 1))     # [T, Hq, D] (views)
        k = numpy_view(key[0].transpose(0, 1))       # [T, Hkv, D]
        v = numpy_view(value[0].transpose(0, 1))
        out = torch.empty((1, T, hq, D), dtype=query.dtype)
        o = numpy_view(out)[0]
        sids = self.decode_sids[g]
        B = len(sids)
        if B:
            if layer == 0 and self.decode_ids is not None:
                cache.append_batch(sids, k[:B], v[:B], layer=0, token_ids=self.decode_ids)
            else:
                cache.append_batch(sids, k[:B], v[:B], layer=layer)
            cache.attend_batch(sids, q[:B], layer=layer, scale=scaling, out=o[:B], **opts)
        for sid, (start, n) in zip(self.chunk_sids[g], self.chunks):
            stop = start + n
            cache.append(sid, k[start:stop], v[start:stop], layer=layer)
            cache.attend(sid, q[start:stop], layer=layer, scale=scaling, out=o[start:stop],
                         **opts)
        return out
