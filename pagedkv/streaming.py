"""StreamingLLM attention sinks + recent window (Xiao et al., 2023)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.policy import CachePolicy


@dataclass(frozen=True)
class StreamingLLM(CachePolicy):
    """Keep the first ``sink_tokens`` and the last ``window_tokens`` tokens.

    Semantics of the reference implementation's evaluation loop: before an
    append of n tokens (layer 0), a sequence holding more than
    ``sink_tokens + window_tokens`` tokens is cut to its first ``sink_tokens``
    tokens plus its ``window_tokens`` most recent ones; then the n new tokens
    are added.  A decoded token therefore attends to ``S + R + 1`` keys.

    Eviction copies no data: evicted slots are skipped, fully evicted blocks
    return to the pool at once, a partly evicted block stays until its last
    held token goes.  Positions are ranks in the cache (use
    ``PagedKVCache(rope=RoPE(...))`` so keys are rotated by those ranks).

    The policy applies to every sequence of the cache, once per step (at the
    layer-0 append); all layers hold the same tokens.  For a one-shot trim use
    ``PagedKVCache.apply_streaming_llm(sid, S, R)``.  A sequence holds its
    tokens in at most two runs (sinks, then window), so trimming one sequence
    with different sizes at different times can be refused with ValueError
    when the kept tokens would form a third run.
    """

    sink_tokens: int = 4
    window_tokens: int = 1020

    def __post_init__(self):
        for name in ("sink_tokens", "window_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**61:
                raise ValueError(f"{name} must be an int in [0, 2**61), got {v!r}")
            object.__setattr__(self, name, int(v))  # a NumPy int would overflow in sums
        if self.sink_tokens + self.window_tokens < 1:
            raise ValueError("sink_tokens + window_tokens must be at least 1")

    def attach(self, core) -> None:
        """The policy hook (``pagedkv/policy.py``): the core trims every sequence
        before each layer-0 append (``_seqtable.pxi`` holds the mechanics)."""
        core.set_streaming(self.sink_tokens, self.window_tokens)

    def max_blocks(self, block_size: int, n: int = 1) -> int:
        """Blocks a sequence can hold under this policy when appending n tokens at a
        time: ``ceil(S / bs) + ceil((R + n) / bs) + 1`` (a pool or ``max_blocks_per_seq``
        this large lets one sequence stream forever)."""
        return (-(-self.sink_tokens // block_size) + -(-(self.window_tokens + n) // block_size) + 1)
