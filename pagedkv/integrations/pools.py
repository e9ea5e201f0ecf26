"""The pools of the continuous batcher: a model's cache geometry, how many blocks each layer
group's pool gets (from ``num_blocks`` or a ``kv_cache_bytes`` budget), and one layer group's
block arithmetic (``Group``).  ``paged_cache`` (hf.py) sizes its caches with the same
functions."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from pagedkv._core import CacheCore
from pagedkv.cache import PagedKVCache

TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}
HALF_DTYPES = ("bfloat16", "float16")
# with neither num_blocks nor kv_cache_bytes: room for max_seqs sequences of this many
# tokens, at most _DEFAULT_BYTES
DEFAULT_TOKENS_PER_SEQ = 2048
_DEFAULT_BYTES = 1 << 30


def num_blocks_for_bytes(kv_cache_bytes: int, block_size: int, num_kv_heads: int, head_dim: int,
                         num_layers: int, dtype: str = "float32",
                         kv_dtype: Optional[str] = None) -> int:
    """How many blocks of this geometry fit in ``kv_cache_bytes`` (K and V of every layer,
    scales included for int8); ValueError when not even one does."""
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, (int, np.integer)):
        raise TypeError(f"kv_cache_bytes must be an int, got {type(kv_cache_bytes).__name__}")
    per_block = _bytes_per_block(block_size, num_kv_heads, head_dim, num_layers, dtype, kv_dtype)
    n = int(kv_cache_bytes) // per_block
    if n < 1:
        raise ValueError(f"kv_cache_bytes={int(kv_cache_bytes)} holds no block of "
                         f"{per_block} bytes (block_size {block_size}, {num_layers} layers, "
                         f"{num_kv_heads} KV heads of {head_dim}, {kv_dtype or dtype})")
    return n


def _bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int,
                     dtype: str, kv_dtype: Optional[str]) -> int:
    probe = CacheCore(1, block_size, num_kv_heads, head_dim, num_layers, dtype, 1, None,
                      None, None, kv_dtype=kv_dtype, raw16=dtype in HALF_DTYPES)
    return int(probe.bytes_per_block)


def model_geometry(model) -> Dict[str, object]:
    """Cache geometry of a transformers decoder: layers, KV heads, head dim, dtype (raises
    for a model off the CPU, another dtype, or attention pagedkv cannot run: see
    ``check_attention``)."""
    config = model.config.get_text_config(decoder=True)
    if model.device.type != "cpu":
        raise ValueError(f"pagedkv runs on the CPU; the model is on {model.device}")
    dtype = TORCH_DTYPES.get(model.dtype)
    if dtype is None:
        raise TypeError(f"pagedkv takes float32, float64, bfloat16 or float16 models; the model "
                        f"is {model.dtype}")
    check_attention(model, config)
    num_heads = int(config.num_attention_heads)
    return dict(num_layers=int(config.num_hidden_layers),
                num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
                head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_heads),
                dtype=dtype)


def check_attention(model, config) -> None:
    """NotImplementedError, naming the cause, for a model whose attention pagedkv cannot run:
    an encoder-decoder model (no cross-attention cache); a model whose attention code does
    not go through transformers' ``AttentionInterface`` (the "pagedkv" attention would never
    be called: Bloom, Falcon, GPT-J, CodeGen in transformers 5); and multi-head latent attention
    (DeepSeek V2/V3: a compressed latent and a rotary key of other sizes than its values)."""
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name} is an encoder-decoder model: pagedkv has no "
                                  "cross-attention cache")
    # what set_attn_implementation consults (a look at the model's source for a call of the
    # attention interface); it only logs a warning where it declines
    can_switch = getattr(type(model), "_can_set_attn_implementation", None)
    if not (can_switch() if can_switch is not None else type(model).is_backend_compatible()):
        raise NotImplementedError(
            f"{name} runs its own attention code, not through transformers' "
            "AttentionInterface: pagedkv's attention cannot take its place")
    if getattr(config, "kv_lora_rank", None):
        raise NotImplementedError(
            f"{name} uses multi-head latent attention (kv_lora_rank={config.kv_lora_rank}): "
            "its cache holds a compressed latent and a rotary key of other sizes than its "
            "values, and pagedkv holds K and V of one head size")


def resolve_num_blocks(num_blocks: Optional[int], kv_cache_bytes: Optional[int],
                       block_size: int, geometry: Dict[str, object],
                       kv_dtype: Optional[str]) -> int:
    """``num_blocks`` as given, or derived from ``kv_cache_bytes`` (one of them, not both;
    TypeError with neither)."""
    if num_blocks is not None and kv_cache_bytes is not None:
        raise TypeError("give num_blocks or kv_cache_bytes, not both")
    if num_blocks is not None:
        return num_blocks
    if kv_cache_bytes is None:
        raise TypeError("give num_blocks (blocks in the pool) or kv_cache_bytes (a budget)")
    return num_blocks_for_bytes(kv_cache_bytes, block_size, kv_dtype=kv_dtype, **geometry)


def blocks_per_group(num_blocks, groups) -> Dict[str, int]:
    """{group name: blocks} from ``num_blocks``: one count for every group, or a dict that
    names exactly the model's groups (ValueError otherwise)."""
    if not isinstance(num_blocks, dict):
        return {name: num_blocks for name in groups}
    if set(num_blocks) != set(groups):
        raise ValueError(f"num_blocks names groups {sorted(num_blocks)}; this model's are "
                         f"{sorted(groups)}")
    return dict(num_blocks)


def group_blocks(num_blocks, kv_cache_bytes, groups, block_size: int, geometry, kv_dtype,
                  default_tokens: int, caps: Dict[str, Optional[int]]) -> Dict[str, int]:
    """{group name: blocks} of the batcher's pools.

    ``num_blocks``: an int for every group, or a dict {group name: blocks}.  ``kv_cache_bytes``:
    a budget split so that every group gets the same number of blocks n, except that a group
    with a cap (a sliding group: more blocks than its running requests can ever hold at once)
    gets min(n, cap) and the rest goes to the others; n is the largest that fits.  Neither:
    ``default_tokens`` worth of blocks per group (capped the same way), at most 1 GiB in all.
    """
    if num_blocks is not None and kv_cache_bytes is not None:
        raise TypeError("give num_blocks or kv_cache_bytes, not both")
    if num_blocks is not None:
        return blocks_per_group(num_blocks, groups)
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or
                                       not isinstance(kv_cache_bytes, (int, np.integer))):
        raise TypeError(f"kv_cache_bytes must be an int, got {type(kv_cache_bytes).__name__}")
    per_block = {name: _bytes_per_block(block_size, geometry["num_kv_heads"],
                                        geometry["head_dim"], len(layers), geometry["dtype"],
                                        kv_dtype)
                 for name, (_, layers) in groups.items()}

    def blocks(n: int) -> Dict[str, int]:
        return {name: n if caps.get(name) is None else min(n, caps[name]) for name in groups}

    def nbytes(of: Dict[str, int]) -> int:
        return sum(of[name] * per_block[name] for name in groups)

    if kv_cache_bytes is None:
        want = blocks(max(1, -(-int(default_tokens) // int(block_size))))
        if nbytes(want) <= _DEFAULT_BYTES:
            return want
        budget = _DEFAULT_BYTES
    else:
        budget = int(kv_cache_bytes)
    lo, hi = 0, budget // min(per_block.values()) + 1   # nbytes(blocks(lo)) <= budget < ...(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if nbytes(blocks(mid)) <= budget else (lo, mid)
    out = blocks(lo)
    if min(out.values()) < 1:
        name = max(per_block, key=per_block.get)
        raise ValueError(f"kv_cache_bytes={budget} holds no block of every layer group (a "
                         f"block of {name!r} is {per_block[name]} bytes: block_size "
                         f"{block_size}, {len(groups[name][1])} layers, "
                         f"{geometry['num_kv_heads']} KV heads of {geometry['head_dim']}, "
                         f"{kv_dtype or geometry['dtype']})")
    return out


def single_group(caches: Dict[str, PagedKVCache], owner: str) -> PagedKVCache:
    """The one PagedKVCache of a model whose layers form one group; AttributeError naming the
    groups otherwise (``owner`` is how the caller is spelled in the message)."""
    if len(caches) != 1:
        raise AttributeError(f"this model's layers form {len(caches)} groups "
                             f"({', '.join(caches)}), each with its own PagedKVCache: use "
                             f"{owner}.groups[name]")
    return next(iter(caches.values()))


class Group:
    """One layer group of the batcher: its window (None: full attention), its layers (model
    indices) and its PagedKVCache.  ``keep`` is what a sliding group keeps before each step
    (window - 1 tokens); None for a full group."""

    __slots__ = ("name", "window", "layers", "cache", "keep")

    def __init__(self, name: str, window: Optional[int], layers: List[int],
                 cache: PagedKVCache):
        self.name = name
        self.window = window
        self.layers = layers
        self.cache = cache
        self.keep = None if cache.streaming is None else cache.streaming.window_tokens

    def blocks_after(self, computed: int, n: int) -> int:
        """Blocks a sequence holding ``computed`` tokens of its stream holds once n more are
        appended (a sliding group first drops the blocks that left what it keeps; a slot's
        place in its block is its stream position modulo the block size)."""
        bs = self.cache.block_size
        first = 0 if self.keep is None else max(computed - self.keep, 0)
        return -(-(computed + n) // bs) - first // bs

    def peak_blocks(self, total: int, chunk: int) -> int:
        """Blocks one request of ``total`` stored tokens can hold at once when it gets up to
        ``chunk`` tokens a step: all of them in a full group; in a sliding group what it keeps
        plus a chunk, one more for a window that straddles blocks."""
        bs = self.cache.block_size
        whole = -(-total // bs)
        if self.keep is None:
            return whole
        return min(whole, -(-(self.keep + min(chunk, total)) // bs) + 1)
