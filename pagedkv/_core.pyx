# cython: language_level=3, wraparound=False, cdivision=True, initializedcheck=False
"""Cython core of pagedkv: the page pool, sequence metadata and kernel calls.

Everything here is mechanics: a free list and reference counts over physical
blocks, per-sequence block tables and segment bounds in preallocated C arrays,
and thin entry points that check every argument once and then call the C
kernels of include/pagedkv/ without the GIL.  Policy (which sequences to
evict, StreamingLLM parameters, statistics objects) lives in the Python layer.

Per-sequence state, for a sequence in metadata slot ``s``::

    table[s, :nblk[s]]   physical block ids, in order
    segs[s]              held slots [a0, a1) then [b0, b1); appends go to b1
    off0[s], off1[s]     stream position of a slot = slot + off (per segment)
    written[s, layer]    stream position up to which that layer is written
    step_n[s]            n of the newest layer-0 append (0: none pending)

Sequence ids are ``epoch * max_seqs + slot``: unique for the life of the cache,
so a freed id never aliases a newer sequence.
"""
import os

import numpy as np

cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset

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
    """

    def __init__(self, needed, available):
        self.needed = int(needed)
        self.available = int(available)
        super().__init__(
            f"out of KV blocks: the call needs {self.needed} free block(s), "
            f"{self.available} available"
        )

    def __reduce__(self):
        return (type(self), (self.needed, self.available))


# ----------------------------------------------------------------------------
# SIMD selection and threads

cdef int _simd_detected = pkv_detect_simd()
_SIMD_NAMES = ("scalar", "avx2", "avx512")


def _choose_simd():
    forced = os.environ.get("PAGEDKV_SIMD", "").strip().lower()
    if not forced:
        return _simd_detected
    if forced not in _SIMD_NAMES:
        raise ValueError(
            f"PAGEDKV_SIMD={forced!r}: expected one of {', '.join(_SIMD_NAMES)}")
    level = _SIMD_NAMES.index(forced)
    if level > _simd_detected:
        raise RuntimeError(
            f"PAGEDKV_SIMD={forced!r} but this CPU supports at most "
            f"{_SIMD_NAMES[_simd_detected]!r}")
    return level


cdef int _simd = _choose_simd()
cdef int _nthreads = 0  # 0: follow OpenMP (OMP_NUM_THREADS)


def simd_backend():
    """Name of the active SIMD path: 'scalar', 'avx2' or 'avx512'."""
    return _SIMD_NAMES[_simd]


def simd_supported():
    """SIMD paths this machine can run, slowest first."""
    return list(_SIMD_NAMES[:_simd_detected + 1])


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


# ----------------------------------------------------------------------------
# helpers

cdef inline int64_t _cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline int64_t _held(const pkv_segs *s) noexcept nogil:
    return (s.a1 - s.a0) + (s.b1 - s.b0)


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


cdef dict _DTYPES = {"float32": 0, "float64": 1}


def _dtype_code(dtype):
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"dtype must be 'float32' or 'float64', got {dtype!r}") from None
    if name not in _DTYPES:
        raise TypeError(f"dtype must be 'float32' or 'float64', got {name!r}")
    return _DTYPES[name]


def _positive_int(name, value, minimum=1):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# A plan for growing one sequence (computed first, applied only if it fits).
ctypedef struct _Plan:
    pkv_segs segs          # new segments (after eviction, after block drop)
    int64_t off0, off1
    int64_t drop_a         # blocks dropped from the front
    int64_t drop_b_start   # then blocks [drop_b_start, drop_b_start + drop_b) dropped
    int64_t drop_b
    int64_t freed          # dropped blocks that return to the pool (refcount 1)
    int64_t evicted_tokens
    int64_t keep_nblk      # blocks held after the drop
    int64_t new_blocks     # fresh blocks for the write
    int64_t cow            # shared blocks the write must copy first


cdef class CacheCore:
    """Preallocated pool + sequence metadata; see PagedKVCache for the API."""

    cdef:
        readonly int64_t num_blocks
        readonly int block_size
        readonly int num_kv_heads
        readonly int head_dim
        readonly int num_layers
        readonly int64_t max_seqs
        readonly int64_t max_blocks_per_seq
        int dtype_code
        int typenum
        size_t itemsize
        size_t row_bytes          # one token of one head: D * itemsize
        size_t block_bytes        # one block of one layer: Hkv * bs * D * itemsize
        size_t layer_bytes
        char *k_data
        char *v_data
        void *k_raw
        void *v_raw
        # pool
        int32_t *refcount
        int32_t *free_stack
        int64_t n_free
        # sequences
        int32_t *tables
        int64_t *nblk
        pkv_segs *segs
        int64_t *off0
        int64_t *off1
        int64_t *written
        int64_t *step_n
        int64_t *sids
        int64_t *epoch
        int32_t *slot_stack
        int64_t n_slots_free
        # per-sequence use statistics (for eviction strategies)
        int64_t *last_use
        int64_t *use_count
        int64_t tick
        # StreamingLLM (cache-wide): sink/window tokens, -1 when off
        int64_t sink_tokens
        int64_t window_tokens
        # RoPE tables (kept alive by these references)
        object _rope_cos
        object _rope_sin
        pkv_rope rope
        bint has_rope
        # batch and kernel scratch
        const int32_t **b_tables
        pkv_segs *b_segs
        int64_t *b_slots
        int64_t *b_mark
        int64_t mark
        _Plan *b_plans
        void *scratch
        void *scratch_raw
        size_t scratch_stride
        int scratch_threads
        void *partial             # split-K partial states, 2 slots per thread
        void *partial_raw
        # counters
        readonly int64_t blocks_allocated
        readonly int64_t blocks_freed
        readonly int64_t cow_copies
        readonly int64_t forks
        readonly int64_t seqs_added
        readonly int64_t seqs_freed
        readonly int64_t evicted_tokens
        readonly int64_t evicted_blocks
        readonly int64_t peak_used
        void *_r[19]              # raw pointers of the metadata arrays, for free()
        bint busy                 # an attend/gather call is under way (it releases the GIL)
        int64_t plan[3]           # the last attention call's threads, heads/item, key chunks

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, num_layers=1,
                 dtype="float32", max_seqs=256, max_blocks_per_seq=None,
                 rope_cos=None, rope_sin=None):
        cdef int64_t i
        if self.k_raw != NULL:
            raise RuntimeError("the cache is already initialized")
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        if max_blocks_per_seq is None:
            self.max_blocks_per_seq = self.num_blocks
        else:
            self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        if self.num_blocks > 2**31 - 1:
            raise ValueError(f"num_blocks must be < 2**31, got {self.num_blocks}")
        for name in ("max_seqs", "max_blocks_per_seq"):
            if int(getattr(self, name)) > 2**31 - 1:
                raise ValueError(f"{name} must be < 2**31, got {getattr(self, name)}")
        self.dtype_code = _dtype_code(dtype)
        self.typenum = cnp.NPY_FLOAT32 if self.dtype_code == 0 else cnp.NPY_FLOAT64
        self.itemsize = 4 if self.dtype_code == 0 else 8
        self.row_bytes = <size_t>self.head_dim * self.itemsize
        self.block_bytes = <size_t>self.num_kv_heads * self.block_size * self.row_bytes
        self.layer_bytes = self.block_bytes * <size_t>self.num_blocks
        self.sink_tokens = -1
        self.window_tokens = -1
        # sizes in Python integers first: no C overflow on absurd arguments
        pool_bytes = (2 * int(self.num_layers) * int(self.num_blocks) * int(self.num_kv_heads)
                      * int(self.block_size) * int(self.head_dim) * int(self.itemsize))
        meta_bytes = int(self.max_seqs) * (4 * int(self.max_blocks_per_seq)
                                           + 8 * int(self.num_layers) + 256)
        if pool_bytes + meta_bytes > 2**56:
            raise MemoryError(f"the cache would need {pool_bytes + meta_bytes} bytes")

        total = self.layer_bytes * <size_t>self.num_layers
        self.k_data = <char *>_zalloc(total, &self.k_raw)
        self.v_data = <char *>_zalloc(total, &self.v_raw)
        self.refcount = <int32_t *>_zalloc(4 * self.num_blocks, &self._r[0])
        self.free_stack = <int32_t *>_zalloc(4 * self.num_blocks, &self._r[1])
        # hand out low block ids first
        for i in range(self.num_blocks):
            self.free_stack[i] = <int32_t>(self.num_blocks - 1 - i)
        self.n_free = self.num_blocks

        cdef int64_t S = self.max_seqs
        self.tables = <int32_t *>_zalloc(4 * S * self.max_blocks_per_seq, &self._r[2])
        self.nblk = <int64_t *>_zalloc(8 * S, &self._r[3])
        self.segs = <pkv_segs *>_zalloc(sizeof(pkv_segs) * S, &self._r[4])
        self.off0 = <int64_t *>_zalloc(8 * S, &self._r[5])
        self.off1 = <int64_t *>_zalloc(8 * S, &self._r[6])
        self.written = <int64_t *>_zalloc(8 * S * self.num_layers, &self._r[7])
        self.step_n = <int64_t *>_zalloc(8 * S, &self._r[8])
        self.sids = <int64_t *>_zalloc(8 * S, &self._r[9])
        self.epoch = <int64_t *>_zalloc(8 * S, &self._r[10])
        self.slot_stack = <int32_t *>_zalloc(4 * S, &self._r[11])
        self.last_use = <int64_t *>_zalloc(8 * S, &self._r[12])
        self.use_count = <int64_t *>_zalloc(8 * S, &self._r[13])
        self.b_tables = <const int32_t **>_zalloc(sizeof(void *) * S, &self._r[14])
        self.b_segs = <pkv_segs *>_zalloc(sizeof(pkv_segs) * S, &self._r[15])
        self.b_slots = <int64_t *>_zalloc(8 * S, &self._r[16])
        self.b_mark = <int64_t *>_zalloc(8 * S, &self._r[17])
        self.b_plans = <_Plan *>_zalloc(sizeof(_Plan) * S, &self._r[18])
        for i in range(S):
            self.sids[i] = -1
            self.slot_stack[i] = <int32_t>(S - 1 - i)
        self.n_slots_free = S

        self.has_rope = rope_cos is not None
        if self.has_rope:
            self._set_rope(rope_cos, rope_sin)
        self._ensure_scratch(max(pkv_max_threads(), os.cpu_count() or 1))

    def __dealloc__(self):
        free(self.k_raw)
        free(self.v_raw)
        for i in range(19):
            free(self._r[i])
        free(self.scratch_raw)
        free(self.partial_raw)

    cdef _set_rope(self, cos, sin):
        dt = np.float32 if self.dtype_code == 0 else np.float64
        cos = np.ascontiguousarray(cos, dtype=dt)
        sin = np.ascontiguousarray(sin, dtype=dt)
        if cos.ndim != 2 or cos.shape != sin.shape:
            raise ValueError("rope tables must be two arrays of equal shape [max_pos, half]")
        half = cos.shape[1]
        if half < 1 or 2 * half > self.head_dim:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={self.head_dim}]")
        if cos.shape[0] < self.max_blocks_per_seq * self.block_size:
            raise ValueError("rope tables must cover max_blocks_per_seq * block_size positions")
        self._rope_cos = cos
        self._rope_sin = sin
        self.rope.cos = cnp.PyArray_DATA(cos)
        self.rope.sin = cnp.PyArray_DATA(sin)
        self.rope.max_pos = cos.shape[0]
        self.rope.half = <int>half

    cdef int _ensure_scratch(self, int threads) except -1:
        if threads <= self.scratch_threads:
            return 0
        stride = pkv_scratch_bytes(self.block_size, self.head_dim, self.itemsize)
        free(self.scratch_raw)
        free(self.partial_raw)
        self.scratch_raw = NULL
        self.partial_raw = NULL
        self.scratch_threads = 0
        self.scratch = _zalloc(stride * threads, &self.scratch_raw)
        self.partial = _zalloc(2 * threads * pkv_partial_slot_bytes(self.head_dim, self.itemsize),
                               &self.partial_raw)
        self.scratch_stride = stride
        self.scratch_threads = threads
        return 0

    # ------------------------------------------------------------------
    # properties

    @property
    def dtype(self):
        return np.dtype(np.float32 if self.dtype_code == 0 else np.float64)

    @property
    def num_free_blocks(self):
        return self.n_free

    @property
    def bytes_per_block(self):
        """Bytes of one block across K and V and all layers."""
        return 2 * self.block_bytes * self.num_layers

    # ------------------------------------------------------------------
    # pool

    cdef inline int32_t _take_block(self) noexcept:
        cdef int32_t b
        self.n_free -= 1
        b = self.free_stack[self.n_free]
        self.refcount[b] = 1
        self.blocks_allocated += 1
        if self.num_blocks - self.n_free > self.peak_used:
            self.peak_used = self.num_blocks - self.n_free
        return b

    cdef inline void _release_block(self, int32_t b) noexcept:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free_stack[self.n_free] = b
            self.n_free += 1
            self.blocks_freed += 1

    # ------------------------------------------------------------------
    # sequence lookup

    cdef inline int _check_idle(self) except -1:
        if self.busy:
            raise RuntimeError(
                "this cache is in use by another thread (a cache serves one call at a time)")
        return 0

    cdef inline int _claim(self) except -1:
        """Mark the cache busy for a call that releases the GIL (the caller clears
        it in a finally): from here on other threads' calls on this cache raise."""
        self._check_idle()
        self.busy = True
        return 0

    cdef inline int64_t _slot(self, object sid) except -1:
        """Metadata slot of a live sequence id (KeyError otherwise); the cache must be idle."""
        self._check_idle()
        return self._lookup(sid)

    cdef inline int64_t _lookup(self, object sid) except -1:
        cdef long long s
        if type(sid) is not int and (not isinstance(sid, (int, np.integer))
                                     or isinstance(sid, (bool, np.bool_))):
            raise TypeError(f"sequence id must be an int, got {type(sid).__name__}")
        try:
            s = PyLong_AsLongLong(sid) if type(sid) is int else int(sid)
        except OverflowError:
            raise KeyError(f"unknown or freed sequence id {sid!r}") from None
        if s < 0 or self.sids[s % self.max_seqs] != s:
            raise KeyError(f"unknown or freed sequence id {sid!r}")
        return s % self.max_seqs

    cdef inline int _check_layer(self, object layer) except -1:
        cdef long long l
        if type(layer) is int:
            l = PyLong_AsLongLong(layer)
        elif isinstance(layer, (int, np.integer)) and not isinstance(layer, (bool, np.bool_)):
            l = int(layer)
        else:
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if l < 0 or l >= self.num_layers:
            raise ValueError(f"layer {layer} out of range: the cache has {self.num_layers} layer(s)")
        return <int>l

    def add_sequence(self):
        """Start an empty sequence and return its id."""
        cdef int64_t slot, sid
        if self.n_slots_free == 0:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use (max_seqs)")
        self.n_slots_free -= 1
        slot = self.slot_stack[self.n_slots_free]
        sid = self.epoch[slot] * self.max_seqs + slot
        self._init_slot(slot, sid)
        self.seqs_added += 1
        return sid

    cdef void _init_slot(self, int64_t slot, int64_t sid) noexcept:
        self.sids[slot] = sid
        self.nblk[slot] = 0
        self.segs[slot].a0 = 0
        self.segs[slot].a1 = 0
        self.segs[slot].b0 = 0
        self.segs[slot].b1 = 0
        self.off0[slot] = 0
        self.off1[slot] = 0
        self.step_n[slot] = 0
        for l in range(self.num_layers):
            self.written[slot * self.num_layers + l] = 0
        self.tick += 1
        self.last_use[slot] = self.tick
        self.use_count[slot] = 0

    def __contains__(self, sid):
        """`sid in cache`: True for a live sequence id."""
        try:
            self._slot(sid)
        except (KeyError, TypeError):
            return False
        return True

    def sequence_ids(self):
        """Ids of the live sequences, oldest slot first."""
        return [self.sids[i] for i in range(self.max_seqs) if self.sids[i] >= 0]

    def free(self, sid):
        """Release a sequence and every block only it held."""
        cdef int64_t slot = self._slot(sid)
        self._free_slot(slot)
        self.seqs_freed += 1

    cdef void _free_slot(self, int64_t slot) noexcept:
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        for i in range(self.nblk[slot]):
            self._release_block(table[i])
        self.nblk[slot] = 0
        self.sids[slot] = -1
        self.epoch[slot] += 1
        self.slot_stack[self.n_slots_free] = <int32_t>slot
        self.n_slots_free += 1

    def seq_len(self, sid):
        """Tokens the sequence holds now (after eviction)."""
        cdef int64_t slot = self._slot(sid)
        return _held(&self.segs[slot])

    def num_seq_blocks(self, sid):
        """Blocks the sequence holds now."""
        return self.nblk[self._slot(sid)]

    def kept_positions(self, sid):
        """Original stream positions of the held tokens, in order (int64)."""
        cdef int64_t slot = self._slot(sid)
        cdef pkv_segs s = self.segs[slot]
        return np.concatenate([
            np.arange(s.a0, s.a1, dtype=np.int64) + self.off0[slot],
            np.arange(s.b0, s.b1, dtype=np.int64) + self.off1[slot],
        ])

    def block_table(self, sid):
        """Physical block ids of the sequence, in order (a copy, int32)."""
        cdef int64_t slot = self._slot(sid)
        out = np.empty(self.nblk[slot], dtype=np.int32)
        if self.nblk[slot]:
            memcpy(cnp.PyArray_DATA(out), self.tables + slot * self.max_blocks_per_seq,
                   4 * self.nblk[slot])
        return out

    def usage(self, sid):
        """(last_use_tick, use_count) of a sequence: appends and attends count."""
        cdef int64_t slot = self._slot(sid)
        return self.last_use[slot], self.use_count[slot]

    def _ref_count(self, int32_t block):
        if block < 0 or block >= self.num_blocks:
            raise IndexError(f"block {block} out of range")
        return self.refcount[block]

    # ------------------------------------------------------------------
    # input checks

    cdef object _input(self, object a, str name, int64_t d0, int d1, int d2, str d0name):
        """Return `a` as a C-contiguous array of the cache dtype and shape (d0, d1, d2).

        d0 < 0 accepts any leading size >= 1.  Other float dtypes are
        converted, non-contiguous arrays copied; anything else raises.
        """
        cdef cnp.ndarray arr
        cdef cnp.npy_intp *dims
        if cnp.PyArray_Check(a):
            arr = <cnp.ndarray>a
            if (cnp.PyArray_TYPE(arr) == self.typenum and cnp.PyArray_NDIM(arr) == 3
                    and cnp.PyArray_ISCARRAY_RO(arr)):
                dims = cnp.PyArray_DIMS(arr)
                if ((dims[0] == d0 or (d0 < 0 and dims[0] >= 1))
                        and dims[1] == d1 and dims[2] == d2):
                    return a
        else:
            try:
                a = np.asarray(a)
            except Exception as e:
                raise TypeError(f"{name} must be a float array, got {type(a).__name__}") from e
            arr = <cnp.ndarray>a
        if arr.dtype.kind != "f":
            raise TypeError(f"{name} must be a float array (float16/32/64), got dtype {arr.dtype}")
        want = f"[{d0name}, {d1}, {d2}]"
        if arr.ndim != 3:
            raise ValueError(f"{name} must have shape {want}, got {np.ndim(arr)}-d shape {np.shape(arr)}")
        dims = cnp.PyArray_DIMS(arr)
        if not ((dims[0] == d0 or (d0 < 0 and dims[0] >= 1)) and dims[1] == d1 and dims[2] == d2):
            raise ValueError(f"{name} must have shape {want}, got {np.shape(arr)}")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    cdef object _output(self, object out, int64_t n, int hq):
        cdef cnp.ndarray arr
        if out is None:
            return cnp.PyArray_EMPTY(3, [n, hq, self.head_dim], self.typenum, 0)
        if not cnp.PyArray_Check(out):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        arr = <cnp.ndarray>out
        if cnp.PyArray_TYPE(arr) != self.typenum:
            raise TypeError(f"out must have dtype {self.dtype}, got {arr.dtype}")
        if (cnp.PyArray_NDIM(arr) != 3 or cnp.PyArray_DIMS(arr)[0] != n
                or cnp.PyArray_DIMS(arr)[1] != hq or cnp.PyArray_DIMS(arr)[2] != self.head_dim):
            raise ValueError(f"out must have shape [{n}, {hq}, {self.head_dim}], got {np.shape(arr)}")
        if not cnp.PyArray_ISCARRAY(arr):
            raise ValueError("out must be C-contiguous, aligned and writable")
        return out

    cdef object _query(self, object q, int64_t d0, str d0name, int *hq_out):
        """q as a C-contiguous [d0, Hq, D] array of the cache dtype; Hq into hq_out."""
        cdef int hq
        if not cnp.PyArray_Check(q):
            try:
                q = np.asarray(q)
            except Exception as e:
                raise TypeError(f"q must be a float array, got {type(q).__name__}") from e
        if cnp.PyArray_TYPE(q) != self.typenum and q.dtype.kind != "f":
            raise TypeError(f"q must be a float array (float16/32/64), got dtype {q.dtype}")
        if cnp.PyArray_NDIM(q) != 3:
            raise ValueError(
                f"q must have shape [{d0name}, Hq, {self.head_dim}], got shape {np.shape(q)}")
        hq = <int>cnp.PyArray_DIMS(q)[1]
        if hq < 1 or hq % self.num_kv_heads != 0:
            raise ValueError(
                f"q has {hq} heads; the number of query heads must be a positive "
                f"multiple of num_kv_heads={self.num_kv_heads}")
        hq_out[0] = hq
        return self._input(q, "q", d0, hq, self.head_dim, d0name)

    # ------------------------------------------------------------------
    # planning an append (no state changes)

    cdef int _plan(self, int64_t slot, int64_t n, _Plan *p) except -1:
        """Plan eviction (StreamingLLM) plus the write of n tokens to `slot`."""
        cdef pkv_segs s = self.segs[slot]
        cdef int64_t bs = self.block_size
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef int64_t i, e, blk
        p.segs = s
        p.off0 = self.off0[slot]
        p.off1 = self.off1[slot]
        p.drop_a = 0
        p.drop_b = 0
        p.drop_b_start = 0
        p.freed = 0
        p.evicted_tokens = 0
        p.cow = 0
        if self.sink_tokens >= 0:
            self._plan_trim(slot, self.sink_tokens, self.window_tokens, p)
        p.keep_nblk = self.nblk[slot] - p.drop_a - p.drop_b
        e = p.segs.b1 + n
        p.new_blocks = _cdiv(e, bs) - p.keep_nblk
        if p.new_blocks < 0:
            p.new_blocks = 0
        if p.segs.b1 % bs != 0 and n > 0:
            # the partly filled last block is written: copy it first if shared
            # (drops are all before it, so its index in the current table is the last)
            blk = table[self.nblk[slot] - 1]
            if self.refcount[blk] > 1:
                p.cow = 1
        return 0

    cdef int _plan_trim(self, int64_t slot, int64_t S, int64_t R, _Plan *p) except -1:
        """StreamingLLM: keep held ranks [0, S) and [h - R, h) (h = held now)."""
        cdef pkv_segs s = p.segs
        cdef int64_t h = _held(&s), n0 = s.a1 - s.a0
        cdef int64_t bs = self.block_size
        cdef int64_t x0[5]
        cdef int64_t x1[5]
        cdef int64_t xo[5]
        cdef int64_t k = 0, j, r, lo, hi, ga, gb0, gb1
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        if h <= S + R:
            return 0
        # slot intervals of the kept ranks, in rank order
        for r in range(2):
            lo = 0 if r == 0 else h - R
            hi = S if r == 0 else h
            if min(hi, n0) > lo:
                x0[k] = s.a0 + lo; x1[k] = s.a0 + min(hi, n0); xo[k] = p.off0; k += 1
            if hi > max(lo, n0):
                x0[k] = s.b0 + max(lo, n0) - n0; x1[k] = s.b0 + hi - n0; xo[k] = p.off1; k += 1
        # merge touching intervals of one segment
        j = 0
        for i in range(1, k):
            if x0[i] == x1[j] and xo[i] == xo[j]:
                x1[j] = x1[i]
            else:
                j += 1
                x0[j] = x0[i]; x1[j] = x1[i]; xo[j] = xo[i]
        k = j + 1
        # the write segment must end at b1 (possibly empty when R == 0)
        if R == 0 or x1[k - 1] != s.b1:
            lo = s.b1; r = p.off1
            if lo % bs != 0 and (k == 0 or x1[k - 1] <= lo - lo % bs):
                # the block being filled keeps no token: the next write starts a fresh
                # block (same stream position) so this one is dropped with the gap
                lo += bs - lo % bs; r = p.off1 + s.b1 - lo
            x0[k] = lo; x1[k] = lo; xo[k] = r; k += 1
            if k >= 2 and x1[k - 2] == lo and xo[k - 2] == r:
                k -= 1
        if k > 2:
            raise ValueError(
                f"cannot keep sink_tokens={S}, window_tokens={R} of this sequence: its held "
                "tokens would form more than two runs (change StreamingLLM sizes only on "
                "sequences that were not trimmed with other sizes)")
        p.evicted_tokens = h - S - R
        if k == 1:
            p.segs.a0 = x0[0]; p.segs.a1 = x0[0]; p.segs.b0 = x0[0]; p.segs.b1 = x1[0]
            p.off0 = xo[0]; p.off1 = xo[0]
        else:
            p.segs.a0 = x0[0]; p.segs.a1 = x1[0]; p.segs.b0 = x0[1]; p.segs.b1 = x1[1]
            p.off0 = xo[0]; p.off1 = xo[1]
        # whole blocks in the gaps [0, a0) and [a1, b0) go back to the pool
        p.drop_a = p.segs.a0 // bs
        gb0 = _cdiv(p.segs.a1, bs) if p.segs.a1 > p.segs.a0 else p.drop_a
        gb1 = p.segs.b0 // bs
        p.drop_b_start = gb0
        p.drop_b = gb1 - gb0 if gb1 > gb0 else 0
        for i in range(p.drop_a):
            if self.refcount[table[i]] == 1:
                p.freed += 1
        for i in range(p.drop_b_start, p.drop_b_start + p.drop_b):
            if self.refcount[table[i]] == 1:
                p.freed += 1
        # shift slots by the dropped blocks
        ga = p.drop_a * bs
        gb0 = (p.drop_a + p.drop_b) * bs
        if p.segs.a1 > p.segs.a0:
            p.segs.a0 -= ga; p.segs.a1 -= ga; p.off0 += ga
        p.segs.b0 -= gb0; p.segs.b1 -= gb0; p.off1 += gb0
        if p.segs.a1 == p.segs.a0:
            p.segs.a0 = p.segs.b0; p.segs.a1 = p.segs.b0; p.off0 = p.off1
        return 0

    cdef int _check_capacity(self, int64_t needed, int64_t freed, int64_t nblk_after) except -1:
        if nblk_after > self.max_blocks_per_seq:
            raise ValueError(
                f"the sequence would hold {nblk_after} blocks; max_blocks_per_seq is "
                f"{self.max_blocks_per_seq}")
        if needed > self.n_free + freed:
            raise OutOfBlocksError(needed, self.n_free + freed)
        return 0

    cdef void _apply_drop(self, int64_t slot, const _Plan *p) noexcept:
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef int64_t i, n = self.nblk[slot]
        if p.drop_a == 0 and p.drop_b == 0:
            return
        for i in range(p.drop_a):
            self._release_block(table[i])
        for i in range(p.drop_b_start, p.drop_b_start + p.drop_b):
            self._release_block(table[i])
        if p.drop_b:
            memmove(table + p.drop_b_start, table + p.drop_b_start + p.drop_b,
                    4 * (n - p.drop_b_start - p.drop_b))
        if p.drop_a:
            memmove(table, table + p.drop_a, 4 * (n - p.drop_a - p.drop_b))
        self.nblk[slot] = n - p.drop_a - p.drop_b
        self.evicted_blocks += p.drop_a + p.drop_b

    cdef void _apply_grow(self, int64_t slot, const _Plan *p, int64_t n) noexcept:
        """Evict, copy-on-write the last block if shared, add blocks: then b1 += n."""
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef int32_t old, new
        cdef int64_t i
        self._apply_drop(slot, p)
        self.segs[slot] = p.segs
        self.off0[slot] = p.off0
        self.off1[slot] = p.off1
        self.evicted_tokens += p.evicted_tokens
        if p.cow:
            old = table[self.nblk[slot] - 1]
            new = self._take_block()
            pkv_copy_block(self.k_data, self.num_blocks, self.num_layers, self.block_bytes, new, old)
            pkv_copy_block(self.v_data, self.num_blocks, self.num_layers, self.block_bytes, new, old)
            self._release_block(old)
            table[self.nblk[slot] - 1] = new
            self.cow_copies += 1
        for i in range(p.new_blocks):
            table[self.nblk[slot]] = self._take_block()
            self.nblk[slot] += 1
        self.segs[slot].b1 += n

    cdef inline void _touch(self, int64_t slot) noexcept:
        self.tick += 1
        self.last_use[slot] = self.tick
        self.use_count[slot] += 1

    cdef int _cow_written_range(self, int64_t slot, int64_t s0, int64_t s1) except -1:
        """Make blocks covering slots [s0, s1) private (layer > 0 writes after a fork)."""
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef int64_t bs = self.block_size, i, shared = 0
        cdef int32_t new
        for i in range(s0 // bs, _cdiv(s1, bs)):
            if self.refcount[table[i]] > 1:
                shared += 1
        if shared == 0:
            return 0
        self._check_capacity(shared, 0, 0)
        for i in range(s0 // bs, _cdiv(s1, bs)):
            if self.refcount[table[i]] > 1:
                new = self._take_block()
                pkv_copy_block(self.k_data, self.num_blocks, self.num_layers, self.block_bytes,
                               new, table[i])
                pkv_copy_block(self.v_data, self.num_blocks, self.num_layers, self.block_bytes,
                               new, table[i])
                self._release_block(table[i])
                table[i] = new
                self.cow_copies += 1
        return 0

    cdef inline void _write(self, int64_t slot, int layer, int64_t slot0, int64_t n,
                            const char *k, const char *v) noexcept:
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef size_t lo = <size_t>layer * self.layer_bytes
        pkv_write_tokens(self.k_data + lo, table, self.block_size, self.num_kv_heads,
                         self.row_bytes, slot0, n, k)
        pkv_write_tokens(self.v_data + lo, table, self.block_size, self.num_kv_heads,
                         self.row_bytes, slot0, n, v)

    cdef int _check_layer_append(self, int64_t slot, int layer, int64_t n) except -1:
        cdef int64_t total = self.segs[slot].b1 + self.off1[slot]
        if n != self.step_n[slot]:
            if self.step_n[slot] == 0:
                raise ValueError(
                    f"append on layer {layer} before any layer-0 append of this step: "
                    "append layer 0 first")
            raise ValueError(
                f"append on layer {layer} must carry the n={self.step_n[slot]} tokens of the "
                f"newest layer-0 append, got n={n}")
        if self.written[slot * self.num_layers + layer] < total - n:
            raise ValueError(
                f"layer {layer} missed an earlier step of this sequence: it is written up to "
                f"position {self.written[slot * self.num_layers + layer]}, the step starts at "
                f"{total - n}")
        return 0

    # ------------------------------------------------------------------
    # append

    def append(self, sid, k, v, layer=0):
        """Append n tokens' keys and values, each [n, Hkv, D]; see PagedKVCache."""
        cdef int64_t slot = self._slot(sid)
        cdef int l = self._check_layer(layer)
        k = self._input(k, "k", -1, self.num_kv_heads, self.head_dim, "n")
        cdef int64_t n = cnp.PyArray_DIMS(k)[0]
        v = self._input(v, "v", n, self.num_kv_heads, self.head_dim, "n")
        cdef _Plan p
        cdef int64_t total
        self._check_idle()  # input conversion may have let another thread in
        if l == 0:
            self._plan(slot, n, &p)
            self._check_capacity(p.new_blocks + p.cow, p.freed, p.keep_nblk + p.new_blocks)
            self._apply_grow(slot, &p, n)
            self.step_n[slot] = n
        else:
            self._check_layer_append(slot, l, n)
            self._cow_written_range(slot, self.segs[slot].b1 - n, self.segs[slot].b1)
        self._write(slot, l, self.segs[slot].b1 - n, n,
                    <const char *>cnp.PyArray_DATA(k), <const char *>cnp.PyArray_DATA(v))
        total = self.segs[slot].b1 + self.off1[slot]
        self.written[slot * self.num_layers + l] = total
        self._touch(slot)

    cdef int64_t _batch_len(self, object sids) except -1:
        """B = len(sids), checked: 1 <= B <= max_seqs."""
        cdef int64_t B
        try:
            B = len(sids)
        except TypeError:
            raise TypeError(f"sids must be a sequence of ints, got {type(sids).__name__}") from None
        if B < 1:
            raise ValueError("sids must name at least one sequence")
        if B > self.max_seqs:
            raise ValueError(f"{B} sequence ids given; the cache holds at most {self.max_seqs}")
        return B

    cdef int64_t _batch_slots(self, object sids) except -1:
        """Fill b_slots from a sequence of distinct ids; return B."""
        cdef int64_t B = self._batch_len(sids), i, slot
        self.mark += 1
        for i in range(B):
            slot = self._slot(sids[i])
            if self.b_mark[slot] == self.mark:
                raise ValueError(f"sequence id {sids[i]!r} appears twice in sids")
            self.b_mark[slot] = self.mark
            self.b_slots[i] = slot
        return B

    def append_batch(self, sids, k, v, layer=0):
        """Append one token to each of B distinct sequences: k, v [B, Hkv, D]."""
        cdef int l = self._check_layer(layer)
        cdef int64_t B = self._batch_slots(sids)
        cdef int64_t i, slot, needed = 0, freed = 0, total
        k = self._input(k, "k", B, self.num_kv_heads, self.head_dim, "B")
        v = self._input(v, "v", B, self.num_kv_heads, self.head_dim, "B")
        cdef const char *kp = <const char *>cnp.PyArray_DATA(k)
        cdef const char *vp = <const char *>cnp.PyArray_DATA(v)
        cdef size_t tok = self.num_kv_heads * self.row_bytes
        cdef int32_t *table
        cdef int64_t bs = self.block_size
        self._check_idle()  # input conversion may have let another thread in
        if l == 0:
            for i in range(B):
                slot = self.b_slots[i]
                self._plan(slot, 1, &self.b_plans[i])
                self._check_capacity(0, 0, self.b_plans[i].keep_nblk + self.b_plans[i].new_blocks)
                needed += self.b_plans[i].new_blocks + self.b_plans[i].cow
                freed += self.b_plans[i].freed
            self._check_capacity(needed, freed, 0)
            for i in range(B):
                slot = self.b_slots[i]
                self._apply_grow(slot, &self.b_plans[i], 1)
                self.step_n[slot] = 1
        else:
            for i in range(B):
                slot = self.b_slots[i]
                self._check_layer_append(slot, l, 1)
                table = self.tables + slot * self.max_blocks_per_seq
                if self.refcount[table[(self.segs[slot].b1 - 1) // bs]] > 1:
                    needed += 1
            self._check_capacity(needed, 0, 0)
            for i in range(B):
                slot = self.b_slots[i]
                self._cow_written_range(slot, self.segs[slot].b1 - 1, self.segs[slot].b1)
        for i in range(B):
            slot = self.b_slots[i]
            self._write(slot, l, self.segs[slot].b1 - 1, 1, kp + i * tok, vp + i * tok)
            total = self.segs[slot].b1 + self.off1[slot]
            self.written[slot * self.num_layers + l] = total
            self._touch(slot)

    # ------------------------------------------------------------------
    # attention

    cdef int _check_attendable(self, int64_t slot, int layer, int64_t n) except -1:
        cdef int64_t held = _held(&self.segs[slot])
        cdef int64_t total = self.segs[slot].b1 + self.off1[slot]
        if held == 0:
            raise ValueError(f"sequence {self.sids[slot]} is empty: append before attend")
        if n > held:
            raise ValueError(f"{n} queries but the sequence holds only {held} tokens")
        if self.written[slot * self.num_layers + layer] != total:
            raise RuntimeError(
                f"layer {layer} of sequence {self.sids[slot]} lacks its newest tokens: "
                f"append them on layer {layer} before attend")
        if pkv_check_seq(self.tables + slot * self.max_blocks_per_seq, self.nblk[slot],
                         &self.segs[slot], self.block_size, self.num_blocks) != 0:
            raise RuntimeError("internal error: inconsistent sequence metadata")
        return 0

    cdef int _fill_args(self, pkv_attn_args *a, int layer, int hq, double scale,
                        object q, object out) except -1:
        cdef size_t lo = <size_t>layer * self.layer_bytes
        a.nthreads = _nthreads if _nthreads > 0 else pkv_max_threads()
        self._ensure_scratch(a.nthreads)
        a.k = self.k_data + lo
        a.v = self.v_data + lo
        a.bs = self.block_size
        a.hkv = self.num_kv_heads
        a.hq = hq
        a.d = self.head_dim
        a.tables = self.b_tables
        a.segs = self.b_segs
        a.q = cnp.PyArray_DATA(q)
        a.out = cnp.PyArray_DATA(out)
        a.scale = scale
        a.rope = &self.rope if self.has_rope else NULL
        a.scratch = self.scratch
        a.scratch_stride = self.scratch_stride
        a.partial = self.partial
        a.partial_slots = 2 * self.scratch_threads
        a.plan_out = self.plan
        return 0

    cdef double _scale(self, object scale) except? -1:
        if scale is None:
            return 1.0 / sqrt(<double>self.head_dim)
        s = float(scale)
        if not np.isfinite(s):
            raise ValueError(f"scale must be finite, got {scale}")
        return s

    def attend(self, sid, q, layer=0, scale=None, out=None):
        """Causal attention of the newest n tokens' queries q [n, Hq, D]."""
        self._claim()
        try:
            return self._attend(sid, q, layer, scale, out)
        finally:
            self.busy = False

    cdef object _attend(self, object sid, object q, object layer, object scale, object out):
        cdef int64_t slot = self._lookup(sid)
        cdef int l = self._check_layer(layer)
        cdef int hq
        q = self._query(q, -1, "n", &hq)
        cdef int64_t n = cnp.PyArray_DIMS(q)[0]
        cdef double sc = self._scale(scale)
        self._check_attendable(slot, l, n)
        out = self._output(out, n, hq)
        cdef pkv_attn_args a
        self._fill_args(&a, l, hq, sc, q, out)
        self.b_tables[0] = self.tables + slot * self.max_blocks_per_seq
        self.b_segs[0] = self.segs[slot]
        a.nseq = 1
        a.nq = n
        with nogil:
            if n == 1:
                pkv_decode(&a, self.dtype_code, _simd)
            else:
                pkv_prefill(&a, self.dtype_code, _simd)
        self._touch(slot)
        return out

    def attend_batch(self, sids, q, layer=0, scale=None, out=None):
        """One query per sequence at its newest token: q [B, Hq, D] -> [B, Hq, D]."""
        self._claim()
        try:
            return self._attend_batch(sids, q, layer, scale, out)
        finally:
            self.busy = False

    cdef object _attend_batch(self, object sids, object q, object layer, object scale,
                              object out):
        cdef int l = self._check_layer(layer)
        cdef int64_t B, i, slot
        cdef int hq
        B = self._batch_len(sids)
        q = self._query(q, B, "B", &hq)
        cdef double sc = self._scale(scale)
        for i in range(B):
            slot = self._lookup(sids[i])
            self._check_attendable(slot, l, 1)
            self.b_slots[i] = slot
            self.b_tables[i] = self.tables + slot * self.max_blocks_per_seq
            self.b_segs[i] = self.segs[slot]
        out = self._output(out, B, hq)
        cdef pkv_attn_args a
        self._fill_args(&a, l, hq, sc, q, out)
        a.nseq = B
        a.nq = 1
        with nogil:
            pkv_decode(&a, self.dtype_code, _simd)
        for i in range(B):
            self._touch(self.b_slots[i])
        return out

    # ------------------------------------------------------------------
    # gather / fork / truncate

    def gather(self, sid, layer=0):
        """Contiguous copies (k, v), each [seq_len, Hkv, D], of the held tokens."""
        self._claim()
        try:
            return self._gather(sid, layer)
        finally:
            self.busy = False

    cdef object _gather(self, object sid, object layer):
        cdef int64_t slot = self._lookup(sid)
        cdef int l = self._check_layer(layer)
        cdef pkv_segs s = self.segs[slot]
        cdef int64_t held = _held(&s), n0 = s.a1 - s.a0
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        cdef size_t lo = <size_t>l * self.layer_bytes
        cdef size_t tok = self.num_kv_heads * self.row_bytes
        k = cnp.PyArray_EMPTY(3, [held, self.num_kv_heads, self.head_dim], self.typenum, 0)
        v = cnp.PyArray_EMPTY(3, [held, self.num_kv_heads, self.head_dim], self.typenum, 0)
        cdef char *kp = <char *>cnp.PyArray_DATA(k)
        cdef char *vp = <char *>cnp.PyArray_DATA(v)
        with nogil:
            pkv_read_tokens(self.k_data + lo, table, self.block_size, self.num_kv_heads,
                            self.row_bytes, s.a0, s.a1, kp)
            pkv_read_tokens(self.v_data + lo, table, self.block_size, self.num_kv_heads,
                            self.row_bytes, s.a0, s.a1, vp)
            pkv_read_tokens(self.k_data + lo, table, self.block_size, self.num_kv_heads,
                            self.row_bytes, s.b0, s.b1, kp + n0 * tok)
            pkv_read_tokens(self.v_data + lo, table, self.block_size, self.num_kv_heads,
                            self.row_bytes, s.b0, s.b1, vp + n0 * tok)
        return k, v

    def fork(self, sid):
        """New sequence sharing every block of `sid` (copy-on-write)."""
        cdef int64_t slot = self._slot(sid)
        cdef int64_t child, csid, i
        if self.n_slots_free == 0:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use (max_seqs)")
        self.n_slots_free -= 1
        child = self.slot_stack[self.n_slots_free]
        csid = self.epoch[child] * self.max_seqs + child
        self._init_slot(child, csid)
        memcpy(self.tables + child * self.max_blocks_per_seq,
               self.tables + slot * self.max_blocks_per_seq, 4 * self.nblk[slot])
        for i in range(self.nblk[slot]):
            self.refcount[self.tables[slot * self.max_blocks_per_seq + i]] += 1
        self.nblk[child] = self.nblk[slot]
        self.segs[child] = self.segs[slot]
        self.off0[child] = self.off0[slot]
        self.off1[child] = self.off1[slot]
        self.step_n[child] = self.step_n[slot]
        memcpy(self.written + child * self.num_layers, self.written + slot * self.num_layers,
               8 * self.num_layers)
        self.forks += 1
        self.seqs_added += 1
        return csid

    def truncate(self, sid, length):
        """Roll back to the first `length` held tokens."""
        cdef int64_t slot = self._slot(sid)
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        cdef pkv_segs s = self.segs[slot]
        cdef int64_t held = _held(&s), n0 = s.a1 - s.a0, L, keep, i, total
        cdef int32_t *table = self.tables + slot * self.max_blocks_per_seq
        if length < 0 or length > held:
            raise ValueError(f"truncate length must be in [0, {held}], got {length}")
        L = length
        if L == held:
            return
        if L == 0:
            self.off1[slot] = s.a0 + self.off0[slot] if n0 > 0 else s.b0 + self.off1[slot]
            s.a0 = 0; s.a1 = 0; s.b0 = 0; s.b1 = 0
            self.off0[slot] = self.off1[slot]
        elif L <= n0:
            self.off1[slot] = self.off0[slot]
            s.b0 = s.a0; s.b1 = s.a0 + L; s.a1 = s.a0
        else:
            s.b1 = s.b0 + (L - n0)
        self.segs[slot] = s
        keep = _cdiv(s.b1, self.block_size)
        for i in range(keep, self.nblk[slot]):
            self._release_block(table[i])
        self.nblk[slot] = keep
        total = s.b1 + self.off1[slot]
        for i in range(self.num_layers):
            if self.written[slot * self.num_layers + i] > total:
                self.written[slot * self.num_layers + i] = total
        self.step_n[slot] = 0

    # ------------------------------------------------------------------
    # eviction hooks for the Python layer

    def _set_streaming(self, int64_t sink_tokens, int64_t window_tokens):
        """Enable (sink, window >= 0) or disable (-1, -1) per-append trimming."""
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens

    def trim(self, sid, sink_tokens, window_tokens):
        """Evict `sid` now to its first sink_tokens + last window_tokens held tokens.

        Returns (evicted_tokens, freed_blocks)."""
        cdef int64_t slot = self._slot(sid)
        cdef _Plan p
        cdef int64_t S = _positive_int("sink_tokens", sink_tokens, 0)
        cdef int64_t R = _positive_int("window_tokens", window_tokens, 0)
        cdef int64_t before = self.n_free
        cdef int64_t total = self.segs[slot].b1 + self.off1[slot], l
        for l in range(self.num_layers):
            # a pending layer append writes the newest step_n slots: they must not move
            if self.written[slot * self.num_layers + l] != total:
                raise ValueError(
                    f"cannot trim sequence {sid} in the middle of a step: layer {l} lacks "
                    "its newest tokens (append them on every layer first)")
        p.segs = self.segs[slot]
        p.off0 = self.off0[slot]
        p.off1 = self.off1[slot]
        p.drop_a = 0; p.drop_b = 0; p.drop_b_start = 0; p.freed = 0; p.evicted_tokens = 0
        self._plan_trim(slot, S, R, &p)
        self._apply_drop(slot, &p)
        self.segs[slot] = p.segs
        self.off0[slot] = p.off0
        self.off1[slot] = p.off1
        self.evicted_tokens += p.evicted_tokens
        return p.evicted_tokens, self.n_free - before

    @property
    def last_attention_plan(self):
        """How the last attend call ran: (threads used, KV heads per work item,
        key chunks per sequence; > 1 means split-K with a log-sum-exp merge)."""
        return (self.plan[0], self.plan[1], self.plan[2])

    def _debug_state(self, sid):
        """Internal view of a sequence (for tests): segments, offsets, table."""
        cdef int64_t slot = self._slot(sid)
        s = self.segs[slot]
        return dict(a0=s.a0, a1=s.a1, b0=s.b0, b1=s.b1, off0=self.off0[slot],
                    off1=self.off1[slot], table=self.block_table(sid).tolist())



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
        s = pkv_read_sum(p, n, 0, _simd, nt)  # warm: pages resident, threads up
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        with nogil:
            s = pkv_read_sum(p, n, 0, _simd, nt)
        dt = time.perf_counter() - t0
        if s != <double>n:
            raise RuntimeError("read kernel returned a wrong sum")
        best = max(best, n * 4 / dt)
    return best
