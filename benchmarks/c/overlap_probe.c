/* overlap_probe.c -- how much arithmetic one core can do on the bytes of a
 * decode's pattern read while still reading them at the read ceiling.
 *
 * decode_ceiling.c compares decode with the pattern read (kvread.h): the K
 * plane, then the V plane, of every block in the block tables' order.  A
 * decode kernel does work on every byte it reads; whether that work hides
 * behind the memory's latency is a property of the core (its out-of-order
 * window, fill buffers, prefetchers), not of the kernel alone.  This probe
 * measures that property with the least arithmetic a kernel can do: the same
 * pool and block order, every 64-byte line loaded once, and per line
 *
 *   read       nothing (XOR into an accumulator: the pattern read itself)
 *   f32 R      R FMAs per vector of float32 values (decode of a GQA group
 *              of R query heads does R per stored value, for K and for V)
 *   bf16 R     each loaded vector of bfloat16 widened to two of float32 by
 *              a shift and a mask, then R FMAs per vector
 *
 * and, in its own mode (i8), the integer products of int8 decode for a GQA
 * group of 4 query heads (AVX-512 + VNNI only), in the layouts the kernels
 * read now and in the layouts that would spare them their shuffles:
 *
 *   now        K^T lines (4 dimensions x 16 keys) transposed in registers
 *              into one key's 4 dimensions per lane and offset (attn_dot.h's
 *              kquad: vpermd, vpshufb, vpxord), then 4 vpdpbusd; V rows of
 *              two keys byte-interleaved and sign-extended into int16 pairs
 *              (vpunpck{l,h}bw, vpmovsxbw; attn_pvdot.h), then 4 vpdpwssd per
 *              pair vector
 *   Kquad      K stored as the dot product takes it (4 dimensions of a key
 *              per 32-bit lane, offset): 4 vpdpbusd per line, nothing else
 *   Vpair      V stored as two keys' values interleaved per dimension: one
 *              vpmovsxbw per 32 bytes, then the vpdpwssd
 *   both       Kquad and Vpair
 *
 * The scales and the softmax are left out: either layout does them alike.
 *
 * on 512-bit vectors where the CPU has AVX-512 F, else (or with
 * PKV_PROBE_ISA=avx2) on 256-bit ones with AVX2 and FMA; FMAs into 16 (12
 * with AVX2) independent accumulators, the multiplier in a register: no
 * loads but the pool's, no dependency chains that bind.  Every variant
 * but read also prefetches, one line per line it reads, the same offset of
 * the block PKV_PROBE_AHEAD (default 1; 0: none) blocks on into L2, as the
 * kernels' prefetch stream does (prefetch.h): the blocks lie where no
 * hardware prefetcher looks.  Rounds alternate the variants; each is reported
 * with its instructions on the vector ports per 64-byte line, its GB/s and
 * its time as % of the read variant's in the same round (median over
 * rounds).  PKV_FLUSH_MIB=n reads n MiB of other memory before every timed
 * pass (none of the pool in the caches when it starts).
 *
 * A kernel's own instructions per line, for comparison: its time with K/V
 * in L2 (decode_ceiling B=1 at an L whose K+V fit L2) x the clock (the FMA
 * peak / FMA lanes per cycle) / the lines, x 2 (two vector ports).
 *
 * The pool: B sequences of L tokens, Hkv = 8 heads, D = 128, block size 16,
 * blocks shuffled, huge pages as the library allocates them (alloc.h).
 *
 *   cc -O3 -std=c11 -D_DEFAULT_SOURCE -Wall -Iinclude benchmarks/c/overlap_probe.c -o overlap_probe
 *   ./overlap_probe f32|bf16|i8 B L rounds
 *
 * x86-64 with AVX-512 F or AVX2 + FMA; i8 with AVX-512 BW + VNNI (it says so
 * and exits elsewhere).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pagedkv/alloc.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "harness.h"

typedef struct {
    const char *pool;
    const int32_t *order; /* block ids in the pattern's order */
    int64_t nblk;
    size_t plane; /* bytes of one plane; a block is two */
    int64_t ahead; /* > 0: each line's twin in the block that many on is prefetched into L2 */
} pattern;

/* The two vector widths, as one vocabulary: V(W, name) is width W's name
 * (W = 512: 64-byte vectors, 16 float lanes, 16 accumulators; W = 256: 32
 * bytes, 8 lanes, 12 accumulators, 16 registers in all) */
#define V(W, name) V##W##_##name
#define V512_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
#define V512_BYTES 64
#define V512_NACC 16
#define V512_PS __m512
#define V512_SI __m512i
#define V512_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define V512_XOR _mm512_xor_si512
#define V512_ZERO_SI _mm512_setzero_si512
#define V512_SLLI _mm512_slli_epi32
#define V512_AND _mm512_and_si512
#define V512_SET1_SI _mm512_set1_epi32
#define V512_CAST _mm512_castsi512_ps
#define V512_ZERO _mm512_setzero_ps
#define V512_SET1 _mm512_set1_ps
#define V512_FMA _mm512_fmadd_ps
#define V512_ADD _mm512_add_ps
#define V512_SUM_SI(x) ((double)_mm512_reduce_add_epi64(x))
#define V512_SUM(x) ((double)_mm512_reduce_add_ps(x))
#define V256_TARGET __attribute__((target("avx2,fma")))
#define V256_BYTES 32
#define V256_NACC 12
#define V256_PS __m256
#define V256_SI __m256i
#define V256_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define V256_XOR _mm256_xor_si256
#define V256_ZERO_SI _mm256_setzero_si256
#define V256_SLLI _mm256_slli_epi32
#define V256_AND _mm256_and_si256
#define V256_SET1_SI _mm256_set1_epi32
#define V256_CAST _mm256_castsi256_ps
#define V256_ZERO _mm256_setzero_ps
#define V256_SET1 _mm256_set1_ps
#define V256_FMA _mm256_fmadd_ps
#define V256_ADD _mm256_add_ps
#define V256_SUM_SI(x) ((double)_mm256_extract_epi64(x, 0))
#define V256_SUM(x) sum256(x)
V256_TARGET static double sum256(__m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    return (double)(v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]);
}

/* XOR of every vector of [p, p + n) into x0, four at a time; the pattern
 * read (XOR of every line of every block in order); a flush of other memory */
#define READS(W)                                                                            \
    V(W, TARGET) static V(W, SI) xor##W(V(W, SI) x0, const char *p, size_t n) {             \
        V(W, SI) x1 = V(W, ZERO_SI)(), x2 = x1, x3 = x1;                                    \
        for (size_t i = 0; i < n; i += 4 * V(W, BYTES)) {                                   \
            x0 = V(W, XOR)(x0, V(W, LOAD)(p + i));                                          \
            x1 = V(W, XOR)(x1, V(W, LOAD)(p + i + V(W, BYTES)));                            \
            x2 = V(W, XOR)(x2, V(W, LOAD)(p + i + 2 * V(W, BYTES)));                        \
            x3 = V(W, XOR)(x3, V(W, LOAD)(p + i + 3 * V(W, BYTES)));                        \
        }                                                                                   \
        return V(W, XOR)(V(W, XOR)(x0, x1), V(W, XOR)(x2, x3));                             \
    }                                                                                       \
    V(W, TARGET) static double p##W##_read(const pattern *p) {                              \
        V(W, SI) x = V(W, ZERO_SI)();                                                       \
        for (int64_t b = 0; b < p->nblk; b++)                                               \
            x = xor##W(x, p->pool + (size_t)p->order[b] * 2 * p->plane, 2 * p->plane);      \
        return V(W, SUM_SI)(x);                                                             \
    }                                                                                       \
    V(W, TARGET) static double flush##W(const char *p, size_t n) {                          \
        return V(W, SUM_SI)(xor##W(V(W, ZERO_SI)(), p, n));                                 \
    }
READS(512)
READS(256)

/* R FMAs per vector x into independent accumulators: vector k of a group of
 * 256 bytes (float32: one per loaded vector; bfloat16: two, the even and the
 * odd halves) starts at accumulator k * R */
#define FMAS(W, x, R, k)                                                                    \
    _Pragma("GCC unroll 8") for (int r_ = 0; r_ < (R); r_++)                                \
        acc[((k) * (R) + r_) % V(W, NACC)] = V(W, FMA)(x, m, acc[((k) * (R) + r_) % V(W, NACC)]);

/* The work on one group of 256 bytes at g: each vector loaded, widened where
 * bfloat16 (BF), and R FMAs per float vector */
#define GROUP(W, R, BF, g)                                                                  \
    _Pragma("GCC unroll 8") for (int l = 0; l < 256 / V(W, BYTES); l++) {                   \
        const V(W, SI) w = V(W, LOAD)((g) + V(W, BYTES) * l);                               \
        if (BF) {                                                                           \
            FMAS(W, V(W, CAST)(V(W, SLLI)(w, 16)), R, 2 * l)                                \
            FMAS(W, V(W, CAST)(V(W, AND)(w, hi)), R, 2 * l + 1)                             \
        } else {                                                                            \
            FMAS(W, V(W, CAST)(w), R, l)                                                    \
        }                                                                                   \
    }

/* One variant: the pattern walked 256 bytes (4 lines) at a time, with the
 * prefetch of the same offset PKV_PROBE_AHEAD blocks on */
#define PASS(W, name, R, BF)                                                                \
    V(W, TARGET) static double p##W##_##name(const pattern *p) {                            \
        V(W, PS) acc[V(W, NACC)];                                                           \
        for (int j = 0; j < V(W, NACC); j++) acc[j] = V(W, ZERO)();                         \
        const V(W, PS) m = V(W, SET1)(1.001f);                                              \
        const V(W, SI) hi = V(W, SET1_SI)((int)0xFFFF0000u);                                \
        (void)hi;                                                                           \
        for (int64_t b = 0; b < p->nblk; b++) {                                             \
            const char *s = p->pool + (size_t)p->order[b] * 2 * p->plane;                   \
            const int64_t bf_ = b + p->ahead < p->nblk ? b + p->ahead : b;                 \
            const char *f = p->pool + (size_t)p->order[bf_] * 2 * p->plane;                 \
            for (size_t i = 0; i < 2 * p->plane; i += 256) {                                \
                if (p->ahead)                                                               \
                    for (int l = 0; l < 4; l++) _mm_prefetch(f + i + 64 * l, _MM_HINT_T1);  \
                GROUP(W, R, BF, s + i)                                                      \
            }                                                                               \
        }                                                                                   \
        V(W, PS) t = acc[0];                                                                \
        for (int j = 1; j < V(W, NACC); j++) t = V(W, ADD)(t, acc[j]);                      \
        return V(W, SUM)(t);                                                                \
    }

#define VARIANTS(W)                                                                         \
    PASS(W, f32_1, 1, 0) PASS(W, f32_2, 2, 0) PASS(W, f32_4, 4, 0) PASS(W, f32_8, 8, 0)    \
    PASS(W, bf16_1, 1, 1) PASS(W, bf16_2, 2, 1) PASS(W, bf16_4, 4, 1) PASS(W, bf16_8, 8, 1)
VARIANTS(512)
VARIANTS(256)

/* The int8 mode (AVX-512 + VNNI).  The dot products through their
 * intrinsics: with the loops below fully unrolled GCC keeps the 16
 * accumulators in registers (checked in the assembly). */
#define I8_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni")))
#define DPBUSD(acc, k, b) ((acc) = _mm512_dpbusd_epi32((acc), (k), (b)))
#define DPWSSD(acc, x, w) ((acc) = _mm512_dpwssd_epi32((acc), (x), (w)))

/* a K^T line of 4 dimensions x 16 keys as the kernels turn it for vpdpbusd:
 * lane j = key j's 4 dimensions, top bits flipped.  The same instructions as
 * kquad in include/pagedkv/attn_dot.h (a function of each kernel instance,
 * which this probe does not build), for blocks of 16 keys */
I8_TARGET static inline __m512i kquad_now(__m512i x) {
    const __m512i didx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i bidx = _mm512_set4_epi32(0x0F0B0703, 0x0E0A0602, 0x0D090501, 0x0C080400);
    x = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(didx, x), bidx);
    return _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80));
}

/* One int8 variant: each block's K plane (every line: 4 vpdpbusd, after
 * kquad_now unless KQ), then its V plane (VP: every 32 bytes one vpmovsxbw
 * and 4 vpdpwssd; else the two keys of a 256-byte group (D = 128: a key is
 * two lines) interleaved as the kernel does, 4 vpdpwssd per vector), into
 * 16 accumulators; the four query rows' operands in registers; the prefetch
 * as in PASS */
#define I8PASS(name, KQ, VP)                                                                \
    I8_TARGET static double p_i8_##name(const pattern *p) {                                  \
        __m512i acc[16];                                                                    \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_si512();                       \
        __m512i q[4];                                                                       \
        for (int r = 0; r < 4; r++) q[r] = _mm512_set1_epi32(0x01020304 * (r + 1));         \
        for (int64_t b = 0; b < p->nblk; b++) {                                             \
            const char *s = p->pool + (size_t)p->order[b] * 2 * p->plane;                   \
            const int64_t bf_ = b + p->ahead < p->nblk ? b + p->ahead : b;                 \
            const char *f = p->pool + (size_t)p->order[bf_] * 2 * p->plane;                 \
            for (size_t i = 0; i < p->plane; i += 256) {                                    \
                if (p->ahead)                                                               \
                    for (int l = 0; l < 4; l++) _mm_prefetch(f + i + 64 * l, _MM_HINT_T1);  \
                _Pragma("GCC unroll 4") for (int l = 0; l < 4; l++) {                       \
                    __m512i x = _mm512_loadu_si512((const void *)(s + i + 64 * l));         \
                    if (!(KQ)) x = kquad_now(x);                                            \
                    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                     \
                        DPBUSD(acc[4 * l + r], x, q[r]);                                    \
                }                                                                           \
            }                                                                               \
            for (size_t i = p->plane; i < 2 * p->plane; i += 256) {                         \
                if (p->ahead)                                                               \
                    for (int l = 0; l < 4; l++) _mm_prefetch(f + i + 64 * l, _MM_HINT_T1);  \
                __m512i x[8];                                                               \
                if (VP) {                                                                   \
                    _Pragma("GCC unroll 8") for (int h = 0; h < 8; h++)                     \
                        x[h] = _mm512_cvtepi8_epi16(                                        \
                            _mm256_loadu_si256((const __m256i *)(s + i + 32 * h)));         \
                } else {                                                                    \
                    /* key 0's 32 bytes h, key 1's */                                       \
                    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) {                   \
                        const char *k0 = s + i + 32 * h, *k1 = k0 + 128;                    \
                        const __m256i a = _mm256_loadu_si256((const __m256i *)k0);          \
                        const __m256i c = _mm256_loadu_si256((const __m256i *)k1);          \
                        x[2 * h] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, c));       \
                        x[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, c));   \
                    }                                                                       \
                }                                                                           \
                /* 8 vectors of 16 dimensions x 2 keys: 32 vpdpwssd */                     \
                _Pragma("GCC unroll 8") for (int h = 0; h < 8; h++)                         \
                    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)                     \
                        DPWSSD(acc[(4 * h + r) % 16], x[h], q[r]);                          \
            }                                                                               \
        }                                                                                   \
        __m512i t = acc[0];                                                                 \
        for (int j = 1; j < 16; j++) t = _mm512_add_epi32(t, acc[j]);                       \
        return (double)_mm512_reduce_add_epi32(t);                                          \
    }
I8PASS(now, 0, 0)
I8PASS(kquad, 1, 0)
I8PASS(vpair, 0, 1)
I8PASS(both, 1, 1)
I8_TARGET static double p_i8_read(const pattern *p) { return p512_read(p); }

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s f32|bf16|i8 B L rounds\n", argv[0]);
        return 2;
    }
    /* AVX-512 where the CPU has it (PKV_PROBE_ISA=avx2 asks for AVX2), else AVX2 */
    const char *ie = getenv("PKV_PROBE_ISA");
    const int w512 = __builtin_cpu_supports("avx512f") && !(ie && !strcmp(ie, "avx2"));
    if (!w512 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        printf("overlap_probe: this CPU has neither AVX-512 F nor AVX2 with FMA; nothing measured\n");
        return 0;
    }
    const int bf = !strcmp(argv[1], "bf16"), i8 = !strcmp(argv[1], "i8");
    if (i8 && !(w512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))) {
        printf("overlap_probe: i8 needs AVX-512 BW and VNNI, which this CPU (or PKV_PROBE_ISA) lacks; "
               "nothing measured\n");
        return 0;
    }
    const int64_t B = atoll(argv[2]), L = atoll(argv[3]);
    const int rounds = atoi(argv[4]);
    const int hkv = 8, d = 128, bs = 16;
    if (B < 1 || L < 1 || rounds < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    const size_t item = i8 ? 1 : bf ? 2 : 4, plane = (size_t)hkv * bs * d * item;
    const int64_t nblk = B * ((L + bs - 1) / bs);
    void *raw;
    char *pool = pkv_alloc((size_t)nblk * 2 * plane, &raw);
    int32_t *order = malloc(sizeof(int32_t) * nblk);
    if (!pool || !order) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t j = 0; j < (size_t)nblk * 2 * plane / 2; j++) /* small values: bfloat16 or float; int8: any */
        ((uint16_t *)pool)[j] = (uint16_t)(0x3c00 + (rng() & 0xff));
    shuffled_ids(order, nblk);
    const char *pe = getenv("PKV_PROBE_AHEAD");
    const pattern p = {pool, order, nblk, plane, pe ? atoll(pe) : 1};
    const char *fe = getenv("PKV_FLUSH_MIB");
    const size_t flush = fe ? (size_t)atoll(fe) << 20 : 0;
    char *fbuf = NULL;
    if (flush) {
        fbuf = pkv_alloc(flush, &raw);
        if (!fbuf) return 1;
        memset(fbuf, 1, flush);
    }
    typedef double (*pass_fn)(const pattern *);
    const char *names[5] = {"read", "R=1", "R=2", "R=4", "R=8"};
    const char *names8[5] = {"read", "now", "Kquad", "Vpair", "both"};
    const pass_fn fi8[5] = {p_i8_read, p_i8_now, p_i8_kquad, p_i8_vpair, p_i8_both};
    const pass_fn f512[2][5] = {{p512_read, p512_f32_1, p512_f32_2, p512_f32_4, p512_f32_8},
                                {p512_read, p512_bf16_1, p512_bf16_2, p512_bf16_4, p512_bf16_8}};
    const pass_fn f256[2][5] = {{p256_read, p256_f32_1, p256_f32_2, p256_f32_4, p256_f32_8},
                                {p256_read, p256_bf16_1, p256_bf16_2, p256_bf16_4, p256_bf16_8}};
    const pass_fn *fns = i8 ? fi8 : w512 ? f512[bf] : f256[bf];
    double (*flush_read)(const char *, size_t) = w512 ? flush512 : flush256;
    double *t = calloc((size_t)5 * rounds, sizeof(double)), *rel = calloc((size_t)rounds, sizeof(double));
    double *srt = calloc((size_t)rounds, sizeof(double));
    volatile double sink = 0;
    for (int v = 0; v < 5; v++) sink += fns[v](&p); /* warm-up */
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < 5; k++) {
            const int v = r % 2 ? 4 - k : k;
            if (flush) sink += flush_read(fbuf, flush);
            const double t0 = now();
            sink += fns[v](&p);
            t[v * rounds + r] = now() - t0;
        }
    const double bytes = (double)nblk * 2 * plane;
    printf("%s B=%lld L=%lld Hkv=%d D=%d bs=%d: %.1f MiB, %d rounds, flush %zu MiB, isa=%s\n",
           argv[1], (long long)B, (long long)L, hkv, d, bs, bytes / 1048576.0, rounds, flush >> 20,
           w512 ? "avx512" : "avx2");
    for (int v = 0; v < 5; v++) {
        for (int r = 0; r < rounds; r++) rel[r] = t[r] / t[v * rounds + r];
        qsort(rel, rounds, sizeof(double), cmp_d);
        memcpy(srt, t + v * rounds, sizeof(double) * rounds);
        qsort(srt, rounds, sizeof(double), cmp_d);
        const double med = srt[rounds / 2];
        const double vals = bytes / item;
        if (i8) {
            /* vector instructions per 64-byte line, the mean of a K line
             * (now 3 + 4, Kquad 4) and a V line (now 4 + 8, Vpair 2 + 8); 4
             * products per value (the four query rows) */
            static const double ops8[5] = {0, 9.5, 8, 8.5, 7};
            printf("  %-5s %4.1f ops/line %8.3f ms  %6.2f GB/s  %6.1f G products/s  %5.1f%% of read\n",
                   names8[v], ops8[v], med * 1e3, bytes / med / 1e9, v ? 4 * vals / med / 1e9 : 0.0,
                   100.0 * rel[rounds / 2]);
            continue;
        }
        /* FMA lanes per second: R per value */
        const double fmas = v ? vals * (1 << (v - 1)) : 0;
        /* instructions on the vector ALU ports per 64-byte line: R FMAs per
         * vector of values, and bfloat16's shift and mask per loaded vector
         * (AVX-512: 1 vector of 64 bytes, 16 lanes; AVX2: 2 of 32, 8 lanes) */
        const int R = v ? 1 << (v - 1) : 0, nv = w512 ? 1 : 2;
        const int ops = v ? nv * (bf ? 2 + 2 * R : R) : 0;
        printf("  %-5s %2d ops/line %8.3f ms  %6.2f GB/s  %6.1f G FMA lanes/s  %5.1f%% of read\n",
               names[v], ops, med * 1e3, bytes / med / 1e9, fmas / med / 1e9, 100.0 * rel[rounds / 2]);
    }
    return sink == 1.2345 ? 3 : 0;
}
#else
#include <stdio.h>
int main(void) {
    printf("overlap_probe: x86-64 only; nothing measured\n");
    return 0;
}
#endif
