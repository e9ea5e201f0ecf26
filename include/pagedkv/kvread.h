/* pagedkv/kvread.h -- the read ceilings the benchmarks judge the kernels
 * against (`pagedkv bench`, benchmarks/c/decode_ceiling.c); no kernel uses
 * anything here (their prefetch cursor: prefetch.h).
 *
 * pkv_read_sum: a sequential read of an array with the kernels' own vector
 * loads (the stream_sum instances of attn_math.h), the machine's read
 * bandwidth.
 *
 * pkv_read_pattern: the read ceiling of decode: read the K and V bytes a
 * decode call reads, in the same block pattern, and do nothing else.
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
#include "attention.h"
#include "simd.h"
#include "types.h"

/* The instruction set whose loads a ceiling of `bytes` reads with on path
 * `simd`: the path's own (its base: pkv_simd_base), but AVX2's where float32
 * and float64 decode calls of that size run the AVX2 kernels on an AVX-512
 * path (attn_args.h: pkv_decode_on_avx2), because 256-bit loads read memory
 * faster there (Zen 4 class, one thread, 64 MiB: 33.9-35.9 GB/s against
 * 31.7-32.2 with 512-bit loads, benchmarks/c/decode_ceiling.c; in cache the
 * 512-bit loads were the faster: the 128 KiB pattern read of `pagedkv bench`'s
 * small call 1.42 us against 1.66).  So a ceiling is the faster of the two
 * reads, also for the narrower storages, whose kernels load 8-32 bytes at a
 * time and widen them. */
static inline int pkv_read_simd(int simd, double bytes) {
    simd = pkv_simd_base(simd);
#if PKV_X86
    if (simd == PKV_SIMD_AVX512 && pkv_decode_on_avx2(bytes)) return PKV_SIMD_AVX2;
#else
    (void)bytes;
#endif
    return simd;
}

/* Read n elements of p (dtype 0 = f32, 1 = f64) split over nthreads threads;
 * returns their sum (so the reads cannot be optimized away). */
static inline double pkv_read_sum(const void *p, size_t n, int dtype, int simd, int nthreads) {
    typedef double (*sum_fn)(const void *, size_t);
    sum_fn f = dtype ? (sum_fn)stream_sum_f64_scalar : (sum_fn)stream_sum_f32_scalar;
    simd = pkv_read_simd(simd, (double)n * (dtype ? 8 : 4));
#if PKV_X86
    if (simd == PKV_SIMD_AVX512) f = dtype ? (sum_fn)stream_sum_f64_avx512 : (sum_fn)stream_sum_f32_avx512;
    else if (simd == PKV_SIMD_AVX2) f = dtype ? (sum_fn)stream_sum_f64_avx2 : (sum_fn)stream_sum_f32_avx2;
#endif
#if PKV_ARM64
    if (simd == PKV_SIMD_NEON) f = dtype ? (sum_fn)stream_sum_f64_neon : (sum_fn)stream_sum_f32_neon;
#endif
    const size_t item = dtype ? 8 : 4;
    if (nthreads <= 1) return f(p, n); /* no OpenMP region, as the kernels */
    double total = 0.0;
    int t;
#pragma omp parallel for num_threads(nthreads) reduction(+ : total) schedule(static)
    for (t = 0; t < nthreads; t++) {
        const size_t lo = n * (size_t)t / (size_t)nthreads, hi = n * (size_t)(t + 1) / (size_t)nthreads;
        total += f((const char *)p + lo * item, hi - lo);
    }
    return total;
}

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

/* One wide read loop, written once: PKV_XOR_BYTES_DEFINE(name, V, B, ZERO,
 * LOAD, STORE, XOR) defines `name` over register type V of B bytes with
 * those operations (unaligned LOAD / STORE); four independent accumulators,
 * the tail left to the portable loop.  The includer puts a target attribute
 * in front. */
#define PKV_XOR_BYTES_DEFINE(name, V, B, ZERO, LOAD, STORE, XOR)                    \
    static uint64_t name(const char *p, size_t n) {                                 \
        V x0 = ZERO(), x1 = x0, x2 = x0, x3 = x0;                                   \
        size_t i = 0;                                                               \
        for (; i + 4 * (B) <= n; i += 4 * (B)) {                                    \
            x0 = XOR(x0, LOAD((const void *)(p + i)));                              \
            x1 = XOR(x1, LOAD((const void *)(p + i + (B))));                        \
            x2 = XOR(x2, LOAD((const void *)(p + i + 2 * (B))));                    \
            x3 = XOR(x3, LOAD((const void *)(p + i + 3 * (B))));                    \
        }                                                                           \
        x0 = XOR(XOR(x0, x1), XOR(x2, x3));                                         \
        uint64_t w[(B) / 8], r = 0;                                                 \
        STORE((void *)w, x0);                                                       \
        for (int j = 0; j < (B) / 8; j++) r ^= w[j];                                \
        return r ^ pkv_xor_bytes_scalar(p + i, n - i);                              \
    }

__attribute__((target("avx2")))
PKV_XOR_BYTES_DEFINE(pkv_xor_bytes_avx2, __m256i, 32, _mm256_setzero_si256, _mm256_loadu_si256,
                     _mm256_storeu_si256, _mm256_xor_si256)
__attribute__((target("avx512f")))
PKV_XOR_BYTES_DEFINE(pkv_xor_bytes_avx512, __m512i, 64, _mm512_setzero_si512, _mm512_loadu_si512,
                     _mm512_storeu_si512, _mm512_xor_si512)
#undef PKV_XOR_BYTES_DEFINE
#endif

/* The read kernel of a SIMD path: AVX2 / AVX-512 loads on x86; elsewhere
 * (scalar, NEON) the portable loop, which the compiler vectorizes with the
 * baseline instruction set (SSE2, Advanced SIMD). */
typedef uint64_t (*pkv_xor_fn)(const char *, size_t);

static inline pkv_xor_fn pkv_xor_bytes_for(int simd, double bytes) {
    simd = pkv_read_simd(simd, bytes);
#if PKV_X86
    if (simd == PKV_SIMD_AVX512) return pkv_xor_bytes_avx512;
    if (simd == PKV_SIMD_AVX2) return pkv_xor_bytes_avx2;
#endif
    (void)simd;
    return pkv_xor_bytes_scalar;
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
    int64_t total = 0;
    for (int64_t s = 0; s < nseq; s++) total += pkv_pattern_runs(&segs[s], bs);
    const pkv_xor_fn f = pkv_xor_bytes_for(simd, (double)total * 2 * (double)plane_bytes);
    if (bytes_read) *bytes_read = (size_t)total * 2 * plane_bytes;
    if (nthreads < 1) nthreads = 1;
    if (total < nthreads) nthreads = total > 0 ? (int)total : 1;
    uint64_t acc = 0;
    int t;
    if (nthreads == 1) /* no OpenMP region, as the kernels (attn_calls.h) */
        return pkv_read_pattern_part(k, v, plane_bytes, block_stride, bs, nseq, tables, segs, f,
                                     0, total);
#pragma omp parallel for num_threads(nthreads) reduction(^ : acc) schedule(static)
    for (t = 0; t < nthreads; t++)
        acc ^= pkv_read_pattern_part(k, v, plane_bytes, block_stride, bs, nseq, tables, segs, f,
                                     total * t / nthreads, total * (t + 1) / nthreads);
    return acc;
}
