"""PagedKVCache: the user-facing cache.

The mechanics (pool, block tables, kernels, argument checks) are in the
Cython core, which this class extends with policy and reporting: the
StreamingLLM configuration, RoPE tables, statistics and ``repr``.  The hot
methods (``append``, ``attend``, ``append_batch``, ``attend_batch``) are the
core's own, so a call crosses into C once and allocates nothing.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Iterable, List, Optional, Tuple, Union

import numpy as np

from pagedkv._core import CacheCore, OutOfBlocksError
from pagedkv.eviction import (
    CAUSE_MANUAL,
    CAUSE_ONE_SHOT,
    CAUSE_OUT_OF_BLOCKS,
    CAUSE_STRATEGY,
    CAUSE_STREAMING,
    CAUSE_THRESHOLD,
    EvictionRecord,
    EvictionStrategy,
    SequenceInfo,
    eviction_order,
    select_victim,
)
from pagedkv.rope import RoPE
from pagedkv.stats import CacheStats
from pagedkv.streaming import StreamingLLM


_OnEvict = Callable[[int, str], None]


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
        eviction_strategy: which whole sequence to evict when the pool runs
            low: "lru" (default), "lfu", "longest", "priority" or a
            ``pagedkv.EvictionStrategy`` (see pagedkv/eviction.py for the
            order and its tie-breaks).
        eviction_threshold: default target utilization (used blocks / total)
            of ``evict_to_threshold()``, in [0, 1].
        auto_evict: when True, an ``append``/``append_batch`` that would raise
            OutOfBlocksError first evicts other sequences by the strategy (see
            "Automatic eviction").  Can be switched later via the attribute.
        on_evict: optional ``callback(sid, cause)`` called after every
            whole-sequence eviction (cause: "manual", "strategy", "threshold"
            or "out_of_blocks").

    Methods (arrays are NumPy; k, v, q of another float dtype are converted,
    non-contiguous ones copied):
        add_sequence(priority=0) -> sid
        append(sid, k, v, layer=0)          k, v: [n, Hkv, D]
        attend(sid, q, layer=0, scale=None, out=None) -> [n, Hq, D]
            causal attention of the newest n tokens' queries (Hq % Hkv == 0)
        append_batch(sids, k, v, layer=0)   one token per sequence, [B, Hkv, D]
        attend_batch(sids, q, layer=0, scale=None, out=None) -> [B, Hq, D]
        gather(sid, layer=0) -> (k, v)      [seq_len, Hkv, D] copies
        seq_len(sid), kept_positions(sid), fork(sid), truncate(sid, length), free(sid)
        apply_streaming_llm(sid, sink_tokens, window_tokens) -> evicted tokens
        select_eviction_target(exclude=()), eviction_order(exclude=()),
        evict(sid=None), evict_to_threshold(utilization=None)
        stats() -> CacheStats

    Layers: ``append(layer=0)`` grows a sequence by n (evicting first under
    StreamingLLM); ``append(layer=l)`` for l > 0 writes the same newest n
    positions and must carry the same n; ``attend`` on a layer whose newest
    tokens were not written raises RuntimeError.  Any call that raises leaves
    the cache unchanged.

    Automatic eviction (``auto_evict=True``): ``append``/``append_batch``
    catch the core's OutOfBlocksError, evict one sequence at a time in the
    strategy's order (never a sequence of the call) and retry, so no more is
    evicted than the call needs.  They then return the tuple of evicted ids
    (``()`` when none; without auto_evict they return None).  Each eviction is
    also passed to ``on_evict`` and appended to ``eviction_log``.  When even
    evicting every other sequence could not make room, nothing is evicted and
    the OutOfBlocksError is raised.  (That check counts the blocks the other
    sequences hold alone or share only with the call's sequences; with forks
    it can be optimistic, and then the evictions made before the error are
    still reported.)  Without auto_evict, ``append`` is the core's method
    itself: no Python runs per call.

    Eviction statistics: ``stats().evicted_tokens`` / ``evicted_blocks``
    count StreamingLLM evictions plus the tokens and blocks held by evicted
    sequences (a block counts when it leaves a sequence's block table, shared
    or not); ``evicted_sequences`` counts whole-sequence evictions (they are
    not in ``sequences_freed``).  ``evictions_by_cause`` splits them as
    ``{"<cause>.<tokens|blocks|sequences>": count}`` (non-zero entries only)
    with causes "streaming_llm" (per-append trimming), "apply_streaming_llm",
    "manual", "strategy", "threshold" and "out_of_blocks".
    """

    eviction_log: "collections.deque[EvictionRecord]"

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
        eviction_strategy: Union[str, EvictionStrategy] = EvictionStrategy.LRU,
        eviction_threshold: float = 0.95,
        auto_evict: bool = False,
        on_evict: Optional[_OnEvict] = None,
    ):
        if eviction is not None and not isinstance(eviction, StreamingLLM):
            raise TypeError(f"eviction must be None or a StreamingLLM, got {type(eviction).__name__}")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be None or a RoPE, got {type(rope).__name__}")
        strategy = EvictionStrategy.parse(eviction_strategy)
        threshold = _utilization("eviction_threshold", eviction_threshold)
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be callable, got {type(on_evict).__name__}")
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
        self._strategy = strategy
        self._threshold = threshold
        self.on_evict = on_evict
        #: the latest whole-sequence evictions, oldest first (at most 1024 kept)
        self.eviction_log = collections.deque(maxlen=1024)
        self._evicted_sequences = 0
        # cause -> [sequences, tokens, blocks] of whole-sequence evictions
        self._seq_evictions = {}
        # part of the core's evicted_tokens / evicted_blocks due to apply_streaming_llm
        self._one_shot_tokens = 0
        self._one_shot_blocks = 0
        # sid -> [priority, creation order]
        self._seq_meta = {}
        self._created = 0
        self.auto_evict = auto_evict

    @property
    def eviction_strategy(self) -> EvictionStrategy:
        """The whole-sequence eviction strategy (settable; names are accepted)."""
        return self._strategy

    @eviction_strategy.setter
    def eviction_strategy(self, value: Union[str, EvictionStrategy]) -> None:
        self._strategy = EvictionStrategy.parse(value)

    @property
    def eviction_threshold(self) -> float:
        """Default target utilization of evict_to_threshold() (settable, in [0, 1])."""
        return self._threshold

    @eviction_threshold.setter
    def eviction_threshold(self, value: float) -> None:
        self._threshold = _utilization("eviction_threshold", value)

    # ------------------------------------------------------------------
    # sequences (bookkeeping for the eviction strategies)

    def add_sequence(self, priority: float = 0) -> int:
        """Start an empty sequence and return its id.

        ``priority`` matters to the "priority" strategy only: lower values
        are evicted first."""
        p = _priority(priority)
        sid = CacheCore.add_sequence(self)
        self._seq_meta[sid] = [p, self._created]
        self._created += 1
        return sid

    def fork(self, sid: int) -> int:
        """New sequence sharing every block of `sid` (copy-on-write); it
        inherits the parent's priority."""
        child = CacheCore.fork(self, sid)
        self._seq_meta[child] = [self._meta(sid)[0], self._created]
        self._created += 1
        return child

    def free(self, sid: int) -> None:
        """Release a sequence and every block only it held."""
        CacheCore.free(self, sid)
        self._seq_meta.pop(sid, None)

    def set_priority(self, sid: int, priority: float) -> None:
        """Change the priority of a live sequence (lower is evicted first)."""
        self.seq_len(sid)  # KeyError for an unknown id
        self._meta(sid)[0] = _priority(priority)

    def priority(self, sid: int) -> float:
        """The priority of a live sequence."""
        self.seq_len(sid)
        return self._meta(sid)[0]

    def _meta(self, sid):
        m = self._seq_meta.get(sid)
        if m is None:  # a sequence made through CacheCore directly
            m = self._seq_meta[sid] = [0, self._created]
            self._created += 1
        return m

    # ------------------------------------------------------------------
    # StreamingLLM

    def apply_streaming_llm(self, sid: int, sink_tokens: int, window_tokens: int) -> int:
        """Evict `sid` once, now, to its first sink_tokens plus last window_tokens
        held tokens (no-op when it holds no more).  Returns the tokens evicted.

        Raises ValueError in the middle of a step (a layer lacks the newest
        tokens) or when the kept tokens would not form at most two runs (a
        sequence trimmed before with other sizes)."""
        StreamingLLM(sink_tokens, window_tokens)  # validates
        blocks_before = self.evicted_blocks
        evicted, _ = self.trim(sid, sink_tokens, window_tokens)
        self._one_shot_tokens += evicted
        self._one_shot_blocks += self.evicted_blocks - blocks_before
        return evicted

    # ------------------------------------------------------------------
    # whole-sequence eviction

    def _infos(self, exclude) -> List[SequenceInfo]:
        out = []
        for sid in self.sequence_ids():
            if sid in exclude:
                continue
            last, count = self.usage(sid)
            pri, order = self._meta(sid)
            out.append(SequenceInfo(sid=sid, last_use=last, use_count=count,
                                    tokens=self.seq_len(sid), blocks=self.num_seq_blocks(sid),
                                    priority=pri, order=order))
        return out

    def eviction_order(self, exclude: Iterable[int] = ()) -> List[int]:
        """Live sequence ids in the order the strategy would evict them."""
        return eviction_order(self.eviction_strategy, self._infos(_id_set(exclude)))

    def select_eviction_target(self, exclude: Iterable[int] = ()) -> Optional[int]:
        """The id the strategy would evict next (None when no live sequence
        remains outside `exclude`).  Changes nothing."""
        return select_victim(self.eviction_strategy, self._infos(_id_set(exclude)))

    def evict(self, sid: Optional[int] = None) -> Optional[int]:
        """Evict a whole sequence now and return its id.

        With `sid`, that sequence (cause "manual"); without, the strategy's
        choice (cause "strategy"), or None when there is no live sequence.
        The sequence is freed: its id raises KeyError from then on and the
        blocks it held alone return to the pool.  The eviction is reported to
        ``on_evict`` and recorded in ``eviction_log`` and the statistics."""
        if sid is None:
            sid = self.select_eviction_target()
            if sid is None:
                return None
            return self._evict(sid, CAUSE_STRATEGY, str(self.eviction_strategy))
        self.seq_len(sid)  # KeyError / TypeError for a bad id, before anything changes
        return self._evict(int(sid), CAUSE_MANUAL, None)

    def evict_to_threshold(self, utilization: Optional[float] = None,
                           exclude: Iterable[int] = ()) -> List[int]:
        """Evict sequences in the strategy's order until used blocks / total
        blocks <= `utilization` (default: ``eviction_threshold``) or no
        sequence outside `exclude` is left.  Returns the evicted ids in order
        (cause "threshold")."""
        target = self.eviction_threshold if utilization is None else _utilization(
            "utilization", utilization)
        ex = _id_set(exclude)
        evicted = []
        while (self.num_blocks - self.num_free_blocks) > target * self.num_blocks:
            sid = self.select_eviction_target(ex)
            if sid is None:
                break
            evicted.append(self._evict(sid, CAUSE_THRESHOLD, str(self.eviction_strategy)))
        return evicted

    def _evict(self, sid: int, cause: str, strategy: Optional[str]) -> int:
        tokens = self.seq_len(sid)
        blocks = self.num_seq_blocks(sid)
        free_before = self.num_free_blocks
        CacheCore.free(self, sid)
        self._seq_meta.pop(sid, None)
        rec = EvictionRecord(sid=sid, cause=cause, strategy=strategy, tokens=tokens,
                             blocks=blocks, blocks_freed=self.num_free_blocks - free_before)
        self._evicted_sequences += 1
        c = self._seq_evictions.setdefault(cause, [0, 0, 0])
        c[0] += 1
        c[1] += tokens
        c[2] += blocks
        self.eviction_log.append(rec)
        if self.on_evict is not None:
            self.on_evict(sid, cause)
        return sid

    # ------------------------------------------------------------------
    # automatic eviction

    @property
    def auto_evict(self) -> bool:
        """Whether appends evict other sequences instead of raising OutOfBlocksError."""
        return isinstance(self, _AutoEvict)

    @auto_evict.setter
    def auto_evict(self, on: bool) -> None:
        # The automatic mode is a subclass with Python ``append``/``append_batch``:
        # switching swaps the instance's class, so the default mode keeps the
        # core's methods (no wrapper on the hot path) and no bound method is
        # stored on the instance (no reference cycle keeping the pool alive).
        on = bool(on)
        if on == self.auto_evict:
            return
        if on:
            self.__class__ = _auto_class(type(self))
        else:
            self.__class__ = type(self).__mro__[2]  # (_auto class, _AutoEvict, base, ...)

    def _make_room(self, err: OutOfBlocksError, exclude: set, retry) -> Tuple[int, ...]:
        """Evict by the strategy (never `exclude`) until `retry()` stops
        raising OutOfBlocksError; return the evicted ids."""
        deficit = err.needed - err.available
        if self._releasable_blocks(exclude) < deficit:
            raise err
        evicted = []
        while True:
            sid = self.select_eviction_target(exclude)
            if sid is None:
                raise err
            evicted.append(self._evict(sid, CAUSE_OUT_OF_BLOCKS, str(self.eviction_strategy)))
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
        held = collections.Counter()
        mine = collections.Counter()
        for sid in self.sequence_ids():
            (mine if sid in exclude else held).update(self.block_table(sid).tolist())
        return sum(1 for b, c in held.items() if c + mine.get(b, 0) == self._ref_count(b))

    # ------------------------------------------------------------------
    # statistics

    def stats(self) -> CacheStats:
        """A CacheStats snapshot (counts, bytes, fragmentation, activity)."""
        used = self.num_blocks - self.num_free_blocks
        tokens = slots = 0
        for sid in self.sequence_ids():
            tokens += self.seq_len(sid)
            slots += self.num_seq_blocks(sid) * self.block_size
        bpb = self.bytes_per_block
        seq_tokens = sum(c[1] for c in self._seq_evictions.values())
        seq_blocks = sum(c[2] for c in self._seq_evictions.values())
        user_freed = self.seqs_freed - self._evicted_sequences
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
            sequences_active=self.seqs_added - user_freed - self._evicted_sequences,
            sequences_added=self.seqs_added,
            sequences_freed=user_freed,
            blocks_allocated=self.blocks_allocated,
            blocks_freed=self.blocks_freed,
            cow_copies=self.cow_copies,
            forks=self.forks,
            prefix_hits=0,
            prefix_misses=0,
            evicted_tokens=self.evicted_tokens + seq_tokens,
            evicted_blocks=self.evicted_blocks + seq_blocks,
            evicted_sequences=self._evicted_sequences,
            evictions_by_cause=self._by_cause(),
        )

    def _by_cause(self) -> dict:
        out = {}

        def put(cause, unit, n):
            if n:
                out[f"{cause}.{unit}"] = int(n)

        put(CAUSE_STREAMING, "tokens", self.evicted_tokens - self._one_shot_tokens)
        put(CAUSE_STREAMING, "blocks", self.evicted_blocks - self._one_shot_blocks)
        put(CAUSE_ONE_SHOT, "tokens", self._one_shot_tokens)
        put(CAUSE_ONE_SHOT, "blocks", self._one_shot_blocks)
        for cause, (nseq, ntok, nblk) in self._seq_evictions.items():
            put(cause, "sequences", nseq)
            put(cause, "tokens", ntok)
            put(cause, "blocks", nblk)
        return out

    def __repr__(self) -> str:
        used = self.num_blocks - self.num_free_blocks
        extra = ""
        if self.eviction is not None:
            extra += f", eviction=StreamingLLM({self.eviction.sink_tokens}, {self.eviction.window_tokens})"
        if self.rope is not None:
            extra += f", rope=RoPE(theta={self.rope.theta})"
        if self.auto_evict:
            extra += f", auto_evict={self.eviction_strategy.value!r}"
        return (
            f"PagedKVCache(blocks={used}/{self.num_blocks} used, block_size={self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, layers={self.num_layers}, "
            f"dtype={self.dtype.name}, sequences={len(self.sequence_ids())}{extra})"
        )

    __str__ = __repr__


class _AutoEvict:
    """Mixin of the automatic-eviction mode (see PagedKVCache, "Automatic eviction")."""

    def append(self, sid, k, v, layer=0):
        """Append as PagedKVCache.append; when the pool is short, evict other
        sequences by the strategy first.  Returns the evicted ids (a tuple)."""
        try:
            super().append(sid, k, v, layer)
            return ()
        except OutOfBlocksError as e:
            err = e
        return self._make_room(err, _id_set((sid,)), lambda: super(_AutoEvict, self).append(sid, k, v, layer))

    def append_batch(self, sids, k, v, layer=0):
        """Append as PagedKVCache.append_batch; when the pool is short, evict
        sequences outside `sids` by the strategy first.  Returns the evicted ids."""
        try:
            super().append_batch(sids, k, v, layer)
            return ()
        except OutOfBlocksError as e:
            err = e
        return self._make_room(err, _id_set(sids),
                               lambda: super(_AutoEvict, self).append_batch(sids, k, v, layer))


_AUTO_CLASSES = {}


def _auto_class(base: type) -> type:
    cls = _AUTO_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_AutoEvict, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__,
                    "__doc__": base.__doc__})
        _AUTO_CLASSES[base] = cls
    return cls


def _id_set(ids) -> set:
    return {int(s) for s in ids}


def _priority(p) -> float:
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"priority must be a number, got {type(p).__name__}")
    if not math.isfinite(p):
        raise ValueError(f"priority must be finite, got {p}")
    return p


def _utilization(name, u) -> float:
    if isinstance(u, (bool, np.bool_)) or not isinstance(u, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(u).__name__}")
    u = float(u)
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {u}")
    return u
