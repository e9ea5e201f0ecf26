"""Sequence-level eviction strategies for a PagedKVCache whose pool runs low.

StreamingLLM (``pagedkv.streaming``) evicts *tokens* inside one sequence; the
strategies here evict *whole sequences* when the pool as a whole is short of
blocks.  The policy is pure Python and runs only when something must be
evicted: the cache gathers one :class:`SequenceInfo` per live sequence and
:func:`eviction_order` ranks them.

Strategies (first evicted first):

``LRU``       least recently used: smallest last-use tick (every append and
              attend, on any layer, touches a sequence; so do add and fork).
``LFU``       least frequently used: fewest append/attend calls.
``LONGEST``   most tokens held (then most blocks held).
``PRIORITY``  lowest ``priority`` (given to ``add_sequence(priority=...)``).

Ties are broken the same way for every strategy, deterministically: first
the least recently used sequence, then the one added (or forked) earliest.
The last-use ticks come from one cache-wide counter and are distinct, so in
practice a tie on the strategy's own key is settled by recency.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, List, Optional, Union


class EvictionStrategy(str, enum.Enum):
    """Which sequence to evict first when the pool runs low."""

    LRU = "lru"
    LFU = "lfu"
    LONGEST = "longest"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, value: Union[str, "EvictionStrategy"]) -> "EvictionStrategy":
        """An EvictionStrategy from itself or its name ("lru", "lfu", "longest",
        "priority"; case-insensitive)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if member.value == key:
                    return member
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown eviction strategy {value!r}; expected one of {names} "
                         "or a pagedkv.EvictionStrategy")

    def __str__(self) -> str:
        return self.value


#: Causes recorded for evictions (keys of ``CacheStats.evictions_by_cause``).
CAUSE_STREAMING = "streaming_llm"            # per-append StreamingLLM trimming
CAUSE_ONE_SHOT = "apply_streaming_llm"       # cache.apply_streaming_llm(...)
CAUSE_MANUAL = "manual"                      # cache.evict(sid) naming the sequence
CAUSE_STRATEGY = "strategy"                  # cache.evict() choosing by strategy
CAUSE_THRESHOLD = "threshold"                # cache.evict_to_threshold(...)
CAUSE_OUT_OF_BLOCKS = "out_of_blocks"        # automatic mode: an append was short of blocks


@dataclass(frozen=True)
class SequenceInfo:
    """What a strategy may look at for one live sequence."""

    sid: int
    last_use: int      # cache-wide tick of the latest add/fork/append/attend
    use_count: int     # append + attend calls (each layer counts)
    tokens: int        # tokens held now
    blocks: int        # blocks held now
    priority: float    # from add_sequence(priority=...); forks inherit it
    order: int         # creation order (add_sequence / fork), 0 first


def _key(strategy: EvictionStrategy, s: SequenceInfo):
    tie = (s.last_use, s.order)
    if strategy is EvictionStrategy.LRU:
        return tie
    if strategy is EvictionStrategy.LFU:
        return (s.use_count,) + tie
    if strategy is EvictionStrategy.LONGEST:
        return (-s.tokens, -s.blocks) + tie
    return (s.priority,) + tie


def eviction_order(strategy: Union[str, EvictionStrategy],
                   sequences: Iterable[SequenceInfo]) -> List[int]:
    """Sequence ids in the order `strategy` would evict them."""
    st = EvictionStrategy.parse(strategy)
    return [s.sid for s in sorted(sequences, key=lambda s: _key(st, s))]


def select_victim(strategy: Union[str, EvictionStrategy],
                  sequences: Iterable[SequenceInfo]) -> Optional[int]:
    """The id `strategy` evicts first, or None when there is no sequence."""
    st = EvictionStrategy.parse(strategy)
    best = None
    best_key = None
    for s in sequences:
        k = _key(st, s)
        if best_key is None or k < best_key:
            best, best_key = s.sid, k
    return best


@dataclass(frozen=True)
class EvictionRecord:
    """One whole-sequence eviction, as reported in ``PagedKVCache.eviction_log``.

    ``blocks`` counts the blocks the sequence held; ``blocks_freed`` those that
    went back to the pool (fewer when some were shared with a fork).
    """

    sid: int
    cause: str
    strategy: Optional[str]   # the strategy that chose it (None when named by the caller)
    tokens: int
    blocks: int
    blocks_freed: int
