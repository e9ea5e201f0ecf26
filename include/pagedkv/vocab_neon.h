/* pagedkv/vocab_neon.h -- the SIMD vocabulary (names: vocab_scalar.h) on
 * NEON, aarch64 Advanced SIMD: 128-bit registers, 4 float / 2 double lanes.
 * Baseline on every AArch64 CPU, so no target pragma and no -march.
 * PKV_VMAX / PKV_VMIN are the IEEE maxNum / minNum forms (vmaxnmq / vminnmq):
 * with a NaN operand they return the other one, like the x86 and scalar
 * paths do for the exp clamp.  PKV_VROUND rounds ties to even, as nearbyint
 * and _MM_FROUND_TO_NEAREST_INT do, so every path computes the same exp.
 *
 * Storage loads: bfloat16 widens the 16 bits into the top of a float32,
 * float16 converts with vcvt_f32_f16 (base AArch64), int8 widens twice; the
 * float64 instances read 2 values and widen once more.  Loads narrower than
 * 64 bits go through memcpy so no read passes the last stored value.
 *
 * Included by attention.h with PKV_T_F64 defined (0: float, 1: double) and
 * undone by attn_vocab_end.h, once per compute type; the helpers are
 * defined once.
 */
#include "simd.h"
#if !PKV_ARM64
#error "vocab_neon.h: aarch64 only"
#endif

#ifndef PKV_VOCAB_NEON_HELPERS
#define PKV_VOCAB_NEON_HELPERS
#include <arm_neon.h>
#include <string.h>
static inline uint16x4_t pkv_ld2_u16(const uint16_t *p) { /* 2 values, rest 0 */
    uint32_t x;
    memcpy(&x, p, 4);
    return vreinterpret_u16_u32(vset_lane_u32(x, vdup_n_u32(0), 0));
}
static inline int8x8_t pkv_ld_i8_n(const int8_t *p, int n) { /* n = 2 or 4 */
    uint32_t x = 0;
    memcpy(&x, p, (size_t)n);
    return vreinterpret_s8_u32(vset_lane_u32(x, vdup_n_u32(0), 0));
}
static inline float32x4_t pkv_bf16x4_f32(uint16x4_t h) {
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}
static inline float32x4_t pkv_f16x4_f32(uint16x4_t h) {
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}
static inline float32x4_t pkv_i8x4_f32(int8x8_t b) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}
static inline float32x4_t pkv_scale2k_f32x4(float32x4_t p, float32x4_t k) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
static inline float64x2_t pkv_scale2k_f64x2(float64x2_t p, float64x2_t k) {
    const int64x2_t e = vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(k), vdupq_n_s64(1023)), 52);
    return vmulq_f64(p, vreinterpretq_f64_s64(e));
}
/* NEON + dot product (attention.h, GCC only: PKV_HAVE_NEONDOT): the int8
 * scores' sdot, compiled between PKV_TARGET_BEGIN(PKV_NEONDOT_TARGET) and
 * PKV_TARGET_END (Armv8.2, the first with the extension) */
#if PKV_HAVE_NEONDOT
#define PKV_STR(x) #x
#define PKV_TARGET_BEGIN(s) _Pragma("GCC push_options") _Pragma(PKV_STR(GCC target(s)))
#define PKV_TARGET_END _Pragma("GCC pop_options")
#define PKV_NEONDOT_TARGET "arch=armv8.2-a+dotprod"
#endif
#endif /* PKV_VOCAB_NEON_HELPERS */

#if PKV_T_F64
#define PKV_T double
#define PKV_TAG _f64_neon
#define PKV_VEC float64x2_t
#define PKV_W 2
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define PKV_VLOAD(p) vld1q_f64(p)
#define PKV_VSTORE(p, x) vst1q_f64(p, x)
#define PKV_VSET1(s) vdupq_n_f64(s)
#define PKV_VZERO() vdupq_n_f64(0.0)
#define PKV_VADD(a, b) vaddq_f64(a, b)
#define PKV_VSUB(a, b) vsubq_f64(a, b)
#define PKV_VMUL(a, b) vmulq_f64(a, b)
#define PKV_VDIV(a, b) vdivq_f64(a, b)
#define PKV_VMAX(a, b) vmaxnmq_f64(a, b)
#define PKV_VMIN(a, b) vminnmq_f64(a, b)
#define PKV_VFMA(a, b, c) vfmaq_f64(c, a, b)
#define PKV_VREDUCE(x) vaddvq_f64(x)
#define PKV_VHMAX(x) vmaxnmvq_f64(x)
#define PKV_VROUND(x) vrndnq_f64(x)
#define PKV_VSCALE2K(p, k) pkv_scale2k_f64x2(p, k)
#define PKV_VFRAC(x) vsubq_f64(x, vrndmq_f64(x))
#define PKV_VSCALE2FL(p, x) pkv_scale2k_f64x2(p, vrndmq_f64(x))
#define PKV_LD_F32(p) vcvt_f64_f32(vld1_f32(p))
#define PKV_LD_BF16(p) vcvt_f64_f32(vget_low_f32(pkv_bf16x4_f32(pkv_ld2_u16(p))))
#define PKV_LD_F16(p) vcvt_f64_f32(vget_low_f32(pkv_f16x4_f32(pkv_ld2_u16(p))))
#define PKV_LD_I8(p) vcvt_f64_f32(vget_low_f32(pkv_i8x4_f32(pkv_ld_i8_n(p, 2))))
#else
#define PKV_T float
#define PKV_TAG _f32_neon
#define PKV_VEC float32x4_t
#define PKV_W 4
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define PKV_VLOAD(p) vld1q_f32(p)
#define PKV_VSTORE(p, x) vst1q_f32(p, x)
#define PKV_VSET1(s) vdupq_n_f32(s)
#define PKV_VZERO() vdupq_n_f32(0.0f)
#define PKV_VADD(a, b) vaddq_f32(a, b)
#define PKV_VSUB(a, b) vsubq_f32(a, b)
#define PKV_VMUL(a, b) vmulq_f32(a, b)
#define PKV_VDIV(a, b) vdivq_f32(a, b)
#define PKV_VMAX(a, b) vmaxnmq_f32(a, b)
#define PKV_VMIN(a, b) vminnmq_f32(a, b)
#define PKV_VFMA(a, b, c) vfmaq_f32(c, a, b)
#define PKV_VREDUCE(x) vaddvq_f32(x)
#define PKV_VHMAX(x) vmaxnmvq_f32(x)
#define PKV_VROUND(x) vrndnq_f32(x)
#define PKV_VSCALE2K(p, k) pkv_scale2k_f32x4(p, k)
#define PKV_VFRAC(x) vsubq_f32(x, vrndmq_f32(x))
#define PKV_VSCALE2FL(p, x) pkv_scale2k_f32x4(p, vrndmq_f32(x))
#define PKV_LD_BF16(p) pkv_bf16x4_f32(vld1_u16(p))
#define PKV_LD_F16(p) pkv_f16x4_f32(vld1_u16(p))
#define PKV_LD_I8(p) pkv_i8x4_f32(pkv_ld_i8_n(p, 4))
#endif
