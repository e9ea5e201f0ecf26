"""Whole-sequence eviction for a PagedKVCache whose pool runs low.

StreamingLLM (``pagedkv.streaming``) trims *tokens* inside one sequence; this
module evicts *whole sequences* when the pool as a whole is short of blocks.
Everything about it lives here: the strategies, :class:`SequenceEvictor`
(evict, evict to a threshold, the automatic mode, the log and the counters),
reading each sequence's usage and priority from the core's sequence table.
The policy is pure Python and runs only when something must be evicted: one
:class:`SequenceInfo` per live sequence, ranked by :func:`eviction_order`.

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

import collections
import enum
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from pagedkv._core import OutOfBlocksError
from pagedkv.policy import CachePolicy


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


OnEvict = Callable[[int, str], None]


class SequenceEvictor(CachePolicy):
    """Whole-sequence eviction over a cache core (``pagedkv._core.CacheCore``).

    Holds the strategy, the default threshold, the ``on_evict`` callback, the
    log of recent evictions and the per-cause counters; reads usage, size and
    priority of the live sequences from the core.  PagedKVCache exposes it as
    its eviction methods.  As a CachePolicy (``pagedkv/policy.py``) it wraps
    the cache's append methods while ``automatic`` is on.  It holds no
    reference to the PagedKVCache, so binding its methods on the cache makes
    no reference cycle.
    """

    def __init__(self, core, strategy: Union[str, EvictionStrategy] = EvictionStrategy.LRU,
                 threshold: float = 0.95, on_evict: Optional[OnEvict] = None):
        self._core = core
        self.strategy = strategy
        self.threshold = threshold
        self.on_evict = on_evict
        #: the latest whole-sequence evictions, oldest first (at most 1024 kept)
        self.log: "collections.deque[EvictionRecord]" = collections.deque(maxlen=1024)
        # cause -> [sequences, tokens, blocks]
        self._counts: Dict[str, List[int]] = {}
        #: called with each evicted id before on_evict (the other policies' ``released``)
        self.notify_released: Optional[Callable[[int], None]] = None
        #: whether the cache's appends evict other sequences instead of raising
        self.automatic = False

    def attach(self, core) -> None:
        """The policy hook (``pagedkv/policy.py``): the core whose sequences it ranks and
        evicts (a SequenceEvictor made with core None, to validate its settings first)."""
        self._core = core

    # settings, validated
    @property
    def strategy(self) -> EvictionStrategy:
        return self._strategy

    @strategy.setter
    def strategy(self, value: Union[str, EvictionStrategy]) -> None:
        self._strategy = EvictionStrategy.parse(value)

    @property
    def threshold(self) -> float:
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = check_utilization("eviction_threshold", value)

    @property
    def on_evict(self) -> Optional[OnEvict]:
        return self._on_evict

    @on_evict.setter
    def on_evict(self, fn: Optional[OnEvict]) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"on_evict must be callable, got {type(fn).__name__}")
        self._on_evict = fn

    # ranking
    def infos(self, exclude: Iterable[int] = ()) -> List[SequenceInfo]:
        """One SequenceInfo per live sequence outside `exclude`."""
        ex = id_set(exclude)
        return [SequenceInfo(*row) for row in self._core.sequence_infos() if row[0] not in ex]

    def order(self, exclude: Iterable[int] = ()) -> List[int]:
        return eviction_order(self.strategy, self.infos(exclude))

    def select(self, exclude: Iterable[int] = ()) -> Optional[int]:
        return select_victim(self.strategy, self.infos(exclude))

    # evicting
    def evict(self, sid: Optional[int] = None) -> Optional[int]:
        """See PagedKVCache.evict."""
        with self._core.hold():  # choose and evict as one step for other threads
            return self._evict_one(sid)

    def _evict_one(self, sid: Optional[int]) -> Optional[int]:
        if sid is None:
            sid = self.select()
            if sid is None:
                return None
            return self._evict(sid, CAUSE_STRATEGY, str(self.strategy))
        self._core.seq_len(sid)  # KeyError / TypeError for a bad id, before anything changes
        return self._evict(int(sid), CAUSE_MANUAL, None)

    def evict_to_threshold(self, utilization: Optional[float] = None,
                           exclude: Iterable[int] = ()) -> List[int]:
        """See PagedKVCache.evict_to_threshold."""
        target = self.threshold if utilization is None else check_utilization(
            "utilization", utilization)
        core = self._core
        ex = id_set(exclude)
        evicted = []
        with core.hold():
            while core.num_blocks - core.num_free_blocks > target * core.num_blocks:
                sid = self.select(ex)
                if sid is None:
                    break
                evicted.append(self._evict(sid, CAUSE_THRESHOLD, str(self.strategy)))
        return evicted

    def _evict(self, sid: int, cause: str, strategy: Optional[str]) -> int:
        tokens, blocks, freed = self._core.evict_sequence(sid)
        if self.notify_released is not None:
            self.notify_released(sid)
        c = self._counts.setdefault(cause, [0, 0, 0])
        c[0] += 1
        c[1] += tokens
        c[2] += blocks
        self.log.append(EvictionRecord(sid=sid, cause=cause, strategy=strategy, tokens=tokens,
                                       blocks=blocks, blocks_freed=freed))
        if self._on_evict is not None:
            self._on_evict(sid, cause)
        return sid

    def counts(self) -> Dict[str, Tuple[int, int, int]]:
        """cause -> (sequences, tokens, blocks) evicted so far."""
        return {cause: tuple(c) for cause, c in self._counts.items()}

    # automatic mode: the cache's append methods evict by the strategy when the pool is short
    def wrap_append(self, inner):
        if not self.automatic:
            return inner
        core = self._core

        def append(sid, k, v, layer=0, token_ids=None) -> Tuple[int, ...]:
            """Append; when the pool is short, first evict other sequences by the strategy.
            Returns the evicted ids."""
            with core.hold():  # the append, the evictions and the retry as one step
                return self._with_room((sid,), lambda: inner(sid, k, v, layer, token_ids))

        return append

    def wrap_append_batch(self, inner):
        if not self.automatic:
            return inner
        core = self._core

        def append_batch(sids, k, v, layer=0, token_ids=None) -> Tuple[int, ...]:
            """append_batch; when the pool is short, first evict sequences outside `sids`."""
            with core.hold():
                return self._with_room(sids, lambda: inner(sids, k, v, layer, token_ids))

        return append_batch

    def _with_room(self, sids, call) -> Tuple[int, ...]:
        try:
            call()
            return ()
        except OutOfBlocksError as e:
            err = e
        return self._make_room(err, id_set(sids), call)

    def _make_room(self, err: OutOfBlocksError, exclude: set, retry) -> Tuple[int, ...]:
        """Evict by the strategy (never `exclude`) until `retry()` stops
        raising OutOfBlocksError; return the evicted ids."""
        if err.whole_pool or self._releasable_blocks(exclude) < err.needed - err.available:
            raise err
        evicted = []
        while True:
            sid = self.select(exclude)
            if sid is None:
                raise err
            evicted.append(self._evict(sid, CAUSE_OUT_OF_BLOCKS, str(self.strategy)))
            try:
                retry()
            except OutOfBlocksError as e:
                err = e
                continue
            return tuple(evicted)

    def _releasable_blocks(self, exclude: set) -> int:
        """Blocks that evicting every sequence outside `exclude` could give
        back: those held only by such sequences, plus those shared only with
        `exclude` (evictions make them private to the call, which can save a
        copy or let its own StreamingLLM trim free them)."""
        core = self._core
        held: collections.Counter = collections.Counter()
        mine: collections.Counter = collections.Counter()
        for sid in core.sequence_ids():
            (mine if sid in exclude else held).update(core.block_table(sid).tolist())
        return sum(1 for b, c in held.items() if c + mine.get(b, 0) == core.ref_count(b))


class EvictionMethods:
    """PagedKVCache's whole-sequence eviction methods and settings, over its ``_evictor``
    (a SequenceEvictor; ``auto_evict``, which rebinds the append methods, is the cache's)."""

    @property
    def eviction_strategy(self) -> EvictionStrategy:
        """The whole-sequence eviction strategy (settable; names are accepted)."""
        return self._evictor.strategy

    @eviction_strategy.setter
    def eviction_strategy(self, value: Union[str, EvictionStrategy]) -> None:
        self._evictor.strategy = value

    @property
    def eviction_threshold(self) -> float:
        """Default target utilization of evict_to_threshold() (settable, in [0, 1])."""
        return self._evictor.threshold

    @eviction_threshold.setter
    def eviction_threshold(self, value: float) -> None:
        self._evictor.threshold = value

    @property
    def on_evict(self) -> Optional[OnEvict]:
        """``callback(sid, cause)`` called after every whole-sequence eviction (settable)."""
        return self._evictor.on_evict

    @on_evict.setter
    def on_evict(self, fn: Optional[OnEvict]) -> None:
        self._evictor.on_evict = fn

    @property
    def eviction_log(self):
        """The latest whole-sequence evictions (EvictionRecord), oldest first (at most 1024)."""
        return self._evictor.log

    def eviction_order(self, exclude: Iterable[int] = ()) -> List[int]:
        """Live sequence ids in the order the strategy would evict them."""
        return self._evictor.order(exclude)

    def select_eviction_target(self, exclude: Iterable[int] = ()) -> Optional[int]:
        """The id the strategy would evict next (None when no live sequence
        remains outside `exclude`).  Changes nothing."""
        return self._evictor.select(exclude)

    def evict(self, sid: Optional[int] = None) -> Optional[int]:
        """Evict a whole sequence now and return its id.

        With `sid`, that sequence (cause "manual"); without, the strategy's
        choice (cause "strategy"), or None when there is no live sequence.
        The sequence is freed: its id raises KeyError from then on and the
        blocks it held alone return to the pool.  The eviction is reported to
        ``on_evict`` and recorded in ``eviction_log`` and the statistics."""
        return self._evictor.evict(sid)

    def evict_to_threshold(self, utilization: Optional[float] = None,
                           exclude: Iterable[int] = ()) -> List[int]:
        """Evict sequences in the strategy's order until used blocks / total
        blocks <= `utilization` (default: ``eviction_threshold``) or no
        sequence outside `exclude` is left.  Returns the evicted ids in order
        (cause "threshold")."""
        return self._evictor.evict_to_threshold(utilization, exclude)


def id_set(ids) -> set:
    return {int(s) for s in ids}


def _as_float(x, what: str) -> float:
    """x (a real number, not a bool) as a float; inf for an int beyond the float range."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what}, got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:
        return math.inf


def check_priority(p) -> float:
    value = _as_float(p, "priority must be a number")
    if not math.isfinite(value):
        raise ValueError(f"priority must be a finite number, got {p}")
    return value


def check_utilization(name, u) -> float:
    value = _as_float(u, f"{name} must be a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {u}")
    return value
