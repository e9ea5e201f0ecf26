/* pagedkv/convert.h -- storage formats: scalar conversions between the
 * compute types (float, double) and the storage types of types.h, and the
 * row writers/readers that layout.h uses for appends and gathers.  The
 * attention kernels convert on load with their own vector vocabulary
 * (PKV_LD_* of vocab_*.h) and fall back to the scalar readers here for tails.
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
#include "types.h"

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

/* ---- rows: one head vector of d values ---- */

/* int8 quantization of one group of n <= PKV_I8_GROUP values; returns the scale. */
#define PKV_DEF_QUANT(name, T)                                                        \
    static inline float name(int8_t *dst, const T *src, int n) {                      \
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
PKV_DEF_QUANT(pkv_quant_group_f32, float)
PKV_DEF_QUANT(pkv_quant_group_f64, double)
#undef PKV_DEF_QUANT

/* dst[i * dstride] = src[i * sstride] for i < d, elements of sz bytes (2, 4 or 8): K's
 * transposed rows.  Typed loops: a memcpy of a run-time size per element made appending a
 * 16,384-token prompt of bfloat16 K/V (8 heads, D=64) about 30 ms a layer. */
static inline void pkv_strided_copy(char *dst, size_t dstride, const char *src, size_t sstride,
                                    int d, size_t sz) {
    switch (sz) {
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
    default: /* no other size reaches here (int8 rows are quantized, not copied); kept general */
        for (int i = 0; i < d; i++)
            memcpy(dst + (size_t)i * dstride * sz, src + (size_t)i * sstride * sz, sz);
    }
}

/* values converted at a time by pkv_store_row (a stack buffer) */
#define PKV_CHUNK 64

/* Element i of a row of type `type` (float32, bfloat16 or float16) as a float. */
static inline float pkv_src_f32(const char *src, int type, int i) {
    switch (type) {
    case PKV_BF16: return pkv_bf16_to_f32(((const uint16_t *)src)[i]);
    case PKV_F16: return pkv_f16_to_f32(((const uint16_t *)src)[i]);
    default: return ((const float *)src)[i];
    }
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
        if (compute == PKV_F64) for (int i = 0; i < d; i++) ((float *)dst)[i * vstride] = (float)sd[i];
        else for (int i = 0; i < d; i++) ((float *)dst)[i * vstride] = pkv_src_f32(src, compute, i);
        break;
    case PKV_F64: /* only with compute f64 (see CacheCore) */
        for (int i = 0; i < d; i++) ((double *)dst)[i * vstride] = (double)((const float *)src)[i];
        break;
    case PKV_BF16:
    case PKV_F16: /* converted PKV_CHUNK values at a time in a contiguous loop, then placed */
        for (int i0 = 0; i0 < d; i0 += PKV_CHUNK) {
            const int n = d - i0 < PKV_CHUNK ? d - i0 : PKV_CHUNK;
            uint16_t t[PKV_CHUNK];
            if (store == PKV_BF16) {
                if (compute == PKV_F64) for (int i = 0; i < n; i++) t[i] = pkv_f64_to_bf16(sd[i0 + i]);
                else if (compute == PKV_F32) for (int i = 0; i < n; i++) t[i] = pkv_f32_to_bf16(((const float *)src)[i0 + i]);
                else for (int i = 0; i < n; i++) t[i] = pkv_f32_to_bf16(pkv_src_f32(src, compute, i0 + i));
            } else {
                if (compute == PKV_F64) for (int i = 0; i < n; i++) t[i] = pkv_f64_to_f16(sd[i0 + i]);
                else if (compute == PKV_F32) for (int i = 0; i < n; i++) t[i] = pkv_f32_to_f16(((const float *)src)[i0 + i]);
                else for (int i = 0; i < n; i++) t[i] = pkv_f32_to_f16(pkv_src_f32(src, compute, i0 + i));
            }
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
                for (int i = 0; i < n; i++) f[i] = pkv_src_f32(src, compute, i0 + i);
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
 * of type `compute` (float32, float64, bfloat16 or float16). */
static inline void pkv_load_row(const pkv_geom *g, int compute, char *dst, const char *src,
                                const float *scales, size_t vstride, size_t sstride) {
    const int d = g->d;
    if ((int)g->store.dtype == compute && vstride == 1) {
        memcpy(dst, src, g->row_bytes);
        return;
    }
    if ((int)g->store.dtype == compute && compute != PKV_I8) { /* transposed, same type */
        pkv_strided_copy(dst, 1, src, vstride, d, g->store.itemsize);
        return;
    }
    for (int i = 0; i < d; i++) {
        double x; /* every storage value is exact in double, and so is q * scale */
        float xf = 0.0f;
        const size_t at = (size_t)i * vstride;
        switch (g->store.dtype) {
        case PKV_F32: xf = ((const float *)src)[at]; x = xf; break;
        case PKV_F64: x = ((const double *)src)[at]; break;
        case PKV_BF16: xf = pkv_bf16_to_f32(((const uint16_t *)src)[at]); x = xf; break;
        case PKV_F16: xf = pkv_f16_to_f32(((const uint16_t *)src)[at]); x = xf; break;
        case PKV_I8: {
            /* the kernels compute (T)q * (T)scale; so does this */
            const float sc = scales[(size_t)(i / PKV_I8_GROUP) * sstride];
            if (compute != PKV_F64) {
                xf = (float)((const int8_t *)src)[at] * sc;
                x = xf;
            } else {
                x = (double)((const int8_t *)src)[at] * (double)sc;
            }
            break;
        }
        default: x = 0.0; break;
        }
        switch (compute) { /* x is exactly a float unless compute is float64 */
        case PKV_F32: ((float *)dst)[i] = (float)x; break;
        case PKV_BF16: ((uint16_t *)dst)[i] = pkv_f32_to_bf16((float)x); break;
        case PKV_F16: ((uint16_t *)dst)[i] = pkv_f32_to_f16((float)x); break;
        default: ((double *)dst)[i] = x; break;
        }
    }
}
