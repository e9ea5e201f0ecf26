# Declarations of the C headers in include/pagedkv/ (names kept as in C).
from libc.stdint cimport int32_t, int64_t

cdef extern from "pagedkv/simd.h" nogil:
    enum:
        PKV_SIMD_SCALAR
        PKV_SIMD_AVX2
        PKV_SIMD_AVX512
    int pkv_detect_simd()

cdef extern from "pagedkv/layout.h" nogil:
    ctypedef struct pkv_segs:
        int64_t a0
        int64_t a1
        int64_t b0
        int64_t b1
    int pkv_max_threads()
    int pkv_have_openmp()
    int pkv_check_seq(const int32_t *table, int64_t nblk, const pkv_segs *s, int bs,
                      int64_t num_blocks)
    void pkv_write_tokens(char *base, const int32_t *table, int bs, int hkv, size_t row,
                          int64_t slot0, int64_t n, const char *src)
    void pkv_read_tokens(const char *base, const int32_t *table, int bs, int hkv, size_t row,
                         int64_t slot0, int64_t slot1, char *dst)
    void pkv_copy_block(char *buf, int64_t num_blocks, int num_layers, size_t block_bytes,
                        int32_t dst, int32_t src)

cdef extern from "pagedkv/attention.h" nogil:
    enum:
        PKV_MAX_ROWS
    ctypedef struct pkv_rope:
        const void *cos
        const void *sin
        int64_t max_pos
        int half
    ctypedef struct pkv_attn_args:
        const void *k
        const void *v
        int bs, hkv, hq, d
        int64_t nseq
        const int32_t *const *tables
        const pkv_segs *segs
        const void *q
        void *out
        int64_t nq
        double scale
        const pkv_rope *rope
        void *scratch
        size_t scratch_stride
        void *partial
        int64_t partial_slots
        int nthreads
        int64_t *plan_out
    size_t pkv_scratch_bytes(int bs, int d, size_t itemsize)
    size_t pkv_partial_slot_bytes(int d, size_t itemsize)
    void pkv_decode(const pkv_attn_args *a, int dtype, int simd)
    void pkv_prefill(const pkv_attn_args *a, int dtype, int simd)
    double pkv_read_sum(const void *p, size_t n, int dtype, int simd, int nthreads)
