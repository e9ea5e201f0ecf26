/* pagedkv/peak.h -- the arithmetic peak of the instruction the kernels are
 * built on, measured on this machine.
 *
 * Decode with K/V in L2 is bound by arithmetic, not by memory: its rate is
 * judged against what one core can do with the instruction its inner loops
 * use.  Today that is the fused multiply-add of the compute type (float32 or
 * float64; bfloat16 / float16 / int8 storage is widened on load and folded
 * with the same FMAs), so the probe here is a loop of PKV_PEAK_CHAINS
 * independent FMA chains, each one SIMD register wide:
 *
 *     c_j = c_j * a + b     (j = 0 .. PKV_PEAK_CHAINS-1, `iters` times)
 *
 * Twelve chains cover the FMA latency times the number of FMA ports of
 * current cores (4-5 cycles x 2 ports); they fit the register file of every
 * path (16 ymm on AVX2, 32 zmm / v registers on AVX-512 / NEON).  a and b are
 * arguments, so nothing folds at compile time, and the final lanes are summed
 * into *sum, so the loop cannot be dropped.  With a = 0.5, b = 1 every lane
 * moves towards 2 by halving its distance (exact in binary floating point),
 * which keeps the values normal and gives the tests an exact checksum.
 *
 * Kinds (PKV_PEAK_*): the instruction measured; lanes = element operations
 * (one multiply-add of one lane counts 1).  A later dot-product instruction
 * (e.g. AVX512_BF16 vdpbf16ps, VNNI vpdpbusd) is a new kind with its own
 * loops and lane count; callers select by kind.
 *
 * Paths: x86-64 scalar / AVX2+FMA / AVX-512 through per-function target
 * attributes (no -m flags; the caller only runs a path pkv_simd_supported()
 * allows), aarch64 scalar / NEON.  The scalar loop is portable C: the
 * compiler picks its instructions (a multiply then an add on baseline
 * x86-64, which has no FMA; it may pack chains into SSE2 / Advanced SIMD
 * registers), as it does for the scalar kernels.
 */
#pragma once
#include <stdint.h>
#include "simd.h"

enum {
    PKV_PEAK_FMA_F32 = 0,
    PKV_PEAK_FMA_F64 = 1,
    PKV_NUM_PEAK_KINDS = 2
};

#define PKV_PEAK_CHAINS 12

/* The probe loops touch nothing but their own locals.  Under AddressSanitizer
 * with detect_stack_use_after_return its locals move to a heap "fake stack"
 * whose frames are not 64-byte aligned, and the spilled vector chains (aligned
 * stores at -O1) fault there: the probe is left uninstrumented. */
#if defined(__SANITIZE_ADDRESS__)
#define PKV_PEAK_FN __attribute__((no_sanitize_address)) static
#else
#define PKV_PEAK_FN static
#endif

/* One probe loop: `iters` rounds of the chains; returns the lanes done
 * (PKV_PEAK_CHAINS * width * iters) and the sum of the final lanes in *sum. */
typedef uint64_t (*pkv_peak_fn)(int64_t iters, double a, double b, double *sum);

/* The body of a probe loop, written once over a small vocabulary the
 * function defines before it: PKV_PK_V (vector type), PKV_PK_E (element
 * type), PKV_PK_W (lanes per vector), PKV_PK_SET1(x), PKV_PK_LOAD(p),
 * PKV_PK_STORE(p, v), PKV_PK_FMA(c, a, b) = c * a + b.  The chains are
 * spelled out (c0 .. c11), so they live in registers at every -O level that
 * keeps locals in registers, and no inner loop is left to the unroller.
 * Lane k of the chains starts at k. */
#define PKV_PK_REP(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define PKV_PK_DECL(j) PKV_PK_V c##j = PKV_PK_LOAD(buf + (j) * PKV_PK_W);
#define PKV_PK_STEP(j) c##j = PKV_PK_FMA(c##j, va, vb);
#define PKV_PK_SAVE(j) PKV_PK_STORE(buf + (j) * PKV_PK_W, c##j);
#define PKV_PEAK_BODY                                                         \
    PKV_PK_E buf[PKV_PEAK_CHAINS * PKV_PK_W];                                 \
    for (int k = 0; k < PKV_PEAK_CHAINS * PKV_PK_W; k++) buf[k] = (PKV_PK_E)k; \
    const PKV_PK_V va = PKV_PK_SET1((PKV_PK_E)a), vb = PKV_PK_SET1((PKV_PK_E)b); \
    PKV_PK_REP(PKV_PK_DECL)                                                   \
    for (int64_t i = 0; i < iters; i++) {                                     \
        PKV_PK_REP(PKV_PK_STEP)                                               \
    }                                                                         \
    PKV_PK_REP(PKV_PK_SAVE)                                                   \
    double s = 0.0;                                                           \
    for (int k = 0; k < PKV_PEAK_CHAINS * PKV_PK_W; k++) s += (double)buf[k]; \
    *sum = s;                                                                 \
    return iters > 0 ? (uint64_t)iters * PKV_PEAK_CHAINS * PKV_PK_W : 0;

/* ---- scalar (portable C) ------------------------------------------------ */
#define PKV_PK_SET1(x) (x)
#define PKV_PK_LOAD(p) (*(p))
#define PKV_PK_STORE(p, v) (*(p) = (v))
#define PKV_PK_FMA(c, a, b) ((c) * (a) + (b))
#define PKV_PK_W 1

#define PKV_PK_V float
#define PKV_PK_E float
PKV_PEAK_FN uint64_t pkv_peak_fma_f32_scalar(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E

#define PKV_PK_V double
#define PKV_PK_E double
PKV_PEAK_FN uint64_t pkv_peak_fma_f64_scalar(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA
#undef PKV_PK_W

#if PKV_X86
#include <immintrin.h>

/* ---- AVX2 + FMA: 8 / 4 lanes --------------------------------------------- */
#define PKV_PK_V __m256
#define PKV_PK_E float
#define PKV_PK_W 8
#define PKV_PK_SET1(x) _mm256_set1_ps(x)
#define PKV_PK_LOAD(p) _mm256_loadu_ps(p)
#define PKV_PK_STORE(p, v) _mm256_storeu_ps(p, v)
#define PKV_PK_FMA(c, a, b) _mm256_fmadd_ps(c, a, b)
__attribute__((target("avx2,fma")))
PKV_PEAK_FN uint64_t pkv_peak_fma_f32_avx2(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA

#define PKV_PK_V __m256d
#define PKV_PK_E double
#define PKV_PK_W 4
#define PKV_PK_SET1(x) _mm256_set1_pd(x)
#define PKV_PK_LOAD(p) _mm256_loadu_pd(p)
#define PKV_PK_STORE(p, v) _mm256_storeu_pd(p, v)
#define PKV_PK_FMA(c, a, b) _mm256_fmadd_pd(c, a, b)
__attribute__((target("avx2,fma")))
PKV_PEAK_FN uint64_t pkv_peak_fma_f64_avx2(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA

/* ---- AVX-512: 16 / 8 lanes ----------------------------------------------- */
#define PKV_PK_V __m512
#define PKV_PK_E float
#define PKV_PK_W 16
#define PKV_PK_SET1(x) _mm512_set1_ps(x)
#define PKV_PK_LOAD(p) _mm512_loadu_ps(p)
#define PKV_PK_STORE(p, v) _mm512_storeu_ps(p, v)
#define PKV_PK_FMA(c, a, b) _mm512_fmadd_ps(c, a, b)
__attribute__((target("avx512f")))
PKV_PEAK_FN uint64_t pkv_peak_fma_f32_avx512(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA

#define PKV_PK_V __m512d
#define PKV_PK_E double
#define PKV_PK_W 8
#define PKV_PK_SET1(x) _mm512_set1_pd(x)
#define PKV_PK_LOAD(p) _mm512_loadu_pd(p)
#define PKV_PK_STORE(p, v) _mm512_storeu_pd(p, v)
#define PKV_PK_FMA(c, a, b) _mm512_fmadd_pd(c, a, b)
__attribute__((target("avx512f")))
PKV_PEAK_FN uint64_t pkv_peak_fma_f64_avx512(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA
#endif /* PKV_X86 */

#if PKV_ARM64
#include <arm_neon.h>

/* ---- NEON (base AArch64, no target attribute): 4 / 2 lanes --------------
 * vfmaq(b, c, a) = b + c * a, one fused instruction. */
#define PKV_PK_V float32x4_t
#define PKV_PK_E float
#define PKV_PK_W 4
#define PKV_PK_SET1(x) vdupq_n_f32(x)
#define PKV_PK_LOAD(p) vld1q_f32(p)
#define PKV_PK_STORE(p, v) vst1q_f32(p, v)
#define PKV_PK_FMA(c, a, b) vfmaq_f32(b, c, a)
PKV_PEAK_FN uint64_t pkv_peak_fma_f32_neon(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA

#define PKV_PK_V float64x2_t
#define PKV_PK_E double
#define PKV_PK_W 2
#define PKV_PK_SET1(x) vdupq_n_f64(x)
#define PKV_PK_LOAD(p) vld1q_f64(p)
#define PKV_PK_STORE(p, v) vst1q_f64(p, v)
#define PKV_PK_FMA(c, a, b) vfmaq_f64(b, c, a)
PKV_PEAK_FN uint64_t pkv_peak_fma_f64_neon(int64_t iters, double a, double b, double *sum) {
    PKV_PEAK_BODY
}
#undef PKV_PK_V
#undef PKV_PK_E
#undef PKV_PK_W
#undef PKV_PK_SET1
#undef PKV_PK_LOAD
#undef PKV_PK_STORE
#undef PKV_PK_FMA
#endif /* PKV_ARM64 */

#undef PKV_PEAK_BODY
#undef PKV_PK_REP
#undef PKV_PK_DECL
#undef PKV_PK_STEP
#undef PKV_PK_SAVE

/* The probe loop of (kind, simd), or NULL when this build has none (unknown
 * kind, or a path of another architecture).  Whether the CPU runs the path
 * is the caller's check (pkv_simd_supported). */
static inline pkv_peak_fn pkv_peak_fn_for(int kind, int simd) {
    const int f64 = kind == PKV_PEAK_FMA_F64;
    if (kind != PKV_PEAK_FMA_F32 && kind != PKV_PEAK_FMA_F64) return 0;
    if (simd == PKV_SIMD_SCALAR) return f64 ? pkv_peak_fma_f64_scalar : pkv_peak_fma_f32_scalar;
#if PKV_X86
    if (simd == PKV_SIMD_AVX2) return f64 ? pkv_peak_fma_f64_avx2 : pkv_peak_fma_f32_avx2;
    if (simd == PKV_SIMD_AVX512) return f64 ? pkv_peak_fma_f64_avx512 : pkv_peak_fma_f32_avx512;
#endif
#if PKV_ARM64
    if (simd == PKV_SIMD_NEON) return f64 ? pkv_peak_fma_f64_neon : pkv_peak_fma_f32_neon;
#endif
    return 0;
}

/* Lanes per chain of (kind, simd): its vector width in elements; 0 when
 * pkv_peak_fn_for has no loop for it. */
static inline int pkv_peak_width(int kind, int simd) {
    if (!pkv_peak_fn_for(kind, simd)) return 0;
    const int f64 = kind == PKV_PEAK_FMA_F64;
    switch (simd) {
    case PKV_SIMD_AVX2: return f64 ? 4 : 8;
    case PKV_SIMD_AVX512: return f64 ? 8 : 16;
    case PKV_SIMD_NEON: return f64 ? 2 : 4;
    default: return 1;
    }
}

/* Run the probe of (kind, simd) on nthreads threads at once (OpenMP; without
 * it the threads' loops run one after another), each `iters` rounds.
 * Returns the lanes done by all threads (0 when there is no such loop or an
 * argument is out of range) and the sum of all their final lanes in *sum. */
static inline uint64_t pkv_peak_run(int kind, int simd, int64_t iters, int nthreads, double a,
                                    double b, double *sum) {
    const pkv_peak_fn f = pkv_peak_fn_for(kind, simd);
    *sum = 0.0;
    if (!f || iters < 0 || nthreads < 1) return 0;
    uint64_t lanes = 0;
    double total = 0.0;
    int t;
#pragma omp parallel for num_threads(nthreads) reduction(+ : lanes, total) schedule(static) if (nthreads > 1)
    for (t = 0; t < nthreads; t++) {
        double s;
        lanes += f(iters, a, b, &s);
        total += s;
    }
    *sum = total;
    return lanes;
}
