"""PagedKVCache: the user-facing cache.

The mechanics (pool, block tables, kernels, argument checks) are in the
Cython core, which this class extends with policy and reporting: the
StreamingLLM configuration, RoPE tables, statistics and ``repr``.  The hot
methods (``append``, ``attend``, ``append_batch``, ``attend_batch``) are the
core's own, so a call crosses into C once and allocates nothing.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pagedkv._core import CacheCore
from pagedkv.rope import RoPE
from pagedkv.stats import CacheStats
from pagedkv.streaming import StreamingLLM


class PagedKVCache(CacheCore):
    """A paged KV cache with paged attention over its pages.

    K/V live in one preallocated pool of ``num_blocks`` blocks of
    ``block_size`` tokens (all layers, K and V).  Sequences map their tokens
    to blocks through block tables; appending never allocates memory.

    Args:
        num_blocks: blocks in the pool (all usable).
        block_size: tokens per block.
        num_kv_heads: key/value heads (Hkv).
        head_dim: dimension of one head (D).
        num_layers: layers sharing the block tables.
        dtype: "float32" or "float64".
        max_seqs: live sequences at most (metadata is preallocated).
        max_blocks_per_seq: blocks one sequence may hold (None: num_blocks).
        eviction: None or ``StreamingLLM(sink_tokens, window_tokens)``.
        rope: None or ``RoPE(theta, rotary_dim)``: keys and queries arrive
            un-rotated and are rotated inside attention by cache position.

    Methods (arrays are NumPy; k, v, q of another float dtype are converted,
    non-contiguous ones copied):
        add_sequence() -> sid
        append(sid, k, v, layer=0)          k, v: [n, Hkv, D]
        attend(sid, q, layer=0, scale=None, out=None) -> [n, Hq, D]
            causal attention of the newest n tokens' queries (Hq % Hkv == 0)
        append_batch(sids, k, v, layer=0)   one token per sequence, [B, Hkv, D]
        attend_batch(sids, q, layer=0, scale=None, out=None) -> [B, Hq, D]
        gather(sid, layer=0) -> (k, v)      [seq_len, Hkv, D] copies
        seq_len(sid), kept_positions(sid), fork(sid), truncate(sid, length), free(sid)
        stats() -> CacheStats

    Layers: ``append(layer=0)`` grows a sequence by n (evicting first under
    StreamingLLM); ``append(layer=l)`` for l > 0 writes the same newest n
    positions and must carry the same n; ``attend`` on a layer whose newest
    tokens were not written raises RuntimeError.  Any call that raises leaves
    the cache unchanged.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype="float32",
        max_seqs: int = 256,
        max_blocks_per_seq: Optional[int] = None,
        eviction: Optional[StreamingLLM] = None,
        rope: Optional[RoPE] = None,
    ):
        if eviction is not None and not isinstance(eviction, StreamingLLM):
            raise TypeError(f"eviction must be None or a StreamingLLM, got {type(eviction).__name__}")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be None or a RoPE, got {type(rope).__name__}")
        cos = sin = None
        if rope is not None:
            if not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
                raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
            mbps = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
            cos, sin = rope.tables(int(mbps) * int(block_size), int(head_dim),
                                   np.dtype(dtype))
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, num_layers, dtype,
                         max_seqs, max_blocks_per_seq, cos, sin)
        self.eviction = eviction
        self.rope = rope
        if eviction is not None:
            self._set_streaming(eviction.sink_tokens, eviction.window_tokens)
        self._evicted_sequences = 0
        self._evictions_by_cause = {}

    def apply_streaming_llm(self, sid: int, sink_tokens: int, window_tokens: int) -> int:
        """Evict `sid` once, now, to its first sink_tokens plus last window_tokens
        held tokens (no-op when it holds no more).  Returns the tokens evicted."""
        StreamingLLM(sink_tokens, window_tokens)  # validates
        evicted, _ = self.trim(sid, sink_tokens, window_tokens)
        return evicted

    def stats(self) -> CacheStats:
        """A CacheStats snapshot (counts, bytes, fragmentation, activity)."""
        used = self.num_blocks - self.num_free_blocks
        tokens = slots = 0
        for sid in self.sequence_ids():
            tokens += self.seq_len(sid)
            slots += self.num_seq_blocks(sid) * self.block_size
        bpb = self.bytes_per_block
        return CacheStats(
            blocks_total=self.num_blocks,
            blocks_free=self.num_free_blocks,
            blocks_used=used,
            peak_blocks_used=self.peak_used,
            utilization=used / self.num_blocks,
            tokens_held=tokens,
            token_slots_allocated=slots,
            internal_fragmentation=1.0 - tokens / slots if slots else 0.0,
            bytes_per_block=bpb,
            bytes_total=bpb * self.num_blocks,
            bytes_used=bpb * used,
            sequences_active=self.seqs_added - self.seqs_freed - self._evicted_sequences,
            sequences_added=self.seqs_added,
            sequences_freed=self.seqs_freed,
            blocks_allocated=self.blocks_allocated,
            blocks_freed=self.blocks_freed,
            cow_copies=self.cow_copies,
            forks=self.forks,
            prefix_hits=0,
            prefix_misses=0,
            evicted_tokens=self.evicted_tokens,
            evicted_blocks=self.evicted_blocks,
            evicted_sequences=self._evicted_sequences,
            evictions_by_cause=dict(self._evictions_by_cause),
        )

    def __repr__(self) -> str:
        used = self.num_blocks - self.num_free_blocks
        extra = ""
        if self.eviction is not None:
            extra += f", eviction=StreamingLLM({self.eviction.sink_tokens}, {self.eviction.window_tokens})"
        if self.rope is not None:
            extra += f", rope=RoPE(theta={self.rope.theta})"
        return (
            f"PagedKVCache(blocks={used}/{self.num_blocks} used, block_size={self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, layers={self.num_layers}, "
            f"dtype={self.dtype.name}, sequences={len(self.sequence_ids())}{extra})"
        )

    __str__ = __repr__
