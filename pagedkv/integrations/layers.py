"""The layer groups of a transformers model: which decoder layers slide and by how much, and
what a sliding group keeps.  ``paged_cache`` (hf.py) and ``ContinuousBatcher`` (batching.py)
build one PagedKVCache per group."""
from __future__ import annotations

from typing import List, Optional, Sequence

from pagedkv.streaming import StreamingLLM

FULL = "full_attention"
SLIDING = "sliding_attention"


def layer_windows(config) -> List[Optional[int]]:
    """The sliding window of each decoder layer (None: full attention) from a text config.

    ``config.layer_types`` ("full_attention" / "sliding_attention", Gemma 2/3, gpt-oss, Qwen2/3)
    where the config has it, else ``config.sliding_window`` for every layer (Mistral) unless
    ``use_sliding_window`` is False.  Any other layer type raises NotImplementedError naming it.
    """
    num_layers = int(config.num_hidden_layers)
    sw = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        slide = sw is not None and getattr(config, "use_sliding_window", True) is not False
        types = [SLIDING if slide else FULL] * num_layers
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"config.layer_types names {len(types)} layers; the model has {num_layers}")
    other = sorted({t for t in types if t not in (FULL, SLIDING)})
    if other:
        raise NotImplementedError(
            f"pagedkv supports 'full_attention' and 'sliding_attention' layers; this model has "
            f"{', '.join(map(repr, other))} layers")
    if SLIDING in types and (isinstance(sw, bool) or not isinstance(sw, int) or sw < 1):
        raise ValueError(f"sliding-window layers need config.sliding_window >= 1, got {sw!r}")
    return [int(sw) if t == SLIDING else None for t in types]


def _group_name(window: Optional[int], windows) -> str:
    if window is None:
        return FULL
    return SLIDING if len({w for w in windows if w is not None}) == 1 else f"{SLIDING}_{window}"


def group_layers(windows: Sequence[Optional[int]]) -> dict:
    """{group name: (window or None, layer indices)} of ``layer_windows(config)``: the layer
    groups of ``paged_cache`` and of ``ContinuousBatcher``, in order of first layer."""
    out: dict = {}
    for i, w in enumerate(windows):
        out.setdefault(_group_name(w, windows), (w, []))[1].append(i)
    return out


def sliding_policy(window: int) -> StreamingLLM:
    """What a sliding group with this window keeps before each step: its last
    ``window - 1`` tokens (at least 1 for the policy), no sinks."""
    return StreamingLLM(sink_tokens=0, window_tokens=max(int(window) - 1, 1))


def layer_groups(model) -> dict:
    """{group name: layer indices} that ``paged_cache(model, ...)`` would build."""
    windows = layer_windows(model.config.get_text_config(decoder=True))
    return {name: layers for name, (_, layers) in group_layers(windows).items()}
