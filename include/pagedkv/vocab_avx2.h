/* pagedkv/vocab_avx2.h -- the SIMD vocabulary (names: vocab_scalar.h) on
 * AVX2 + FMA, with F16C for float16 loads: 256-bit registers, 8 float / 4
 * double lanes.  Built without -m flags: attention.h instantiates the
 * kernels between PKV_TARGET_BEGIN(PKV_AVX2_TARGET) and PKV_TARGET_END, and
 * the helpers below carry the same target.
 *
 * Included by attention.h with PKV_T_F64 defined (0: float, 1: double) and
 * undone by attn_vocab_end.h, once per compute type; the helpers are
 * defined once.
 */
#include "simd.h"
#if !PKV_X86
#error "vocab_avx2.h: x86-64 only"
#endif
#include "vocab_x86.h"

#ifndef PKV_AVX2_TARGET
#define PKV_AVX2_TARGET "avx2,fma,f16c"
/* AVX2 + AVX-VNNI (attention.h): the int8 scores' 256-bit vpdpbusd */
#define PKV_AVXVNNI_TARGET "avx2,fma,f16c,avxvnni"
#include <string.h>

PKV_TARGET_BEGIN(PKV_AVX2_TARGET)
static inline float pkv_hsum256_ps(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float pkv_hmax256_ps(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline double pkv_hmax256_pd(__m256d x) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
static inline double pkv_hsum256_pd(__m256d x) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
static inline __m256 pkv_scale2k256_ps(__m256 p, __m256 k) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline __m256d pkv_scale2k256_pd(__m256d p, __m256d k) {
    const __m256i ki = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k));
    const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(ki, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}
/* 4 int8 values (32 bits) into the low lane of an xmm register */
static inline __m128i pkv_load4_i8(const int8_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return _mm_cvtsi32_si128(x);
}
PKV_TARGET_END
#endif /* PKV_AVX2_TARGET */

#if PKV_T_F64
#define PKV_T double
#define PKV_TAG _f64_avx2
#define PKV_VEC __m256d
#define PKV_W 4
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define PKV_VLOAD(p) _mm256_loadu_pd(p)
#define PKV_VSTORE(p, x) _mm256_storeu_pd(p, x)
#define PKV_VSET1(s) _mm256_set1_pd(s)
#define PKV_VZERO() _mm256_setzero_pd()
#define PKV_VADD(a, b) _mm256_add_pd(a, b)
#define PKV_VSUB(a, b) _mm256_sub_pd(a, b)
#define PKV_VMUL(a, b) _mm256_mul_pd(a, b)
#define PKV_VDIV(a, b) _mm256_div_pd(a, b)
#define PKV_VMAX(a, b) _mm256_max_pd(a, b)
#define PKV_VMIN(a, b) _mm256_min_pd(a, b)
#define PKV_VFMA(a, b, c) _mm256_fmadd_pd(a, b, c)
#define PKV_VREDUCE(x) pkv_hsum256_pd(x)
#define PKV_VHMAX(x) pkv_hmax256_pd(x)
#define PKV_VROUND(x) _mm256_round_pd(x, PKV_RN)
#define PKV_VSCALE2K(p, k) pkv_scale2k256_pd(p, k)
#define PKV_VFRAC(x) _mm256_sub_pd(x, _mm256_floor_pd(x))
#define PKV_VSCALE2FL(p, x) pkv_scale2k256_pd(p, _mm256_floor_pd(x))
#define PKV_LD_F32(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define PKV_LD_BF16(p) _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(p))), 16)))
#define PKV_LD_F16(p) _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p))))
#define PKV_LD_I8(p) _mm256_cvtepi32_pd(_mm_cvtepi8_epi32(pkv_load4_i8(p)))
#else
#define PKV_T float
#define PKV_TAG _f32_avx2
#define PKV_VEC __m256
#define PKV_W 8
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define PKV_VLOAD(p) _mm256_loadu_ps(p)
#define PKV_VSTORE(p, x) _mm256_storeu_ps(p, x)
#define PKV_VSET1(s) _mm256_set1_ps(s)
#define PKV_VZERO() _mm256_setzero_ps()
#define PKV_VADD(a, b) _mm256_add_ps(a, b)
#define PKV_VSUB(a, b) _mm256_sub_ps(a, b)
#define PKV_VMUL(a, b) _mm256_mul_ps(a, b)
#define PKV_VDIV(a, b) _mm256_div_ps(a, b)
#define PKV_VMAX(a, b) _mm256_max_ps(a, b)
#define PKV_VMIN(a, b) _mm256_min_ps(a, b)
#define PKV_VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PKV_VREDUCE(x) pkv_hsum256_ps(x)
#define PKV_VHMAX(x) pkv_hmax256_ps(x)
#define PKV_VROUND(x) _mm256_round_ps(x, PKV_RN)
#define PKV_VSCALE2K(p, k) pkv_scale2k256_ps(p, k)
#define PKV_VFRAC(x) _mm256_sub_ps(x, _mm256_floor_ps(x))
#define PKV_VSCALE2FL(p, x) pkv_scale2k256_ps(p, _mm256_floor_ps(x))
#define PKV_LD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define PKV_LD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define PKV_LD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
