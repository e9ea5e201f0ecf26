"""StreamingLLM attention sinks + recent window (Xiao et al., 2023)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamingLLM:
    """Keep the first ``sink_tokens`` and the last ``window_tokens`` tokens.

    Semantics of the reference implementation's evaluation loop: before an
    append of n tokens (layer 0), a sequence holding more than
    ``sink_tokens + window_tokens`` tokens is cut to its first ``sink_tokens``
    tokens plus its ``window_tokens`` most recent ones; then the n new tokens
    are added.  A decoded token therefore attends to ``S + R + 1`` keys.

    Eviction copies no data: evicted slots are skipped, fully evicted blocks
    return to the pool at once.  Positions are ranks in the cache (use
    ``PagedKVCache(rope=RoPE(...))`` so keys are rotated by those ranks).
    """

    sink_tokens: int = 4
    window_tokens: int = 1020

    def __post_init__(self):
        for name in ("sink_tokens", "window_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.sink_tokens + self.window_tokens < 1:
            raise ValueError("sink_tokens + window_tokens must be at least 1")

    def max_blocks(self, block_size: int, n: int = 1) -> int:
        """Blocks a sequence can hold under this policy when appending n tokens at a time."""
        return (-(-self.sink_tokens // block_size) + -(-(self.window_tokens + n) // block_size) + 1)
