"""Cache statistics as a plain dataclass."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a PagedKVCache's memory and activity.

    Block counts are physical blocks of the pool (one block holds
    ``block_size`` tokens of K and V for every layer).  Token slots count the
    slots of the blocks held by live sequences: a block shared by forks
    counts once per sequence in ``token_slots_allocated``.
    """

    blocks_total: int
    blocks_free: int
    blocks_used: int
    peak_blocks_used: int
    utilization: float            # blocks_used / blocks_total
    tokens_held: int              # tokens held by live sequences (shared ones once per sequence)
    token_slots_allocated: int    # block slots of the blocks live sequences hold
    internal_fragmentation: float # 1 - tokens_held / token_slots_allocated
    bytes_per_block: int
    bytes_total: int
    bytes_used: int
    sequences_active: int
    sequences_added: int
    sequences_freed: int
    blocks_allocated: int         # cumulative
    blocks_freed: int             # cumulative
    cow_copies: int
    forks: int
    prefix_hits: int
    prefix_misses: int
    evicted_tokens: int
    evicted_blocks: int
    evicted_sequences: int
    evictions_by_cause: Dict[str, int] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        n = self.prefix_hits + self.prefix_misses
        return self.prefix_hits / n if n else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d

    def __str__(self) -> str:
        return (
            f"blocks {self.blocks_used}/{self.blocks_total} used ({self.utilization:.1%}, "
            f"peak {self.peak_blocks_used}), {self.sequences_active} sequences, "
            f"{self.tokens_held} tokens in {self.token_slots_allocated} slots "
            f"({self.internal_fragmentation:.1%} fragmentation), "
            f"{self.cow_copies} COW copies, {self.evicted_tokens} tokens evicted"
        )
