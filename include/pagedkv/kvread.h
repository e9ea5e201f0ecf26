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
#pragma omp parallel for num_threads(nthreads) reduction(^ : acc) schedule(static) if (nthreads > 1)
    for (t = 0; t < nthreads; t++) {
        const int64_t r0 = total * t / nthreads, r1 = total * (t + 1) / nthreads;
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
        acc ^= x;
    }
    return acc;
}

/* ---- prefetching the pattern ahead of a kernel ----------------------------
 * A work item of decode reads, for each block of its rank range, the K run of
 * its heads (one contiguous run of `run` bytes: the heads of a block are
 * adjacent), then their V run.  The kernel reports how far it has consumed
 * that sequence of bytes; the cursor keeps software prefetches PKV_PF_AHEAD
 * bytes in front, across block boundaries (the next block may be anywhere in
 * the pool, where no hardware prefetcher looks).  Offsets count bytes of the
 * sequence: block j of the item starts at j * 2 * run, its V run at + run.
 *
 * Measured with benchmarks/c/decode_ceiling.c (AVX2 EPYC shared with other
 * jobs; f32 B=8 L=2048, 1 thread; decode CPU time as % of the pattern read's,
 * paired per round, three runs each): no software prefetch 48-52%; every line
 * 4, 8, 16 or 32 KiB ahead 60-72% (indistinguishable; 16 KiB kept); only the
 * first 1-4 KiB of each run, leaving the rest to the hardware streamer,
 * 41-48%; a second lane into L2 32-64 KiB ahead 54-62%. */
#ifndef PKV_PF_AHEAD
#define PKV_PF_AHEAD (16 << 10)
#endif

typedef struct {
    const char *k, *v;      /* K / V of the item's first head in block 0 */
    const int32_t *table;
    size_t bstride, run;    /* bytes from block to block; bytes of one block's K run */
    int64_t lo[2], hi[2];   /* the item's table ranges, in the order it reads them */
    int seg;                /* range being prefetched; 2: all issued */
    int64_t bi;             /* table index being prefetched */
    size_t base, pos;       /* offset of block bi in the sequence; bytes of it issued */
} pkv_prefetch;

static inline void pkv_pf_skip_empty(pkv_prefetch *c) {
    while (c->seg < 2 && c->bi >= c->hi[c->seg]) {
        c->seg++;
        if (c->seg < 2) c->bi = c->lo[c->seg];
    }
}

static inline void pkv_pf_init(pkv_prefetch *c, const char *k, const char *v, const int32_t *table,
                               size_t bstride, size_t run, const int64_t lo[2], const int64_t hi[2]) {
    c->k = k;
    c->v = v;
    c->table = table;
    c->bstride = bstride;
    c->run = run;
    c->lo[0] = lo[0];
    c->lo[1] = lo[1];
    c->hi[0] = hi[0];
    c->hi[1] = hi[1];
    c->seg = 0;
    c->bi = lo[0];
    c->base = 0;
    c->pos = 0;
    pkv_pf_skip_empty(c);
}

/* The kernel has consumed the sequence up to `offset`: prefetch (into L1)
 * every line up to PKV_PF_AHEAD bytes in front of it. */
static inline void pkv_pf_consumed(pkv_prefetch *c, size_t offset) {
    const size_t goal = offset + PKV_PF_AHEAD;
    while (c->seg < 2 && c->base + c->pos < goal) {
        const size_t blk = (size_t)c->table[c->bi] * c->bstride;
        const char *p = c->pos < c->run ? c->k + blk + c->pos : c->v + blk + (c->pos - c->run);
        __builtin_prefetch(p, 0, 3);
        c->pos += 64;
        if (c->pos >= 2 * c->run) {
            c->base += 2 * c->run;
            c->pos = 0;
            c->bi++;
            pkv_pf_skip_empty(c);
        }
    }
}
