"""PagedKVCache: the user-facing cache, a facade over the Cython core.

The facade holds the core (``pagedkv._core.CacheCore``: block pool, sequence
table, kernels) and the whole-sequence evictor (``pagedkv/eviction.py``) and
exposes exactly the documented API.  Where each concept lives:

    pool, free queue         pagedkv/_pool.pxi
    sequence table           pagedkv/_seqtable.pxi
    argument checks, calls   pagedkv/_core.pyx
    kernels, dispatch        include/pagedkv/ (attention.h has the table)
    how policies hook in     pagedkv/policy.py
    StreamingLLM policy      pagedkv/streaming.py
    sequence eviction        pagedkv/eviction.py
    prefix caching           pagedkv/prefix.py
    save / load              pagedkv/persist.py
    statistics               pagedkv/stats.py
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple, Union

import numpy as np

from pagedkv._core import CacheCore
from pagedkv.eviction import (
    EvictionMethods,
    EvictionStrategy,
    OnEvict,
    SequenceEvictor,
    SequenceInfo,
    check_priority,
)
from pagedkv import persist
from pagedkv.policy import PolicySet
from pagedkv.prefix import PrefixCache
from pagedkv.rope import RoPE
from pagedkv.stats import CacheStats, collect
from pagedkv.streaming import StreamingLLM

_UNSET = object()


class PagedKVCache(EvictionMethods):
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
        dtype: "float32", "float64", "bfloat16" or "float16": the arrays
            passed in and returned.  With the 16-bit dtypes the kernels compute
            in float32 (scores, softmax and P·V accumulate in float32) and round
            the output once; "bfloat16" arrays are ``ml_dtypes.bfloat16`` (the
            ``bf16`` extra) unless ``raw16=True``.
        raw16: with dtype "bfloat16" or "float16", every array in and out is
            ``np.uint16`` holding the 16-bit patterns (e.g. ``torch_tensor
            .view(torch.int16).numpy()``): no ml_dtypes needed, no conversion.
        kv_dtype: how K/V are stored: None (= dtype), "float32", "float64"
            (with dtype "float64" only), "bfloat16", "float16" or "int8"
            (symmetric, one float32 scale per 32 values of a token's head
            vector).  Appends round to it (nearest, ties to even); attention
            converts on load, in the compute dtype; ``gather`` returns dtype
            arrays.  See "Dtypes and storage formats" in the README for the accuracy.
        max_seqs: live sequences at most (metadata is preallocated).
        max_blocks_per_seq: blocks one sequence may hold (None: num_blocks).
        streaming: None or ``StreamingLLM(sink_tokens, window_tokens)``: trim
            every sequence to its attention sinks plus a recent window
            (``eviction=`` is the old name, accepted with a DeprecationWarning).
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
        prefix_caching: reuse the K/V of full blocks whose token ids were
            seen before (see "Prefix caching"; not with ``streaming``).

    Methods (arrays are NumPy; k, v, q of another float dtype are converted,
    non-contiguous ones copied):
        add_sequence(priority=0, token_ids=None, cache_salt=None) -> sid
        append(sid, k, v, layer=0, token_ids=None)    k, v: [n, Hkv, D]
        attend(sid, q, layer=0, scale=None, out=None, window=None, softcap=None, sinks=None)
            -> [n, Hq, D]: causal attention of the newest n tokens' queries (Hq % Hkv == 0),
            optionally a sliding window, logit softcapping, learned sinks
        append_batch(sids, k, v, layer=0)   one token per sequence, [B, Hkv, D]
        attend_batch(sids, q, layer=0, scale=None, out=None) -> [B, Hq, D]
        gather(sid, layer=0) -> (k, v)      [seq_len, Hkv, D] copies
        seq_len(sid), kept_positions(sid), fork(sid), truncate(sid, length), free(sid)
        save(sid, path), load(path) -> sid, compact() -> blocks moved, resize(num_blocks)
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
    still reported.)

    The hot methods (``append``, ``attend``, ``append_batch``,
    ``attend_batch``) are the core's own, bound on the instance: a call
    crosses into C once and runs no Python; in automatic mode ``append`` and
    ``append_batch`` are the evictor's.

    Prefix caching (``prefix_caching=True``, policy in pagedkv/prefix.py):
    every full block is identified by a hash chain over its token ids (and
    an optional ``cache_salt``).  ``append(..., token_ids=ids)`` on layer 0
    tells the cache the appended tokens' ids; a block is registered once
    every layer has written it.  ``add_sequence(token_ids=prompt)`` starts
    the sequence with the longest cached prefix of the prompt (at most
    ``(len(prompt) - 1) // block_size`` blocks, shared copy-on-write):
    afterwards ``seq_len(sid)`` tokens are present and the caller appends the
    rest (their ids are known from the prompt).  Freed blocks stay hit-able
    until the pool hands them out again, least recently freed first; a hit
    verifies the token ids, so a hash collision is a miss, never another
    prompt's K/V.  ``stats()`` reports hits, misses and cached-free blocks.

    Eviction statistics: ``stats().evicted_tokens`` / ``evicted_blocks``
    count StreamingLLM evictions plus the tokens and blocks held by evicted
    sequences (a block counts when it leaves a sequence's block table, shared
    or not); ``evicted_sequences`` counts whole-sequence evictions (they are
    not in ``sequences_freed``).  ``evictions_by_cause`` splits them as
    ``{"<cause>.<tokens|blocks|sequences>": count}`` (non-zero entries only)
    with causes "streaming_llm" (per-append trimming), "apply_streaming_llm",
    "manual", "strategy", "threshold" and "out_of_blocks".
    """


    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype="float32",
        kv_dtype=None,
        max_seqs: int = 256,
        max_blocks_per_seq: Optional[int] = None,
        streaming: Optional[StreamingLLM] = None,
        rope: Optional[RoPE] = None,
        eviction_strategy: Union[str, EvictionStrategy] = EvictionStrategy.LRU,
        eviction_threshold: float = 0.95,
        auto_evict: bool = False,
        on_evict: Optional[OnEvict] = None,
        prefix_caching: bool = False,
        eviction=_UNSET,
        raw16: bool = False,
    ):
        if eviction is not _UNSET:
            warnings.warn("PagedKVCache(eviction=...) is deprecated; pass streaming=... instead",
                          DeprecationWarning, stacklevel=2)
            if streaming is not None:
                raise TypeError("pass StreamingLLM as streaming=, not both streaming= and eviction=")
            streaming = eviction
        if streaming is not None and not isinstance(streaming, StreamingLLM):
            raise TypeError(
                f"streaming must be None or a StreamingLLM, got {type(streaming).__name__}")
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
        if prefix_caching and streaming is not None:
            raise ValueError("prefix_caching cannot be combined with StreamingLLM: the tokens a "
                             "streaming sequence holds no longer form a prefix")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be None or a RoPE, got {type(rope).__name__}")
        cos = sin = None
        if rope is not None:
            if not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
                raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
            mbps = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
            # the tables are in the compute dtype (float32 for the 16-bit dtypes)
            wide = isinstance(dtype, str) and dtype == "float64" or (
                not isinstance(dtype, str) and np.dtype(dtype) == np.float64)
            cos, sin = rope.tables(int(mbps) * int(block_size), int(head_dim),
                                   np.float64 if wide else np.float32)
        # validated before the pool is allocated; bound to the core by attach() below
        self._evictor = SequenceEvictor(None, eviction_strategy, eviction_threshold, on_evict)
        core = CacheCore(num_blocks, block_size, num_kv_heads, head_dim, num_layers, dtype,
                         max_seqs, max_blocks_per_seq, cos, sin, lrf=bool(prefix_caching),
                         kv_dtype=kv_dtype, raw16=raw16)
        self._core = core
        self._prefix = PrefixCache(core) if prefix_caching else None
        self.streaming = streaming
        self.rope = rope
        # the policies, called in this order once per operation (pagedkv/policy.py)
        policies = [p for p in (streaming, self._evictor, self._prefix) if p is not None]
        self._policies = PolicySet(policies)
        self._evictor.notify_released = PolicySet(
            p for p in policies if p is not self._evictor).released
        self._policies.attach(core)
        # the hot methods: the core's own (see the class docstring)
        self.attend = core.attend
        self.attend_batch = core.attend_batch
        self.gather = core.gather
        self.auto_evict = auto_evict

    # ------------------------------------------------------------------
    # geometry and state

    num_blocks = property(lambda self: self._core.num_blocks, doc="Blocks in the pool.")
    num_free_blocks = property(lambda self: self._core.num_free_blocks,
                               doc="Blocks on the free queue now.")
    block_size = property(lambda self: self._core.block_size, doc="Tokens per block.")
    num_kv_heads = property(lambda self: self._core.num_kv_heads, doc="Key/value heads (Hkv).")
    head_dim = property(lambda self: self._core.head_dim, doc="Dimension of one head (D).")
    num_layers = property(lambda self: self._core.num_layers, doc="Layers.")
    max_seqs = property(lambda self: self._core.max_seqs, doc="Live sequences at most.")
    max_blocks_per_seq = property(lambda self: self._core.max_blocks_per_seq,
                                  doc="Blocks one sequence may hold.")
    dtype = property(lambda self: self._core.dtype,
                     doc="NumPy dtype of arrays in and out (uint16 when raw16).")
    dtype_name = property(lambda self: self._core.dtype_name,
                          doc="'float32', 'float64', 'bfloat16' or 'float16'.")
    raw16 = property(lambda self: self._core.raw16,
                     doc="Whether 16-bit arrays are uint16 bit patterns.")
    kv_dtype = property(lambda self: self._core.kv_dtype,
                        doc="How K/V are stored: 'float32', 'float64', 'bfloat16', "
                            "'float16' or 'int8'.")
    prefix_caching = property(lambda self: self._prefix is not None,
                              doc="Whether prefix caching is on.")
    quantizes_queries = property(
        lambda self: self._core.quantizes_queries,
        doc="Whether attention rounds the queries to int8 (a float32 scale per 32 values) to "
            "score int8 keys with an integer dot product (int8 storage, float32 compute, an "
            "integer dot SIMD path: 'avx512vnni', 'avx512bf16' or 'avx512amx' with block_size >= 16, "
            "'avxvnni' with block_size >= 8, 'neondot' with block_size >= 4; no RoPE).")
    rounds_queries_bf16 = property(
        lambda self: self._core.rounds_queries_bf16,
        doc="Whether attention rounds the queries to bfloat16 (to nearest even) to score "
            "bfloat16 keys with vdpbf16ps (bfloat16 storage, float32 compute, the 'avx512bf16' "
            "SIMD path, block_size >= 16, no RoPE).")
    quantizes_weights = property(
        lambda self: self._core.quantizes_weights,
        doc="Whether attention rounds the attention weights (times the values' scales) to int16 "
            "per tile, row and group of 32 values to multiply-add int8 values with vpdpwssd, "
            "in tiles that take query rows four at a time (several query heads per KV head, or "
            "prefill): int8 storage, float32 compute, the 'avx512vnni', 'avx512bf16' or "
            "'avx512amx' SIMD path on an Intel or AMD Zen 4 class CPU.")
    bytes_per_block = property(lambda self: self._core.bytes_per_block,
                               doc="Bytes of one block: K and V of every layer.")
    last_attention_plan = property(
        lambda self: self._core.last_attention_plan,
        doc="How the last attend call ran: (threads used, KV heads per work item, key chunks "
            "per sequence; > 1 means split-K with a log-sum-exp merge).")

    @property
    def eviction(self) -> Optional[StreamingLLM]:
        """Deprecated name of ``streaming``."""
        warnings.warn("PagedKVCache.eviction is deprecated; use .streaming",
                      DeprecationWarning, stacklevel=2)
        return self.streaming

    # ------------------------------------------------------------------
    # the hot methods (bound to the core's on each instance; these class-level
    # definitions document them and serve unbound calls)

    def append(self, sid: int, k, v, layer: int = 0, token_ids=None):
        """Append n tokens' keys and values, each [n, Hkv, D] (see the class
        docstring); token_ids: their n ids (prefix caching only)."""
        return self._core.append(sid, k, v, layer, token_ids)

    def append_batch(self, sids, k, v, layer: int = 0, token_ids=None):
        """Append one token to each of B distinct sequences: k, v [B, Hkv, D];
        token_ids: one id per sequence (prefix caching only)."""
        return self._core.append_batch(sids, k, v, layer, token_ids)

    def attend(self, sid: int, q, layer: int = 0, scale=None, out=None, window=None,
               softcap=None, sinks=None) -> np.ndarray:
        """Causal attention of the newest n tokens' queries q [n, Hq, D] -> [n, Hq, D].

        Options (None: off), on every kernel path and storage dtype:
            window: sliding window; the query at cache rank i sees ranks
                (i - window, i] (transformers' convention, e.g. Mistral's
                ``sliding_window``); blocks before the window are not read.
                Ranks are positions in the cache, so under StreamingLLM the
                window counts held tokens.
            softcap: logit softcapping, each scaled score s becomes
                ``softcap * tanh(s / softcap)`` (Gemma 2).
            sinks: float32/float64 array [Hq], one learned logit per query
                head that joins the softmax denominator and carries no value
                (gpt-oss)."""
        return self._core.attend(sid, q, layer, scale, out, window, softcap, sinks)

    def attend_batch(self, sids, q, layer: int = 0, scale=None, out=None, window=None,
                     softcap=None, sinks=None) -> np.ndarray:
        """One query per sequence at its newest token: q [B, Hq, D] -> [B, Hq, D];
        window / softcap / sinks as in ``attend``."""
        return self._core.attend_batch(sids, q, layer, scale, out, window, softcap, sinks)

    def gather(self, sid: int, layer: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """Contiguous copies (k, v), each [seq_len, Hkv, D], of the held tokens."""
        return self._core.gather(sid, layer)

    def read_kv_pattern(self, sids, layer: int = 0) -> Tuple[int, int]:
        """Diagnostic: read the K and V bytes ``attend_batch(sids)`` reads, in the
        same block pattern and with as many threads, and compute nothing.  Its
        time is the ceiling of decode on this pool (``pagedkv bench`` reports
        decode as a percentage of it).  Returns (bytes read, XOR of every byte
        read).  Whole blocks are read where a sequence holds part of one."""
        return self._core.read_kv_pattern(sids, layer)

    # ------------------------------------------------------------------
    # sequences

    def add_sequence(self, priority: float = 0, token_ids=None, cache_salt=None) -> int:
        """Start a sequence and return its id.

        ``priority`` matters to the "priority" strategy only: lower values
        are evicted first.  With prefix caching, ``token_ids`` (the prompt)
        starts the sequence with the prompt's longest cached prefix
        (``seq_len(sid)`` tells how many tokens; append the rest) and
        ``cache_salt`` (any hashable) keeps its blocks apart from other
        salts' (e.g. per tenant)."""
        priority = check_priority(priority)
        with self._core.hold():  # a policy's lookup and adopt as one step for other threads
            sid = self._policies.start(priority, token_ids, cache_salt)
            if sid is not None:
                return sid
        if token_ids is not None or cache_salt is not None:
            raise TypeError("token_ids= and cache_salt= are for caches made with "
                            "prefix_caching=True")
        return self._core.add_sequence(priority)

    def fork(self, sid: int) -> int:
        """New sequence sharing every block of `sid` (copy-on-write); it
        inherits the parent's priority."""
        with self._core.hold():
            child = self._core.fork(sid)
            self._policies.forked(sid, child)
        return child

    def truncate(self, sid: int, length: int) -> None:
        """Roll back to the first `length` held tokens."""
        with self._core.hold():
            self._core.truncate(sid, length)
            self._policies.truncated(sid, length)

    def free(self, sid: int) -> None:
        """Release a sequence and every block only it held."""
        with self._core.hold():
            self._core.free(sid)
            self._policies.released(sid)

    def seq_len(self, sid: int) -> int:
        """Tokens the sequence holds now (after eviction)."""
        return self._core.seq_len(sid)

    def kept_positions(self, sid: int) -> np.ndarray:
        """Original stream positions of the held tokens, in order (int64)."""
        return self._core.kept_positions(sid)

    def num_seq_blocks(self, sid: int) -> int:
        """Blocks the sequence holds now."""
        return self._core.num_seq_blocks(sid)

    def block_table(self, sid: int) -> np.ndarray:
        """Physical block ids of the sequence, in order (a copy, int32)."""
        return self._core.block_table(sid)

    def sequence_ids(self) -> List[int]:
        """Ids of the live sequences."""
        return self._core.sequence_ids()

    def __contains__(self, sid) -> bool:
        """``sid in cache``: True for a live sequence id."""
        return sid in self._core

    def sequence_info(self, sid: int) -> SequenceInfo:
        """What the eviction strategies see of a live sequence: last use,
        use count, tokens, blocks, priority, creation order."""
        with self._core.hold():
            self._core.seq_len(sid)  # KeyError / TypeError for a bad id
            sid = int(sid)
            return next(i for i in self._evictor.infos() if i.sid == sid)

    def set_priority(self, sid: int, priority: float) -> None:
        """Change the priority of a live sequence (lower is evicted first)."""
        self._core.set_priority(sid, check_priority(priority))

    def priority(self, sid: int) -> float:
        """The priority of a live sequence."""
        return self._core.priority(sid)

    # ------------------------------------------------------------------
    # StreamingLLM

    def apply_streaming_llm(self, sid: int, sink_tokens: int, window_tokens: int) -> int:
        """Evict `sid` once, now, to its first sink_tokens plus last window_tokens
        held tokens (no-op when it holds no more).  Returns the tokens evicted.

        Raises ValueError in the middle of a step (a layer lacks the newest
        tokens) or when the kept tokens would not form at most two runs (a
        sequence trimmed before with other sizes)."""
        StreamingLLM(sink_tokens, window_tokens)  # validates
        with self._core.hold():
            self._policies.trimming(sid)  # prefix caching refuses
            evicted, _ = self._core.trim(sid, sink_tokens, window_tokens)
        return evicted

    # ------------------------------------------------------------------
    # whole-sequence eviction: the methods and settings are EvictionMethods' (pagedkv/eviction.py)

    @property
    def auto_evict(self) -> bool:
        """Whether appends evict other sequences instead of raising OutOfBlocksError."""
        return self._evictor.automatic

    @auto_evict.setter
    def auto_evict(self, on: bool) -> None:
        self._evictor.automatic = bool(on)
        # each policy wraps the core's method or keeps it (then the hot path is the core's own)
        self.append = self._policies.wrap_append(self._core.append)
        self.append_batch = self._policies.wrap_append_batch(self._core.append_batch)

    # ------------------------------------------------------------------
    # persistence, compaction and resize

    def save(self, sid: int, path) -> int:
        """Write sequence `sid` (K/V of every layer, kept positions, the cache
        configuration) to `path`; returns the bytes written.  Crash-consistent:
        a save killed or failing midway leaves the previous file or the new
        complete one, never a torn one.  The format and the write protocol are
        documented in pagedkv/persist.py."""
        return persist.save(self, sid, path)

    def _snapshot(self, sid: int):
        """For persist.py: (the core's export of `sid` with its length, the
        policies' state of it), taken as one step."""
        with self._core.hold():
            meta, blocks = self._core.export_seq(sid)
            meta["length"] = self._core.seq_len(sid)
            return meta, blocks, self._policies.saved(sid)

    def _restore(self, meta: dict, payload, state: dict) -> int:
        """For persist.py: a sequence imported from a file's header and payload, the
        policies told of it with `state` (as ``_snapshot`` gave it), as one step."""
        with self._core.hold():
            sid = self._core.import_seq(meta, payload)
            self._policies.loaded(sid, state)
        return sid

    def load(self, path, priority: Optional[float] = None) -> int:
        """A new sequence read from a file written by ``save``; returns its id.

        Raises ``pagedkv.CacheFileError`` (a ValueError) for a foreign,
        truncated or corrupt file, ValueError when it was saved from a cache
        of another configuration, OutOfBlocksError when it does not fit; the
        cache is then unchanged."""
        if priority is not None:
            priority = check_priority(priority)
        return persist.load(self, path, priority)

    def compact(self) -> int:
        """Move every used block to the lowest block ids (updating every block
        table and the prefix index) so that ``resize`` can hand the top of the
        pool back; returns the blocks moved.  Contents are unchanged."""
        with self._core.hold():  # the moves and the policies' updates as one step
            self._policies.compacting()
            moved, moved_to = self._core.compact()
            self._policies.compacted(moved_to)
        return moved

    def resize(self, num_blocks: int) -> None:
        """Grow or shrink the pool to `num_blocks`.  Shrinking below the highest
        used block raises ValueError (call ``compact()`` first) and changes
        nothing.  ``max_blocks_per_seq`` stays as it was."""
        with self._core.hold():
            self._core.resize(num_blocks)
            self._policies.resized()

    # ------------------------------------------------------------------
    # statistics

    def stats(self) -> CacheStats:
        """A CacheStats snapshot (counts, bytes, fragmentation, activity)."""
        with self._core.hold():  # one consistent snapshot
            return collect(self._core, self._evictor, self._policies.stats())

    def __repr__(self) -> str:
        with self._core.hold():
            return self._summary()

    def _summary(self) -> str:
        core = self._core
        extra = ""
        if self.streaming is not None:
            extra += (f", streaming=StreamingLLM({self.streaming.sink_tokens}, "
                      f"{self.streaming.window_tokens})")
        if self.rope is not None:
            extra += f", rope=RoPE(theta={self.rope.theta})"
        if self.auto_evict:
            extra += f", auto_evict={self.eviction_strategy.value!r}"
        if self._prefix is not None:
            extra += ", prefix_caching=True"
        if core.kv_dtype != core.dtype_name:
            extra += f", kv_dtype={core.kv_dtype}"
        if core.raw16:
            extra += ", raw16=True"
        return (
            f"PagedKVCache(blocks={core.num_blocks - core.num_free_blocks}/{core.num_blocks} used, "
            f"block_size={core.block_size}, kv_heads={core.num_kv_heads}, "
            f"head_dim={core.head_dim}, layers={core.num_layers}, dtype={core.dtype_name}, "
            f"sequences={len(core.sequence_ids())}{extra})"
        )

    __str__ = __repr__
