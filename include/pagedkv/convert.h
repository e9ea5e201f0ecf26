/* pagedkv/convert.h -- storage formats: scalar conversions between the
 * compute types (float, double) and the storage types of types.h, and the
 * row writers/readers that layout.h uses for appends and gathers.  The
 * attention kernels convert on load with their own vector vocabulary
 * (PKV_LD_* of vocab_*.h) and fall back to the scalar readers here for tails.
 * Appends from float32 and float64 convert whole vectors where x86-64
 * allows (SSE2, and F16C for float16: the *_row functions and
 * pkv_quant32_*) and with NEON on aarch64, giving the scalar rules' results
 * bit for bit.
 *
 * Rounding is to nearest, ties to even, everywhere:
 *   - float  -> bfloat16 / float16: on the bits (exact RNE);
 *   - double -> bfloat16 / float16: double -> float rounded to odd, then the
 *     float rule (round-to-odd with >= 2 spare bits makes the second rounding
 *     exact, so there is no double rounding);
 *   - int8: per group of PKV_I8_GROUP values of one head vector,
 *     scale = (float)(amax / 127) with amax the largest finite |x|, then
 *     q = rint(x * (1 / (double)scale)) clamped to [-127, 127]; value q * scale.
 *     A group holding NaN or +-inf gets a NaN scale (it reads back as NaN, as
 *     a float cache would poison that token's scores); other groups and other
 *     tokens never see it.  All-zero groups get scale 0.
 */
#pragma once
#include <math.h>
#include <string.h>
#include "simd.h"
#include "types.h"
#if PKV_X86
#include "vocab_x86.h" /* PKV_TARGET_BEGIN */
#endif
/* SSE2 is part of x86-64's baseline: the row conversions below use it without dispatch */
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define PKV_SSE2 1
#else
#define PKV_SSE2 0
#endif
/* Advanced SIMD is part of every AArch64 CPU: the NEON rows below need no dispatch either */
#if PKV_ARM64
#include <arm_neon.h>
#endif

static inline uint32_t pkv_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float pkv_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ---- 16-bit formats: reading ---- */

static inline float pkv_bf16_to_f32(uint16_t h) { return pkv_bits_f32((uint32_t)h << 16); }

static inline float pkv_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float */
        const float x = (float)m * 5.9604644775390625e-8f;
        return pkv_bits_f32(pkv_f32_bits(x) | sign);
    }
    if (e == 31) return pkv_bits_f32(sign | 0x7f800000u | (m << 13)); /* inf / NaN */
    return pkv_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* ---- 16-bit formats: writing (RNE) ---- */

static inline uint16_t pkv_f32_to_bf16(float x) {
    const uint32_t u = pkv_f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t pkv_f32_to_f16(float x) {
    uint32_t u = pkv_f32_bits(x);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;      /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00;     /* >= 65520 (and inf) -> inf */
    if (u < 0x38800000u) {                          /* below 2^-14: subnormal half */
        /* units of 2^-24; the scaling is exact, rintf rounds to even */
        return sign | (uint16_t)rintf(pkv_bits_f32(u) * 16777216.0f);
    }
    /* rebias the exponent (127 -> 15) and round the 13 dropped bits; a carry
     * into the exponent is the correct result */
    return sign | (uint16_t)(((u + 0x0fffu + ((u >> 13) & 1)) >> 13) - (112u << 10));
}

/* double -> float rounded to odd: truncate toward zero, set the last bit when
 * inexact (finite inputs beyond float's range give FLT_MAX, odd) */
static inline float pkv_f64_to_f32_odd(double x) {
    if (!(fabs(x) <= 3.4028234663852886e38)) {
        if (isnan(x) || isinf(x)) return (float)x;
        return x > 0 ? 3.4028234663852886e38f : -3.4028234663852886e38f;
    }
    float f = (float)x;
    if ((double)f == x) return f;
    uint32_t u = pkv_f32_bits(f);
    if (fabs((double)f) > fabs(x)) u -= 1; /* rounded away from zero: step back */
    return pkv_bits_f32(u | 1);
}

static inline uint16_t pkv_f64_to_bf16(double x) { return pkv_f32_to_bf16(pkv_f64_to_f32_odd(x)); }
static inline uint16_t pkv_f64_to_f16(double x) { return pkv_f32_to_f16(pkv_f64_to_f32_odd(x)); }

/* n float64 values -> float32 rounded to odd (pkv_f64_to_f32_odd), the first
 * step of float64 -> bfloat16 / float16, four at a time with SSE2 on x86-64:
 * rounded to nearest, then, where inexact, stepped back toward zero if it
 * rounded away and its last bit set (an overflow to inf steps back to
 * FLT_MAX, as the scalar rule returns; a NaN stays a NaN whose upper bits are
 * the scalar rule's, all the 16-bit rules read). */
static inline void pkv_f64_to_f32_odd_row(float *dst, const double *src, int n) {
    int i = 0;
#if PKV_SSE2
    const __m128d absm = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffll));
    const __m128i one = _mm_set1_epi32(1);
    for (; i + 4 <= n; i += 4) {
        __m128i u[2];
        for (int j = 0; j < 2; j++) {
            const __m128d x = _mm_loadu_pd(src + i + 2 * j);
            const __m128 f = _mm_cvtpd_ps(x);
            const __m128d back = _mm_cvtps_pd(f);
            /* 64-bit lane masks -> the low two 32-bit lanes */
            const __m128i inexact = _mm_shuffle_epi32(_mm_castpd_si128(_mm_cmpneq_pd(back, x)), 0x08);
            const __m128i away = _mm_shuffle_epi32(
                _mm_castpd_si128(_mm_cmpgt_pd(_mm_and_pd(back, absm), _mm_and_pd(x, absm))), 0x08);
            const __m128i b = _mm_sub_epi32(_mm_castps_si128(f), _mm_and_si128(away, one));
            u[j] = _mm_or_si128(b, _mm_and_si128(inexact, one));
        }
        _mm_storeu_ps(dst + i, _mm_castsi128_ps(_mm_unpacklo_epi64(u[0], u[1])));
    }
#elif PKV_ARM64
    /* fcvtxn rounds to odd itself (an overflow gives FLT_MAX, as above) */
    for (; i + 4 <= n; i += 4)
        vst1q_f32(dst + i, vcvtx_high_f32_f64(vcvtx_f32_f64(vld1q_f64(src + i)), vld1q_f64(src + i + 2)));
#endif
    for (; i < n; i++) dst[i] = pkv_f64_to_f32_odd(src[i]);
}

/* n float32 values -> bfloat16, the rule of pkv_f32_to_bf16, eight at a time
 * (two SSE2 vectors, packed into one) on x86-64 (baseline: no dispatch), the
 * same integer steps with NEON on aarch64.
 * Checked equal to the scalar rule over all 2^32 float32 inputs. */
static inline void pkv_f32_to_bf16_row(uint16_t *dst, const float *src, int n) {
    int i = 0;
#if PKV_SSE2
    const __m128i absm = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
    const __m128i one = _mm_set1_epi32(1), half = _mm_set1_epi32(0x7fff), quiet = _mm_set1_epi32(0x40);
    const __m128i bias = _mm_set1_epi32(0x8000), bias16 = _mm_set1_epi16((short)0x8000);
    for (; i + 8 <= n; i += 8) {
        __m128i h[2];
        for (int j = 0; j < 2; j++) {
            const __m128i u = _mm_loadu_si128((const __m128i *)(src + i + 4 * j));
            const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, absm), inf);
            const __m128i r = _mm_srli_epi32(
                _mm_add_epi32(_mm_add_epi32(u, half), _mm_and_si128(_mm_srli_epi32(u, 16), one)), 16);
            const __m128i q = _mm_or_si128(_mm_srli_epi32(u, 16), quiet);
            /* 16-bit results, biased so that a signed saturating pack keeps them */
            h[j] = _mm_sub_epi32(_mm_or_si128(_mm_and_si128(nan, q), _mm_andnot_si128(nan, r)), bias);
        }
        _mm_storeu_si128((__m128i *)(dst + i), _mm_add_epi16(_mm_packs_epi32(h[0], h[1]), bias16));
    }
#elif PKV_ARM64
    const uint32x4_t absm = vdupq_n_u32(0x7fffffff), inf = vdupq_n_u32(0x7f800000);
    const uint32x4_t one = vdupq_n_u32(1), half = vdupq_n_u32(0x7fff), quiet = vdupq_n_u32(0x40);
    for (; i + 8 <= n; i += 8) {
        uint16x4_t h[2];
        for (int j = 0; j < 2; j++) {
            const uint32x4_t u = vld1q_u32((const uint32_t *)(src + i + 4 * j));
            const uint32x4_t nan = vcgtq_u32(vandq_u32(u, absm), inf);
            const uint32x4_t r =
                vshrq_n_u32(vaddq_u32(vaddq_u32(u, half), vandq_u32(vshrq_n_u32(u, 16), one)), 16);
            h[j] = vmovn_u32(vbslq_u32(nan, vorrq_u32(vshrq_n_u32(u, 16), quiet), r));
        }
        vst1q_u16(dst + i, vcombine_u16(h[0], h[1]));
    }
#endif
    for (; i < n; i++) dst[i] = pkv_f32_to_bf16(src[i]);
}

/* n float32 values -> float16, the rule of pkv_f32_to_f16.  Where the CPU has
 * F16C (every CPU of the AVX2 path), eight at a time with vcvtps2ph, whose
 * rounding (ties to even, subnormals, overflow to inf) is the scalar rule's;
 * a vector holding a NaN goes through the scalar rule, which makes every NaN
 * the same quiet NaN (vcvtps2ph would keep part of its payload); on aarch64
 * fcvtn the same way.  Checked equal to the scalar rule over all 2^32
 * float32 inputs (F16C).  A token [1, 8, 128]
 * of K and V into float16 (Zen 4 class, AVX2 path): 4.6-6.1 us with the
 * scalar rule, 1.1-1.9 us this way. */
#if PKV_X86
PKV_TARGET_BEGIN("avx,f16c")
static inline int pkv_f32_to_f16_f16c(uint16_t *dst, const float *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(src + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
            for (int j = i; j < i + 8; j++) dst[j] = pkv_f32_to_f16(src[j]);
        else
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    return i;
}
PKV_TARGET_END
#endif
static inline void pkv_f32_to_f16_row(uint16_t *dst, const float *src, int n) {
    int i = 0;
#if PKV_X86
    if (pkv_x86_paths() & (1u << PKV_SIMD_AVX2)) i = pkv_f32_to_f16_f16c(dst, src, n);
#elif PKV_ARM64
    /* fcvtn, as vcvtps2ph: ties to even (the default mode), half subnormals kept (conversions
     * ignore FPCR.FZ16), overflow to inf; vectors holding a NaN take the scalar rule */
    for (; i + 8 <= n; i += 8) {
        const float32x4_t x0 = vld1q_f32(src + i), x1 = vld1q_f32(src + i + 4);
        if (vmaxvq_u32(vmvnq_u32(vandq_u32(vceqq_f32(x0, x0), vceqq_f32(x1, x1)))))
            for (int j = i; j < i + 8; j++) dst[j] = pkv_f32_to_f16(src[j]);
        else
            vst1q_u16(dst + i, vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(x0), x1)));
    }
#endif
    for (; i < n; i++) dst[i] = pkv_f32_to_f16(src[i]);
}

/* ---- rows: one head vector of d values ---- */

/* int8 quantization of one group of n <= PKV_I8_GROUP values; returns the scale.
 * A whole group on x86-64 goes through pkv_quant32_* (SSE2, part of the
 * baseline: no dispatch; NEON on aarch64), which computes the same values: the largest |x|
 * compared in the source type (exact), the product x * (1 / scale) in double,
 * and cvtpd2dq's (frinti's) rounding, which like rint's follows the current
 * mode (to nearest, ties to even, by default).  A token [1, 8, 128] of K and V into
 * int8 (Zen 4 class, AVX2 path): 7.6-11.4 us with the scalar loop, 2.8-4.4 us
 * this way (float32 storage: 1.4-1.7 us). */
/* the group's scale from its largest |x| (as scalar code computes it) and the
 * reciprocal the values are multiplied by */
static inline float pkv_quant_scale(double amax, double *inv) {
    const float scale = (float)(amax / 127.0);
    *inv = scale > 0 ? 1.0 / (double)scale : 0.0;
    return scale;
}
#if PKV_SSE2
/* 4 products x * inv (two pairs of doubles) -> 4 int32 rounded by the mode */
static inline __m128i pkv_quant_round4(__m128d lo, __m128d hi, __m128d inv) {
    return _mm_unpacklo_epi64(_mm_cvtpd_epi32(_mm_mul_pd(lo, inv)), _mm_cvtpd_epi32(_mm_mul_pd(hi, inv)));
}
/* 16 int32 (4 vectors) clamped to [-127, 127] -> 16 int8 at dst */
static inline void pkv_quant_pack16(int8_t *dst, __m128i a, __m128i b, __m128i c, __m128i d) {
    const __m128i lo = _mm_set1_epi16(-127), hi = _mm_set1_epi16(127);
    const __m128i ab = _mm_min_epi16(_mm_max_epi16(_mm_packs_epi32(a, b), lo), hi);
    const __m128i cd = _mm_min_epi16(_mm_max_epi16(_mm_packs_epi32(c, d), lo), hi);
    _mm_storeu_si128((__m128i *)dst, _mm_packs_epi16(ab, cd));
}
/* a group of 32 float32 values; *ok = 0 (nothing written) when one is NaN or infinite */
static inline float pkv_quant32_f32(int8_t *dst, const float *src, int *ok) {
    const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff)), big = _mm_set1_ps(3.4028234663852886e38f);
    __m128 x[8], m = _mm_setzero_ps(), bad = _mm_setzero_ps();
    for (int i = 0; i < 8; i++) {
        x[i] = _mm_loadu_ps(src + 4 * i);
        const __m128 a = _mm_and_ps(x[i], absmask);
        bad = _mm_or_ps(bad, _mm_cmpnle_ps(a, big)); /* NaN or inf */
        m = _mm_max_ps(m, a);
    }
    *ok = _mm_movemask_ps(bad) == 0;
    if (!*ok) return NAN;
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    double invs;
    const float scale = pkv_quant_scale((double)_mm_cvtss_f32(m), &invs);
    const __m128d inv = _mm_set1_pd(invs);
    __m128i q[8];
    for (int i = 0; i < 8; i++)
        q[i] = pkv_quant_round4(_mm_cvtps_pd(x[i]), _mm_cvtps_pd(_mm_movehl_ps(x[i], x[i])), inv);
    pkv_quant_pack16(dst, q[0], q[1], q[2], q[3]);
    pkv_quant_pack16(dst + 16, q[4], q[5], q[6], q[7]);
    return scale;
}
/* the same for 32 float64 values */
static inline float pkv_quant32_f64(int8_t *dst, const double *src, int *ok) {
    const __m128d absmask = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffll));
    const __m128d big = _mm_set1_pd(1.7976931348623157e308);
    __m128d m = _mm_setzero_pd(), bad = _mm_setzero_pd();
    for (int i = 0; i < 32; i += 2) {
        const __m128d a = _mm_and_pd(_mm_loadu_pd(src + i), absmask);
        bad = _mm_or_pd(bad, _mm_cmpnle_pd(a, big));
        m = _mm_max_pd(m, a);
    }
    *ok = _mm_movemask_pd(bad) == 0;
    if (!*ok) return NAN;
    m = _mm_max_sd(m, _mm_unpackhi_pd(m, m));
    double invs;
    const float scale = pkv_quant_scale(_mm_cvtsd_f64(m), &invs);
    const __m128d inv = _mm_set1_pd(invs);
    __m128i q[8];
    for (int i = 0; i < 8; i++)
        q[i] = pkv_quant_round4(_mm_loadu_pd(src + 4 * i), _mm_loadu_pd(src + 4 * i + 2), inv);
    pkv_quant_pack16(dst, q[0], q[1], q[2], q[3]);
    pkv_quant_pack16(dst + 16, q[4], q[5], q[6], q[7]);
    return scale;
}
#elif PKV_ARM64
/* the same steps with NEON: the product in double, frinti (the current mode, as rint) */
static inline int32x4_t pkv_quant_round4(float64x2_t lo, float64x2_t hi, float64x2_t inv) {
    const int64x2_t a = vcvtq_s64_f64(vrndiq_f64(vmulq_f64(lo, inv)));
    const int64x2_t b = vcvtq_s64_f64(vrndiq_f64(vmulq_f64(hi, inv)));
    return vcombine_s32(vmovn_s64(a), vmovn_s64(b));
}
static inline void pkv_quant_pack16(int8_t *dst, int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    const int16x8_t lo = vdupq_n_s16(-127), hi = vdupq_n_s16(127);
    const int16x8_t ab = vminq_s16(vmaxq_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b)), lo), hi);
    const int16x8_t cd = vminq_s16(vmaxq_s16(vcombine_s16(vqmovn_s32(c), vqmovn_s32(d)), lo), hi);
    vst1q_s8(dst, vcombine_s8(vqmovn_s16(ab), vqmovn_s16(cd)));
}
static inline float pkv_quant32_f32(int8_t *dst, const float *src, int *ok) {
    const float32x4_t big = vdupq_n_f32(3.4028234663852886e38f);
    float32x4_t x[8], m = vdupq_n_f32(0.0f);
    uint32x4_t good = vdupq_n_u32(~0u);
    for (int i = 0; i < 8; i++) {
        x[i] = vld1q_f32(src + 4 * i);
        const float32x4_t a = vabsq_f32(x[i]);
        good = vandq_u32(good, vcleq_f32(a, big)); /* false for NaN and inf */
        m = vmaxq_f32(m, a);
    }
    *ok = vminvq_u32(good) != 0;
    if (!*ok) return NAN;
    double invs;
    const float scale = pkv_quant_scale((double)vmaxvq_f32(m), &invs);
    const float64x2_t inv = vdupq_n_f64(invs);
    int32x4_t q[8];
    for (int i = 0; i < 8; i++)
        q[i] = pkv_quant_round4(vcvt_f64_f32(vget_low_f32(x[i])), vcvt_high_f64_f32(x[i]), inv);
    pkv_quant_pack16(dst, q[0], q[1], q[2], q[3]);
    pkv_quant_pack16(dst + 16, q[4], q[5], q[6], q[7]);
    return scale;
}
static inline float pkv_quant32_f64(int8_t *dst, const double *src, int *ok) {
    const float64x2_t big = vdupq_n_f64(1.7976931348623157e308);
    float64x2_t m = vdupq_n_f64(0.0);
    uint64x2_t good = vdupq_n_u64(~0ull);
    for (int i = 0; i < 32; i += 2) {
        const float64x2_t a = vabsq_f64(vld1q_f64(src + i));
        good = vandq_u64(good, vcleq_f64(a, big));
        m = vmaxq_f64(m, a);
    }
    *ok = (vgetq_lane_u64(good, 0) & vgetq_lane_u64(good, 1)) != 0;
    if (!*ok) return NAN;
    double invs;
    const float scale = pkv_quant_scale(vmaxvq_f64(m), &invs);
    const float64x2_t inv = vdupq_n_f64(invs);
    int32x4_t q[8];
    for (int i = 0; i < 8; i++)
        q[i] = pkv_quant_round4(vld1q_f64(src + 4 * i), vld1q_f64(src + 4 * i + 2), inv);
    pkv_quant_pack16(dst, q[0], q[1], q[2], q[3]);
    pkv_quant_pack16(dst + 16, q[4], q[5], q[6], q[7]);
    return scale;
}
#endif
#if PKV_SSE2 || PKV_ARM64
#define PKV_QUANT_WHOLE(tag, dst, src, n)                                            \
    if ((n) == 32 && PKV_I8_GROUP == 32) {                                           \
        int ok_;                                                                     \
        const float s_ = pkv_quant32_##tag(dst, src, &ok_);                          \
        if (!ok_) memset(dst, 0, 32);                                                \
        return s_;                                                                   \
    }
#else
#define PKV_QUANT_WHOLE(tag, dst, src, n)
#endif
#define PKV_DEF_QUANT(name, tag, T)                                                   \
    static inline float name(int8_t *dst, const T *src, int n) {                      \
        PKV_QUANT_WHOLE(tag, dst, src, n)                                            \
        double amax = 0.0;                                                           \
        int bad = 0;                                                                 \
        for (int i = 0; i < n; i++) {                                                \
            const double a = fabs((double)src[i]);                                   \
            if (!(a <= 1.7976931348623157e308)) bad = 1; /* NaN or inf */           \
            else if (a > amax) amax = a;                                             \
        }                                                                            \
        if (bad) {                                                                   \
            memset(dst, 0, (size_t)n);                                               \
            return NAN;                                                              \
        }                                                                            \
        const float scale = (float)(amax / 127.0);                                   \
        const double inv = scale > 0 ? 1.0 / (double)scale : 0.0;                   \
        for (int i = 0; i < n; i++) {                                                \
            double q = rint((double)src[i] * inv);                                   \
            q = q > 127.0 ? 127.0 : (q < -127.0 ? -127.0 : q);                       \
            dst[i] = (int8_t)q;                                                      \
        }                                                                            \
        return scale;                                                                \
    }
PKV_DEF_QUANT(pkv_quant_group_f32, f32, float)
PKV_DEF_QUANT(pkv_quant_group_f64, f64, double)
#undef PKV_DEF_QUANT
#undef PKV_QUANT_WHOLE

/* dst[i * dstride] = src[i * sstride] for i < d, elements of sz bytes (1, 2, 4 or 8): K's
 * transposed rows.  Typed loops: a memcpy of a run-time size per element made appending a
 * 16,384-token prompt of bfloat16 K/V (8 heads, D=64) about 30 ms a layer. */
static inline void pkv_strided_copy(char *dst, size_t dstride, const char *src, size_t sstride,
                                    int d, size_t sz) {
    switch (sz) {
    case 1: {
        uint8_t *o = (uint8_t *)dst;
        const uint8_t *x = (const uint8_t *)src;
        for (int i = 0; i < d; i++) o[(size_t)i * dstride] = x[(size_t)i * sstride];
        break;
    }
    case 2: {
        uint16_t *o = (uint16_t *)dst;
        const uint16_t *x = (const uint16_t *)src;
        for (int i = 0; i < d; i++) o[(size_t)i * dstride] = x[(size_t)i * sstride];
        break;
    }
    case 4: {
        uint32_t *o = (uint32_t *)dst;
        const uint32_t *x = (const uint32_t *)src;
        for (int i = 0; i < d; i++) o[(size_t)i * dstride] = x[(size_t)i * sstride];
        break;
    }
    case 8: {
        uint64_t *o = (uint64_t *)dst;
        const uint64_t *x = (const uint64_t *)src;
        for (int i = 0; i < d; i++) o[(size_t)i * dstride] = x[(size_t)i * sstride];
        break;
    }
    default: /* no other size reaches here; kept general */
        for (int i = 0; i < d; i++)
            memcpy(dst + (size_t)i * dstride * sz, src + (size_t)i * sstride * sz, sz);
    }
}

/* values converted at a time by pkv_store_row and pkv_load_row (a stack
 * buffer): whole int8 groups */
#define PKV_CHUNK 64
_Static_assert(PKV_CHUNK % PKV_I8_GROUP == 0, "a chunk holds whole int8 groups");

/* n 16-bit values (`type` PKV_BF16 or PKV_F16) -> float32, exactly: bfloat16
 * by SSE2's interleave with zeros (NEON: a widening shift), float16 with
 * F16C's vcvtph2ps where the CPU has it (NEON: fcvtl), except a vector
 * holding a NaN (vcvtph2ps quiets a signaling NaN; the scalar rule keeps its
 * bits).  Checked equal to the scalar rules over all
 * 2^16 inputs (tests/c). */
#if PKV_X86
PKV_TARGET_BEGIN("avx,f16c")
static inline int pkv_f16_to_f32_f16c(float *dst, const uint16_t *src, int n) {
    const __m128i absm = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, absm), inf)))
            for (int j = i; j < i + 8; j++) dst[j] = pkv_f16_to_f32(src[j]);
        else
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    return i;
}
PKV_TARGET_END
#endif
static inline void pkv_16_to_f32_row(float *dst, const uint16_t *src, int type, int n) {
    int i = 0;
    if (type == PKV_BF16) {
#if PKV_SSE2
        const __m128i z = _mm_setzero_si128();
        for (; i + 8 <= n; i += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
            _mm_storeu_ps(dst + i, _mm_castsi128_ps(_mm_unpacklo_epi16(z, h)));
            _mm_storeu_ps(dst + i + 4, _mm_castsi128_ps(_mm_unpackhi_epi16(z, h)));
        }
#elif PKV_ARM64
        for (; i + 8 <= n; i += 8) {
            const uint16x8_t h = vld1q_u16(src + i);
            vst1q_u32((uint32_t *)(dst + i), vshll_n_u16(vget_low_u16(h), 16));
            vst1q_u32((uint32_t *)(dst + i + 4), vshll_high_n_u16(h, 16));
        }
#endif
        for (; i < n; i++) dst[i] = pkv_bf16_to_f32(src[i]);
        return;
    }
#if PKV_X86
    if (pkv_x86_paths() & (1u << PKV_SIMD_AVX2)) i = pkv_f16_to_f32_f16c(dst, src, n);
#elif PKV_ARM64
    /* fcvtl; as with vcvtph2ps, a vector holding a NaN takes the scalar rule (fcvtl quiets a
     * signaling NaN) */
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t h = vld1q_u16(src + i);
        if (vmaxvq_u16(vcgtq_u16(vandq_u16(h, vdupq_n_u16(0x7fff)), vdupq_n_u16(0x7c00))))
            for (int j = i; j < i + 8; j++) dst[j] = pkv_f16_to_f32(src[j]);
        else {
            const float16x8_t x = vreinterpretq_f16_u16(h);
            vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(x)));
            vst1q_f32(dst + i + 4, vcvt_high_f32_f16(x));
        }
    }
#endif
    for (; i < n; i++) dst[i] = pkv_f16_to_f32(src[i]);
}

/* Store one head vector src[d] of type `compute` (the arrays' type: float32,
 * float64, bfloat16 or float16) as the storage type, the i-th value at
 * dst[i * vstride] (K is stored transposed: vstride = block_size), int8
 * group scales at scales[g * sstride].  Every conversion rounds once (a
 * 16-bit value converts exactly to float32 first). */
static inline void pkv_store_row(const pkv_geom *g, int compute, char *dst, float *scales,
                                 const char *src, size_t vstride, size_t sstride) {
    const int d = g->d;
    const int store = (int)g->store.dtype;
    const double *sd = (const double *)src;
    if (store == compute && store != PKV_I8) { /* same type: the bits as they are */
        const size_t sz = g->store.itemsize;
        if (vstride == 1) memcpy(dst, src, (size_t)d * sz);
        else pkv_strided_copy(dst, vstride, src, 1, d, sz);
        return;
    }
    switch (store) {
    case PKV_F32: /* from float64, bfloat16 or float16 */
        if (compute == PKV_F64) {
            for (int i = 0; i < d; i++) ((float *)dst)[i * vstride] = (float)sd[i];
        } else if (vstride == 1) {
            pkv_16_to_f32_row((float *)dst, (const uint16_t *)src, compute, d);
        } else {
            for (int i0 = 0; i0 < d; i0 += PKV_CHUNK) {
                const int n = d - i0 < PKV_CHUNK ? d - i0 : PKV_CHUNK;
                float f[PKV_CHUNK];
                pkv_16_to_f32_row(f, (const uint16_t *)src + i0, compute, n);
                pkv_strided_copy(dst + (size_t)i0 * vstride * 4, vstride, (const char *)f, 1, n, 4);
            }
        }
        break;
    case PKV_F64: /* only with compute f64 (see CacheCore) */
        for (int i = 0; i < d; i++) ((double *)dst)[i * vstride] = (double)((const float *)src)[i];
        break;
    case PKV_BF16:
    case PKV_F16: /* converted PKV_CHUNK values at a time in a contiguous loop, then placed */
        for (int i0 = 0; i0 < d; i0 += PKV_CHUNK) {
            const int n = d - i0 < PKV_CHUNK ? d - i0 : PKV_CHUNK;
            uint16_t t[PKV_CHUNK];
            float f[PKV_CHUNK];
            const float *x = f; /* the chunk as float32 (float64 rounded to odd: no double rounding) */
            if (compute == PKV_F32) x = (const float *)src + i0;
            else if (compute == PKV_F64) pkv_f64_to_f32_odd_row(f, sd + i0, n);
            else pkv_16_to_f32_row(f, (const uint16_t *)src + i0, compute, n); /* the other 16-bit format: exact */
            if (store == PKV_BF16) pkv_f32_to_bf16_row(t, x, n);
            else pkv_f32_to_f16_row(t, x, n);
            pkv_strided_copy(dst + (size_t)i0 * vstride * 2, vstride, (const char *)t, 1, n, 2);
        }
        break;
    case PKV_I8:
        for (int i0 = 0, gi = 0; i0 < d; i0 += PKV_I8_GROUP, gi++) {
            const int n = d - i0 < PKV_I8_GROUP ? d - i0 : PKV_I8_GROUP;
            int8_t q[PKV_I8_GROUP];
            float scale;
            if (compute == PKV_F64) {
                scale = pkv_quant_group_f64(q, sd + i0, n);
            } else if (compute == PKV_F32) {
                scale = pkv_quant_group_f32(q, (const float *)src + i0, n);
            } else { /* 16-bit values: exact in float32 */
                float f[PKV_I8_GROUP];
                pkv_16_to_f32_row(f, (const uint16_t *)src + i0, compute, n);
                scale = pkv_quant_group_f32(q, f, n);
            }
            scales[(size_t)gi * sstride] = scale;
            for (int i = 0; i < n; i++) ((int8_t *)dst)[(size_t)(i0 + i) * vstride] = q[i];
        }
        break;
    default:
        break;
    }
}

/* Read one stored head vector (strides as pkv_store_row) back into dst[d]
 * of type `compute` (float32, float64, bfloat16 or float16).  Narrower
 * storage reads PKV_CHUNK values at a time: gathered into a contiguous
 * buffer, made float32 (exact: a 16-bit value is a float32, an int8 value
 * reads as q * scale computed in float, as the kernels compute it), then
 * converted to the compute type by the row functions above.  float64
 * arrays over int8 take q * scale in double, as the float64 kernels do. */
static inline void pkv_load_row(const pkv_geom *g, int compute, char *dst, const char *src,
                                const float *scales, size_t vstride, size_t sstride) {
    const int d = g->d;
    const int store = (int)g->store.dtype;
    if (store == compute && vstride == 1) {
        memcpy(dst, src, g->row_bytes);
        return;
    }
    if (store == compute && compute != PKV_I8) { /* transposed, same type */
        pkv_strided_copy(dst, 1, src, vstride, d, g->store.itemsize);
        return;
    }
    for (int i0 = 0; i0 < d; i0 += PKV_CHUNK) {
        const int n = d - i0 < PKV_CHUNK ? d - i0 : PKV_CHUNK;
        const size_t at = (size_t)i0 * vstride;
        float f[PKV_CHUNK];
        if (store == PKV_I8) {
            int8_t q[PKV_CHUNK];
            pkv_strided_copy((char *)q, 1, src + at, vstride, n, 1);
            for (int j0 = 0; j0 < n; j0 += PKV_I8_GROUP) { /* a group at a time (PKV_CHUNK is whole groups) */
                const float sc = scales[(size_t)((i0 + j0) / PKV_I8_GROUP) * sstride];
                const int j1 = n - j0 < PKV_I8_GROUP ? n : j0 + PKV_I8_GROUP;
                if (compute == PKV_F64) /* as the float64 kernels compute it */
                    for (int i = j0; i < j1; i++) ((double *)dst)[i0 + i] = (double)q[i] * (double)sc;
                else
                    for (int i = j0; i < j1; i++) f[i] = (float)q[i] * sc;
            }
            if (compute == PKV_F64) continue;
        } else if (store == PKV_F32) {
            pkv_strided_copy((char *)f, 1, src + at * 4, vstride, n, 4);
        } else if (store == PKV_F64) { /* (float64 storage holds float64 arrays only: CacheCore) */
            for (int i = 0; i < n; i++) f[i] = (float)((const double *)src)[at + (size_t)i * vstride];
        } else { /* bfloat16, float16 */
            uint16_t t[PKV_CHUNK];
            pkv_strided_copy((char *)t, 1, src + at * 2, vstride, n, 2);
            pkv_16_to_f32_row(f, t, store, n);
        }
        switch (compute) { /* the chunk, exactly a float32, into the arrays' type */
        case PKV_F32: memcpy(dst + (size_t)i0 * 4, f, (size_t)n * 4); break;
        case PKV_F64:
            for (int i = 0; i < n; i++) ((double *)dst)[i0 + i] = (double)f[i];
            break;
        case PKV_BF16: pkv_f32_to_bf16_row((uint16_t *)dst + i0, f, n); break;
        case PKV_F16: pkv_f32_to_f16_row((uint16_t *)dst + i0, f, n); break;
        default: break;
        }
    }
}
