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
 * (one multiply-add of one lane counts 1).  PKV_PEAK_DPBUSD is the integer
 * dot product the int8 scores of the VNNI paths are built on (vpdpbusd:
 * products of unsigned by signed bytes, summed four at a time into int32
 * lanes); its lanes are the products, so 64 per instruction on AVX-512 +
 * VNNI, 32 on AVX2 + AVX-VNNI.  PKV_PEAK_SDOT is its aarch64 counterpart
 * (sdot: signed bytes, 16 products per instruction).
 * Its chains start at lane k = k and add 4 * 1 * 1 each round (bytes 1 and
 * 1), an exact checksum too.  PKV_PEAK_DPWSSD is the int16 dot product P.V
 * of int8 values is built on where the weights are rounded to int16
 * (attn_pvdot.h; vpdpwssd: products of int16 pairs, summed two at a time
 * into int32 lanes, 32 per AVX-512 instruction); its chains gain 2 * 1 * 1
 * a round.  PKV_PEAK_DPBF16 is the bfloat16 dot product
 * the bfloat16 scores of the AVX-512 + BF16 path are built on (vdpbf16ps:
 * two products of bfloat16 pairs added into each float32 lane, 32 products
 * per instruction); its chains start at lane k = k and add 1 * 1 + 1 * 1
 * each round (exact while the lanes stay below 2^24).  Callers select by
 * kind.
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
    PKV_PEAK_DPBUSD = 2, /* the VNNI paths only */
    PKV_PEAK_SDOT = 3,   /* NEON + dot product only */
    PKV_PEAK_DPBF16 = 4, /* the AVX-512 + BF16 path only */
    PKV_PEAK_DPWSSD = 5, /* the AVX-512 + VNNI paths only */
    PKV_NUM_PEAK_KINDS = 6
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

/* One probe loop, written once: PKV_PEAK_DEFINE(name, V, E, W, SET1, LOAD,
 * STORE, FMA) defines `name` over vector type V of W lanes of element type E
 * with those operations (FMA(c, a, b) = c * a + b); the includer puts a
 * target attribute in front where the path needs one.  The chains are spelled
 * out (c0 .. c11), so they live in registers at every -O level that keeps
 * locals in registers, and no inner loop is left to the unroller.  Lane k of
 * the chains starts at k. */
#define PKV_PEAK_DEFINE(name, V, E, W, SET1, LOAD, STORE, FMA)                        \
    PKV_PEAK_FN uint64_t name(int64_t iters, double a, double b, double *sum) {        \
        E buf[PKV_PEAK_CHAINS * (W)];                                                  \
        for (int k = 0; k < PKV_PEAK_CHAINS * (W); k++) buf[k] = (E)k;                 \
        const V va = SET1((E)a), vb = SET1((E)b);                                      \
        V c0 = LOAD(buf + 0 * (W)), c1 = LOAD(buf + 1 * (W)), c2 = LOAD(buf + 2 * (W)),\
          c3 = LOAD(buf + 3 * (W)), c4 = LOAD(buf + 4 * (W)), c5 = LOAD(buf + 5 * (W)),\
          c6 = LOAD(buf + 6 * (W)), c7 = LOAD(buf + 7 * (W)), c8 = LOAD(buf + 8 * (W)),\
          c9 = LOAD(buf + 9 * (W)), c10 = LOAD(buf + 10 * (W)), c11 = LOAD(buf + 11 * (W));\
        for (int64_t i = 0; i < iters; i++) {                                         \
            c0 = FMA(c0, va, vb); c1 = FMA(c1, va, vb); c2 = FMA(c2, va, vb); c3 = FMA(c3, va, vb);\
            c4 = FMA(c4, va, vb); c5 = FMA(c5, va, vb); c6 = FMA(c6, va, vb); c7 = FMA(c7, va, vb);\
            c8 = FMA(c8, va, vb); c9 = FMA(c9, va, vb); c10 = FMA(c10, va, vb); c11 = FMA(c11, va, vb);\
        }                                                                             \
        STORE(buf + 0 * (W), c0); STORE(buf + 1 * (W), c1); STORE(buf + 2 * (W), c2); STORE(buf + 3 * (W), c3);\
        STORE(buf + 4 * (W), c4); STORE(buf + 5 * (W), c5); STORE(buf + 6 * (W), c6); STORE(buf + 7 * (W), c7);\
        STORE(buf + 8 * (W), c8); STORE(buf + 9 * (W), c9); STORE(buf + 10 * (W), c10); STORE(buf + 11 * (W), c11);\
        double s = 0.0;                                                                \
        for (int k = 0; k < PKV_PEAK_CHAINS * (W); k++) s += (double)buf[k];           \
        *sum = s;                                                                      \
        return iters > 0 ? (uint64_t)iters * PKV_PEAK_CHAINS * (W) : 0;                \
    }

/* scalar (portable C) */
#define PKV_PK_ID(x) (x)
#define PKV_PK_DEREF(p) (*(p))
#define PKV_PK_ASSIGN(p, v) (*(p) = (v))
#define PKV_PK_MULADD(c, a, b) ((c) * (a) + (b))
PKV_PEAK_DEFINE(pkv_peak_fma_f32_scalar, float, float, 1, PKV_PK_ID, PKV_PK_DEREF, PKV_PK_ASSIGN,
                PKV_PK_MULADD)
PKV_PEAK_DEFINE(pkv_peak_fma_f64_scalar, double, double, 1, PKV_PK_ID, PKV_PK_DEREF, PKV_PK_ASSIGN,
                PKV_PK_MULADD)

/* Integer dot chains (vpdpbusd, sdot; vpdpwssd): c = c + dot(a, b) per int32
 * lane, a and b all elements 1 (bytes, or int16 pairs: ONES), N products a
 * lane (a and b of the signature are not used: the checksum is exact
 * anyway); the chains as in PKV_PEAK_DEFINE, the sum in int64.
 * PKV_PEAK_DEFINE_DP defines one over vector type V of W int32 lanes (DP:
 * the instruction, SET1 / LOAD / STORE of int32 lanes) with the target
 * attribute `tgt`: the AVX-512, AVX-VNNI (VEX-encoded, 256-bit) and NEON +
 * dot product forms below. */
#define PKV_PEAK_DEFINE_DP(name, tgt, V, W, DP, SET1, LOAD, STORE)                             \
    PKV_PEAK_DEFINE_DPN(name, tgt, V, W, DP, SET1, LOAD, STORE, 0x01010101, 4)
#define PKV_PEAK_DEFINE_DPN(name, tgt, V, W, DP, SET1, LOAD, STORE, ONES, N)                   \
    __attribute__((target(tgt))) PKV_PEAK_FN uint64_t name(int64_t iters, double a, double b, \
                                                            double *sum) {                    \
        (void)a;                                                                              \
        (void)b;                                                                              \
        int32_t buf[PKV_PEAK_CHAINS * (W)];                                                   \
        for (int k = 0; k < PKV_PEAK_CHAINS * (W); k++) buf[k] = k;                           \
        const V ones = SET1(ONES);                                                            \
        V c0 = LOAD(buf + 0 * (W)), c1 = LOAD(buf + 1 * (W)), c2 = LOAD(buf + 2 * (W)),       \
          c3 = LOAD(buf + 3 * (W)), c4 = LOAD(buf + 4 * (W)), c5 = LOAD(buf + 5 * (W)),       \
          c6 = LOAD(buf + 6 * (W)), c7 = LOAD(buf + 7 * (W)), c8 = LOAD(buf + 8 * (W)),       \
          c9 = LOAD(buf + 9 * (W)), c10 = LOAD(buf + 10 * (W)), c11 = LOAD(buf + 11 * (W));   \
        for (int64_t i = 0; i < iters; i++) {                                                 \
            c0 = DP(c0, ones, ones); c1 = DP(c1, ones, ones); c2 = DP(c2, ones, ones);         \
            c3 = DP(c3, ones, ones); c4 = DP(c4, ones, ones); c5 = DP(c5, ones, ones);         \
            c6 = DP(c6, ones, ones); c7 = DP(c7, ones, ones); c8 = DP(c8, ones, ones);         \
            c9 = DP(c9, ones, ones); c10 = DP(c10, ones, ones); c11 = DP(c11, ones, ones);     \
        }                                                                                     \
        const V c[PKV_PEAK_CHAINS] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};      \
        int64_t s = 0;                                                                        \
        for (int j = 0; j < PKV_PEAK_CHAINS; j++) {                                           \
            STORE(buf, c[j]);                                                                 \
            for (int k = 0; k < (W); k++) s += buf[k];                                        \
        }                                                                                     \
        *sum = (double)s;                                                                     \
        return iters > 0 ? (uint64_t)iters * PKV_PEAK_CHAINS * (N) * (W) : 0;                 \
    }

#if PKV_X86
#include <immintrin.h>
/* Both loops of an x86 path: pkv_peak_fma_{f32,f64}_<isa> with the target
 * attribute `tgt`, over registers V32 / V64 of W32 floats (W32 / 2
 * doubles) and the intrinsics of prefix `mm` (_mm256, _mm512). */
#define PKV_PEAK_DEFINE_X86(isa, tgt, V32, V64, W32, mm)                                     \
    __attribute__((target(tgt)))                                                             \
    PKV_PEAK_DEFINE(pkv_peak_fma_f32_##isa, V32, float, W32, mm##_set1_ps, mm##_loadu_ps,    \
                    mm##_storeu_ps, mm##_fmadd_ps)                                           \
    __attribute__((target(tgt)))                                                             \
    PKV_PEAK_DEFINE(pkv_peak_fma_f64_##isa, V64, double, (W32) / 2, mm##_set1_pd,            \
                    mm##_loadu_pd, mm##_storeu_pd, mm##_fmadd_pd)
/* AVX2 + FMA: 8 / 4 lanes; AVX-512: 16 / 8 lanes */
PKV_PEAK_DEFINE_X86(avx2, "avx2,fma", __m256, __m256d, 8, _mm256)
PKV_PEAK_DEFINE_X86(avx512, "avx512f", __m512, __m512d, 16, _mm512)
#undef PKV_PEAK_DEFINE_X86

#define PKV_PK_LD512(p) _mm512_loadu_si512(p)
#define PKV_PK_ST512(p, x) _mm512_storeu_si512(p, x)
#define PKV_PK_LD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define PKV_PK_ST256(p, x) _mm256_storeu_si256((__m256i *)(p), x)
PKV_PEAK_DEFINE_DP(pkv_peak_dpbusd_avx512vnni, "avx512f,avx512bw,avx512vnni", __m512i, 16,
                   _mm512_dpbusd_epi32, _mm512_set1_epi32, PKV_PK_LD512, PKV_PK_ST512)
PKV_PEAK_DEFINE_DPN(pkv_peak_dpwssd_avx512vnni, "avx512f,avx512bw,avx512vnni", __m512i, 16,
                    _mm512_dpwssd_epi32, _mm512_set1_epi32, PKV_PK_LD512, PKV_PK_ST512, 0x00010001, 2)
PKV_PEAK_DEFINE_DP(pkv_peak_dpbusd_avxvnni, "avx2,avxvnni", __m256i, 8, _mm256_dpbusd_avx_epi32,
                   _mm256_set1_epi32, PKV_PK_LD256, PKV_PK_ST256)
#if PKV_HAVE_AVX512BF16
/* vdpbf16ps on float32 lanes, both operands bfloat16 pairs (1, 1): the
 * chains' int32 stores and sums of PKV_PEAK_DEFINE_DP would misread float
 * lanes, so the checksum is taken here in floating point */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) PKV_PEAK_FN uint64_t
pkv_peak_dpbf16_avx512bf16(int64_t iters, double a, double b, double *sum) {
    (void)a;
    (void)b;
    float buf[PKV_PEAK_CHAINS * 16];
    for (int k = 0; k < PKV_PEAK_CHAINS * 16; k++) buf[k] = (float)k;
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bfloat16 1.0 */
    __m512 c0 = _mm512_loadu_ps(buf), c1 = _mm512_loadu_ps(buf + 16), c2 = _mm512_loadu_ps(buf + 32),
           c3 = _mm512_loadu_ps(buf + 48), c4 = _mm512_loadu_ps(buf + 64), c5 = _mm512_loadu_ps(buf + 80),
           c6 = _mm512_loadu_ps(buf + 96), c7 = _mm512_loadu_ps(buf + 112), c8 = _mm512_loadu_ps(buf + 128),
           c9 = _mm512_loadu_ps(buf + 144), c10 = _mm512_loadu_ps(buf + 160), c11 = _mm512_loadu_ps(buf + 176);
    for (int64_t i = 0; i < iters; i++) {
        c0 = _mm512_dpbf16_ps(c0, ones, ones); c1 = _mm512_dpbf16_ps(c1, ones, ones);
        c2 = _mm512_dpbf16_ps(c2, ones, ones); c3 = _mm512_dpbf16_ps(c3, ones, ones);
        c4 = _mm512_dpbf16_ps(c4, ones, ones); c5 = _mm512_dpbf16_ps(c5, ones, ones);
        c6 = _mm512_dpbf16_ps(c6, ones, ones); c7 = _mm512_dpbf16_ps(c7, ones, ones);
        c8 = _mm512_dpbf16_ps(c8, ones, ones); c9 = _mm512_dpbf16_ps(c9, ones, ones);
        c10 = _mm512_dpbf16_ps(c10, ones, ones); c11 = _mm512_dpbf16_ps(c11, ones, ones);
    }
    const __m512 c[PKV_PEAK_CHAINS] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    double s = 0.0;
    for (int j = 0; j < PKV_PEAK_CHAINS; j++) {
        _mm512_storeu_ps(buf, c[j]);
        for (int k = 0; k < 16; k++) s += (double)buf[k];
    }
    *sum = s;
    return iters > 0 ? (uint64_t)iters * PKV_PEAK_CHAINS * 32 : 0;
}
#endif
#undef PKV_PK_LD512
#undef PKV_PK_ST512
#undef PKV_PK_LD256
#undef PKV_PK_ST256
#endif /* PKV_X86 */

#if PKV_ARM64
#include <arm_neon.h>
/* NEON (base AArch64, no target attribute): 4 / 2 lanes; vfmaq(b, c, a) =
 * b + c * a, one fused instruction */
#define PKV_PK_FMA_F32X4(c, a, b) vfmaq_f32(b, c, a)
#define PKV_PK_FMA_F64X2(c, a, b) vfmaq_f64(b, c, a)
PKV_PEAK_DEFINE(pkv_peak_fma_f32_neon, float32x4_t, float, 4, vdupq_n_f32, vld1q_f32, vst1q_f32,
                PKV_PK_FMA_F32X4)
PKV_PEAK_DEFINE(pkv_peak_fma_f64_neon, float64x2_t, double, 2, vdupq_n_f64, vld1q_f64, vst1q_f64,
                PKV_PK_FMA_F64X2)
#undef PKV_PK_FMA_F32X4
#undef PKV_PK_FMA_F64X2

#if PKV_HAVE_NEONDOT
/* sdot on int32 lanes as bytes (signed by signed: bytes 1 either way) */
#define PKV_PK_SDOT(c, a, b) vdotq_s32(c, vreinterpretq_s8_s32(a), vreinterpretq_s8_s32(b))
PKV_PEAK_DEFINE_DP(pkv_peak_sdot_neondot, "arch=armv8.2-a+dotprod", int32x4_t, 4, PKV_PK_SDOT,
                   vdupq_n_s32, vld1q_s32, vst1q_s32)
#undef PKV_PK_SDOT
#endif
#endif /* PKV_ARM64 */
#undef PKV_PEAK_DEFINE_DP
#undef PKV_PEAK_DEFINE_DPN
#undef PKV_PK_ID
#undef PKV_PK_DEREF
#undef PKV_PK_ASSIGN
#undef PKV_PK_MULADD

/* The probe loop of (kind, simd), or NULL when this build has none (unknown
 * kind, or a path of another architecture).  Whether the CPU runs the path
 * is the caller's check (pkv_simd_supported). */
static inline pkv_peak_fn pkv_peak_fn_for(int kind, int simd) {
    const int f64 = kind == PKV_PEAK_FMA_F64;
#if PKV_X86
    if (kind == PKV_PEAK_DPBUSD && pkv_simd_avx512_vnni(simd)) return pkv_peak_dpbusd_avx512vnni;
    if (kind == PKV_PEAK_DPWSSD && pkv_simd_avx512_vnni(simd)) return pkv_peak_dpwssd_avx512vnni;
#if PKV_HAVE_AVX512BF16
    if (kind == PKV_PEAK_DPBF16 && simd == PKV_SIMD_AVX512BF16) return pkv_peak_dpbf16_avx512bf16;
#endif
    if (kind == PKV_PEAK_DPBUSD && simd == PKV_SIMD_AVXVNNI) return pkv_peak_dpbusd_avxvnni;
#endif
#if PKV_ARM64 && PKV_HAVE_NEONDOT
    if (kind == PKV_PEAK_SDOT && simd == PKV_SIMD_NEONDOT) return pkv_peak_sdot_neondot;
#endif
    if (kind != PKV_PEAK_FMA_F32 && kind != PKV_PEAK_FMA_F64) return 0;
    simd = pkv_simd_base(simd);
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
    if (kind == PKV_PEAK_DPBUSD) return simd == PKV_SIMD_AVXVNNI ? 32 : 64;
    if (kind == PKV_PEAK_DPWSSD) return 32;
    if (kind == PKV_PEAK_SDOT) return 16;
    if (kind == PKV_PEAK_DPBF16) return 32;
    const int w = pkv_simd_f32_lanes(simd); /* float64: half as many, scalar 1 */
    return kind == PKV_PEAK_FMA_F64 && w > 1 ? w / 2 : w;
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
