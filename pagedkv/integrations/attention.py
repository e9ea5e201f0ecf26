"""The "pagedkv" attention function of transformers (``AttentionInterface``) and its mask.

A key tensor that a ``PagedLayer`` (hf.py) returned from ``update`` carries the layer under
``LINK``; the function runs pagedkv's kernels through it.  A ``ContinuousBatcher`` step arrives
as the ``STEP_KWARG`` keyword argument (step.py).  Any other key tensor goes to transformers'
sdpa attention (the module's eager one where it needs softcap or sinks).
"""
from __future__ import annotations

import importlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pagedkv.integrations.step import STEP_KWARG, kernel_options

ATTENTION_NAME = "pagedkv"
#: the attribute of a key tensor that names its PagedLayer
LINK = "_pagedkv_layer"


def register() -> None:
    """Register the "pagedkv" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def switch_attention(model) -> None:
    """Register the "pagedkv" attention and switch ``model`` to it; NotImplementedError where
    transformers declines the switch (it only logs a warning for a model whose attention
    code it cannot swap: pools.check_attention refuses those first)."""
    register()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise NotImplementedError(
            f"transformers did not switch {type(model).__name__} to the {ATTENTION_NAME!r} "
            f"attention (it uses {model.config._attn_implementation!r})")


def pagedkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """The "pagedkv" attention function (``transformers.AttentionInterface``).

    query [B, Hq, Tq, D], key/value as returned by the cache's ``update``; returns
    ``([B, Tq, Hq, D], None)``.  Without a ``PagedCache`` link on ``key``, transformers' sdpa
    attention runs instead.
    """
    step = kwargs.pop(STEP_KWARG, None)
    if step is not None:  # a ContinuousBatcher step (pagedkv/integrations/step.py)
        return step.attend(module, query, key, value, scaling, dict(kwargs, dropout=dropout)), None
    layer = getattr(key, LINK, None)
    softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
    if layer is None:
        if softcap is not None or s_aux is not None:  # sdpa has neither: the model's eager
            eager = getattr(importlib.import_module(type(module).__module__),
                            "eager_attention_forward", None)
            if eager is None:
                raise NotImplementedError(f"{type(module).__name__} uses softcap / s_aux and "
                                          "has no eager_attention_forward to fall back on")
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
                # the "pagedkv" mask is sdpa's boolean one; eager adds a float mask
                attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min)
            return eager(module, query, key, value, attention_mask, dropout=dropout,
                         scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    idx = getattr(module, "layer_idx", None)
    if idx is not None and idx != layer.layer_idx:  # a layer reusing another's K/V (Gemma 3n)
        layer = layer.reused_by(idx, key, value)
    opts = kernel_options(layer.layer_idx, layer.window, dict(kwargs, dropout=dropout))

    def own_kv(k, v):  # a fresh prompt over its own K/V, as transformers runs it (hf.py)
        # contiguous, as DynamicCache's cat leaves them: over the model's strided K/V torch's
        # sdpa ran about 9% slower at 16,384 tokens (docs/performance.md)
        k, v = k.contiguous(), v.contiguous()
        return sdpa_attention_forward(module, query, k, v, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)[0]

    return layer.attend(query, attention_mask, scaling, own_kv=own_kv, **opts), None
