"""Rotary position embedding applied inside the cache's attention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class RoPE:
    """Rotary embedding, rotate-half (GPT-NeoX) convention.

    With ``PagedKVCache(rope=RoPE(...))`` keys are stored un-rotated and the
    attention kernels rotate keys and queries by their *rank in the cache*
    (held token i has position i), which is what StreamingLLM prescribes: an
    eviction never rewrites a key.

    Args:
        theta: base of the frequencies, ``inv_freq[i] = theta ** (-2 i / rotary_dim)``.
        rotary_dim: leading dimensions rotated (even); None rotates all of head_dim.
    """

    theta: float = 10000.0
    rotary_dim: Optional[int] = None

    def __post_init__(self):
        if not (np.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"theta must be a positive finite number, got {self.theta}")
        if self.rotary_dim is not None and (
            not isinstance(self.rotary_dim, (int, np.integer))
            or self.rotary_dim < 2
            or self.rotary_dim % 2
        ):
            raise ValueError(f"rotary_dim must be an even int >= 2, got {self.rotary_dim!r}")

    def dim(self, head_dim: int) -> int:
        rd = head_dim if self.rotary_dim is None else int(self.rotary_dim)
        if rd > head_dim or rd % 2:
            raise ValueError(
                f"rotary_dim={rd} must be even and at most head_dim={head_dim}")
        return rd

    def tables(self, max_pos: int, head_dim: int, dtype) -> Tuple[np.ndarray, np.ndarray]:
        """cos and sin, each [max_pos, rotary_dim // 2], computed in float64."""
        half = self.dim(head_dim) // 2
        inv_freq = self.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / (2 * half))
        ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
        return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
