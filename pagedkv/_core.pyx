# cython: language_level=3, wraparound=False, cdivision=True, initializedcheck=False
"""Cython core of pagedkv: mechanics only, one file per concept.

    _pool.pxi       BlockPool: the arena of K/V blocks, reference counts, the
                    free queue (least recently freed first)
    _seqtable.pxi   SequenceTable: one Seq struct per sequence, ids, grow /
                    StreamingLLM trim / copy-on-write / fork / truncate / free
    _lock.pxi       the cache's lock (thread model), hold()
    _checks.pxi     argument checks: dtypes, sizes, layers, ids, arrays in and
                    out, attention options
    _kernels.pxi    append / attend / gather: the calls of the C kernels of
                    include/pagedkv/ (picked from their dispatch table), made
                    without the GIL
    _transfer.pxi   export / import of sequences, adopt, compact, resize
    _diag.pxi       views for the Python layer and tests, the read pattern,
                    read bandwidth and instruction peak
    _linear.pxi     linear(): y = x W^T + b for a decode step's few rows
                    (include/pagedkv/linear.h), used by the batcher
    _core.pyx       CacheCore: the facade PagedKVCache holds; each public
                    method takes the lock and calls the functions above

Policy (which sequences to evict, StreamingLLM sizes, statistics objects)
lives in the Python layer.
"""
import importlib
import os

import numpy as np

cimport numpy as cnp
from libc.math cimport isfinite, sqrt
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.pythread cimport (WAIT_LOCK, PyThread_acquire_lock,
                               PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_get_thread_ident, PyThread_release_lock,
                               PyThread_type_lock)

# the declarations of _core.pxd (the C headers) are included automatically

cnp.import_array()

cdef extern from "Python.h":
    # Fast int extraction without creating objects.
    long long PyLong_AsLongLong(object) except? -1

# ----------------------------------------------------------------------------
# errors


class SequenceMetaError(ValueError):
    """import_seq's metadata or blocks do not describe a sequence (malformed or inconsistent
    segments, offsets or sizes); pagedkv.persist reports it as CacheFileError."""


class OutOfBlocksError(MemoryError):
    """The block pool cannot satisfy a request.

    Attributes:
        needed: free blocks the call needed.
        available: free blocks there were (counting blocks the call itself
            would have released by eviction).
        whole_pool: True when a sequence would hold more blocks than the
            whole pool has, so freeing other sequences cannot help.
    """

    def __init__(self, needed, available, whole_pool=False):
        self.needed = int(needed)
        self.available = int(available)
        self.whole_pool = bool(whole_pool)
        super().__init__(
            f"out of KV blocks: the call needs {self.needed} free block(s), "
            f"{self.available} available"
            + ("; the sequence would hold more blocks than the whole pool has"
               if self.whole_pool else "")
        )

    def __reduce__(self):
        return (type(self), (self.needed, self.available, self.whole_pool))


# ----------------------------------------------------------------------------
# SIMD selection and threads

cdef int _simd_detected = pkv_detect_simd()
# indexed by PKV_SIMD_* (simd.h); "avx512vnni" is AVX-512 with int8 keys scored by vpdpbusd,
# "avxvnni" AVX2 with them scored by the VEX-encoded vpdpbusd, "neondot" NEON with sdot,
# "avx512bf16" AVX-512 + VNNI with bfloat16 keys scored by vdpbf16ps on a bfloat16 query,
# "avx512amx" AVX-512 + VNNI with bfloat16 keys scored in AMX tiles
_SIMD_NAMES = ("scalar", "avx2", "avx512", "neon", "avx512vnni", "avxvnni", "neondot", "avx512amx",
               "avx512bf16")
_SIMD_SLOWEST_FIRST = ("scalar", "avx2", "avxvnni", "neon", "neondot", "avx512", "avx512vnni",
                       "avx512bf16", "avx512amx")


def simd_supported():
    """SIMD paths this machine can run, slowest first."""
    return [name for name in _SIMD_SLOWEST_FIRST if pkv_simd_supported(_SIMD_NAMES.index(name))]


def _choose_simd():
    forced = os.environ.get("PAGEDKV_SIMD", "").strip().lower()
    if not forced:
        return _simd_detected
    if forced not in _SIMD_NAMES:
        raise ValueError(
            f"PAGEDKV_SIMD={forced!r}: expected one of {', '.join(_SIMD_NAMES)}")
    if forced not in simd_supported():
        raise RuntimeError(
            f"PAGEDKV_SIMD={forced!r} but this machine runs only "
            f"{', '.join(simd_supported())}")
    return _SIMD_NAMES.index(forced)


cdef int _simd = _choose_simd()
cdef int _nthreads = 0  # 0: follow OpenMP (OMP_NUM_THREADS)


def simd_backend():
    """Name of the active SIMD path: 'scalar', 'avx2', 'avxvnni', 'avx512', 'avx512vnni',
    'avx512bf16', 'avx512amx', 'neon' or 'neondot'."""
    return _SIMD_NAMES[_simd]


def has_openmp():
    """True when the extension was built with OpenMP."""
    return bool(pkv_have_openmp())


#: the most threads set_num_threads takes.  The largest machines have some hundreds of logical
#: CPUs; a count the system refuses to create (tens of thousands on a 2-CPU VM) makes the
#: OpenMP runtime end the process at the next parallel call, so such a count is refused here.
_MAX_THREADS = 4096


def set_num_threads(n):
    """Threads used by the attention kernels and linear(): an int from 1 to 4096;
    0 restores the default (OpenMP's: OMP_NUM_THREADS or the logical CPUs)."""
    global _nthreads
    n = _positive_int("number of threads", n, 0)  # (_checks.pxi)
    if n > _MAX_THREADS:
        raise ValueError(f"number of threads must be from 0 (the default) to {_MAX_THREADS}, got {n}")
    _nthreads = n


def get_num_threads():
    """Threads the attention kernels and linear() use now."""
    return _nthreads if _nthreads > 0 else pkv_max_threads()


#: logical CPUs, read once: os.cpu_count() reads /sys on Linux (about 12 us on a VM, most of
#: the construction of a small cache); a cache sizes its starting kernel scratch by it
_CPUS = os.cpu_count() or 1


# ----------------------------------------------------------------------------
# helpers

cdef inline int64_t _cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef void *_zalloc(size_t n, void **raw) except NULL:
    """Zeroed allocation aligned to 64 bytes (2 MiB, with huge pages advised on Linux, for
    2 MiB or more: include/pagedkv/alloc.h); *raw receives the pointer to free.

    The memory is written here (not left to lazy zero pages), so the pool is
    resident from construction on and no append ever takes a page fault."""
    cdef void *p = pkv_alloc(n, raw)
    if p == NULL:
        raise MemoryError(f"cannot allocate {n} bytes")
    with nogil:
        memset(p, 0, n)
    return p


include "_lock.pxi"
include "_pool.pxi"
include "_seqtable.pxi"
include "_checks.pxi"
include "_kernels.pxi"
include "_transfer.pxi"
include "_diag.pxi"
include "_linear.pxi"


# ----------------------------------------------------------------------------
# the facade: each public method takes the cache's lock (_lock.pxi) for the
# whole call and hands the work to a function of the .pxi files above, which
# reads the fields

cdef class CacheCore:
    """Pool + sequence table behind a checked API; see PagedKVCache."""

    cdef:
        readonly BlockPool pool
        readonly SequenceTable seqs
        # geometry (fixed for the life of the cache)
        readonly int block_size
        readonly int num_kv_heads
        readonly int head_dim
        readonly int num_layers
        readonly int64_t max_seqs
        readonly int64_t max_blocks_per_seq
        int io                    # pkv_dtype of the arrays passed in and returned
        int compute               # what the kernels accumulate in: F32 (also for 16-bit io) or F64
        int storage               # pkv_dtype of K/V in the pool
        readonly bint raw16       # 16-bit arrays are uint16 bit patterns
        object np_dtype           # NumPy dtype of the arrays
        int typenum               # ... its type number
        size_t itemsize           # ... its item size
        size_t csize              # item size of the compute type
        const pkv_kernels *kernels
        # StreamingLLM (cache-wide): sink/window tokens, -1 when off
        int64_t sink_tokens
        int64_t window_tokens
        # RoPE tables (kept alive by these references)
        object _rope_cos
        object _rope_sin
        object _rope_cos_t
        object _rope_sin_t
        pkv_rope rope
        bint has_rope
        # batch arrays (max_seqs entries) and kernel scratch
        const int32_t **b_tables
        pkv_segs *b_segs
        Seq **b_seqs
        int64_t *b_mark
        int64_t mark
        _Plan *b_plans
        void *_raw[5]
        void *scratch
        void *scratch_raw
        size_t scratch_stride
        int scratch_threads
        void *partial             # split-K partial states, 2 slots per thread
        void *partial_raw
        readonly int64_t seqs_freed
        _Lock lock                # the cache's lock (_lock.pxi)
        int64_t plan[3]           # the last attention call's threads, heads/item, key chunks

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, num_layers=1,
                 dtype="float32", max_seqs=256, max_blocks_per_seq=None,
                 rope_cos=None, rope_sin=None, bint lrf=False, kv_dtype=None, raw16=False):
        """lrf: the pool hands out its least recently freed blocks first (for
        caches whose freed blocks keep reusable contents; see _pool.pxi)."""
        if self.pool is not None:
            raise RuntimeError("the cache is already initialized")
        _lock_init(&self.lock)
        nb = _positive_int("num_blocks", num_blocks)
        bs = _positive_int("block_size", block_size)
        hkv = _positive_int("num_kv_heads", num_kv_heads)
        d = _positive_int("head_dim", head_dim)
        nl = _positive_int("num_layers", num_layers)
        ms = _positive_int("max_seqs", max_seqs)
        mb = nb if max_blocks_per_seq is None else _positive_int("max_blocks_per_seq",
                                                                 max_blocks_per_seq)
        for name, value in (("num_blocks", nb), ("max_seqs", ms), ("max_blocks_per_seq", mb),
                            ("block_size", bs), ("num_kv_heads", hkv), ("head_dim", d),
                            ("num_layers", nl)):
            if value > 2**31 - 1:
                raise ValueError(f"{name} must be < 2**31, got {value}")
        self.io = _dtype_code(dtype)
        if not isinstance(raw16, (bool, np.bool_)):
            raise TypeError(f"raw16 must be a bool, got {type(raw16).__name__}")
        if raw16 and self.io not in (PKV_BF16, PKV_F16):
            raise ValueError(f"raw16=True is for dtype 'bfloat16' or 'float16', got "
                             f"{_KV_NAMES[self.io]!r}")
        self.raw16 = raw16
        self.compute = PKV_F64 if self.io == PKV_F64 else PKV_F32
        self.np_dtype = _array_dtype(self.io, raw16)
        self.typenum = self.np_dtype.num
        self.itemsize = self.np_dtype.itemsize
        self.csize = 8 if self.compute == PKV_F64 else 4
        storage = _kv_dtype_code(kv_dtype, self.io)
        self.storage = storage
        self.kernels = pkv_kernels_for(storage, self.compute, _simd)
        if self.kernels == NULL:
            raise ValueError(f"no kernels for kv_dtype {_KV_NAMES[storage]!r} with dtype "
                             f"{self.dtype_name!r}")
        self.sink_tokens = -1
        self.window_tokens = -1
        # sizes in Python integers first: no C overflow on absurd arguments
        pool_bytes = 2 * nl * nb * hkv * bs * (d * 8 + 8) + 64 * nb  # an upper bound
        meta_bytes = ms * (4 * mb + 8 * nl + 256)
        if pool_bytes + meta_bytes > 2**56:
            raise MemoryError(f"the cache would need {pool_bytes + meta_bytes} bytes")

        self.pool = BlockPool(nb, nl, hkv, bs, d, storage, lrf)
        self.seqs = SequenceTable(self.pool, ms, mb)
        self.block_size, self.num_kv_heads, self.head_dim, self.num_layers = bs, hkv, d, nl
        self.max_seqs, self.max_blocks_per_seq = ms, mb
        self.b_tables = <const int32_t **>_zalloc(sizeof(void *) * ms, &self._raw[0])
        self.b_segs = <pkv_segs *>_zalloc(sizeof(pkv_segs) * ms, &self._raw[1])
        self.b_seqs = <Seq **>_zalloc(sizeof(void *) * ms, &self._raw[2])
        self.b_mark = <int64_t *>_zalloc(8 * ms, &self._raw[3])
        self.b_plans = <_Plan *>_zalloc(sizeof(_Plan) * ms, &self._raw[4])
        self.has_rope = rope_cos is not None
        if self.has_rope:
            _set_rope(self, rope_cos, rope_sin)
        _ensure_scratch(self, max(pkv_max_threads(), _CPUS))

    def __dealloc__(self):
        for i in range(5):
            free(self._raw[i])
        free(self.scratch_raw)
        free(self.partial_raw)
        _lock_free(&self.lock)

    # ------------------------------------------------------------------
    # geometry

    @property
    def num_blocks(self):
        return self.pool.num_blocks

    @property
    def dtype(self):
        """NumPy dtype of the arrays in and out (uint16 for raw16 caches)."""
        return self.np_dtype

    @property
    def dtype_name(self):
        """'float32', 'float64', 'bfloat16' or 'float16' (raw16 caches too)."""
        return _KV_NAMES[self.io]

    @property
    def kv_dtype(self):
        """How K/V are stored: 'float32', 'float64', 'bfloat16', 'float16' or 'int8'."""
        return _KV_NAMES[self.storage]

    @property
    def quantizes_queries(self):
        """True when attention rounds the queries to int8 (a float32 scale per
        32 values) to score int8 keys with an integer dot product: int8
        storage, float32 compute, an integer dot path ("avx512vnni",
        "avx512bf16" or "avx512amx" with block_size >= 16, "avxvnni" with
        block_size >= 8, "neondot" with block_size >= 4), no RoPE
        (include/pagedkv/attn_dot.h)."""
        return bool(pkv_quantizes_queries(self.storage, self.compute, _simd, self.block_size,
                                          self.has_rope))

    @property
    def rounds_queries_bf16(self):
        """True when attention rounds the queries to bfloat16 (to nearest even) to
        score bfloat16 keys with vdpbf16ps: bfloat16 storage, float32 compute,
        the "avx512bf16" path, block_size >= 16, no RoPE
        (include/pagedkv/attn_bf16dot.h)."""
        return bool(pkv_rounds_queries_bf16(self.storage, self.compute, _simd, self.block_size,
                                            self.has_rope))

    @property
    def quantizes_weights(self):
        """True when attention rounds the attention weights (times the values'
        scales) to int16 per tile, row and group of 32 values, to multiply-add
        int8 values with vpdpwssd, wherever a tile takes query rows four at a
        time (several query heads per KV head, or prefill): int8 storage,
        float32 compute, an AVX-512 + VNNI path ("avx512vnni", "avx512bf16",
        "avx512amx") on an Intel or AMD Zen 4 class CPU
        (include/pagedkv/attn_pvdot.h)."""
        return bool(pkv_quantizes_weights(self.storage, self.compute, _simd))

    @property
    def num_free_blocks(self):
        return self.pool.num_free

    @property
    def bytes_per_block(self):
        """Bytes of one block: K and V of every layer."""
        return self.pool.bytes_per_block

    # ------------------------------------------------------------------
    # the lock (thread model: _lock.pxi)

    def hold(self):
        """A context manager holding the cache's lock across several calls of
        this thread (other threads' calls wait until it is left)."""
        return _hold(self, &self.lock)

    # ------------------------------------------------------------------
    # sequences

    def add_sequence(self, double priority=0.0):
        """Start an empty sequence and return its id."""
        _call_enter(&self.lock)
        try:
            return self.seqs.new_seq(priority).sid
        finally:
            _call_exit(&self.lock)

    def __contains__(self, sid):
        """`sid in cache`: True for a live sequence id."""
        _call_enter(&self.lock)
        try:
            self.seqs.lookup(sid)
        except (KeyError, TypeError):
            return False
        finally:
            _call_exit(&self.lock)
        return True

    def sequence_ids(self):
        """Ids of the live sequences, lowest slot first."""
        _call_enter(&self.lock)
        try:
            return self.seqs.live_ids()
        finally:
            _call_exit(&self.lock)

    def free(self, sid):
        """Release a sequence and every block only it held."""
        _call_enter(&self.lock)
        try:
            self.seqs.remove(self.seqs.lookup(sid))
            self.seqs_freed += 1
        finally:
            _call_exit(&self.lock)

    def evict_sequence(self, sid):
        """Release a sequence as an eviction (not counted as freed); returns
        (tokens, blocks held, blocks returned to the pool)."""
        cdef Seq *s
        cdef int64_t tokens, blocks, before
        _call_enter(&self.lock)
        try:
            s = self.seqs.lookup(sid)
            tokens, blocks, before = pkv_held(&s.segs), s.nblk, self.pool.num_free
            self.seqs.remove(s)
            return tokens, blocks, self.pool.num_free - before
        finally:
            _call_exit(&self.lock)

    def seq_len(self, sid):
        """Tokens the sequence holds now (after eviction)."""
        _call_enter(&self.lock)
        try:
            return pkv_held(&self.seqs.lookup(sid).segs)
        finally:
            _call_exit(&self.lock)

    def num_seq_blocks(self, sid):
        """Blocks the sequence holds now."""
        _call_enter(&self.lock)
        try:
            return self.seqs.lookup(sid).nblk
        finally:
            _call_exit(&self.lock)

    def kept_positions(self, sid):
        """Original stream positions of the held tokens, in order (int64)."""
        _call_enter(&self.lock)
        try:
            return _kept_positions(self, sid)
        finally:
            _call_exit(&self.lock)

    def block_table(self, sid):
        """Physical block ids of the sequence, in order (a copy, int32)."""
        _call_enter(&self.lock)
        try:
            return _table_copy(self.seqs.lookup(sid))
        finally:
            _call_exit(&self.lock)

    def sequence_infos(self):
        """(sid, last_use, use_count, tokens, blocks, priority, order) of every live
        sequence, lowest slot first: what the eviction strategies rank."""
        _call_enter(&self.lock)
        try:
            return _sequence_infos(self)
        finally:
            _call_exit(&self.lock)

    def set_priority(self, sid, double priority):
        _call_enter(&self.lock)
        try:
            self.seqs.lookup(sid).priority = priority
        finally:
            _call_exit(&self.lock)

    def priority(self, sid):
        _call_enter(&self.lock)
        try:
            return self.seqs.lookup(sid).priority
        finally:
            _call_exit(&self.lock)

    def fork(self, sid):
        """New sequence sharing every block of `sid` (copy-on-write)."""
        _call_enter(&self.lock)
        try:
            return self.seqs.fork(self.seqs.lookup(sid)).sid
        finally:
            _call_exit(&self.lock)

    def truncate(self, sid, length):
        """Roll back to the first `length` held tokens."""
        cdef Seq *s
        cdef int64_t held
        _call_enter(&self.lock)
        try:
            s = self.seqs.lookup(sid)
            if not _is_int(length):
                raise TypeError(f"length must be an int, got {type(length).__name__}")
            held = pkv_held(&s.segs)
            if length < 0 or length > held:
                raise ValueError(f"truncate length must be in [0, {held}], got {length}")
            self.seqs.truncate(s, length)
        finally:
            _call_exit(&self.lock)

    def written_tokens(self, sid):
        """Stream positions written on every layer (the fully written prefix)."""
        _call_enter(&self.lock)
        try:
            return _written_tokens(self, sid)
        finally:
            _call_exit(&self.lock)

    # ------------------------------------------------------------------
    # StreamingLLM

    def set_streaming(self, int64_t sink_tokens, int64_t window_tokens):
        """Per-append trimming on (sink, window >= 0) or off (-1, -1)."""
        _call_enter(&self.lock)
        try:
            self.sink_tokens = sink_tokens
            self.window_tokens = window_tokens
        finally:
            _call_exit(&self.lock)

    def trim(self, sid, int64_t sink_tokens, int64_t window_tokens):
        """Evict `sid` now to its first sink_tokens + last window_tokens held tokens
        (counted as a one-shot StreamingLLM eviction).  Returns (tokens evicted,
        blocks returned to the pool)."""
        cdef Seq *s
        cdef _Plan p
        cdef int64_t before
        _call_enter(&self.lock)
        try:
            s = self.seqs.lookup(sid)
            before = self.pool.num_free
            # a pending layer append writes the newest step_n slots: they must not move
            _check_step_done(s, sid, self.num_layers, "trim")
            _plan_init(&p, s)
            self.seqs.plan_trim(s, sink_tokens, window_tokens, &p)
            self.seqs.apply_drop(s, &p, _TRIM_ONE_SHOT)
            if s.segs.b1 - s.segs.b0 < s.step_n:
                # the window cut into the newest step: its tokens can no longer be rewritten
                # on another layer (they would land before the segment, out of the sequence)
                s.step_n = 0
            return p.evicted_tokens, self.pool.num_free - before
        finally:
            _call_exit(&self.lock)

    # ------------------------------------------------------------------
    # blocks in and out (_transfer.pxi)

    def adopt(self, blocks, double priority=0.0):
        """A new sequence holding `blocks` (in use, or free but still cached),
        full and written on every layer: a prefix-cache hit (pagedkv/prefix.py).
        Returns its id; raises and changes nothing when a block is invalid."""
        _call_enter(&self.lock)
        try:
            return _adopt(self, blocks, priority)
        finally:
            _call_exit(&self.lock)

    def compact(self):
        """Move every used block to the lowest ids and rewrite the block tables.
        Returns (blocks moved, moved_to) where moved_to[b] is b's new id."""
        _call_enter(&self.lock)
        try:
            return _compact(self)
        finally:
            _call_exit(&self.lock)

    def resize(self, num_blocks):
        """Grow or shrink the pool to num_blocks (every block >= num_blocks must be
        free: compact() first).  max_blocks_per_seq does not change."""
        _call_enter(&self.lock)
        try:
            return _resize(self, num_blocks)
        finally:
            _call_exit(&self.lock)

    def export_seq(self, sid):
        """(meta, blocks) of a sequence: its segments and offsets, and its
        blocks' raw bytes in table order (uint8 [nblk, bytes_per_block])."""
        _call_enter(&self.lock)
        try:
            return _export_seq(self, sid)
        finally:
            _call_exit(&self.lock)

    def import_seq(self, meta, data):
        """A new sequence from export_seq's (meta, blocks); checks everything
        first and changes nothing when it raises."""
        _call_enter(&self.lock)
        try:
            return _import_seq(self, meta, data)
        finally:
            _call_exit(&self.lock)

    # ------------------------------------------------------------------
    # the kernels (_kernels.pxi)

    def append(self, sid, k, v, layer=0, token_ids=None):
        """Append n tokens' keys and values, each [n, Hkv, D]; see PagedKVCache."""
        if token_ids is not None:
            _no_token_ids()
        _call_enter(&self.lock)
        try:
            return _append(self, sid, k, v, layer)
        finally:
            _call_exit(&self.lock)

    def append_batch(self, sids, k, v, layer=0, token_ids=None):
        """Append one token to each of B distinct sequences: k, v [B, Hkv, D]."""
        if token_ids is not None:
            _no_token_ids()
        _call_enter(&self.lock)
        try:
            return _append_batch(self, sids, k, v, layer)
        finally:
            _call_exit(&self.lock)

    def attend(self, sid, q, layer=0, scale=None, out=None, window=None, softcap=None,
               sinks=None):
        """Causal attention of the newest n tokens' queries q [n, Hq, D]."""
        _call_enter(&self.lock)
        try:
            return _attend(self, sid, q, layer, scale, out, window, softcap, sinks)
        finally:
            _call_exit(&self.lock)

    def attend_batch(self, sids, q, layer=0, scale=None, out=None, window=None, softcap=None,
                     sinks=None):
        """One query per sequence at its newest token: q [B, Hq, D] -> [B, Hq, D]."""
        _call_enter(&self.lock)
        try:
            return _attend_batch(self, sids, q, layer, scale, out, window, softcap, sinks)
        finally:
            _call_exit(&self.lock)

    def gather(self, sid, layer=0):
        """Contiguous copies (k, v), each [seq_len, Hkv, D], of the held tokens."""
        _call_enter(&self.lock)
        try:
            return _gather(self, sid, layer)
        finally:
            _call_exit(&self.lock)

    # ------------------------------------------------------------------
    # introspection (_diag.pxi)

    def read_kv_pattern(self, sids, layer=0):
        """Read the K and V bytes attend_batch(sids) reads, in its block pattern,
        and compute nothing: for each sequence, each block its held tokens touch,
        the block's K plane of `layer` (all KV heads), then its V plane
        (include/pagedkv/kvread.h).  Threads as attend_batch.  Returns
        (bytes read, XOR of all bytes read): the decode read ceiling the
        benchmark measures over the same pool and block tables."""
        _call_enter(&self.lock)
        try:
            return _read_kv_pattern(self, sids, layer)
        finally:
            _call_exit(&self.lock)

    def ref_count(self, block):
        """References to a physical block (0: free)."""
        _call_enter(&self.lock)
        try:
            return self.pool.ref_count(block)
        finally:
            _call_exit(&self.lock)

    @property
    def last_attention_plan(self):
        """How the last attend call ran: (threads used, KV heads per work item,
        key chunks per sequence; > 1 means split-K with a log-sum-exp merge)."""
        return (self.plan[0], self.plan[1], self.plan[2])

    @property
    def arena_address(self):
        """(address, bytes) of the pool's arena (for tests: its alignment and huge-page
        advice, include/pagedkv/alloc.h)."""
        return (<uintptr_t>self.pool.arena, self.pool.geom.block_bytes * <size_t>self.pool.num_blocks)

    def debug_snapshot(self):
        """The whole cache's state in one read (for tests; _diag.pxi says what it holds)."""
        _call_enter(&self.lock)
        try:
            return _debug_snapshot(self)
        finally:
            _call_exit(&self.lock)

    def debug_state(self, sid):
        """Internal view of a sequence (for tests): segments, offsets, table."""
        _call_enter(&self.lock)
        try:
            return _debug_state(self, sid)
        finally:
            _call_exit(&self.lock)
