# cython: language_level=3, wraparound=False, cdivision=True, initializedcheck=False
"""Cython core of pagedkv: mechanics only, one file per concept.

    _pool.pxi       BlockPool: the arena of K/V blocks, reference counts, the
                    free queue (least recently freed first)
    _seqtable.pxi   SequenceTable: one Seq struct per sequence, ids, grow /
                    StreamingLLM trim / copy-on-write / fork / truncate / free
    _core.pyx       CacheCore: the facade PagedKVCache holds; it checks every
                    argument once and calls the C kernels of include/pagedkv/
                    (picked from their dispatch table) without the GIL

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
_SIMD_NAMES = ("scalar", "avx2", "avx512", "neon")  # indexed by PKV_SIMD_* (simd.h)


def simd_supported():
    """SIMD paths this machine can run, slowest first."""
    return [name for i, name in enumerate(_SIMD_NAMES) if pkv_simd_supported(i)]


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
    """Name of the active SIMD path: 'scalar', 'avx2', 'avx512' or 'neon'."""
    return _SIMD_NAMES[_simd]


def has_openmp():
    """True when the extension was built with OpenMP."""
    return bool(pkv_have_openmp())


def set_num_threads(n):
    """Threads used by the attention kernels (n >= 1; 0 restores the default)."""
    global _nthreads
    n = int(n)
    if n < 0:
        raise ValueError(f"number of threads must be >= 0, got {n}")
    _nthreads = n


def get_num_threads():
    """Threads the attention kernels use now."""
    return _nthreads if _nthreads > 0 else pkv_max_threads()


#: logical CPUs, read once: os.cpu_count() reads /sys on Linux (about 12 us on a VM, most of
#: the construction of a small cache); a cache sizes its starting kernel scratch by it
_CPUS = os.cpu_count() or 1


# ----------------------------------------------------------------------------
# helpers

cdef inline int64_t _cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef void *_zalloc(size_t n, void **raw) except NULL:
    """Zeroed allocation aligned to 64 bytes; *raw receives the pointer to free.

    The memory is written here (not left to lazy zero pages), so the pool is
    resident from construction on and no append ever takes a page fault."""
    cdef void *p = malloc(n + 64)
    if p == NULL:
        raise MemoryError(f"cannot allocate {n} bytes")
    raw[0] = p
    p = <void *>((<uintptr_t>p + 63) & ~(<uintptr_t>63))
    with nogil:
        memset(p, 0, n)
    return p



include "_lock.pxi"
include "_pool.pxi"
include "_seqtable.pxi"
include "_checks.pxi"
include "_kernels.pxi"


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
    def num_free_blocks(self):
        return self.pool.num_free

    @property
    def bytes_per_block(self):
        """Bytes of one block: K and V of every layer."""
        return self.pool.bytes_per_block

    # ------------------------------------------------------------------
    # the lock (thread model: _lock.pxi) and ids

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
        cdef Seq *s
        cdef int64_t i, n = 0
        cdef int64_t *p
        _call_enter(&self.lock)
        try:
            s = self.seqs.lookup(sid)
            out = cnp.PyArray_EMPTY(1, [pkv_held(&s.segs)], cnp.NPY_INT64, 0)
            p = <int64_t *>cnp.PyArray_DATA(out)
            for i in range(s.segs.a0, s.segs.a1):
                p[n] = i + s.off0
                n += 1
            for i in range(s.segs.b0, s.segs.b1):
                p[n] = i + s.off1
                n += 1
            return out
        finally:
            _call_exit(&self.lock)

    cdef object _table_copy(self, const Seq *s):
        out = np.empty(s.nblk, dtype=np.int32)
        if s.nblk:
            memcpy(cnp.PyArray_DATA(out), s.table, 4 * s.nblk)
        return out

    def block_table(self, sid):
        """Physical block ids of the sequence, in order (a copy, int32)."""
        cdef Seq *s
        _call_enter(&self.lock)
        try:
            return self._table_copy(self.seqs.lookup(sid))
        finally:
            _call_exit(&self.lock)

    def sequence_infos(self):
        """(sid, last_use, use_count, tokens, blocks, priority, order) of every live
        sequence, lowest slot first: what the eviction strategies rank."""
        cdef int64_t i
        cdef Seq *s
        _call_enter(&self.lock)
        try:
            out = []
            for i in range(self.seqs.max_seqs):
                s = &self.seqs.seqs[i]
                if s.sid >= 0:
                    out.append((s.sid, s.last_use, s.use_count, pkv_held(&s.segs), s.nblk,
                                s.priority, s.order))
            return out
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
            return self._written_tokens(sid)
        finally:
            _call_exit(&self.lock)

    cdef object _written_tokens(self, object sid):
        cdef Seq *s = self.seqs.lookup(sid)
        cdef int64_t w = s.written[0]
        cdef int l
        for l in range(1, self.num_layers):
            w = min(w, s.written[l])
        return w

    def adopt(self, blocks, double priority=0.0):
        """A new sequence holding `blocks` (in use, or free but still cached),
        full and written on every layer: a prefix-cache hit (pagedkv/prefix.py).
        Returns its id; raises and changes nothing when a block is invalid."""
        _call_enter(&self.lock)
        try:
            return self._adopt(blocks, priority)
        finally:
            _call_exit(&self.lock)

    cdef object _adopt(self, object blocks, object priority):
        cdef cnp.ndarray arr = np.require(blocks, np.int32, ("C_CONTIGUOUS", "ALIGNED"))
        cdef int64_t n = arr.shape[0] if arr.ndim == 1 else -1, i
        cdef const int32_t *b = <const int32_t *>cnp.PyArray_DATA(arr)
        if n < 0:
            raise ValueError("blocks must be one-dimensional")
        if n > self.max_blocks_per_seq:
            raise ValueError(f"{n} blocks exceed max_blocks_per_seq={self.max_blocks_per_seq}")
        for i in range(n):
            if b[i] < 0 or b[i] >= self.pool.num_blocks or (
                    self.pool.refcount[b[i]] == 0 and not self.pool.cached[b[i]]):
                raise ValueError(f"block {b[i]} is neither in use nor cached")
        return self.seqs.adopt(b, n, priority).sid

    # ------------------------------------------------------------------
    # compaction, resize, export / import

    def compact(self):
        """Move every used block to the lowest ids and rewrite the block tables.
        Returns (blocks moved, moved_to) where moved_to[b] is b's new id."""
        _call_enter(&self.lock)
        try:
            return self._compact()
        finally:
            _call_exit(&self.lock)

    cdef object _compact(self):
        moved_to = np.empty(self.pool.num_blocks, dtype=np.int32)
        cdef int32_t *m = <int32_t *>cnp.PyArray_DATA(moved_to)
        moves = self.pool.compact(m)
        self.seqs.renumber(m)
        return moves, moved_to

    def resize(self, num_blocks):
        """Grow or shrink the pool to num_blocks (every block >= num_blocks must be
        free: compact() first).  max_blocks_per_seq does not change."""
        _call_enter(&self.lock)
        try:
            return self._resize(num_blocks)
        finally:
            _call_exit(&self.lock)

    cdef object _resize(self, object num_blocks):
        n = _positive_int("num_blocks", num_blocks)
        if n > 2**31 - 1:
            raise ValueError(f"num_blocks must be < 2**31, got {n}")
        hi = self.pool.highest_used()
        if n <= hi:
            raise ValueError(
                f"cannot shrink the pool to {n} blocks: block {hi} is in use "
                f"({self.pool.num_blocks - self.pool.num_free} blocks used); call compact() first")
        if n * self.pool.geom.block_bytes > 2**56:
            raise MemoryError(f"the pool would need {n * self.pool.geom.block_bytes} bytes")
        if n != self.pool.num_blocks:
            self.pool.resize(n)

    def export_seq(self, sid):
        """(meta, blocks) of a sequence: its segments and offsets, and its
        blocks' raw bytes in table order (uint8 [nblk, bytes_per_block])."""
        _call_enter(&self.lock)
        try:
            return self._export_seq(sid)
        finally:
            _call_exit(&self.lock)

    cdef object _export_seq(self, object sid):
        cdef Seq *s = self.seqs.lookup(sid)
        cdef int64_t i
        cdef size_t bb = self.pool.geom.block_bytes
        _check_step_done(s, sid, self.num_layers, "export")
        data = np.empty((s.nblk, bb), dtype=np.uint8)
        cdef char *d = <char *>cnp.PyArray_DATA(data)
        for i in range(s.nblk):
            memcpy(d + i * bb, self.pool.block_ptr(s.table[i]), bb)
        meta = dict(nblk=s.nblk, a0=s.segs.a0, a1=s.segs.a1, b0=s.segs.b0, b1=s.segs.b1,
                    off0=s.off0, off1=s.off1, priority=s.priority)
        return meta, data

    def import_seq(self, meta, data):
        """A new sequence from export_seq's (meta, blocks); checks everything
        first and changes nothing when it raises."""
        _call_enter(&self.lock)
        try:
            return self._import_seq(meta, data)
        finally:
            _call_exit(&self.lock)

    cdef object _import_seq(self, object meta, object data):
        cdef size_t bb = self.pool.geom.block_bytes
        cdef int64_t bs = self.block_size, i
        try:
            nblk, a0, a1, b0, b1, off0, off1 = (int(meta[k]) for k in (
                "nblk", "a0", "a1", "b0", "b1", "off0", "off1"))
            priority = float(meta.get("priority", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"sequence metadata is incomplete or malformed: {e}") from None
        # kept positions (slot + offset of its segment) must increase: the sinks before the window
        if not (0 <= a0 <= a1 <= b0 <= b1 and 0 <= nblk and _cdiv(b1, bs) == nblk
                and 0 <= off0 < 2**62 and 0 <= off1 < 2**62
                and (a0 == a1 or a1 + off0 <= b0 + off1)):
            raise ValueError(
                f"inconsistent sequence metadata: segments [{a0}, {a1}) [{b0}, {b1}) at "
                f"offsets {off0}, {off1}, {nblk} blocks of {bs} tokens")
        if nblk > self.max_blocks_per_seq:
            raise ValueError(
                f"the sequence holds {nblk} blocks; max_blocks_per_seq is {self.max_blocks_per_seq}")
        cdef cnp.ndarray arr = np.ascontiguousarray(data, dtype=np.uint8)
        if arr.size != nblk * bb:
            raise ValueError(f"expected {nblk * bb} bytes of blocks, got {arr.size}")
        if self.seqs.n_slots_free == 0:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use (max_seqs)")
        self.seqs.check_free(nblk, 0)
        cdef Seq *s = self.seqs.new_seq(priority)
        cdef const char *d = <const char *>cnp.PyArray_DATA(arr)
        for i in range(nblk):
            s.table[i] = self.pool.take()
            memcpy(self.pool.block_ptr(s.table[i]), d + i * bb, bb)
        s.nblk = nblk
        s.segs.a0, s.segs.a1, s.segs.b0, s.segs.b1 = a0, a1, b0, b1
        s.off0, s.off1 = off0, off1
        for i in range(self.num_layers):
            s.written[i] = b1 + off1
        return s.sid

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
    # append

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

    # ------------------------------------------------------------------
    # attention

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

    def read_kv_pattern(self, sids, layer=0):
        """Read the K and V bytes attend_batch(sids) reads, in its block pattern,
        and compute nothing: for each sequence, each block its held tokens touch,
        the block's K plane of `layer` (all KV heads), then its V plane
        (include/pagedkv/kvread.h).  Threads as attend_batch.  Returns
        (bytes read, XOR of all bytes read): the decode read ceiling the
        benchmark measures over the same pool and block tables."""
        _call_enter(&self.lock)
        try:
            return self._read_kv_pattern(sids, layer)
        finally:
            _call_exit(&self.lock)

    cdef object _read_kv_pattern(self, object sids, object layer):
        cdef int l = _check_layer(self, layer)
        cdef int64_t B = _batch_len(self, sids), i
        cdef Seq *s
        for i in range(B):
            s = self.seqs.lookup(sids[i])
            _check_attendable(self, s, l, 1)
            self.b_tables[i] = s.table
            self.b_segs[i] = s.segs
        cdef int nt = _nthreads if _nthreads > 0 else pkv_max_threads()
        cdef const char *k = self.pool.plane(l)
        cdef size_t plane = self.pool.geom.plane_bytes, nbytes = 0
        cdef uint64_t x
        with nogil:
            x = pkv_read_pattern(k, k + plane, plane, self.pool.geom.block_bytes,
                                 self.block_size, B, <const int32_t *const *>self.b_tables,
                                 self.b_segs, _simd, nt, &nbytes)
        x ^= x >> 32
        x ^= x >> 16
        x ^= x >> 8
        return int(nbytes), int(x & 0xFF)

    # ------------------------------------------------------------------
    # gather

    def gather(self, sid, layer=0):
        """Contiguous copies (k, v), each [seq_len, Hkv, D], of the held tokens."""
        _call_enter(&self.lock)
        try:
            return _gather(self, sid, layer)
        finally:
            _call_exit(&self.lock)

    # ------------------------------------------------------------------
    # introspection

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

    def debug_state(self, sid):
        """Internal view of a sequence (for tests): segments, offsets, table."""
        cdef Seq *s
        _call_enter(&self.lock)
        try:
            s = self.seqs.lookup(sid)
            return dict(a0=s.segs.a0, a1=s.segs.a1, b0=s.segs.b0, b1=s.segs.b1, off0=s.off0,
                        off1=s.off1, table=self._table_copy(s).tolist())
        finally:
            _call_exit(&self.lock)


def read_bandwidth(nbytes=256 << 20, repeats=5, threads=None):
    """Measure memory read bandwidth (bytes/s, best of `repeats`) with the core's
    SIMD read kernel over a buffer of `nbytes` (should be well above the L3 size)."""
    import time
    cdef int nt = get_num_threads() if threads is None else int(threads)
    if nt < 1:
        raise ValueError(f"threads must be >= 1, got {nt}")
    buf = np.ones(max(int(nbytes) // 4, 1024), dtype=np.float32)
    cdef const void *p = cnp.PyArray_DATA(buf)
    cdef size_t n = buf.size
    cdef double s
    best = 0.0
    with nogil:
        s = pkv_read_sum(p, n, PKV_F32, _simd, nt)  # warm: pages resident, threads up
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        with nogil:
            s = pkv_read_sum(p, n, PKV_F32, _simd, nt)
        dt = time.perf_counter() - t0
        if s != <double>n:
            raise RuntimeError("read kernel returned a wrong sum")
        best = max(best, n * 4 / dt)
    return best


# ----------------------------------------------------------------------------
# instruction peak (include/pagedkv/peak.h)

_PEAK_KINDS = {"fma_f32": PKV_PEAK_FMA_F32, "fma_f64": PKV_PEAK_FMA_F64}


def _peak_args(kind, simd, threads):
    """(kind index, SIMD index, threads) of a peak probe, checked."""
    if not isinstance(kind, str) or kind not in _PEAK_KINDS:
        raise ValueError(f"unknown instruction kind {kind!r}; expected one of "
                         f"{', '.join(_PEAK_KINDS)}")
    cdef int k = _PEAK_KINDS[kind]
    cdef int s = _simd
    if simd is not None:
        if not isinstance(simd, str) or simd not in _SIMD_NAMES:
            raise ValueError(f"unknown SIMD path {simd!r}; expected one of "
                             f"{', '.join(_SIMD_NAMES)}")
        s = _SIMD_NAMES.index(simd)
        if not pkv_simd_supported(s):
            raise ValueError(f"SIMD path {simd!r} does not run on this machine (it runs "
                             f"{', '.join(simd_supported())})")
    if pkv_peak_width(k, s) == 0:
        raise ValueError(f"no {kind} probe for SIMD path {_SIMD_NAMES[s]!r} in this build")
    nt = int(threads)
    if nt < 1:
        raise ValueError(f"threads must be >= 1, got {nt}")
    return k, s, nt


def _fma_probe(kind="fma_f32", simd=None, iters=1, threads=1, a=0.5, b=1.0):
    """Run the peak loop once, `iters` rounds on each of `threads` threads:
    (lanes done, sum of every final lane).  Lane k of a thread's chains
    starts at k, and each round turns its value c into c * a + b (for the
    tests)."""
    cdef int k, s, nt
    k, s, nt = _peak_args(kind, simd, threads)
    cdef int64_t n = int(iters)
    if n < 0:
        raise ValueError(f"iters must be >= 0, got {n}")
    cdef double fa = float(a), fb = float(b), total = 0.0
    cdef uint64_t lanes
    with nogil:
        lanes = pkv_peak_run(k, s, n, nt, fa, fb, &total)
    return int(lanes), float(total)


def instruction_peak(kind="fma_f32", simd=None, threads=1, seconds=0.05, repeats=20):
    """Measured peak rate of an instruction on this machine, in lanes per second.

    kind: "fma_f32" / "fma_f64", the fused multiply-add the attention kernels
    are built on (one multiply-add of one lane counts 1).  simd: the path
    ("scalar", "avx2", "avx512", "neon"; None: the active one,
    simd_backend()).  threads: threads running the loop at once (OpenMP;
    a build without it runs their loops one after another, so the rate is
    one thread's); the rate is the lanes of all of them / wall time.  The loop
    (include/pagedkv/peak.h: 12 independent FMA chains over SIMD registers)
    is timed for about `seconds` in all, as `repeats` runs of equal length
    after a calibration that also warms up; the best run counts (short runs
    are less likely to lose the CPU to another process on a shared machine).
    Raises ValueError for an unknown kind or path, a path this machine does
    not run, threads < 1, seconds <= 0 or repeats < 1."""
    import math
    import time
    cdef int k, s, nt
    k, s, nt = _peak_args(kind, simd, threads)
    secs = float(seconds)
    if not (secs > 0 and math.isfinite(secs)):
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    nrep = int(repeats)
    if nrep < 1:
        raise ValueError(f"repeats must be >= 1, got {nrep}")
    run_s = secs / nrep
    cdef uint64_t per_round = <uint64_t>nt * PKV_PEAK_CHAINS * pkv_peak_width(k, s)
    cdef int64_t iters = 256
    rate = 0.0  # best rounds per second seen
    # calibration, which also warms up (thread pool started, clocks up): at
    # least 3 runs, until one lasts half a timed run
    for cal in range(64):
        dt = _peak_once(k, s, iters, nt, per_round)
        rate = max(rate, iters / dt)
        if cal >= 2 and dt >= 0.5 * run_s:
            break
        iters = max(iters, min(64 * iters, <int64_t>(rate * run_s) + 1))
    iters = max(256, <int64_t>(rate * run_s))
    best = 0.0
    for _ in range(nrep):
        best = max(best, iters * per_round / _peak_once(k, s, iters, nt, per_round))
    return best


cdef double _peak_once(int k, int s, int64_t iters, int nt, uint64_t per_round) except -1:
    """Seconds one run of the probe took; checks the lanes it counted and its
    checksum: with a = 0.5, b = 1 every lane ends at exactly 2 after >= 256
    rounds (2^-256 times any start is below half an ulp of 2)."""
    import time
    cdef uint64_t lanes
    cdef double total = 0.0
    t0 = time.perf_counter()
    with nogil:
        lanes = pkv_peak_run(k, s, iters, nt, 0.5, 1.0, &total)
    dt = time.perf_counter() - t0
    if total != 2.0 * per_round or lanes != <uint64_t>iters * per_round:
        raise RuntimeError(f"peak probe: {lanes} lanes with checksum {total}, expected "
                           f"{iters * per_round} lanes with checksum {2.0 * per_round}")
    return max(dt, 1e-9)
