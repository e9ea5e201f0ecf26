# Declarations of the C headers in include/pagedkv/ (names kept as in C).
from libc.stdint cimport int32_t, int64_t, uint64_t

cdef extern from "pagedkv/alloc.h" nogil:
    void *pkv_alloc(size_t n, void **raw)

cdef extern from "pagedkv/simd.h" nogil:
    enum:
        PKV_SIMD_SCALAR
        PKV_SIMD_AVX2
        PKV_SIMD_AVX512
        PKV_SIMD_NEON
        PKV_SIMD_AVX512VNNI
        PKV_SIMD_AVXVNNI
        PKV_SIMD_NEONDOT
        PKV_SIMD_AVX512AMX
        PKV_SIMD_AVX512BF16
    int pkv_detect_simd()
    int pkv_simd_supported(int simd)

cdef extern from "pagedkv/types.h" nogil:
    ctypedef enum pkv_dtype:
        PKV_F32
        PKV_F64
        PKV_BF16
        PKV_F16
        PKV_I8
    ctypedef struct pkv_storage:
        pkv_dtype dtype
        int itemsize
        int scaled
    ctypedef struct pkv_geom:
        int num_layers, hkv, bs, d
        pkv_storage store
        size_t row_bytes
        size_t head_bytes
        size_t scale_row
        size_t scale_offset
        size_t plane_bytes
        size_t block_bytes
    ctypedef struct pkv_segs:
        int64_t a0
        int64_t a1
        int64_t b0
        int64_t b1
    pkv_geom pkv_geom_make(int num_layers, int hkv, int bs, int d, pkv_dtype store)
    size_t pkv_k_offset(const pkv_geom *g, int layer)
    int64_t pkv_held(const pkv_segs *s)
    int pkv_max_threads()
    int pkv_have_openmp()

cdef extern from "pagedkv/layout.h" nogil:
    int pkv_check_seq(const int32_t *table, int64_t nblk, const pkv_segs *s, int bs,
                      int64_t num_blocks)
    void pkv_write_tokens(const pkv_geom *g, char *arena, const int32_t *table, int layer,
                          int64_t slot0, int64_t n, const char *k, const char *v,
                          int compute)
    void pkv_read_tokens(const pkv_geom *g, const char *arena, const int32_t *table, int layer,
                         int64_t slot0, int64_t slot1, char *k, char *v,
                         int compute)
    void pkv_copy_block(const pkv_geom *g, char *arena, int32_t dst, int32_t src)

cdef extern from "pagedkv/attention.h" nogil:
    enum:
        PKV_MAX_ROWS
    ctypedef struct pkv_rope:
        const void *cos
        const void *sin
        const void *cos_t
        const void *sin_t
        int64_t max_pos
        int half
    ctypedef struct pkv_attn_args:
        const void *k
        const void *v
        size_t block_stride
        size_t scale_offset
        int bs, hkv, hq, d
        int64_t nseq
        const int32_t *const *tables
        const pkv_segs *segs
        const void *q
        void *out
        int qo16
        int64_t nq
        double scale
        const pkv_rope *rope
        void *scratch
        size_t scratch_stride
        void *partial
        int64_t partial_slots
        int nthreads
        int64_t *plan_out
        int64_t window
        double softcap
        const double *sinks
    ctypedef void (*pkv_attn_fn)(const pkv_attn_args *a)
    ctypedef struct pkv_kernels:
        pkv_attn_fn decode
        pkv_attn_fn prefill
    const pkv_kernels *pkv_kernels_for(int storage, int compute, int simd)
    int pkv_quantizes_queries(int storage, int compute, int simd, int bs, int rope)
    int pkv_rounds_queries_bf16(int storage, int compute, int simd, int bs, int rope)
    int pkv_quantizes_weights(int storage, int compute, int simd)
    size_t pkv_scratch_bytes(int bs, int d, size_t itemsize)
    size_t pkv_partial_slot_bytes(int d, size_t itemsize)

cdef extern from "pagedkv/kvread.h" nogil:
    double pkv_read_sum(const void *p, size_t n, int dtype, int simd, int nthreads)
    uint64_t pkv_read_pattern(const char *k, const char *v, size_t plane_bytes,
                              size_t block_stride, int bs, int64_t nseq,
                              const int32_t *const *tables, const pkv_segs *segs, int simd,
                              int nthreads, size_t *bytes_read)

cdef extern from "pagedkv/peak.h" nogil:
    enum:
        PKV_PEAK_FMA_F32
        PKV_PEAK_FMA_F64
        PKV_PEAK_DPBUSD
        PKV_PEAK_SDOT
        PKV_PEAK_DPBF16
        PKV_PEAK_DPWSSD
        PKV_PEAK_CHAINS
    int pkv_peak_width(int kind, int simd)
    uint64_t pkv_peak_run(int kind, int simd, int64_t iters, int nthreads, double a, double b,
                          double *sum)

cdef extern from "pagedkv/linear.h" nogil:
    void pkv_linear(int f64, int simd, int nthreads, const void *x, int64_t M, const void *w,
                    const void *bias, int64_t K, int64_t N, void *y, int64_t ldy)
