/* pagedkv/attn_impl.h -- paged attention over stored K/V, written once and
 * instantiated by attention.h for each (storage type, compute type,
 * instruction set) on top of attn_math.h.  No include guard on purpose.
 *
 * The includer defines, besides attn_math.h's vocabulary:
 *   S          storage type of K/V in the pool
 *   SLOAD(p)   W stored values at p -> VEC of the compute type
 *   SGET(p)    one stored value at p -> T
 *   KFN(name)  name mangling per (storage, compute, ISA)
 *   PKV_STORE_IS_COMPUTE  1 when S is T (then attn_math.h's dot products serve)
 *   PKV_STORE_SCALED      1 for int8: its own score and value loops read the
 *              integers in place and apply each group's scale once per group;
 *              the softmax (and, with RoPE, the scores over keys dequantized
 *              into scratch) are the compute-type instance's, named CFN(name)
 *
 * A new storage format is a load vocabulary (SLOAD/SGET) plus an entry in
 * attention.h's instantiation list and dispatch table; nothing here changes.
 *
 * Layout (types.h): a->k / a->v point at the K / V plane of one layer in
 * block 0; each further block is a->block_stride bytes on.
 */

#ifndef PKV_STORE_SCALED
#define PKV_STORE_SCALED 0
#define PKV_SCALED_DEFAULTED
#endif

#if PKV_STORE_SCALED
/* Dequantize n stored int8 rows (d values, then d / 32 rounded up scales
 * each) into dst [n][d] of the compute type: x = (T)q * (T)scale.  A vector
 * of W values starts at a multiple of W, which divides PKV_I8_GROUP, so it
 * lies in one group. */
static inline void KFN(dequant_run)(T *restrict dst, const S *restrict src,
                                    const float *restrict scales, int n, int d) {
    const int ng = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP;
    for (int j = 0; j < n; j++) {
        const S *x = src + (size_t)j * d;
        const float *sc = scales + (size_t)j * ng;
        T *y = dst + (size_t)j * d;
        int i = 0;
        for (; i + W <= d; i += W) VSTORE(y + i, VMUL(SLOAD(x + i), VSET1((T)sc[i / PKV_I8_GROUP])));
        for (; i < d; i++) y[i] = SGET(x + i) * (T)sc[i / PKV_I8_GROUP];
    }
}

/* Scores of rows[0, na) of q (one head) against n stored int8 keys, read in
 * place: per group of PKV_I8_GROUP dimensions the dot product with the raw
 * integers, times that group's scale.  The K run spans [at, at + span) of the
 * prefetch sequence. */
static inline void KFN(i8_scores)(const T *restrict q, const int *rows, int na,
                                  const S *restrict k, const float *restrict ksc, int n, int d,
                                  T *restrict sbuf, pkv_prefetch *pf, size_t at, size_t span) {
    const int ngrp = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP;
    const size_t step = span / (size_t)n; /* bytes per key */
    for (int j = 0; j < n; j++) {
        pkv_pf_consumed(pf, at + step * (size_t)(j + 1));
        const S *kj = k + (size_t)j * d;
        const float *sj = ksc + (size_t)j * ngrp;
        int a = 0;
        for (; a + 4 <= na; a += 4) {
            const T *q0 = q + (size_t)rows[a] * d, *q1 = q + (size_t)rows[a + 1] * d;
            const T *q2 = q + (size_t)rows[a + 2] * d, *q3 = q + (size_t)rows[a + 3] * d;
            VEC t0 = VZERO(), t1 = VZERO(), t2 = VZERO(), t3 = VZERO();
            T u0 = 0, u1 = 0, u2 = 0, u3 = 0; /* scalar tails */
            for (int g = 0, i = 0; g < ngrp; g++) {
                const int end = (g + 1) * PKV_I8_GROUP < d ? (g + 1) * PKV_I8_GROUP : d;
                VEC a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
                for (; i + W <= end; i += W) {
                    const VEC x = SLOAD(kj + i);
                    a0 = VFMA(VLOAD(q0 + i), x, a0);
                    a1 = VFMA(VLOAD(q1 + i), x, a1);
                    a2 = VFMA(VLOAD(q2 + i), x, a2);
                    a3 = VFMA(VLOAD(q3 + i), x, a3);
                }
                const T sg = (T)sj[g];
                const VEC vs = VSET1(sg);
                t0 = VFMA(a0, vs, t0);
                t1 = VFMA(a1, vs, t1);
                t2 = VFMA(a2, vs, t2);
                t3 = VFMA(a3, vs, t3);
                for (; i < end; i++) {
                    const T x = SGET(kj + i) * sg;
                    u0 += q0[i] * x;
                    u1 += q1[i] * x;
                    u2 += q2[i] * x;
                    u3 += q3[i] * x;
                }
            }
            sbuf[(size_t)(a + 0) * n + j] = VREDUCE(t0) + u0;
            sbuf[(size_t)(a + 1) * n + j] = VREDUCE(t1) + u1;
            sbuf[(size_t)(a + 2) * n + j] = VREDUCE(t2) + u2;
            sbuf[(size_t)(a + 3) * n + j] = VREDUCE(t3) + u3;
        }
        for (; a < na; a++) {
            const T *q0 = q + (size_t)rows[a] * d;
            VEC t0 = VZERO();
            T u0 = 0;
            for (int g = 0, i = 0; g < ngrp; g++) {
                const int end = (g + 1) * PKV_I8_GROUP < d ? (g + 1) * PKV_I8_GROUP : d;
                VEC a0 = VZERO();
                for (; i + W <= end; i += W) a0 = VFMA(VLOAD(q0 + i), SLOAD(kj + i), a0);
                const T sg = (T)sj[g];
                t0 = VFMA(a0, VSET1(sg), t0);
                for (; i < end; i++) u0 += q0[i] * (SGET(kj + i) * sg);
            }
            sbuf[(size_t)a * n + j] = VREDUCE(t0) + u0;
        }
    }
    pkv_pf_consumed(pf, at + span);
}

/* acc rows (one head) = acc * alpha + P . V over n stored int8 values, read in
 * place: the weights are scaled per group first (pw [rows][group][n] in
 * scratch: p[j] * scale of value j's group), so the inner loop is the float
 * one with a converting load. */
static inline void KFN(i8_values)(T *restrict acc, const int *rows, int na, const T *restrict p,
                                  const T *restrict alpha, const S *restrict v,
                                  const float *restrict vsc, int n, int d, T *restrict pw,
                                  pkv_prefetch *pf, size_t at, size_t span) {
    const int ngrp = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP;
    const size_t step = span / (size_t)d; /* bytes per dimension of the run */
    for (int a = 0; a < na; a += 4) {
        const int nr = na - a < 4 ? na - a : 4;
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < ngrp; g++)
                for (int j = 0; j < n; j++)
                    pw[((size_t)r * ngrp + g) * n + j] =
                        p[(size_t)(a + r) * n + j] * (T)vsc[(size_t)j * ngrp + g];
        if (nr == 4) {
            T *y0 = acc + (size_t)rows[a] * d, *y1 = acc + (size_t)rows[a + 1] * d;
            T *y2 = acc + (size_t)rows[a + 2] * d, *y3 = acc + (size_t)rows[a + 3] * d;
            const VEC al0 = VSET1(alpha[a]), al1 = VSET1(alpha[a + 1]);
            const VEC al2 = VSET1(alpha[a + 2]), al3 = VSET1(alpha[a + 3]);
            int i = 0;
            for (; i + W <= d; i += W) {
                if (a == 0) pkv_pf_consumed(pf, at + step * (size_t)(i + W));
                const size_t g = (size_t)(i / PKV_I8_GROUP);
                const T *p0 = pw + g * n, *p1 = pw + (ngrp + g) * n;
                const T *p2 = pw + (2 * ngrp + g) * n, *p3 = pw + (3 * ngrp + g) * n;
                VEC a0 = VMUL(VLOAD(y0 + i), al0), a1 = VMUL(VLOAD(y1 + i), al1);
                VEC a2 = VMUL(VLOAD(y2 + i), al2), a3 = VMUL(VLOAD(y3 + i), al3);
                for (int j = 0; j < n; j++) {
                    const VEC x = SLOAD(v + (size_t)j * d + i);
                    a0 = VFMA(VSET1(p0[j]), x, a0);
                    a1 = VFMA(VSET1(p1[j]), x, a1);
                    a2 = VFMA(VSET1(p2[j]), x, a2);
                    a3 = VFMA(VSET1(p3[j]), x, a3);
                }
                VSTORE(y0 + i, a0);
                VSTORE(y1 + i, a1);
                VSTORE(y2 + i, a2);
                VSTORE(y3 + i, a3);
            }
            for (; i < d; i++) {
                const size_t g = (size_t)(i / PKV_I8_GROUP);
                T b0 = y0[i] * alpha[a], b1 = y1[i] * alpha[a + 1];
                T b2 = y2[i] * alpha[a + 2], b3 = y3[i] * alpha[a + 3];
                for (int j = 0; j < n; j++) {
                    const T x = SGET(v + (size_t)j * d + i);
                    b0 += pw[g * n + j] * x;
                    b1 += pw[(ngrp + g) * n + j] * x;
                    b2 += pw[(2 * ngrp + g) * n + j] * x;
                    b3 += pw[(3 * ngrp + g) * n + j] * x;
                }
                y0[i] = b0;
                y1[i] = b1;
                y2[i] = b2;
                y3[i] = b3;
            }
        } else {
            for (int r = 0; r < nr; r++) {
                T *y = acc + (size_t)rows[a + r] * d;
                const VEC al = VSET1(alpha[a + r]);
                int i = 0;
                for (; i + W <= d; i += W) {
                    const T *pr = pw + ((size_t)r * ngrp + (size_t)(i / PKV_I8_GROUP)) * n;
                    VEC b = VMUL(VLOAD(y + i), al);
                    for (int j = 0; j < n; j++) b = VFMA(VSET1(pr[j]), SLOAD(v + (size_t)j * d + i), b);
                    VSTORE(y + i, b);
                }
                for (; i < d; i++) {
                    const T *pr = pw + ((size_t)r * ngrp + (size_t)(i / PKV_I8_GROUP)) * n;
                    T b = y[i] * alpha[a + r];
                    for (int j = 0; j < n; j++) b += pr[j] * SGET(v + (size_t)j * d + i);
                    y[i] = b;
                }
            }
        }
    }
    pkv_pf_consumed(pf, at + span);
}
#else

#if PKV_STORE_IS_COMPUTE
#define KDOT(name) FN(name)
#else
#define KT S
#define KLOAD(p) SLOAD(p)
#define KGET(p) SGET(p)
#define DOTFN(name) KFN(name)
#include "attn_dot.h"
#define KDOT(name) KFN(name)
#endif

/* One stored key rotated by RoPE at rank `pos`, in the compute type. */
static inline void KFN(rope_key)(T *restrict dst, const S *restrict src, const pkv_rope *rope,
                                 int64_t pos, int d) {
#if PKV_STORE_IS_COMPUTE
    FN(rope_one)(dst, src, rope, pos, d);
#else
    for (int i = 0; i < d; i++) dst[i] = SGET(src + i);
    FN(rope_one)(dst, dst, rope, pos, d);
#endif
}

/* y_r = y_r * alpha_r + sum_j p_r[j] * x[j]  for rows r < 4 (p_r = p + r * ps),
 * j < n; x rows are d long.  Each x vector is loaded once for four rows.  x spans
 * [at, at + span) of the prefetch sequence (pf NULL: no prefetching). */
static inline void KFN(pv4)(T *restrict y, int yd, const T *restrict alpha, const T *restrict p,
                           int ps, const S *restrict x, int n, int d, pkv_prefetch *pf,
                           size_t at, size_t span) {
    int i = 0;
    T *y0 = y, *y1 = y + yd, *y2 = y + 2 * (size_t)yd, *y3 = y + 3 * (size_t)yd;
    const T *p0 = p, *p1 = p + ps, *p2 = p + 2 * ps, *p3 = p + 3 * ps;
    const VEC al0 = VSET1(alpha[0]), al1 = VSET1(alpha[1]), al2 = VSET1(alpha[2]),
              al3 = VSET1(alpha[3]);
    const size_t step = span / (size_t)d; /* bytes per dimension of the run */
    for (; i + 2 * W <= d; i += 2 * W) {
        if (pf) pkv_pf_consumed(pf, at + step * (size_t)(i + 2 * W));
        VEC a0 = VMUL(VLOAD(y0 + i), al0), b0 = VMUL(VLOAD(y0 + i + W), al0);
        VEC a1 = VMUL(VLOAD(y1 + i), al1), b1 = VMUL(VLOAD(y1 + i + W), al1);
        VEC a2 = VMUL(VLOAD(y2 + i), al2), b2 = VMUL(VLOAD(y2 + i + W), al2);
        VEC a3 = VMUL(VLOAD(y3 + i), al3), b3 = VMUL(VLOAD(y3 + i + W), al3);
        for (int j = 0; j < n; j++) {
            const VEC x0 = SLOAD(x + (size_t)j * d + i), x1 = SLOAD(x + (size_t)j * d + i + W);
            VEC pj = VSET1(p0[j]);
            a0 = VFMA(pj, x0, a0);
            b0 = VFMA(pj, x1, b0);
            pj = VSET1(p1[j]);
            a1 = VFMA(pj, x0, a1);
            b1 = VFMA(pj, x1, b1);
            pj = VSET1(p2[j]);
            a2 = VFMA(pj, x0, a2);
            b2 = VFMA(pj, x1, b2);
            pj = VSET1(p3[j]);
            a3 = VFMA(pj, x0, a3);
            b3 = VFMA(pj, x1, b3);
        }
        VSTORE(y0 + i, a0);
        VSTORE(y0 + i + W, b0);
        VSTORE(y1 + i, a1);
        VSTORE(y1 + i + W, b1);
        VSTORE(y2 + i, a2);
        VSTORE(y2 + i + W, b2);
        VSTORE(y3 + i, a3);
        VSTORE(y3 + i + W, b3);
    }
    for (; i + W <= d; i += W) {
        VEC a0 = VMUL(VLOAD(y0 + i), al0), a1 = VMUL(VLOAD(y1 + i), al1);
        VEC a2 = VMUL(VLOAD(y2 + i), al2), a3 = VMUL(VLOAD(y3 + i), al3);
        for (int j = 0; j < n; j++) {
            const VEC x0 = SLOAD(x + (size_t)j * d + i);
            a0 = VFMA(VSET1(p0[j]), x0, a0);
            a1 = VFMA(VSET1(p1[j]), x0, a1);
            a2 = VFMA(VSET1(p2[j]), x0, a2);
            a3 = VFMA(VSET1(p3[j]), x0, a3);
        }
        VSTORE(y0 + i, a0);
        VSTORE(y1 + i, a1);
        VSTORE(y2 + i, a2);
        VSTORE(y3 + i, a3);
    }
    for (; i < d; i++) {
        T a0 = y0[i] * alpha[0], a1 = y1[i] * alpha[1], a2 = y2[i] * alpha[2], a3 = y3[i] * alpha[3];
        for (int j = 0; j < n; j++) {
            const T xv = SGET(x + (size_t)j * d + i);
            a0 += p0[j] * xv;
            a1 += p1[j] * xv;
            a2 += p2[j] * xv;
            a3 += p3[j] * xv;
        }
        y0[i] = a0;
        y1[i] = a1;
        y2[i] = a2;
        y3[i] = a3;
    }
}

/* y = y * alpha + sum_j p[j] * x[j*d : j*d+d]  for j < n (one row) */
static inline void KFN(scale_axpy_n)(T *restrict y, T alpha, const T *restrict p,
                                    const S *restrict x, int n, int d) {
    int i = 0;
    const VEC va = VSET1(alpha);
    for (; i + 2 * W <= d; i += 2 * W) {
        VEC y0 = VMUL(VLOAD(y + i), va), y1 = VMUL(VLOAD(y + i + W), va);
        for (int j = 0; j < n; j++) {
            const VEC pj = VSET1(p[j]);
            y0 = VFMA(pj, SLOAD(x + (size_t)j * d + i), y0);
            y1 = VFMA(pj, SLOAD(x + (size_t)j * d + i + W), y1);
        }
        VSTORE(y + i, y0);
        VSTORE(y + i + W, y1);
    }
    for (; i + W <= d; i += W) {
        VEC y0 = VMUL(VLOAD(y + i), va);
        for (int j = 0; j < n; j++) y0 = VFMA(VSET1(p[j]), SLOAD(x + (size_t)j * d + i), y0);
        VSTORE(y + i, y0);
    }
    for (; i < d; i++) {
        T acc = y[i] * alpha;
        for (int j = 0; j < n; j++) acc += p[j] * SGET(x + (size_t)j * d + i);
        y[i] = acc;
    }
}

/* q . key j of a run (see fold_run for k and k_rotated) */
static inline T KFN(score)(const T *restrict q, const void *k, int k_rotated, int j, int d) {
    if (k_rotated) return FN(dot)(q, (const T *)k + (size_t)j * d, d);
    return KDOT(dot)(q, (const S *)k + (size_t)j * d, d);
}

/* ---- online softmax over the blocks of a work item ------------------------
 * A run is n keys of ranks [r, r + n) of one block (n <= bs), stored
 * contiguously per head.  A work item folds a run into the running state
 * (m, l, acc) of its query rows in three phases over all its heads:
 *
 *   K phase   scores of every head's rows against its keys, head after head:
 *             the item reads the block's K run of its heads front to back
 *   softmax   per row: new max, rescale factor alpha, exp of the scores
 *   V phase   acc = acc * alpha + P . V, head after head: the V run front
 *             to back
 *
 * so memory sees two long runs per block, and the prefetch cursor
 * (kvread.h), told the offset consumed, keeps PKV_PF_AHEAD bytes in flight
 * across the jump to the next block.  Row i of a head sees only ranks
 * <= lim[i]; rows[0, na) are the rows that see rank r at all.  Scores go to
 * sbuf [head][na][n], alpha to [head][na].
 *
 * Measured on an AVX2 EPYC (benchmarks/c/decode_ceiling.c, f32 B=8 L=2048,
 * 1 thread, CPU time paired per round): the former order (K then V of each
 * head in turn, prefetching the next head's runs into L1 spread over the
 * score loop) 50-58% of the pattern read, this one 60-72%; f64 44-46% ->
 * 66%.  Splitting one sequence over 2 threads by key chunks instead of by
 * head groups made no difference there (head groups kept: no merge).
 */

/* Scores of rows[0, na) of q (one head) against the run's n keys; the K run
 * consumed spans [at, at + span) of the prefetch sequence. */
static inline void KFN(run_scores)(const T *restrict q, const int *rows, int na, const void *k,
                                   int k_rotated, int n, int d, T *restrict sbuf,
                                   pkv_prefetch *pf, size_t at, size_t span) {
    const S *ks = (const S *)k;
    const T *kt = (const T *)k;
    const size_t step = span / (size_t)n; /* bytes per key (no division in the loop) */
    int a = 0;
    for (; a + 4 <= na; a += 4) {
        const T *q0 = q + (size_t)rows[a] * d, *q1 = q + (size_t)rows[a + 1] * d;
        const T *q2 = q + (size_t)rows[a + 2] * d, *q3 = q + (size_t)rows[a + 3] * d;
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            T t[8];
            if (a == 0) pkv_pf_consumed(pf, at + step * (size_t)(j + 2));
            if (k_rotated)
                FN(dot4x2)(q0, q1, q2, q3, kt + (size_t)j * d, kt + (size_t)(j + 1) * d, d, t);
            else
                KDOT(dot4x2)(q0, q1, q2, q3, ks + (size_t)j * d, ks + (size_t)(j + 1) * d, d, t);
            for (int rr = 0; rr < 4; rr++) {
                sbuf[(size_t)(a + rr) * n + j] = t[2 * rr];
                sbuf[(size_t)(a + rr) * n + j + 1] = t[2 * rr + 1];
            }
        }
        for (; j < n; j++) {
            sbuf[(size_t)(a + 0) * n + j] = KFN(score)(q0, k, k_rotated, j, d);
            sbuf[(size_t)(a + 1) * n + j] = KFN(score)(q1, k, k_rotated, j, d);
            sbuf[(size_t)(a + 2) * n + j] = KFN(score)(q2, k, k_rotated, j, d);
            sbuf[(size_t)(a + 3) * n + j] = KFN(score)(q3, k, k_rotated, j, d);
        }
    }
    for (; a < na; a++) {
        const T *qi = q + (size_t)rows[a] * d;
        for (int j = 0; j < n; j++) {
            if (a == 0) pkv_pf_consumed(pf, at + step * (size_t)(j + 1));
            sbuf[(size_t)a * n + j] = KFN(score)(qi, k, k_rotated, j, d);
        }
    }
    pkv_pf_consumed(pf, at + span);
}

/* Softmax step of rows[0, na) (one head) over the run's scores s [na][n]. */
static inline void KFN(run_softmax)(T *restrict s, const int *rows, int na, const int64_t *lim,
                                    int64_t r, int n, double *m, double *l, T *restrict alpha) {
    for (int a = 0; a < na; a++, s += n) {
        const int i = rows[a];
        const int64_t c64 = lim[i] - r + 1;
        const int cnt = c64 < n ? (int)c64 : n;
        T mx = s[0];
        for (int j = 1; j < cnt; j++) mx = s[j] > mx ? s[j] : mx;
        const double m_new = m[i] > (double)mx ? m[i] : (double)mx;
        const T al = m[i] == -INFINITY ? (T)0 : FN(sexp)((T)(m[i] - m_new));
        const double psum = FN(exp_shift)(s, cnt, (T)m_new);
        for (int j = cnt; j < n; j++) s[j] = 0;  /* causally masked */
        l[i] = l[i] * (double)al + psum;
        m[i] = m_new;
        alpha[a] = al;
    }
}

/* acc rows (one head) = acc * alpha + P . V over the run's n values. */
static inline void KFN(run_values)(T *restrict acc, const int *rows, int na, const T *restrict p,
                                   const T *restrict alpha, const S *restrict v, int n, int d,
                                   pkv_prefetch *pf, size_t at, size_t span) {
    int a = 0;
    for (; a + 4 <= na; a += 4) {
        /* rows[a..a+3] are consecutive in the common case; fall back otherwise */
        if (rows[a + 3] == rows[a] + 3) {
            KFN(pv4)(acc + (size_t)rows[a] * d, d, alpha + a, p + (size_t)a * n, n, v, n, d,
                     a == 0 ? pf : NULL, at, span);
        } else {
            for (int b = a; b < a + 4; b++)
                KFN(scale_axpy_n)(acc + (size_t)rows[b] * d, alpha[b], p + (size_t)b * n, v, n, d);
        }
    }
    for (; a < na; a++)
        KFN(scale_axpy_n)(acc + (size_t)rows[a] * d, alpha[a], p + (size_t)a * n, v, n, d);
    pkv_pf_consumed(pf, at + span);
}

#endif /* !PKV_STORE_SCALED */

/* One work item: kv heads [h0, h0 + nh) of sequence s against their query
 * rows over held ranks [rbeg, rend).  Rows are laid out head-major: head hh
 * owns rows [hh * nqh, (hh + 1) * nqh) of q / acc / m / l, and row i of every
 * head sees ranks <= lim[i].  The heads of one block are adjacent in the pool
 * (HND), so an item reads each block as one contiguous run per K and V. */
static void KFN(attend_item)(const pkv_attn_args *a, int64_t s, int h0, int nh,
                            const T *restrict q, int nqh, const int64_t *lim, int64_t rbeg,
                            int64_t rend, T *restrict acc, double *m, double *l,
                            T *restrict sbuf, T *restrict kbuf, T *restrict alpha) {
    const int bs = a->bs, d = a->d;
    const size_t row = sizeof(S) * (size_t)d; /* bytes of one stored head vector */
    const size_t hstride = (size_t)bs * row;  /* one head of a block */
    const size_t run = (size_t)nh * hstride;  /* the item's heads of a block */
    const size_t bstride = a->block_stride;   /* one block */
    const char *kb = (const char *)a->k + (size_t)h0 * hstride;
    const char *vb = (const char *)a->v + (size_t)h0 * hstride;
    const int32_t *table = a->tables[s];
    const pkv_segs sg = a->segs[s];
    const int nq = nh * nqh;
#if PKV_STORE_SCALED
    const int ngrp = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP;
    const size_t srow = sizeof(float) * (size_t)ngrp; /* scales of one head vector */
    const size_t hscales = (size_t)bs * srow;         /* one head's scales in a block */
    const char *ksc = (const char *)a->k + a->scale_offset + (size_t)h0 * hscales;
    const char *vsc = (const char *)a->v + a->scale_offset + (size_t)h0 * hscales;
    const int64_t nblk = (sg.b1 + bs - 1) / bs;
#endif
    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0;
    }
    memset(acc, 0, sizeof(T) * (size_t)nq * d);

    /* held ranks map to slots: [0, n0) -> [a0, a1), [n0, ...) -> [b0, b1) */
    const int64_t n0 = sg.a1 - sg.a0;
    const int64_t seg_slot[2] = {sg.a0, sg.b0};
    const int64_t seg_rank[2] = {0, n0};
    const int64_t seg_end[2] = {n0, n0 + sg.b1 - sg.b0};
    int64_t rfirst[2], rlast[2], blo[2], bhi[2];
    for (int sgi = 0; sgi < 2; sgi++) {
        rfirst[sgi] = seg_rank[sgi] > rbeg ? seg_rank[sgi] : rbeg;
        rlast[sgi] = seg_end[sgi] < rend ? seg_end[sgi] : rend;
        if (rlast[sgi] < rfirst[sgi]) rlast[sgi] = rfirst[sgi];
        pkv_blocks_of(seg_slot[sgi] + (rfirst[sgi] - seg_rank[sgi]),
                      seg_slot[sgi] + (rlast[sgi] - seg_rank[sgi]), bs, &blo[sgi], &bhi[sgi]);
    }
    pkv_prefetch pf;
    pkv_pf_init(&pf, kb, vb, table, bstride, run, blo, bhi);
    pkv_pf_consumed(&pf, 0);
    size_t at = 0; /* offset of the current block in the prefetch sequence */
    int rows[PKV_MAX_ROWS];
    for (int sgi = 0; sgi < 2; sgi++) {
        int64_t rr = rfirst[sgi];
        int64_t slot = seg_slot[sgi] + (rr - seg_rank[sgi]);
        while (rr < rlast[sgi]) {
            const int64_t bi = slot / bs;
            const int off = (int)(slot - bi * bs);
            int n = bs - off;
            if (n > rlast[sgi] - rr) n = (int)(rlast[sgi] - rr);
            const size_t base = (size_t)table[bi] * bstride + (size_t)off * row;
            int na = 0;
            for (int i = 0; i < nqh; i++)
                if (lim[i] >= rr) rows[na++] = i;
            if (na > 0) {
#if PKV_STORE_SCALED
                /* int8: read in place, each group's scale applied to the
                 * group's partial dot product (K) and folded into the
                 * softmax weights (V); with RoPE each head's K run is
                 * dequantized into scratch and rotated there first.  The
                 * cursor prefetches the values; the next block's scales are
                 * asked for here. */
                if (bi + 1 < nblk) {
                    const size_t nso = (size_t)table[bi + 1] * bstride;
                    for (size_t o = 0; o < (size_t)nh * hscales; o += 64) {
                        __builtin_prefetch(ksc + nso + o, 0, 3);
                        __builtin_prefetch(vsc + nso + o, 0, 3);
                    }
                }
                const size_t so = (size_t)table[bi] * bstride + (size_t)off * srow;
                for (int hh = 0; hh < nh; hh++) {
                    const S *kp = (const S *)(kb + base + hh * hstride);
                    const float *ks = (const float *)(ksc + so + hh * hscales);
                    if (a->rope) {
                        KFN(dequant_run)(kbuf, kp, ks, n, d);
                        for (int j = 0; j < n; j++)
                            FN(rope_one)(kbuf + (size_t)j * d, kbuf + (size_t)j * d, a->rope, rr + j, d);
                        CFN(run_scores)(q + (size_t)hh * nqh * d, rows, na, kbuf, 1, n, d,
                                        sbuf + (size_t)hh * na * n, &pf, at + hh * hstride, hstride);
                    } else {
                        KFN(i8_scores)(q + (size_t)hh * nqh * d, rows, na, kp, ks, n, d,
                                       sbuf + (size_t)hh * na * n, &pf, at + hh * hstride, hstride);
                    }
                }
                for (int hh = 0; hh < nh; hh++)
                    CFN(run_softmax)(sbuf + (size_t)hh * na * n, rows, na, lim, rr, n,
                                     m + (size_t)hh * nqh, l + (size_t)hh * nqh, alpha + hh * na);
                for (int hh = 0; hh < nh; hh++)
                    KFN(i8_values)(acc + (size_t)hh * nqh * d, rows, na, sbuf + (size_t)hh * na * n,
                                   alpha + hh * na, (const S *)(vb + base + hh * hstride),
                                   (const float *)(vsc + so + hh * hscales), n, d, kbuf, &pf,
                                   at + run + hh * hstride, hstride);
#else
                for (int hh = 0; hh < nh; hh++) {
                    const char *kp = kb + base + hh * hstride;
                    const void *kr = kp;
                    if (a->rope) {
                        for (int j = 0; j < n; j++)
                            KFN(rope_key)(kbuf + (size_t)j * d, (const S *)kp + (size_t)j * d,
                                          a->rope, rr + j, d);
                        kr = kbuf;
                    }
                    KFN(run_scores)(q + (size_t)hh * nqh * d, rows, na, kr, a->rope != NULL, n, d,
                                    sbuf + (size_t)hh * na * n, &pf, at + hh * hstride, hstride);
                }
                for (int hh = 0; hh < nh; hh++)
                    KFN(run_softmax)(sbuf + (size_t)hh * na * n, rows, na, lim, rr, n,
                                     m + (size_t)hh * nqh, l + (size_t)hh * nqh, alpha + hh * na);
                for (int hh = 0; hh < nh; hh++)
                    KFN(run_values)(acc + (size_t)hh * nqh * d, rows, na,
                                    sbuf + (size_t)hh * na * n, alpha + hh * na,
                                    (const S *)(vb + base + hh * hstride), n, d, &pf,
                                    at + run + hh * hstride, hstride);
#endif
            }
            at += 2 * run;
            rr += n;
            slot += n;
        }
    }
}

/* Batched decode: one query token per sequence, at its newest held rank.
 *
 * Work items are (sequence, head group, member chunk, key chunk).  A head
 * group is as many KV heads as fit PKV_MAX_ROWS query rows, split further
 * while there are fewer items than threads; if that is still too few (few
 * sequences, few KV heads), each sequence's keys are split into chunks whose
 * partial softmax states (m, l, acc) are merged by log-sum-exp afterwards. */
static void KFN(decode)(const pkv_attn_args *a) {
    const int gsz = a->hq / a->hkv, d = a->d;
    double work = 0.0; /* multiply-adds */
    for (int64_t b = 0; b < a->nseq; b++)
        work += (double)((a->segs[b].a1 - a->segs[b].a0) + (a->segs[b].b1 - a->segs[b].b0));
    work *= 2.0 * a->hq * d;
    const int nthreads = work < PKV_PARALLEL_MIN ? 1 : a->nthreads;
    const int ng_max = gsz < PKV_MAX_ROWS ? gsz : PKV_MAX_ROWS;
    const int ngc = (gsz + ng_max - 1) / ng_max;
    int hpg = PKV_MAX_ROWS / ng_max;
    if (hpg > a->hkv) hpg = a->hkv;
    while (hpg > 1 && a->nseq * ((a->hkv + hpg - 1) / hpg) * ngc < nthreads) hpg = (hpg + 1) / 2;
    const int ngroups = (a->hkv + hpg - 1) / hpg;
    const int64_t base = a->nseq * ngroups * ngc;
    int64_t nchunk = 1;
    if (base < nthreads && a->partial_slots > 0) {
        int64_t held_min = INT64_MAX;
        for (int64_t b = 0; b < a->nseq; b++) {
            const int64_t h = (a->segs[b].a1 - a->segs[b].a0) + (a->segs[b].b1 - a->segs[b].b0);
            if (h < held_min) held_min = h;
        }
        nchunk = (nthreads + base - 1) / base;
        if (nchunk * base > a->partial_slots) nchunk = a->partial_slots / base;
        if (nchunk > held_min / PKV_SPLIT_MIN) nchunk = held_min / PKV_SPLIT_MIN;
        if (nchunk < 1) nchunk = 1;
    }
    const int64_t items = base * nchunk;
    const size_t slot_bytes = pkv_partial_slot_bytes(d, sizeof(T));
    if (a->plan_out) {
        a->plan_out[0] = nthreads;
        a->plan_out[1] = hpg;
        a->plan_out[2] = nchunk;
    }
    int64_t it;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (it = 0; it < items; it++) {
        FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
        const int64_t c = it % nchunk, rest = it / nchunk;
        const int gc = (int)(rest % ngc);
        const int grp = (int)((rest / ngc) % ngroups);
        const int64_t b = rest / ((int64_t)ngc * ngroups);
        const int h0 = grp * hpg, nh = a->hkv - h0 < hpg ? a->hkv - h0 : hpg;
        const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
        const pkv_segs sg = a->segs[b];
        const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
        FN(load_queries)(a, h0, nh, b, 1, g0, ng, held - 1, sc.qbuf, sc.lim);
        /* the query token is token b of q: load_queries/store_out index tokens from t0 = b */
        KFN(attend_item)(a, b, h0, nh, sc.qbuf, ng, sc.lim, held * c / nchunk,
                        held * (c + 1) / nchunk, sc.acc, sc.m, sc.l, sc.sbuf, sc.kbuf, sc.alpha);
        if (nchunk == 1) {
            FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l);
        } else {
            char *p = (char *)a->partial + (size_t)it * slot_bytes;
            const int nq = nh * ng;
            memcpy(p, sc.m, sizeof(double) * nq);
            memcpy(p + sizeof(double) * PKV_MAX_ROWS, sc.l, sizeof(double) * nq);
            memcpy(p + 2 * sizeof(double) * PKV_MAX_ROWS, sc.acc, sizeof(T) * (size_t)nq * d);
        }
    }
    if (nchunk == 1) return;
    /* merge the key chunks of each (sequence, head group, member chunk) */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (it = 0; it < base; it++) {
        FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
        const int gc = (int)(it % ngc);
        const int grp = (int)((it / ngc) % ngroups);
        const int64_t b = it / ((int64_t)ngc * ngroups);
        const int h0 = grp * hpg, nh = a->hkv - h0 < hpg ? a->hkv - h0 : hpg;
        const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
        const int nq = nh * ng;
        for (int i = 0; i < nq; i++) {
            double mx = -INFINITY;
            for (int64_t c = 0; c < nchunk; c++) {
                const double *pm = (const double *)((char *)a->partial + (size_t)(it * nchunk + c) * slot_bytes);
                if (pm[i] > mx) mx = pm[i];
            }
            double lsum = 0.0;
            T *dst = sc.acc + (size_t)i * d;
            for (int j = 0; j < d; j++) dst[j] = 0;
            for (int64_t c = 0; c < nchunk; c++) {
                const char *p = (const char *)a->partial + (size_t)(it * nchunk + c) * slot_bytes;
                const double pm = ((const double *)p)[i];
                if (pm == -INFINITY) continue; /* empty chunk */
                const double w = exp(pm - mx);
                lsum += w * ((const double *)(p + sizeof(double) * PKV_MAX_ROWS))[i];
                const T *pa = (const T *)(p + 2 * sizeof(double) * PKV_MAX_ROWS) + (size_t)i * d;
                for (int j = 0; j < d; j++) dst[j] += (T)w * pa[j];
            }
            sc.l[i] = lsum;
        }
        FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l);
    }
}

/* Causal prefill of one sequence: a->nq query tokens are its newest held ranks.
 * Items are (kv head, member chunk, query tile); a tile of tq tokens x ng
 * members reads each key block once and skips the blocks past its last
 * query's rank (the causal mask costs no work beyond the diagonal blocks). */
static void KFN(prefill)(const pkv_attn_args *a) {
    const int gsz = a->hq / a->hkv;
    const int ng_max = gsz < PKV_MAX_ROWS ? gsz : PKV_MAX_ROWS;
    const int ngc = (gsz + ng_max - 1) / ng_max;
    const int tq = PKV_MAX_ROWS / ng_max;
    const int64_t ntile = (a->nq + tq - 1) / tq;
    const int64_t items = (int64_t)a->hkv * ngc * ntile;
    const pkv_segs sg = a->segs[0];
    const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
    const int64_t rank0 = held - a->nq;
    /* causal multiply-adds: query i sees rank0 + i + 1 keys */
    const double work = 2.0 * a->hq * a->d * (double)a->nq * ((double)rank0 + 0.5 * (a->nq + 1));
    const int nthreads = work < PKV_PARALLEL_MIN ? 1 : a->nthreads;
    if (a->plan_out) {
        a->plan_out[0] = nthreads;
        a->plan_out[1] = 1;
        a->plan_out[2] = 1;
    }
    int64_t it;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (it = 0; it < items; it++) {
        FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
        /* latest tiles (most keys) first, for balance */
        const int64_t tile = ntile - 1 - it / ((int64_t)a->hkv * ngc);
        const int h = (int)((it / ngc) % a->hkv);
        const int gc = (int)(it % ngc);
        const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
        const int64_t t0 = tile * tq;
        const int nt = (int)(a->nq - t0 < tq ? a->nq - t0 : tq);
        FN(load_queries)(a, h, 1, t0, nt, g0, ng, rank0 + t0, sc.qbuf, sc.lim);
        KFN(attend_item)(a, 0, h, 1, sc.qbuf, nt * ng, sc.lim, 0, rank0 + t0 + nt, sc.acc, sc.m,
                        sc.l, sc.sbuf, sc.kbuf, sc.alpha);
        FN(store_out)(a, h, 1, t0, nt, g0, ng, sc.acc, sc.l);
    }
}

#undef KDOT
#ifdef PKV_SCALED_DEFAULTED
#undef PKV_STORE_SCALED
#undef PKV_SCALED_DEFAULTED
#endif
