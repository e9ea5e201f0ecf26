/* pagedkv/attn_math.h -- the compute-type half of the attention kernels:
 * vector exp, RoPE, query staging, output, scratch, the read kernel.  It is
 * instantiated by attn_instances.h once per (compute type, instruction set)
 * and knows nothing of the storage type; attn_impl.h (instantiated per
 * storage type) builds the kernels on top of it.
 *
 * A template: included after a vocabulary (vocab_*.h, which lists its names:
 * PKV_T, PKV_VEC, PKV_W, PKV_VLOAD, ...) and with PKV_FN(name), the name
 * mangling per (compute, ISA) (e.g. name##_f32_avx2), defined; once per
 * pair, so no include guard.
 */
#include <math.h>
#include <string.h>
#include "attn_args.h"
#include "convert.h"
#include "types.h"

/* ---- vector helpers ----------------------------------------------------- */

#ifndef PKV_LOG2E
#define PKV_LOG2E 1.44269504088896340736 /* log2(e) */
#endif

/* exp(x) for the softmax's rescale factors and softcapping (the weights use
 * vexp2 below): 2^k * p(r) with k = round(x / ln 2) and a Cody-Waite
 * split of ln 2; x is clamped so that 2^k stays a normal number.  f32: a
 * degree-6 minimax polynomial (~1 ulp); f64: Taylor to degree 12 (~1e-16).
 * Every path, the scalar one included, computes this same function. */
#if PKV_T_F64
#define PKV_EXP_LO (-708.0)
#define PKV_EXP_HI (709.0)
#define PKV_LN2_HI 6.93145751953125E-1
#define PKV_LN2_LO 1.42860682030941723212E-6
#define PKV_EXP_POLY(r, P)                                                                        \
    P = PKV_VFMA(PKV_VSET1((PKV_T)(1.0 / 479001600.0)), r, PKV_VSET1((PKV_T)(1.0 / 39916800.0))); \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 3628800.0)));                                      \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 362880.0)));                                       \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 40320.0)));                                        \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 5040.0)));                                         \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 720.0)));                                          \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 120.0)));                                          \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 24.0)));                                           \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)(1.0 / 6.0)));                                            \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)0.5));                                                    \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)1.0));                                                    \
    P = PKV_VFMA(P, r, PKV_VSET1((PKV_T)1.0));
#else
#define PKV_EXP_LO (-87.0f)
#define PKV_EXP_HI (88.0f)
#define PKV_LN2_HI 0.693359375f
#define PKV_LN2_LO (-2.12194440e-4f)
#define PKV_EXP_POLY(r, P)                                                               \
    P = PKV_VFMA(PKV_VSET1(1.9875691500E-4f), r, PKV_VSET1(1.3981999507E-3f));           \
    P = PKV_VFMA(P, r, PKV_VSET1(8.3334519073E-3f));                                     \
    P = PKV_VFMA(P, r, PKV_VSET1(4.1665795894E-2f));                                     \
    P = PKV_VFMA(P, r, PKV_VSET1(1.6666665459E-1f));                                     \
    P = PKV_VFMA(P, r, PKV_VSET1(5.0000001201E-1f));                                     \
    P = PKV_VFMA(P, PKV_VMUL(r, r), PKV_VADD(r, PKV_VSET1(1.0f)));
#endif

/* 2^x for the softmax's weights, whose arguments are at most 0 up to
 * rounding (the scores' logs to base 2 less their maximum's; any x below 128
 * is exact): x is clamped below at PKV_EXP2_LO, then 2^floor(x) * p(x -
 * floor(x)) with p a polynomial for 2^f on [0, 1).  Base 2 folds log2(e)
 * into the softmax scale and needs no split of ln 2, and the fraction and
 * the scaling take x as it is (AVX-512: vreduce and vscalef, one instruction
 * each, no rounded copy of x).  f32: degree 6 (a weighted least-squares fit
 * of the relative error, 7.5e-8 evaluated in float); f64: Taylor to degree
 * 13 about 1/2 (1.6e-16).  p(0) = 1: integral x give 2^x exactly. */
#if PKV_T_F64
#define PKV_EXP2_LO (-1022.0)
#define PKV_EXP2_POLY(f, P, FMA, SET)                                                   \
    P = FMA(SET((PKV_T)1.9362689226271282e-12), f, SET((PKV_T)2.3729044445444126e-11)); \
    P = FMA(P, f, SET((PKV_T)4.4856254094894154e-10));                                  \
    P = FMA(P, f, SET((PKV_T)7.0493068729275765e-09));                                  \
    P = FMA(P, f, SET((PKV_T)1.017865276902509e-07));                                   \
    P = FMA(P, f, SET((PKV_T)1.3215443942365573e-06));                                  \
    P = FMA(P, f, SET((PKV_T)1.5252736267248011e-05));                                  \
    P = FMA(P, f, SET((PKV_T)0.00015403530285111638));                                  \
    P = FMA(P, f, SET((PKV_T)0.0013333558150051006));                                   \
    P = FMA(P, f, SET((PKV_T)0.0096181291075376346));                                   \
    P = FMA(P, f, SET((PKV_T)0.055504108664838139));                                    \
    P = FMA(P, f, SET((PKV_T)0.24022650695909864));                                     \
    P = FMA(P, f, SET((PKV_T)0.69314718055994551));                                     \
    P = FMA(P, f, SET((PKV_T)1.0));
#else
#define PKV_EXP2_LO (-126.0f)
#define PKV_EXP2_POLY(f, P, FMA, SET)                                                   \
    P = FMA(SET(2.17025736e-04f), f, SET(1.24397280e-03f));                             \
    P = FMA(P, f, SET(9.67881922e-03f));                                                \
    P = FMA(P, f, SET(5.54833636e-02f));                                                \
    P = FMA(P, f, SET(2.40229830e-01f));                                                \
    P = FMA(P, f, SET(6.93147004e-01f));                                                \
    P = FMA(P, f, SET(1.0f));
#endif

static inline PKV_VEC PKV_FN(vexp)(PKV_VEC x) {
    x = PKV_VMAX(x, PKV_VSET1((PKV_T)PKV_EXP_LO));
    x = PKV_VMIN(x, PKV_VSET1((PKV_T)PKV_EXP_HI));
    const PKV_VEC k = PKV_VROUND(PKV_VMUL(x, PKV_VSET1((PKV_T)PKV_LOG2E)));
    PKV_VEC r = PKV_VFMA(k, PKV_VSET1((PKV_T)-PKV_LN2_HI), x);
    r = PKV_VFMA(k, PKV_VSET1((PKV_T)-PKV_LN2_LO), r);
    PKV_VEC P;
    PKV_EXP_POLY(r, P)
    return PKV_VSCALE2K(P, k);
}

/* 2^k for an integral k in the normal exponent range, built from its bits:
 * P * 2^k then rounds once, as ldexp, without a library call */
static inline PKV_T PKV_FN(pow2i)(PKV_T k) {
#if PKV_T_F64
    const uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52;
    double two_k;
#else
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float two_k;
#endif
    memcpy(&two_k, &bits, sizeof two_k);
    return two_k;
}

/* the same function one lane at a time (vector tails) */
static inline PKV_T PKV_FN(sexp)(PKV_T x) {
    x = x < (PKV_T)PKV_EXP_LO ? (PKV_T)PKV_EXP_LO : (x > (PKV_T)PKV_EXP_HI ? (PKV_T)PKV_EXP_HI : x);
    const PKV_T k = (PKV_T)nearbyint((double)(x * (PKV_T)PKV_LOG2E));
    PKV_T r = x - k * (PKV_T)PKV_LN2_HI;
    r = r - k * (PKV_T)PKV_LN2_LO;
#if PKV_T_F64
    PKV_T P = (PKV_T)(1.0 / 479001600.0) * r + (PKV_T)(1.0 / 39916800.0);
    P = P * r + (PKV_T)(1.0 / 3628800.0);
    P = P * r + (PKV_T)(1.0 / 362880.0);
    P = P * r + (PKV_T)(1.0 / 40320.0);
    P = P * r + (PKV_T)(1.0 / 5040.0);
    P = P * r + (PKV_T)(1.0 / 720.0);
    P = P * r + (PKV_T)(1.0 / 120.0);
    P = P * r + (PKV_T)(1.0 / 24.0);
    P = P * r + (PKV_T)(1.0 / 6.0);
    P = P * r + (PKV_T)0.5;
    P = P * r + (PKV_T)1.0;
    P = P * r + (PKV_T)1.0;
#else
    PKV_T P = 1.9875691500E-4f * r + 1.3981999507E-3f;
    P = P * r + 8.3334519073E-3f;
    P = P * r + 4.1665795894E-2f;
    P = P * r + 1.6666665459E-1f;
    P = P * r + 5.0000001201E-1f;
    P = P * (r * r) + (r + 1.0f);
#endif
    return P * PKV_FN(pow2i)(k);
}

/* x[j] = exp(x[j]) for j < n, in place (the softmax's rescale factors).
 * Every value goes through the vector exp, the tail too, so a value's
 * result does not depend on where it lies in x: attend_item takes the rows
 * of all its heads at once or one head at a time, with the same bits. */
static inline void PKV_FN(exp_inplace)(PKV_T *x, int n) {
    int j = 0;
    for (; j + PKV_W <= n; j += PKV_W) PKV_VSTORE(x + j, PKV_FN(vexp)(PKV_VLOAD(x + j)));
    if (j < n) {
#ifdef PKV_VLOADN /* the tail in one masked vector (exp_tail_note) */
        const PKV_VEC t = PKV_VLOADN(x + j, n - j);
        PKV_VSTOREN(x + j, PKV_VKEEPNAN(PKV_FN(vexp)(t), t), n - j);
#else /* through a vector's worth of scratch; a NaN stays NaN */
        PKV_T t[PKV_W] = {0};
        for (int i = 0; i < n - j; i++) t[i] = x[j + i];
        PKV_VSTORE(t, PKV_FN(vexp)(PKV_VLOAD(t)));
        for (int i = 0; i < n - j; i++) x[j + i] = x[j + i] == x[j + i] ? t[i] : x[j + i];
#endif
    }
}

static inline PKV_VEC PKV_FN(vexp2)(PKV_VEC x) {
    x = PKV_VMAX(x, PKV_VSET1((PKV_T)PKV_EXP2_LO));
    const PKV_VEC f = PKV_VFRAC(x);
    PKV_VEC P;
    PKV_EXP2_POLY(f, P, PKV_VFMA, PKV_VSET1)
    return PKV_VSCALE2FL(P, x);
}

/* the same function one lane at a time (vector tails) */
static inline PKV_T PKV_FN(sexp2)(PKV_T x) {
    x = x < (PKV_T)PKV_EXP2_LO ? (PKV_T)PKV_EXP2_LO : x;
    const PKV_T k = (PKV_T)floor((double)x);
    const PKV_T f = x - k;
    PKV_T P;
#define PKV_SFMA_(a, b, c) ((a) * (b) + (c))
#define PKV_SSET_(a) (a)
    PKV_EXP2_POLY(f, P, PKV_SFMA_, PKV_SSET_)
#undef PKV_SFMA_
#undef PKV_SSET_
    return P * PKV_FN(pow2i)(k);
}

/* p[j] = exp(s[j] * c - mx) for j < n, in place, as 2^(s[j] * c2 - m2) with
 * c2 = c log2(e) and m2 = mx log2(e) (c: the softmax scale still to apply, 1
 * where the scores carry it; the caller folds log2(e) in once per tile and
 * row); returns the sum in double.
 * exp_tail_note: where the vocabulary has masked loads and stores
 * (PKV_VLOADN: AVX-512) the last n mod PKV_W values go through the vector
 * function in one masked vector (a NaN argument kept as NaN, as the scalar
 * function does), elsewhere one at a time.  A tile whose keys
 * end mid-block (most decode calls' last tile) has up to 15 of them per row
 * on AVX-512: one scalar exp each made a call over 31 keys cost more than
 * one over 32 (f32, AMD Zen 4: 8.4 against 6.8 us).  A copy padded to a
 * whole vector measured no faster: the vector load of the lanes just stored
 * one by one waits on the stores. */
static inline double PKV_FN(exp2_shift)(PKV_T *restrict s, int n, PKV_T c2, PKV_T m2) {
    int j = 0;
    double sum = 0.0;
    const PKV_VEC vc = PKV_VSET1(c2), vm = PKV_VSET1(-m2);
    if (n >= PKV_W) {
        PKV_VEC acc = PKV_VZERO();
        for (; j + PKV_W <= n; j += PKV_W) {
            const PKV_VEC p = PKV_FN(vexp2)(PKV_VFMA(PKV_VLOAD(s + j), vc, vm));
            PKV_VSTORE(s + j, p);
            acc = PKV_VADD(acc, p);
        }
        sum = (double)PKV_VREDUCE(acc);
    }
#ifdef PKV_VLOADN
    if (j < n) {
        const PKV_VEC t = PKV_VFMA(PKV_VLOADN(s + j, n - j), vc, vm);
        const PKV_VEC p = PKV_VKEEPNAN(PKV_FN(vexp2)(t), t);
        PKV_VSTOREN(s + j, p, n - j);
        sum += (double)PKV_VREDUCEN(p, n - j);
    }
#else
    for (; j < n; j++) {
        s[j] = PKV_FN(sexp2)(s[j] * c2 - m2);
        sum += s[j];
    }
#endif
    return sum;
}

/* Logit softcapping in place: s[j] = c * tanh(s[j] / c) for j < n, with
 * tanh(x) = 1 - 2 / (exp(2x) + 1) on the softmax's exp (its clamp gives
 * exactly +-1 far out). */
static inline void PKV_FN(softcap)(PKV_T *restrict s, int n, PKV_T c) {
    const PKV_T inv2 = (PKV_T)2 / c;
    int j = 0;
    const PKV_VEC vi = PKV_VSET1(inv2), vc = PKV_VSET1(c), one = PKV_VSET1((PKV_T)1), two = PKV_VSET1((PKV_T)2);
    for (; j + PKV_W <= n; j += PKV_W) {
        const PKV_VEC e = PKV_FN(vexp)(PKV_VMUL(PKV_VLOAD(s + j), vi));
        PKV_VSTORE(s + j, PKV_VMUL(vc, PKV_VSUB(one, PKV_VDIV(two, PKV_VADD(e, one)))));
    }
    for (; j < n; j++) s[j] = c * ((PKV_T)1 - (PKV_T)2 / (PKV_FN(sexp)(s[j] * inv2) + (PKV_T)1));
}

/* max of s[0, n), n >= 1; NaN where any of them is NaN, wherever it lies
 * (the vector max instructions of x86 and NEON drop a NaN in some operand
 * positions: a NaN score must make its row NaN on every path, whatever its
 * column).  x - x is 0 for a finite x and NaN for a NaN or an infinity, so
 * the lanes' sum of it says when to look for a NaN one value at a time. */
static inline PKV_T PKV_FN(row_max)(const PKV_T *restrict s, int n) {
    int j = 0;
    PKV_T mx = s[0];
    if (n >= PKV_W) {
        PKV_VEC x = PKV_VLOAD(s), vm = x, vz = PKV_VSUB(x, x);
        for (j = PKV_W; j + PKV_W <= n; j += PKV_W) {
            x = PKV_VLOAD(s + j);
            vm = PKV_VMAX(vm, x);
            vz = PKV_VADD(vz, PKV_VSUB(x, x));
        }
        mx = PKV_VHMAX(vm);
        const PKV_T z = PKV_VREDUCE(vz);
        if (z != z)
            for (int i = 0; i < j; i++)
                if (s[i] != s[i]) return s[i];
    }
    for (; j < n; j++) {
        if (s[j] != s[j]) return s[j];
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

/* Rotate-half RoPE of one vector at position pos (dims past 2*half copied);
 * dst may be src. */
static inline void PKV_FN(rope_one)(PKV_T *dst, const PKV_T *src, const pkv_rope *rope,
                                    int64_t pos, int d) {
    const int half = rope->half;
    const PKV_T *c = (const PKV_T *)rope->cos + (size_t)pos * half;
    const PKV_T *s = (const PKV_T *)rope->sin + (size_t)pos * half;
    int i = 0;
    for (; i + PKV_W <= half; i += PKV_W) {
        const PKV_VEC x0 = PKV_VLOAD(src + i), x1 = PKV_VLOAD(src + i + half);
        const PKV_VEC cv = PKV_VLOAD(c + i), sv = PKV_VLOAD(s + i);
        PKV_VSTORE(dst + i, PKV_VSUB(PKV_VMUL(x0, cv), PKV_VMUL(x1, sv)));
        PKV_VSTORE(dst + i + half, PKV_VFMA(x0, sv, PKV_VMUL(x1, cv)));
    }
    for (; i < half; i++) {
        const PKV_T x0 = src[i], x1 = src[i + half];
        dst[i] = x0 * c[i] - x1 * s[i];
        dst[i + half] = x1 * c[i] + x0 * s[i];
    }
    for (i = 2 * half; i < d; i++) dst[i] = src[i];
}

/* The query rows of heads [h0, h0 + nh), tokens t0 + [0, nt), group members
 * g0 + [0, ng), head-major, then token, then member, as the compute type and,
 * with RoPE, rotated to rank rank0 + t; not scaled (the softmax step applies
 * the scale to the scores: one multiply per score, not per query value).
 * Returns where they are: in q itself when they lie there in that order (one
 * token, whole GQA groups, no RoPE, queries in the compute type: a small
 * decode call's copy cost more than its scores), else staged in qbuf.
 * lim[t * ng + g] = rank0 + t. */
static inline const PKV_T *PKV_FN(load_queries)(const pkv_attn_args *a, int h0, int nh, int64_t t0,
                                                int nt, int g0, int ng, int64_t rank0,
                                                PKV_T *restrict qbuf, int64_t *lim) {
    const int d = a->d, gsz = a->hq / a->hkv;
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < ng; g++) lim[t * ng + g] = rank0 + t;
    if (nt == 1 && ng == gsz && !a->rope && !a->qo16)
        return (const PKV_T *)a->q + ((size_t)t0 * a->hq + (size_t)h0 * gsz) * d;
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const size_t at = ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                PKV_T *dst = qbuf + (((size_t)hh * nt + t) * ng + g) * d;
                const PKV_T *src = (const PKV_T *)a->q + at;
                if (a->qo16) { /* 16-bit queries: widen into dst, then go on from there */
                    const uint16_t *s16 = (const uint16_t *)a->q + at;
                    int j = 0;
                    if (a->qo16 == PKV_BF16) {
                        for (; j + PKV_W <= d; j += PKV_W) PKV_VSTORE(dst + j, PKV_LD_BF16(s16 + j));
                        for (; j < d; j++) dst[j] = (PKV_T)pkv_bf16_to_f32(s16[j]);
                    } else {
                        for (; j + PKV_W <= d; j += PKV_W) PKV_VSTORE(dst + j, PKV_LD_F16(s16 + j));
                        for (; j < d; j++) dst[j] = (PKV_T)pkv_f16_to_f32(s16[j]);
                    }
                    src = dst;
                }
                if (a->rope) PKV_FN(rope_one)(dst, src, a->rope, rank0 + t, d);
                else if (src != dst) memcpy(dst, src, sizeof(PKV_T) * (size_t)d);
            }
    return qbuf;
}

/* 1 / the softmax denominator of query head h * gsz + g (kv head h, group
 * member g): its sum l and, with learned sinks, exp(sink - m) */
static inline PKV_T PKV_FN(inv_denominator)(const pkv_attn_args *a, int h, int g, double l, double m) {
    double den = l;
    if (a->sinks) den += exp(a->sinks[(size_t)h * (a->hq / a->hkv) + g] - m);
    return (PKV_T)(1.0 / den);
}

/* s[0, n) *= f */
static inline void PKV_FN(scale_row)(PKV_T *restrict s, int n, PKV_T f) {
    const PKV_VEC vf = PKV_VSET1(f);
    int j = 0;
    for (; j + PKV_W <= n; j += PKV_W) PKV_VSTORE(s + j, PKV_VMUL(PKV_VLOAD(s + j), vf));
    for (; j < n; j++) s[j] *= f;
}

/* out rows (same layout as load_queries) = acc / l, rounded once to 16 bits
 * when the arrays are; with learned sinks the denominator also takes
 * exp(sink of the row's query head - m).  l NULL: acc is normalized already. */
static inline void PKV_FN(store_out)(const pkv_attn_args *a, int h0, int nh, int64_t t0, int nt,
                                     int g0, int ng, const PKV_T *acc, const double *l, const double *m) {
    const int d = a->d, gsz = a->hq / a->hkv;
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const size_t i = ((size_t)hh * nt + t) * ng + g;
                const size_t at = ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                const PKV_T inv = l ? PKV_FN(inv_denominator)(a, h0 + hh, g0 + g, l[i], m[i]) : (PKV_T)1;
                if (a->qo16 == PKV_BF16) {
                    uint16_t *dst = (uint16_t *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = pkv_f32_to_bf16((float)(acc[i * d + j] * inv));
                } else if (a->qo16 == PKV_F16) {
                    uint16_t *dst = (uint16_t *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = pkv_f32_to_f16((float)(acc[i * d + j] * inv));
                } else {
                    PKV_T *dst = (PKV_T *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = acc[i * d + j] * inv;
                }
            }
}

typedef struct {
    PKV_T *qbuf, *acc, *sbuf, *kbuf, *alpha;
    double *m, *l;
    int64_t *lim;
    char *qdot; /* the query rows quantized (attn_dot.h) */
} PKV_FN(scratch_t);

static inline PKV_FN(scratch_t) PKV_FN(scratch)(const pkv_attn_args *a, int tid) {
    PKV_FN(scratch_t) sc;
    char *p = (char *)a->scratch + (size_t)tid * a->scratch_stride;
    const size_t nqd = (size_t)PKV_MAX_ROWS * a->d;
    sc.m = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.l = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.lim = (int64_t *)p;    p += sizeof(int64_t) * PKV_MAX_ROWS;
    sc.qbuf = (PKV_T *)p;         p += PKV_ALIGN_UP(sizeof(PKV_T) * nqd);
    sc.acc = (PKV_T *)p;          p += PKV_ALIGN_UP(sizeof(PKV_T) * nqd);
    sc.alpha = (PKV_T *)p;        p += PKV_ALIGN_UP(sizeof(PKV_T) * PKV_MAX_ROWS);
    sc.sbuf = (PKV_T *)p;         p += PKV_ALIGN_UP(sizeof(PKV_T) * PKV_MAX_ROWS * (size_t)pkv_tile_cols(a->bs, PKV_TILE_KEYS));
    sc.qdot = p;                  p += PKV_ALIGN_UP(pkv_qdot_bytes(a->d));
    sc.kbuf = (PKV_T *)p;
    return sc;
}

/* Sum of n elements, read once front to back with four independent vector
 * accumulators: the read kernel `pagedkv bench` uses to measure the machine's
 * memory read bandwidth with the same instructions as the attention loops. */
static inline double PKV_FN(stream_sum)(const PKV_T *restrict p, size_t n) {
    PKV_VEC s0 = PKV_VZERO(), s1 = PKV_VZERO(), s2 = PKV_VZERO(), s3 = PKV_VZERO();
    size_t i = 0;
    for (; i + 4 * PKV_W <= n; i += 4 * PKV_W) {
        s0 = PKV_VADD(s0, PKV_VLOAD(p + i));
        s1 = PKV_VADD(s1, PKV_VLOAD(p + i + PKV_W));
        s2 = PKV_VADD(s2, PKV_VLOAD(p + i + 2 * PKV_W));
        s3 = PKV_VADD(s3, PKV_VLOAD(p + i + 3 * PKV_W));
    }
    double s = (double)PKV_VREDUCE(PKV_VADD(PKV_VADD(s0, s1), PKV_VADD(s2, s3)));
    for (; i < n; i++) s += p[i];
    return s;
}

#undef PKV_EXP_LO
#undef PKV_EXP_HI
#undef PKV_LN2_HI
#undef PKV_LN2_LO
#undef PKV_EXP_POLY
#undef PKV_EXP2_LO
#undef PKV_EXP2_POLY
