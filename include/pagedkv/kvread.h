/* pagedkv/kvread.h -- the read ceiling of decode: read the K and V bytes a
 * decode call reads, in the same block pattern, and do nothing else.
 *
 * For each sequence, for each block its held slots touch (in rank order):
 * the block's K plane of one layer (all KV heads, one contiguous run), then
 * its V plane.  Blocks lie wherever the block tables put them.  The time of
 * this read over the same pool and tables is the best a decode kernel can
 * reach; `pagedkv bench` and benchmarks/c/decode_ceiling.c report decode as
 * a fraction of it.  Whole planes are read even where a sequence holds part
 * of a block (at most one block per segment more than decode reads).
 *
 * The read works on bytes (XOR of 64-bit words), so it serves every storage
 * type.  Its result, the XOR of all bytes read folded to 64 bits, only keeps
 * the loads alive; XOR-folded further to 8 bits it is the XOR of every byte
 * read, which the tests check against NumPy.
 */
#pragma once
#include <string.h>
#include "types.h"
#include "simd.h"

/* XOR of the 64-bit words of p[0, n) (n a multiple of 8 or not: the tail is
 * zero-padded). */
static inline uint64_t pkv_xor_bytes_scalar(const char *p, size_t n) {
    uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0, w;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        memcpy(&w, p + i, 8);
        x0 ^= w;
        memcpy(&w, p + i + 8, 8);
        x1 ^= w;
        memcpy(&w, p + i + 16, 8);
        x2 ^= w;
        memcpy(&w, p + i + 24, 8);
        x3 ^= w;
    }
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        x0 ^= w;
    }
    if (i < n) {
        w = 0;
        memcpy(&w, p + i, n - i);
        x0 ^= w;
    }
    return x0 ^ x1 ^ x2 ^ x3;
}

#if PKV_X86
#include <immintrin.h>

__attribute__((target("avx2")))
static uint64_t pkv_xor_bytes_avx2(const char *p, size_t n) {
    __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        x0 = _mm256_xor_si256(x0, _mm256_loadu_si256((const __m256i *)(p + i)));
        x1 = _mm256_xor_si256(x1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        x2 = _mm256_xor_si256(x2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        x3 = _mm256_xor_si256(x3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    x0 = _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
    uint64_t w[4];
    _mm256_storeu_si256((__m256i *)w, x0);
    return w[0] ^ w[1] ^ w[2] ^ w[3] ^ pkv_xor_bytes_scalar(p + i, n - i);
}

__attribute__((target("avx512f")))
static uint64_t pkv_xor_bytes_avx512(const char *p, size_t n) {
    __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        x0 = _mm512_xor_si512(x0, _mm512_loadu_si512((const void *)(p + i)));
        x1 = _mm512_xor_si512(x1, _mm512_loadu_si512((const void *)(p + i + 64)));
        x2 = _mm512_xor_si512(x2, _mm512_loadu_si512((const void *)(p + i + 128)));
        x3 = _mm512_xor_si512(x3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    x0 = _mm512_xor_si512(_mm512_xor_si512(x0, x1), _mm512_xor_si512(x2, x3));
    uint64_t w[8];
    _mm512_storeu_si512((void *)w, x0);
    uint64_t r = 0;
    for (int j = 0; j < 8; j++) r ^= w[j];
    return r ^ pkv_xor_bytes_scalar(p + i, n - i);
}
#endif

/* The read kernel of a SIMD path: AVX2 / AVX-512 loads on x86; elsewhere
 * (scalar, NEON) the portable loop, which the compiler vectorizes with the
 * baseline instruction set (SSE2, Advanced SIMD). */
typedef uint64_t (*pkv_xor_fn)(const char *, size_t);

static inline pkv_xor_fn pkv_xor_bytes_for(int simd) {
#if PKV_X86
    if (simd == PKV_SIMD_AVX512) return pkv_xor_bytes_avx512;
    if (simd == PKV_SIMD_AVX2) return pkv_xor_bytes_avx2;
#endif
    (void)simd;
    return pkv_xor_bytes_scalar;
}

/* Blocks [*lo, *hi) of a table that slots [s0, s1) touch (empty when s0 == s1). */
static inline void pkv_blocks_of(int64_t s0, int64_t s1, int bs, int64_t *lo, int64_t *hi) {
    *lo = s0 / bs;
    *hi = s1 > s0 ? (s1 + bs - 1) / bs : *lo;
}

/* Number of K+V plane pairs pkv_read_pattern reads for one sequence. */
static inline int64_t pkv_pattern_runs(const pkv_segs *g, int bs) {
    int64_t lo, hi, n = 0;
    pkv_blocks_of(g->a0, g->a1, bs, &lo, &hi);
    n += hi - lo;
    pkv_blocks_of(g->b0, g->b1, bs, &lo, &hi);
    return n + (hi - lo);
}

/* XOR of the K and V planes of runs [r0, r1) of the pattern (see below). */
static inline uint64_t pkv_read_pattern_part(const char *k, const char *v, size_t plane_bytes,
                                             size_t block_stride, int bs, int64_t nseq,
                                             const int32_t *const *tables, const pkv_segs *segs,
                                             pkv_xor_fn f, int64_t r0, int64_t r1) {
    int64_t r = 0; /* global index of the first run of sequence s */
    uint64_t x = 0;
    for (int64_t s = 0; s < nseq && r < r1; s++) {
        for (int half = 0; half < 2; half++) {
            int64_t lo, hi;
            if (half == 0) pkv_blocks_of(segs[s].a0, segs[s].a1, bs, &lo, &hi);
            else pkv_blocks_of(segs[s].b0, segs[s].b1, bs, &lo, &hi);
            for (int64_t bi = lo; bi < hi; bi++, r++) {
                if (r < r0 || r >= r1) continue;
                const size_t off = (size_t)tables[s][bi] * block_stride;
                x ^= f(k + off, plane_bytes);
                x ^= f(v + off, plane_bytes);
            }
        }
    }
    return x;
}

/* Read the pattern of a decode call over nseq sequences: K plane then V
 * plane of each touched block (k, v: the planes of one layer in block 0;
 * planes `plane_bytes` long, blocks `block_stride` apart), the list of
 * blocks split over nthreads threads in equal contiguous parts (every run
 * has the same length, so equal parts are equal bytes).  Returns the XOR of
 * the bytes read folded to 64 bits; *bytes_read gets the bytes read.
 * Arguments are trusted (the caller checked the tables: layout.h). */
static inline uint64_t pkv_read_pattern(const char *k, const char *v, size_t plane_bytes,
                                        size_t block_stride, int bs, int64_t nseq,
                                        const int32_t *const *tables, const pkv_segs *segs,
                                        int simd, int nthreads, size_t *bytes_read) {
    const pkv_xor_fn f = pkv_xor_bytes_for(simd);
    int64_t total = 0;
    for (int64_t s = 0; s < nseq; s++) total += pkv_pattern_runs(&segs[s], bs);
    if (bytes_read) *bytes_read = (size_t)total * 2 * plane_bytes;
    if (nthreads < 1) nthreads = 1;
    if (total < nthreads) nthreads = total > 0 ? (int)total : 1;
    uint64_t acc = 0;
    int t;
    if (nthreads == 1) /* no OpenMP region, as the kernels (attn_impl.h) */
        return pkv_read_pattern_part(k, v, plane_bytes, block_stride, bs, nseq, tables, segs, f,
                                     0, total);
#pragma omp parallel for num_threads(nthreads) reduction(^ : acc) schedule(static)
    for (t = 0; t < nthreads; t++)
        acc ^= pkv_read_pattern_part(k, v, plane_bytes, block_stride, bs, nseq, tables, segs, f,
                                     total * t / nthreads, total * (t + 1) / nthreads);
    return acc;
}

/* ---- prefetching ahead of a kernel -------------------------------------------
 * A work item of decode reads its blocks a tile at a time in units: the K
 * slices (one head of one block, hstride bytes) of the tile's blocks for
 * head 0, 1, ..., then their V slices head after head, then the next tile.
 * While the kernel works on a unit it can prefetch the next one, a few lines
 * per step of its inner loop (the next tile's blocks may be anywhere in the
 * pool, where no hardware prefetcher looks), so the requests are spread over
 * the unit's arithmetic instead of issued in a burst.  attn_impl.h says which
 * units it prefetches.
 *
 * Measured with benchmarks/c/decode_ceiling.c (this AMD EPYC, AVX-512, f32
 * B=8 L=2048, 1 thread, decode CPU time as % of the pattern read's, paired):
 * one unit ahead 62-66%, two 55-59%, three 55-58%, a whole phase (the next
 * tile's K while V is read, and so on) 58-63%; every line 62-73%, every
 * other line 48-50%, every fourth 52%; into L1 (prefetcht0) 62%, into L2
 * 55-57%; 4 lines per step 62-67%, 2 lines 66%, 8 lines 57%. */
#define PKV_PF_STRIDE 64  /* every line */
#define PKV_PF_LOCALITY 3 /* into L1 */
typedef struct {
    const char *p[64]; /* the next unit's slices (a tile has at most PKV_TILE_KEYS = 64 blocks) */
    int n, cur;        /* slices; the one being prefetched */
    size_t len;        /* bytes per slice */
    const char *at, *end; /* next line to prefetch in slice cur, and its end */
} pkv_pfs;

/* A kernel's inner loop steps a local copy (kept in registers) and writes it
 * back when done:  PKV_PFS_BEGIN(ps); loop { PKV_PFS_STEP; } PKV_PFS_END(ps);
 * A step issues PKV_PF_LINES lines (the units' slices are whole multiples of
 * that in the common geometries; a step may run a little past a slice's end,
 * which a prefetch tolerates), with one branch when nothing is left. */
#ifndef PKV_PF_LINES
#define PKV_PF_LINES 4
#endif
#define PKV_PFS_BEGIN(ps)                                                          \
    pkv_pfs *pf_s_ = (ps);                                                         \
    const char *pf_at_ = pf_s_ ? pf_s_->at : NULL, *pf_end_ = pf_s_ ? pf_s_->end : NULL;
#define PKV_PFS_STEP                                                               \
    if (pf_at_ < pf_end_) {                                                        \
        for (int pf_i_ = 0; pf_i_ < PKV_PF_LINES; pf_i_++)                         \
            __builtin_prefetch(pf_at_ + pf_i_ * PKV_PF_STRIDE, 0, PKV_PF_LOCALITY); \
        pf_at_ += PKV_PF_LINES * PKV_PF_STRIDE;                                    \
        if (pf_at_ >= pf_end_) pkv_pfs_next(pf_s_, &pf_at_, &pf_end_);             \
    }
#define PKV_PFS_END(ps)                                                            \
    if (pf_s_) {                                                                   \
        pf_s_->at = pf_at_;                                                        \
        pf_s_->end = pf_end_;                                                      \
    }

/* move on to the next slice (none left: an empty range) */
static inline void pkv_pfs_next(pkv_pfs *s, const char **at, const char **end) {
    if (s->cur + 1 < s->n) {
        s->cur++;
        *at = s->p[s->cur];
        *end = *at + s->len;
    } else {
        *at = *end; /* done: at == end stops the steps */
    }
}

static inline void pkv_pfs_start(pkv_pfs *s) {
    s->cur = 0;
    s->at = s->n ? s->p[0] : NULL;
    s->end = s->n ? s->p[0] + s->len : NULL;
}

/* issue whatever the steps left (the unit ended before its estimate) */
static inline void pkv_pfs_finish(pkv_pfs *s) {
    const char *at = s->at, *end = s->end;
    while (at < end) {
        for (; at < end; at += PKV_PF_STRIDE) __builtin_prefetch(at, 0, PKV_PF_LOCALITY);
        pkv_pfs_next(s, &at, &end);
    }
    s->at = at;
    s->end = end;
}
