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
 *   ./overlap_probe f32|bf16 B L rounds
 *
 * x86-64 with AVX-512 F or AVX2 + FMA (it says so and exits elsewhere).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pagedkv/alloc.h"

#if defined(__x86_64__)
#include <immintrin.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    const char *pool;
    const int32_t *order; /* block ids in the pattern's order */
    int64_t nblk;
    size_t plane; /* bytes of one plane; a block is two */
    int64_t ahead; /* > 0: each line's twin in the block that many on is prefetched into L2 */
} pattern;

#define T512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
#define T256 __attribute__((target("avx2,fma")))

/* XOR of every 64-byte line of [p, p + n), 256 bytes at a time */
T512 static __m512i xor512(__m512i x0, const char *p, size_t n) {
    __m512i x1 = _mm512_setzero_si512(), x2 = x1, x3 = x1;
    for (size_t i = 0; i < n; i += 256) {
        x0 = _mm512_xor_si512(x0, _mm512_loadu_si512((const void *)(p + i)));
        x1 = _mm512_xor_si512(x1, _mm512_loadu_si512((const void *)(p + i + 64)));
        x2 = _mm512_xor_si512(x2, _mm512_loadu_si512((const void *)(p + i + 128)));
        x3 = _mm512_xor_si512(x3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    return _mm512_xor_si512(_mm512_xor_si512(x0, x1), _mm512_xor_si512(x2, x3));
}
T256 static __m256i xor256(__m256i x0, const char *p, size_t n) {
    __m256i x1 = _mm256_setzero_si256(), x2 = x1, x3 = x1;
    for (size_t i = 0; i < n; i += 128) {
        x0 = _mm256_xor_si256(x0, _mm256_loadu_si256((const __m256i *)(p + i)));
        x1 = _mm256_xor_si256(x1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        x2 = _mm256_xor_si256(x2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        x3 = _mm256_xor_si256(x3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    return _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
}

/* the pattern read (XOR of every line), and a flush of other memory */
T512 static double p512_read(const pattern *p) {
    __m512i x = _mm512_setzero_si512();
    for (int64_t b = 0; b < p->nblk; b++)
        x = xor512(x, p->pool + (size_t)p->order[b] * 2 * p->plane, 2 * p->plane);
    return (double)_mm512_reduce_add_epi64(x);
}
T256 static double p256_read(const pattern *p) {
    __m256i x = _mm256_setzero_si256();
    for (int64_t b = 0; b < p->nblk; b++)
        x = xor256(x, p->pool + (size_t)p->order[b] * 2 * p->plane, 2 * p->plane);
    return (double)_mm256_extract_epi64(x, 0);
}
T512 static double flush512(const char *p, size_t n) {
    return (double)_mm512_reduce_add_epi64(xor512(_mm512_setzero_si512(), p, n));
}
T256 static double flush256(const char *p, size_t n) {
    return (double)_mm256_extract_epi64(xor256(_mm256_setzero_si256(), p, n), 0);
}

/* R FMAs per vector x into independent accumulators: vector k of a group of
 * lines (float32: one per 64-byte line with AVX-512, two with AVX2; bfloat16:
 * twice that, the even and the odd halves) starts at accumulator k * R */
#define FMAS(acc, NACC, FMA, x, R, k)                                            \
    _Pragma("GCC unroll 8") for (int r_ = 0; r_ < (R); r_++)                                             \
        acc[((k) * (R) + r_) % (NACC)] = FMA(x, m, acc[((k) * (R) + r_) % (NACC)]);

/* The walk of the pattern, 256 bytes (4 lines) at a time, with the
 * prefetch of the same offset PKV_PROBE_AHEAD blocks on; BODY(R, BF, s + i)
 * does one group's work */
#define WALK(BODY, R, BF)                                                                         \
    for (int64_t b = 0; b < p->nblk; b++) {                                                  \
        const char *s = p->pool + (size_t)p->order[b] * 2 * p->plane;                        \
        const int64_t bf_ = b + p->ahead < p->nblk ? b + p->ahead : b;                      \
        const char *f = p->pool + (size_t)p->order[bf_] * 2 * p->plane;                      \
        for (size_t i = 0; i < 2 * p->plane; i += 256) {                                     \
            if (p->ahead)                                                                    \
                for (int l = 0; l < 4; l++) _mm_prefetch(f + i + 64 * l, _MM_HINT_T1);       \
            BODY(R, BF, s + i)                                                               \
        }                                                                                    \
    }

/* AVX-512: 16 lanes, 16 accumulators */
#define BODY512(R, BF, g)                                                                    \
    _Pragma("GCC unroll 4") for (int l = 0; l < 4; l++) {                                                            \
        const __m512i w = _mm512_loadu_si512((const void *)((g) + 64 * l));                  \
        if (BF) {                                                                            \
            FMAS(acc, 16, _mm512_fmadd_ps, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), R, 2 * l) \
            FMAS(acc, 16, _mm512_fmadd_ps, _mm512_castsi512_ps(_mm512_and_si512(w, hi)), R, 2 * l + 1) \
        } else {                                                                             \
            FMAS(acc, 16, _mm512_fmadd_ps, _mm512_castsi512_ps(w), R, l)                     \
        }                                                                                    \
    }
#define PASS512(name, R, BF)                                                                 \
    T512 static double name(const pattern *p) {                                              \
        __m512 acc[16];                                                                      \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                           \
        const __m512 m = _mm512_set1_ps(1.001f);                                             \
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);                              \
        (void)hi;                                                                            \
        WALK(BODY512, R, BF)                                                                 \
        __m512 t = acc[0];                                                                   \
        for (int j = 1; j < 16; j++) t = _mm512_add_ps(t, acc[j]);                           \
        return (double)_mm512_reduce_add_ps(t);                                              \
    }

/* AVX2: 8 lanes, 12 accumulators (16 registers in all) */
#define BODY256(R, BF, g)                                                                    \
    _Pragma("GCC unroll 8") for (int l = 0; l < 8; l++) {                                                            \
        const __m256i w = _mm256_loadu_si256((const __m256i *)((g) + 32 * l));               \
        if (BF) {                                                                            \
            FMAS(acc, 12, _mm256_fmadd_ps, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), R, 2 * l) \
            FMAS(acc, 12, _mm256_fmadd_ps, _mm256_castsi256_ps(_mm256_and_si256(w, hi)), R, 2 * l + 1) \
        } else {                                                                             \
            FMAS(acc, 12, _mm256_fmadd_ps, _mm256_castsi256_ps(w), R, l)                     \
        }                                                                                    \
    }
#define PASS256(name, R, BF)                                                                 \
    T256 static double name(const pattern *p) {                                              \
        __m256 acc[12];                                                                      \
        for (int j = 0; j < 12; j++) acc[j] = _mm256_setzero_ps();                           \
        const __m256 m = _mm256_set1_ps(1.001f);                                             \
        const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);                              \
        (void)hi;                                                                            \
        WALK(BODY256, R, BF)                                                                 \
        __m256 t = acc[0];                                                                   \
        for (int j = 1; j < 12; j++) t = _mm256_add_ps(t, acc[j]);                           \
        float v[8];                                                                          \
        _mm256_storeu_ps(v, t);                                                              \
        return (double)(v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]);              \
    }

#define VARIANTS(X)                                                                          \
    X(f32_1, 1, 0) X(f32_2, 2, 0) X(f32_4, 4, 0) X(f32_8, 8, 0)                              \
    X(bf16_1, 1, 1) X(bf16_2, 2, 1) X(bf16_4, 4, 1) X(bf16_8, 8, 1)
#define MK512(v, R, BF) PASS512(p512_##v, R, BF)
#define MK256(v, R, BF) PASS256(p256_##v, R, BF)
VARIANTS(MK512)
VARIANTS(MK256)

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s f32|bf16 B L rounds\n", argv[0]);
        return 2;
    }
    /* AVX-512 where the CPU has it (PKV_PROBE_ISA=avx2 asks for AVX2), else AVX2 */
    const char *ie = getenv("PKV_PROBE_ISA");
    const int w512 = __builtin_cpu_supports("avx512f") && !(ie && !strcmp(ie, "avx2"));
    if (!w512 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        printf("overlap_probe: this CPU has neither AVX-512 F nor AVX2 with FMA; nothing measured\n");
        return 0;
    }
    const int bf = !strcmp(argv[1], "bf16");
    const int64_t B = atoll(argv[2]), L = atoll(argv[3]);
    const int rounds = atoi(argv[4]);
    const int hkv = 8, d = 128, bs = 16;
    if (B < 1 || L < 1 || rounds < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    const size_t item = bf ? 2 : 4, plane = (size_t)hkv * bs * d * item;
    const int64_t nblk = B * ((L + bs - 1) / bs);
    void *raw;
    char *pool = pkv_alloc((size_t)nblk * 2 * plane, &raw);
    int32_t *order = malloc(sizeof(int32_t) * nblk);
    if (!pool || !order) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t j = 0; j < (size_t)nblk * 2 * plane / 2; j++) /* small values: bfloat16 or float */
        ((uint16_t *)pool)[j] = (uint16_t)(0x3c00 + (rng() & 0xff));
    for (int64_t i = 0; i < nblk; i++) order[i] = (int32_t)i;
    for (int64_t i = nblk - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rng() % (uint64_t)(i + 1));
        const int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
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
    const pass_fn f512[2][5] = {{p512_read, p512_f32_1, p512_f32_2, p512_f32_4, p512_f32_8},
                                {p512_read, p512_bf16_1, p512_bf16_2, p512_bf16_4, p512_bf16_8}};
    const pass_fn f256[2][5] = {{p256_read, p256_f32_1, p256_f32_2, p256_f32_4, p256_f32_8},
                                {p256_read, p256_bf16_1, p256_bf16_2, p256_bf16_4, p256_bf16_8}};
    const pass_fn *fns = w512 ? f512[bf] : f256[bf];
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
        /* FMA lanes per second: R per value */
        const double vals = bytes / item, fmas = v ? vals * (1 << (v - 1)) : 0;
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
