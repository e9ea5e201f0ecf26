/* dot_peak.c -- what one core's integer dot-product instructions give
 * against the float32 FMA the kernels use, in the shape of the kernels'
 * register tile.
 *
 * Storage-native dot products (int8 keys against a quantized query) only pay
 * where the integer instructions multiply-add more values per cycle than
 * the FMA; this probe measures that ratio.  Each loop is the inner step of a
 * 4-row x 2-vector register tile: two vectors loaded from an L1-resident
 * buffer, each multiplied with four broadcast rows and accumulated into
 * eight independent accumulators, so the loads, the multiplies and the
 * accumulation all count, as they do in a kernel:
 *
 *   fma_f32      vfmadd231ps: 8 multiply-adds per instruction
 *   madd_i16     vpmaddwd + vpaddd: 16 (int16 pairs into int32)
 *   maddubs_i8   vpsignb + vpmaddubsw + vpmaddwd + vpaddd: 32 (int8 quads
 *                into int32, the sign trick for signed x signed)
 *
 * and, where the CPU has them, the same tile on 512-bit registers (16
 * int32 / float lanes, the buffer's entries one vector each, 4 rows x 2
 * vectors):
 *
 *   fma_f32_512  vfmadd231ps zmm: 16 multiply-adds
 *   dpbusd_512   vpdpbusd (AVX512_VNNI): 64 (unsigned x signed bytes)
 *   dpwssd_512   vpdpwssd (AVX512_VNNI): 32 (int16 pairs)
 *   dpbf16_512   vdpbf16ps (AVX512_BF16): 32 (bfloat16 pairs into float32)
 *
 * and the float32 tile over storage widened as the kernels widen it on load
 * (16 multiply-adds per FMA; one widening per loaded vector, shared by the 4
 * rows, as in decode's tile over a GQA group of 4 query heads):
 *
 *   bf16_fma_512      16 bfloat16 by a zero-masked word permute (vpermw)
 *   bf16pair_fma_512  32 bfloat16 from one 64-byte load, the even ones by a
 *                     shift, the odd ones by a mask (P.V's pairs)
 *   f16_fma_512       16 float16 by vcvtph2ps
 *   i8_fma_512        16 int8 by vpmovsxbd + vcvtdq2ps
 *
 * Their buffers hold small integers, so each loop's sum (printed) is exact
 * for the test's iteration counts.
 *
 * Rates are G multiply-adds per second on one thread (best of the rounds).
 * The int32 accumulators wrap; the checksum each integer loop prints (the
 * sum of its final lanes, mod 2^32) is what tests/kernels/test_dot_peak.py
 * checks against an exact model.  Built without -m flags (per-function
 * target attributes), it reports and exits where the CPU lacks AVX2 or on
 * another architecture, and skips the 512-bit loops the CPU lacks.
 *
 *   cc -O3 -std=c11 -D_POSIX_C_SOURCE=200112L benchmarks/c/dot_peak.c -o dot_peak
 *   ./dot_peak [iterations]      (default 100000000)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NBUF 64 /* buffer entries of 2 vectors (64 bytes): 4 KiB, in L1 */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

static int32_t buf[NBUF * 16] __attribute__((aligned(64)));
static float fbuf[NBUF * 16] __attribute__((aligned(64))); /* normal floats: no assists */
/* storage for the widening loops: small integers (exact float sums) */
static uint16_t bf16buf[NBUF * 32] __attribute__((aligned(64)));
static uint16_t f16buf[NBUF * 16] __attribute__((aligned(64)));
static int8_t i8buf[NBUF * 16] __attribute__((aligned(64)));

/* the row operands: four broadcast 32-bit patterns */
static const uint32_t ROWS[4] = {0x00030002u, 0x7f81f009u, 0x10203040u, 0xf0e0d0c9u};

#define TILE_SUM(acc, out)                                                              \
    {                                                                                   \
        __m256i s_ = acc[0];                                                            \
        for (int k_ = 1; k_ < 8; k_++) s_ = _mm256_add_epi32(s_, acc[k_]);              \
        int32_t l_[8];                                                                  \
        _mm256_storeu_si256((__m256i *)l_, s_);                                         \
        uint32_t t_ = 0;                                                                \
        for (int k_ = 0; k_ < 8; k_++) t_ += (uint32_t)l_[k_];                          \
        *(out) = t_;                                                                    \
    }

__attribute__((target("avx2,fma"), noinline)) static float fma_f32(long n) {
    const float *p0 = fbuf;
    __m256 c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm256_setzero_ps();
    const __m256 b0 = _mm256_set1_ps(1.0f), b1 = _mm256_set1_ps(0.5f), b2 = _mm256_set1_ps(0.25f),
                 b3 = _mm256_set1_ps(0.125f);
    for (long i = 0; i < n; i++) {
        const float *p = p0 + (i & (NBUF - 1)) * 16;
        const __m256 x0 = _mm256_load_ps(p), x1 = _mm256_load_ps(p + 8);
        c[0] = _mm256_fmadd_ps(x0, b0, c[0]);
        c[1] = _mm256_fmadd_ps(x1, b0, c[1]);
        c[2] = _mm256_fmadd_ps(x0, b1, c[2]);
        c[3] = _mm256_fmadd_ps(x1, b1, c[3]);
        c[4] = _mm256_fmadd_ps(x0, b2, c[4]);
        c[5] = _mm256_fmadd_ps(x1, b2, c[5]);
        c[6] = _mm256_fmadd_ps(x0, b3, c[6]);
        c[7] = _mm256_fmadd_ps(x1, b3, c[7]);
    }
    __m256 s = c[0];
    for (int k = 1; k < 8; k++) s = _mm256_add_ps(s, c[k]);
    float l[8];
    _mm256_storeu_ps(l, s);
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

__attribute__((target("avx2"), noinline)) static void madd_i16(long n, uint32_t *sum) {
    __m256i c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm256_setzero_si256();
    __m256i b[4];
    for (int r = 0; r < 4; r++) b[r] = _mm256_set1_epi32((int32_t)ROWS[r]);
    for (long i = 0; i < n; i++) {
        const __m256i *p = (const __m256i *)buf + (i & (NBUF - 1)) * 2;
        const __m256i x0 = _mm256_load_si256(p), x1 = _mm256_load_si256(p + 1);
        for (int r = 0; r < 4; r++) {
            c[2 * r] = _mm256_add_epi32(c[2 * r], _mm256_madd_epi16(x0, b[r]));
            c[2 * r + 1] = _mm256_add_epi32(c[2 * r + 1], _mm256_madd_epi16(x1, b[r]));
        }
    }
    TILE_SUM(c, sum)
}

__attribute__((target("avx2"), noinline)) static void maddubs_i8(long n, uint32_t *sum) {
    __m256i c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm256_setzero_si256();
    __m256i q[4], qa[4];
    for (int r = 0; r < 4; r++) {
        q[r] = _mm256_set1_epi32((int32_t)ROWS[r]);
        qa[r] = _mm256_abs_epi8(q[r]);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (long i = 0; i < n; i++) {
        const __m256i *p = (const __m256i *)buf + (i & (NBUF - 1)) * 2;
        const __m256i x0 = _mm256_load_si256(p), x1 = _mm256_load_si256(p + 1);
        for (int r = 0; r < 4; r++) {
            const __m256i d0 = _mm256_maddubs_epi16(qa[r], _mm256_sign_epi8(x0, q[r]));
            const __m256i d1 = _mm256_maddubs_epi16(qa[r], _mm256_sign_epi8(x1, q[r]));
            c[2 * r] = _mm256_add_epi32(c[2 * r], _mm256_madd_epi16(d0, ones));
            c[2 * r + 1] = _mm256_add_epi32(c[2 * r + 1], _mm256_madd_epi16(d1, ones));
        }
    }
    TILE_SUM(c, sum)
}

/* the 512-bit tile: entry e of the buffer as two zmm (128 bytes: entries e
 * and e + 1 mod NBUF of the 64-byte view) */
#define TILE_SUM512(acc, out)                                                           \
    {                                                                                   \
        __m512i s_ = acc[0];                                                            \
        for (int k_ = 1; k_ < 8; k_++) s_ = _mm512_add_epi32(s_, acc[k_]);              \
        *(out) = (uint32_t)_mm512_reduce_add_epi32(s_);                                 \
    }
#define ENTRY512(i) ((const __m512i *)buf + ((i) & (NBUF - 1)))
#define NEXT512(i) ((const __m512i *)buf + (((i) + 1) & (NBUF - 1)))

__attribute__((target("avx512f"), noinline)) static float fma_f32_512(long n) {
    __m512 c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm512_setzero_ps();
    const __m512 b[4] = {_mm512_set1_ps(1.0f), _mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f),
                         _mm512_set1_ps(0.125f)};
    for (long i = 0; i < n; i++) {
        const __m512 x0 = _mm512_load_ps(fbuf + (i & (NBUF - 1)) * 16);
        const __m512 x1 = _mm512_load_ps(fbuf + ((i + 1) & (NBUF - 1)) * 16);
        for (int r = 0; r < 4; r++) {
            c[2 * r] = _mm512_fmadd_ps(x0, b[r], c[2 * r]);
            c[2 * r + 1] = _mm512_fmadd_ps(x1, b[r], c[2 * r + 1]);
        }
    }
    __m512 s = c[0];
    for (int k = 1; k < 8; k++) s = _mm512_add_ps(s, c[k]);
    return _mm512_reduce_add_ps(s);
}

/* acc + one dot-product instruction, the accumulator updated in place
 * (through the intrinsics GCC 12 moves the accumulators around every
 * instruction, and the loop would measure that) */
#define DP_FN(name, insn, T, tgt)                                                   \
    __attribute__((target(tgt))) static inline T name(T acc, __m512i x, __m512i b) { \
        __asm__(insn " %2, %1, %0" : "+v"(acc) : "v"(x), "v"(b));                   \
        return acc;                                                                 \
    }
DP_FN(dp_busd, "vpdpbusd", __m512i, "avx512f,avx512vnni")
DP_FN(dp_wssd, "vpdpwssd", __m512i, "avx512f,avx512vnni")
DP_FN(dp_bf16, "vdpbf16ps", __m512, "avx512f,avx512bf16")

/* the integer 512-bit tile over instruction DP (for vpdpbusd the buffer is the
 * unsigned side, the rows the signed one) */
#define DP_TILE512(name, DP)                                                              \
    __attribute__((target("avx512f,avx512vnni"), noinline)) static void name(long n, uint32_t *sum) { \
        __m512i c[8];                                                                     \
        for (int k = 0; k < 8; k++) c[k] = _mm512_setzero_si512();                        \
        __m512i b[4];                                                                     \
        for (int r = 0; r < 4; r++) b[r] = _mm512_set1_epi32((int32_t)ROWS[r]);           \
        for (long i = 0; i < n; i++) {                                                    \
            const __m512i x0 = _mm512_load_si512(ENTRY512(i)), x1 = _mm512_load_si512(NEXT512(i)); \
            for (int r = 0; r < 4; r++) {                                                 \
                c[2 * r] = DP(c[2 * r], x0, b[r]);                                        \
                c[2 * r + 1] = DP(c[2 * r + 1], x1, b[r]);                                \
            }                                                                             \
        }                                                                                 \
        TILE_SUM512(c, sum)                                                               \
    }
DP_TILE512(dpbusd_512, dp_busd)
DP_TILE512(dpwssd_512, dp_wssd)

__attribute__((target("avx512f,avx512bf16"), noinline)) static float dpbf16_512(long n) {
    __m512 c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm512_setzero_ps();
    __m512i b[4]; /* bfloat16 pairs of small normal values */
    for (int r = 0; r < 4; r++) b[r] = _mm512_set1_epi32((int32_t)(0x3f803f00u + 0x10001u * (unsigned)r));
    for (long i = 0; i < n; i++) {
        /* the float buffer's bits as bfloat16 pairs: normal values, no assists */
        const __m512i x0 = _mm512_load_si512((const __m512i *)fbuf + (i & (NBUF - 1)));
        const __m512i x1 = _mm512_load_si512((const __m512i *)fbuf + ((i + 1) & (NBUF - 1)));
        for (int r = 0; r < 4; r++) {
            c[2 * r] = dp_bf16(c[2 * r], x0, b[r]);
            c[2 * r + 1] = dp_bf16(c[2 * r + 1], x1, b[r]);
        }
    }
    __m512 s = c[0];
    for (int k = 1; k < 8; k++) s = _mm512_add_ps(s, c[k]);
    return _mm512_reduce_add_ps(s);
}

/* the widening tile: x0, x1 = WIDEN(i) (two float32 vectors of entry i's
 * storage), 4 rows x 2 vectors of FMAs into 8 accumulators; the sum of every
 * lane in double (exact: each lane is an integer below 2^24 for the test's
 * iteration counts) */
#define WIDEN_TILE512(name, tgt, WIDEN)                                                   \
    __attribute__((target(tgt), noinline)) static double name(long n) {                 \
        __m512 c[8];                                                                    \
        for (int k = 0; k < 8; k++) c[k] = _mm512_setzero_ps();                         \
        const __m512 b[4] = {_mm512_set1_ps(1.0f), _mm512_set1_ps(2.0f),               \
                             _mm512_set1_ps(3.0f), _mm512_set1_ps(4.0f)};               \
        for (long i = 0; i < n; i++) {                                                  \
            __m512 x0, x1;                                                              \
            WIDEN(i)                                                                    \
            for (int r = 0; r < 4; r++) {                                               \
                c[2 * r] = _mm512_fmadd_ps(x0, b[r], c[2 * r]);                         \
                c[2 * r + 1] = _mm512_fmadd_ps(x1, b[r], c[2 * r + 1]);                 \
            }                                                                           \
        }                                                                               \
        double t = 0;                                                                   \
        for (int k = 0; k < 8; k++) {                                                   \
            float l[16];                                                                \
            _mm512_storeu_ps(l, c[k]);                                                  \
            for (int j = 0; j < 16; j++) t += l[j];                                     \
        }                                                                               \
        return t;                                                                       \
    }
/* entries i and i + 1 (mod NBUF) of 16 values each, or entry i of 32 (pair) */
#define BF16_AT(e) _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(                          \
    (__mmask32)0xAAAAAAAAu,                                                                     \
    _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, \
                     5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),                                          \
    _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(bf16buf + ((e) & (NBUF - 1)) * 16)))))
#define WIDEN_BF16(i) x0 = BF16_AT(i); x1 = BF16_AT((i) + 1);
#define WIDEN_BF16PAIR(i)                                                                    \
    {                                                                                        \
        const __m512i w_ = _mm512_load_si512((const __m512i *)(bf16buf + ((i) & (NBUF - 1)) * 32)); \
        x0 = _mm512_castsi512_ps(_mm512_slli_epi32(w_, 16));                                 \
        x1 = _mm512_castsi512_ps(_mm512_and_si512(w_, _mm512_set1_epi32((int)0xFFFF0000u))); \
    }
#define F16_AT(e) _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(f16buf + ((e) & (NBUF - 1)) * 16)))
#define WIDEN_F16(i) x0 = F16_AT(i); x1 = F16_AT((i) + 1);
#define I8_AT(e) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(i8buf + ((e) & (NBUF - 1)) * 16))))
#define WIDEN_I8(i) x0 = I8_AT(i); x1 = I8_AT((i) + 1);
WIDEN_TILE512(bf16_fma_512, "avx512f,avx512bw", WIDEN_BF16)
WIDEN_TILE512(bf16pair_fma_512, "avx512f", WIDEN_BF16PAIR)
WIDEN_TILE512(f16_fma_512, "avx512f", WIDEN_F16)
WIDEN_TILE512(i8_fma_512, "avx512f", WIDEN_I8)

/* float16 bits of a small positive integer v (exact) */
static uint16_t f16_bits(int v) {
    int e = 0;
    while ((v >> (e + 1)) != 0) e++;
    return (uint16_t)((15 + e) << 10 | ((v - (1 << e)) << (10 - e)));
}

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 100000000L;
    const int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (n < 1 || rounds < 1) {
        fprintf(stderr, "usage: %s [iterations >= 1] [rounds >= 1]\n", argv[0]);
        return 2;
    }
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        printf("dot_peak: this CPU has no AVX2 + FMA; nothing measured\n");
        return 0;
    }
    /* int8 values in [-127, 127] (the storage's range: no -128) */
    for (int k = 0; k < NBUF * 16; k++) fbuf[k] = 1.0f + 0.25f * (float)(k % 7);
    for (int k = 0; k < NBUF * 16; k++) {
        const uint32_t h = (uint32_t)k * 2654435761u;
        int8_t b[4];
        for (int j = 0; j < 4; j++) b[j] = (int8_t)((int)((h >> (8 * j)) % 255u) - 127);
        buf[k] = (int32_t)((uint32_t)(uint8_t)b[0] | (uint32_t)(uint8_t)b[1] << 8 |
                           (uint32_t)(uint8_t)b[2] << 16 | (uint32_t)(uint8_t)b[3] << 24);
    }
    double best[3] = {0, 0, 0};
    uint32_t s16 = 0, s8 = 0;
    float sf = 0;
    for (int r = 0; r < rounds; r++) {
        double t = now();
        sf = fma_f32(n);
        double dt = now() - t;
        if (64.0 * n / dt > best[0]) best[0] = 64.0 * n / dt;
        t = now();
        madd_i16(n, &s16);
        dt = now() - t;
        if (128.0 * n / dt > best[1]) best[1] = 128.0 * n / dt;
        t = now();
        maddubs_i8(n, &s8);
        dt = now() - t;
        if (256.0 * n / dt > best[2]) best[2] = 256.0 * n / dt;
    }
    printf("iterations %ld, rounds %d, 1 thread (G multiply-adds/s, best)\n", n, rounds);
    printf("fma_f32     %7.1f  1.00x  (sum %g)\n", best[0] / 1e9, (double)sf);
    printf("madd_i16    %7.1f  %.2fx  checksum %u\n", best[1] / 1e9, best[1] / best[0], s16);
    printf("maddubs_i8  %7.1f  %.2fx  checksum %u\n", best[2] / 1e9, best[2] / best[0], s8);
    if (!__builtin_cpu_supports("avx512f")) return 0;
    /* the 512-bit tile: 128 bytes a step, 4 rows x 2 vectors */
    const int vnni = __builtin_cpu_supports("avx512vnni"), bf16 = __builtin_cpu_supports("avx512bf16");
    double b5[4] = {0, 0, 0, 0};
    uint32_t sb = 0, sw = 0;
    float f5 = 0, fb = 0;
    for (int r = 0; r < rounds; r++) {
        double t = now();
        f5 = fma_f32_512(n);
        double dt = now() - t;
        if (128.0 * n / dt > b5[0]) b5[0] = 128.0 * n / dt;
        if (vnni) {
            t = now();
            dpbusd_512(n, &sb);
            dt = now() - t;
            if (512.0 * n / dt > b5[1]) b5[1] = 512.0 * n / dt;
            t = now();
            dpwssd_512(n, &sw);
            dt = now() - t;
            if (256.0 * n / dt > b5[2]) b5[2] = 256.0 * n / dt;
        }
        if (bf16) {
            t = now();
            fb = dpbf16_512(n);
            dt = now() - t;
            if (256.0 * n / dt > b5[3]) b5[3] = 256.0 * n / dt;
        }
    }
    printf("fma_f32_512 %7.1f  %.2fx  (sum %g)\n", b5[0] / 1e9, b5[0] / best[0], (double)f5);
    if (vnni) {
        printf("dpbusd_512  %7.1f  %.2fx  checksum %u\n", b5[1] / 1e9, b5[1] / best[0], sb);
        printf("dpwssd_512  %7.1f  %.2fx  checksum %u\n", b5[2] / 1e9, b5[2] / best[0], sw);
    }
    if (bf16) printf("dpbf16_512  %7.1f  %.2fx  (sum %g)\n", b5[3] / 1e9, b5[3] / best[0], (double)fb);
    /* the widening loops: value k of each buffer is 1 + k % 7 (bfloat16 / float16 bits) */
    for (int k = 0; k < NBUF * 32; k++) {
        const float v = (float)(1 + k % 7);
        uint32_t u;
        __builtin_memcpy(&u, &v, 4);
        bf16buf[k] = (uint16_t)(u >> 16); /* exact: small integers */
        if (k < NBUF * 16) {
            f16buf[k] = f16_bits(1 + k % 7);
            i8buf[k] = (int8_t)(1 + k % 7);
        }
    }
    static const char *wname[4] = {"bf16_fma_512", "bf16pair_fma_512", "f16_fma_512", "i8_fma_512"};
    double (*const wfn[4])(long) = {bf16_fma_512, bf16pair_fma_512, f16_fma_512, i8_fma_512};
    const int wok[4] = {__builtin_cpu_supports("avx512bw"), 1, 1, 1};
    double wb[4] = {0, 0, 0, 0}, ws[4] = {0, 0, 0, 0};
    for (int r = 0; r < rounds; r++)
        for (int w = 0; w < 4; w++) {
            if (!wok[w]) continue;
            const double t = now();
            ws[w] = wfn[w](n);
            const double dt = now() - t;
            if (128.0 * n / dt > wb[w]) wb[w] = 128.0 * n / dt;
        }
    for (int w = 0; w < 4; w++)
        if (wok[w]) printf("%-16s %7.1f  %.2fx of fma_f32_512  sum %.0f\n", wname[w], wb[w] / 1e9,
                           wb[w] / b5[0], ws[w]);
    return 0;
}
#else
int main(void) {
    printf("dot_peak: x86-64 only; nothing measured\n");
    return 0;
}
#endif
