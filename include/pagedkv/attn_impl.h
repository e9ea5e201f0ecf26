/* pagedkv/attn_impl.h -- paged attention, written once over a small SIMD
 * vocabulary and instantiated by attention.h for each (dtype, instruction set).
 * No include guard on purpose.
 *
 * The includer defines:
 *   T         element type (float / double)
 *   FN(name)  name mangling, e.g. name##_f32_avx2
 *   VEC, W    vector type and its number of lanes
 *   VLOAD(p) VSTORE(p, x) VSET1(s) VZERO() VADD(a, b) VMUL(a, b)
 *   VSUB(a, b) VMAX(a, b) VMIN(a, b)
 *   VFMA(a, b, c)  a * b + c
 *   VREDUCE(x)     horizontal sum -> T
 *   VROUND(x)      round to nearest integer (as T)
 *   VSCALE2K(p, k) p * 2^k for integral k in the normal exponent range
 *   PKV_F64        1 for double, 0 for float
 *
 * Layout of one layer of the pool, HND (see attention.h):
 *   block b, kv head h, slot j, dim i  ->  ((b * Hkv + h) * bs + j) * D + i
 */

/* ---- vector helpers ----------------------------------------------------- */

/* exp(x) for the softmax: 2^k * p(r) with k = round(x / ln 2) and a Cody-Waite
 * split of ln 2; x is clamped so that 2^k stays a normal number.  f32: a
 * degree-6 minimax polynomial (~1 ulp); f64: Taylor to degree 12 (~1e-16).
 * Every path, the scalar one included, computes this same function. */
#if PKV_F64
#define PKV_EXP_LO (-708.0)
#define PKV_EXP_HI (709.0)
#define PKV_LN2_HI 6.93145751953125E-1
#define PKV_LN2_LO 1.42860682030941723212E-6
#define PKV_EXP_POLY(r, P)                                                        \
    P = VFMA(VSET1((T)(1.0 / 479001600.0)), r, VSET1((T)(1.0 / 39916800.0)));    \
    P = VFMA(P, r, VSET1((T)(1.0 / 3628800.0)));                                 \
    P = VFMA(P, r, VSET1((T)(1.0 / 362880.0)));                                  \
    P = VFMA(P, r, VSET1((T)(1.0 / 40320.0)));                                   \
    P = VFMA(P, r, VSET1((T)(1.0 / 5040.0)));                                    \
    P = VFMA(P, r, VSET1((T)(1.0 / 720.0)));                                     \
    P = VFMA(P, r, VSET1((T)(1.0 / 120.0)));                                     \
    P = VFMA(P, r, VSET1((T)(1.0 / 24.0)));                                      \
    P = VFMA(P, r, VSET1((T)(1.0 / 6.0)));                                       \
    P = VFMA(P, r, VSET1((T)0.5));                                               \
    P = VFMA(P, r, VSET1((T)1.0));                                               \
    P = VFMA(P, r, VSET1((T)1.0));
#else
#define PKV_EXP_LO (-87.0f)
#define PKV_EXP_HI (88.0f)
#define PKV_LN2_HI 0.693359375f
#define PKV_LN2_LO (-2.12194440e-4f)
#define PKV_EXP_POLY(r, P)                                                        \
    P = VFMA(VSET1(1.9875691500E-4f), r, VSET1(1.3981999507E-3f));               \
    P = VFMA(P, r, VSET1(8.3334519073E-3f));                                     \
    P = VFMA(P, r, VSET1(4.1665795894E-2f));                                     \
    P = VFMA(P, r, VSET1(1.6666665459E-1f));                                     \
    P = VFMA(P, r, VSET1(5.0000001201E-1f));                                     \
    P = VFMA(P, VMUL(r, r), VADD(r, VSET1(1.0f)));
#endif

static inline VEC FN(vexp)(VEC x) {
    x = VMAX(x, VSET1((T)PKV_EXP_LO));
    x = VMIN(x, VSET1((T)PKV_EXP_HI));
    const VEC k = VROUND(VMUL(x, VSET1((T)1.44269504088896340736)));
    VEC r = VFMA(k, VSET1((T)-PKV_LN2_HI), x);
    r = VFMA(k, VSET1((T)-PKV_LN2_LO), r);
    VEC P;
    PKV_EXP_POLY(r, P)
    return VSCALE2K(P, k);
}

/* the same function one lane at a time (vector tails) */
static inline T FN(sexp)(T x) {
    x = x < (T)PKV_EXP_LO ? (T)PKV_EXP_LO : (x > (T)PKV_EXP_HI ? (T)PKV_EXP_HI : x);
    const T k = (T)nearbyint((double)(x * (T)1.44269504088896340736));
    T r = x - k * (T)PKV_LN2_HI;
    r = r - k * (T)PKV_LN2_LO;
#if PKV_F64
    T P = (T)(1.0 / 479001600.0) * r + (T)(1.0 / 39916800.0);
    P = P * r + (T)(1.0 / 3628800.0);
    P = P * r + (T)(1.0 / 362880.0);
    P = P * r + (T)(1.0 / 40320.0);
    P = P * r + (T)(1.0 / 5040.0);
    P = P * r + (T)(1.0 / 720.0);
    P = P * r + (T)(1.0 / 120.0);
    P = P * r + (T)(1.0 / 24.0);
    P = P * r + (T)(1.0 / 6.0);
    P = P * r + (T)0.5;
    P = P * r + (T)1.0;
    P = P * r + (T)1.0;
#else
    T P = 1.9875691500E-4f * r + 1.3981999507E-3f;
    P = P * r + 8.3334519073E-3f;
    P = P * r + 4.1665795894E-2f;
    P = P * r + 1.6666665459E-1f;
    P = P * r + 5.0000001201E-1f;
    P = P * (r * r) + (r + 1.0f);
#endif
    return (T)ldexp((double)P, (int)k);
}

/* p[j] = exp(s[j] - mx) for j < n, in place; returns the sum in double. */
static inline double FN(exp_shift)(T *restrict s, int n, T mx) {
    int j = 0;
    double sum = 0.0;
    const VEC vm = VSET1(mx);
    if (n >= W) {
        VEC acc = VZERO();
        for (; j + W <= n; j += W) {
            const VEC p = FN(vexp)(VSUB(VLOAD(s + j), vm));
            VSTORE(s + j, p);
            acc = VADD(acc, p);
        }
        sum = (double)VREDUCE(acc);
    }
    for (; j < n; j++) {
        s[j] = FN(sexp)(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

static inline T FN(dot)(const T *restrict a, const T *restrict b, int d) {
    int i = 0;
    T s = 0;
    if (d >= 2 * W) {
        VEC s0 = VZERO(), s1 = VZERO();
        for (; i + 2 * W <= d; i += 2 * W) {
            s0 = VFMA(VLOAD(a + i), VLOAD(b + i), s0);
            s1 = VFMA(VLOAD(a + i + W), VLOAD(b + i + W), s1);
        }
        s = VREDUCE(VADD(s0, s1));
    }
    for (; i + W <= d; i += W) s += VREDUCE(VMUL(VLOAD(a + i), VLOAD(b + i)));
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Dot products of two keys k0, k1 with four query rows q0..q3 (8 chains):
 * each q vector is loaded once per two keys and each k vector once per four
 * rows.  out[r * 2 + j] = q_r . k_j */
static inline void FN(dot4x2)(const T *restrict q0, const T *restrict q1, const T *restrict q2,
                              const T *restrict q3, const T *restrict k0,
                              const T *restrict k1, int d, T *out) {
    int i = 0;
    T t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (d >= W) {
        VEC a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        VEC b0 = VZERO(), b1 = VZERO(), b2 = VZERO(), b3 = VZERO();
        for (; i + W <= d; i += W) {
            const VEC x = VLOAD(k0 + i), y = VLOAD(k1 + i);
            VEC qv = VLOAD(q0 + i);
            a0 = VFMA(qv, x, a0);
            b0 = VFMA(qv, y, b0);
            qv = VLOAD(q1 + i);
            a1 = VFMA(qv, x, a1);
            b1 = VFMA(qv, y, b1);
            qv = VLOAD(q2 + i);
            a2 = VFMA(qv, x, a2);
            b2 = VFMA(qv, y, b2);
            qv = VLOAD(q3 + i);
            a3 = VFMA(qv, x, a3);
            b3 = VFMA(qv, y, b3);
        }
        t[0] = VREDUCE(a0);
        t[1] = VREDUCE(b0);
        t[2] = VREDUCE(a1);
        t[3] = VREDUCE(b1);
        t[4] = VREDUCE(a2);
        t[5] = VREDUCE(b2);
        t[6] = VREDUCE(a3);
        t[7] = VREDUCE(b3);
    }
    for (; i < d; i++) {
        t[0] += q0[i] * k0[i];
        t[1] += q0[i] * k1[i];
        t[2] += q1[i] * k0[i];
        t[3] += q1[i] * k1[i];
        t[4] += q2[i] * k0[i];
        t[5] += q2[i] * k1[i];
        t[6] += q3[i] * k0[i];
        t[7] += q3[i] * k1[i];
    }
    for (int r = 0; r < 8; r++) out[r] = t[r];
}

/* y_r = y_r * alpha_r + sum_j p_r[j] * x[j]  for rows r < 4 (p_r = p + r * ps),
 * j < n; x rows are d long.  Each x vector is loaded once for four rows. */
static inline void FN(pv4)(T *restrict y, int yd, const T *restrict alpha, const T *restrict p,
                           int ps, const T *restrict x, int n, int d) {
    int i = 0;
    T *y0 = y, *y1 = y + yd, *y2 = y + 2 * (size_t)yd, *y3 = y + 3 * (size_t)yd;
    const T *p0 = p, *p1 = p + ps, *p2 = p + 2 * ps, *p3 = p + 3 * ps;
    const VEC al0 = VSET1(alpha[0]), al1 = VSET1(alpha[1]), al2 = VSET1(alpha[2]),
              al3 = VSET1(alpha[3]);
    for (; i + 2 * W <= d; i += 2 * W) {
        VEC a0 = VMUL(VLOAD(y0 + i), al0), b0 = VMUL(VLOAD(y0 + i + W), al0);
        VEC a1 = VMUL(VLOAD(y1 + i), al1), b1 = VMUL(VLOAD(y1 + i + W), al1);
        VEC a2 = VMUL(VLOAD(y2 + i), al2), b2 = VMUL(VLOAD(y2 + i + W), al2);
        VEC a3 = VMUL(VLOAD(y3 + i), al3), b3 = VMUL(VLOAD(y3 + i + W), al3);
        for (int j = 0; j < n; j++) {
            const VEC x0 = VLOAD(x + (size_t)j * d + i), x1 = VLOAD(x + (size_t)j * d + i + W);
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
            const VEC x0 = VLOAD(x + (size_t)j * d + i);
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
            const T xv = x[(size_t)j * d + i];
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
static inline void FN(scale_axpy_n)(T *restrict y, T alpha, const T *restrict p,
                                    const T *restrict x, int n, int d) {
    int i = 0;
    const VEC va = VSET1(alpha);
    for (; i + 2 * W <= d; i += 2 * W) {
        VEC y0 = VMUL(VLOAD(y + i), va), y1 = VMUL(VLOAD(y + i + W), va);
        for (int j = 0; j < n; j++) {
            const VEC pj = VSET1(p[j]);
            y0 = VFMA(pj, VLOAD(x + (size_t)j * d + i), y0);
            y1 = VFMA(pj, VLOAD(x + (size_t)j * d + i + W), y1);
        }
        VSTORE(y + i, y0);
        VSTORE(y + i + W, y1);
    }
    for (; i + W <= d; i += W) {
        VEC y0 = VMUL(VLOAD(y + i), va);
        for (int j = 0; j < n; j++) y0 = VFMA(VSET1(p[j]), VLOAD(x + (size_t)j * d + i), y0);
        VSTORE(y + i, y0);
    }
    for (; i < d; i++) {
        T acc = y[i] * alpha;
        for (int j = 0; j < n; j++) acc += p[j] * x[(size_t)j * d + i];
        y[i] = acc;
    }
}

/* Rotate-half RoPE of one vector at position pos (dims past 2*half copied). */
static inline void FN(rope_one)(T *restrict dst, const T *restrict src, const pkv_rope *rope,
                                int64_t pos, int d) {
    const int half = rope->half;
    const T *c = (const T *)rope->cos + (size_t)pos * half;
    const T *s = (const T *)rope->sin + (size_t)pos * half;
    int i = 0;
    for (; i + W <= half; i += W) {
        const VEC x0 = VLOAD(src + i), x1 = VLOAD(src + i + half);
        const VEC cv = VLOAD(c + i), sv = VLOAD(s + i);
        VSTORE(dst + i, VSUB(VMUL(x0, cv), VMUL(x1, sv)));
        VSTORE(dst + i + half, VFMA(x0, sv, VMUL(x1, cv)));
    }
    for (; i < half; i++) {
        const T x0 = src[i], x1 = src[i + half];
        dst[i] = x0 * c[i] - x1 * s[i];
        dst[i + half] = x1 * c[i] + x0 * s[i];
    }
    for (i = 2 * half; i < d; i++) dst[i] = src[i];
}

/* ---- online softmax over a run of held keys -------------------------------
 * Folds keys of ranks [r, r + n) (stored contiguously at k / v, n <= bs) into
 * the running state (m, l, acc) of nq query rows.  Row i sees only ranks
 * <= lim[i].  Scores go to sbuf [nq][n]: first all scores (each key loaded
 * once per four rows), then one vectorized exp per row, then P.V (each value
 * loaded once per four rows).
 */
static inline void FN(fold_run)(const T *restrict q, int nq, const int64_t *lim, int64_t r,
                                const T *restrict k, const T *restrict v, int n, int d,
                                T *restrict acc, double *m, double *l, T *restrict sbuf,
                                T *restrict alpha, const T *kn, const T *vn, int bs) {
    /* kn, vn: the next block's K and V of this head (NULL: none); its bs keys
     * are prefetched spread over the score loop below, a few lines per key */
    const size_t pf_bytes = sizeof(T) * (size_t)bs * d;
    const size_t pf_step = (pf_bytes / (size_t)(n > 0 ? n : 1) + 63) & ~(size_t)63;
    size_t pf = kn ? 0 : pf_bytes;
    int rows[PKV_MAX_ROWS];
    int na = 0;
    for (int i = 0; i < nq; i++)
        if (lim[i] >= r) rows[na++] = i;
    if (na == 0) return;

    int a = 0;
    for (; a + 4 <= na; a += 4) {
        const T *q0 = q + (size_t)rows[a] * d, *q1 = q + (size_t)rows[a + 1] * d;
        const T *q2 = q + (size_t)rows[a + 2] * d, *q3 = q + (size_t)rows[a + 3] * d;
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            T t[8];
            for (size_t e = pf + 2 * pf_step; pf < e && pf < pf_bytes; pf += 64) {
                __builtin_prefetch((const char *)kn + pf, 0, 3);
                __builtin_prefetch((const char *)vn + pf, 0, 3);
            }
            FN(dot4x2)(q0, q1, q2, q3, k + (size_t)j * d, k + (size_t)(j + 1) * d, d, t);
            for (int rr = 0; rr < 4; rr++) {
                sbuf[(size_t)(a + rr) * n + j] = t[2 * rr];
                sbuf[(size_t)(a + rr) * n + j + 1] = t[2 * rr + 1];
            }
        }
        for (; j < n; j++) {
            sbuf[(size_t)(a + 0) * n + j] = FN(dot)(q0, k + (size_t)j * d, d);
            sbuf[(size_t)(a + 1) * n + j] = FN(dot)(q1, k + (size_t)j * d, d);
            sbuf[(size_t)(a + 2) * n + j] = FN(dot)(q2, k + (size_t)j * d, d);
            sbuf[(size_t)(a + 3) * n + j] = FN(dot)(q3, k + (size_t)j * d, d);
        }
    }
    for (; a < na; a++) {
        const T *qi = q + (size_t)rows[a] * d;
        for (int j = 0; j < n; j++) {
            for (size_t e = pf + pf_step; pf < e && pf < pf_bytes; pf += 64) {
                __builtin_prefetch((const char *)kn + pf, 0, 3);
                __builtin_prefetch((const char *)vn + pf, 0, 3);
            }
            sbuf[(size_t)a * n + j] = FN(dot)(qi, k + (size_t)j * d, d);
        }
    }

    for (a = 0; a < na; a++) {
        const int i = rows[a];
        T *s = sbuf + (size_t)a * n;
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

    for (a = 0; a + 4 <= na; a += 4) {
        /* rows[a..a+3] are consecutive in the common case; fall back otherwise */
        if (rows[a + 3] == rows[a] + 3) {
            FN(pv4)(acc + (size_t)rows[a] * d, d, alpha + a, sbuf + (size_t)a * n, n, v, n, d);
        } else {
            for (int b = a; b < a + 4; b++)
                FN(scale_axpy_n)(acc + (size_t)rows[b] * d, alpha[b], sbuf + (size_t)b * n, v, n, d);
        }
    }
    for (; a < na; a++)
        FN(scale_axpy_n)(acc + (size_t)rows[a] * d, alpha[a], sbuf + (size_t)a * n, v, n, d);
}

/* One work item: kv heads [h0, h0 + nh) of sequence s against their query
 * rows over held ranks [rbeg, rend).  Rows are laid out head-major: head hh
 * owns rows [hh * nqh, (hh + 1) * nqh) of q / acc / m / l, and row i of every
 * head sees ranks <= lim[i].  The heads of one block are adjacent in the pool
 * (HND), so an item reads each block as one contiguous run per K and V. */
static void FN(attend_item)(const pkv_attn_args *a, int64_t s, int h0, int nh,
                            const T *restrict q, int nqh, const int64_t *lim, int64_t rbeg,
                            int64_t rend, T *restrict acc, double *m, double *l,
                            T *restrict sbuf, T *restrict kbuf, T *restrict alpha) {
    const int bs = a->bs, d = a->d;
    const size_t hstride = (size_t)bs * d;
    const size_t bstride = (size_t)a->hkv * hstride;
    const T *kb = (const T *)a->k + (size_t)h0 * hstride;
    const T *vb = (const T *)a->v + (size_t)h0 * hstride;
    const int32_t *table = a->tables[s];
    const pkv_segs sg = a->segs[s];
    const int nq = nh * nqh;
    const int64_t nblk = (sg.b1 + bs - 1) / bs;
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
    for (int sgi = 0; sgi < 2; sgi++) {
        int64_t rr = seg_rank[sgi] > rbeg ? seg_rank[sgi] : rbeg;
        const int64_t rlast = seg_end[sgi] < rend ? seg_end[sgi] : rend;
        int64_t slot = seg_slot[sgi] + (rr - seg_rank[sgi]);
        while (rr < rlast) {
            const int64_t bi = slot / bs;
            const int off = (int)(slot - bi * bs);
            int n = bs - off;
            if (n > rlast - rr) n = (int)(rlast - rr);
            const size_t base = (size_t)table[bi] * bstride + (size_t)off * d;
            /* the next block may be anywhere in the pool: fold_run asks for it
             * key by key while it computes on this one */
            for (int hh = 0; hh < nh; hh++) {
                const T *kp = kb + base + hh * hstride, *vp = vb + base + hh * hstride;
                /* prefetch the run needed next: this block's next head, or the
                 * next block's first one (measured: -10% time per key-head over
                 * prefetching the next block's same head; farther ahead, or into
                 * L2 only, made no difference on the development machine) */
                const int ahead = hh + 1;
                const int64_t pbi = bi + ahead / nh;
                const T *kn = pbi < nblk ? kb + (size_t)table[pbi] * bstride + (ahead % nh) * hstride : NULL;
                const T *vn = pbi < nblk ? vb + (size_t)table[pbi] * bstride + (ahead % nh) * hstride : NULL;
                if (a->rope) {
                    for (int j = 0; j < n; j++)
                        FN(rope_one)(kbuf + (size_t)j * d, kp + (size_t)j * d, a->rope, rr + j, d);
                    kp = kbuf;
                }
                const size_t r0 = (size_t)hh * nqh;
                FN(fold_run)(q + r0 * d, nqh, lim, rr, kp, vp, n, d, acc + r0 * d, m + r0, l + r0,
                             sbuf, alpha, kn, vn, bs);
            }
            rr += n;
            slot += n;
        }
    }
}

/* Query rows of heads [h0, h0 + nh), tokens t0 + [0, nt), group members
 * g0 + [0, ng) into qbuf (head-major, then token, then member), scaled and,
 * with RoPE, rotated to rank rank0 + t.  lim[t * ng + g] = rank0 + t. */
static inline void FN(load_queries)(const pkv_attn_args *a, int h0, int nh, int64_t t0, int nt,
                                    int g0, int ng, int64_t rank0, T *restrict qbuf,
                                    int64_t *lim) {
    const int d = a->d, gsz = a->hq / a->hkv;
    const T sc = (T)a->scale;
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const T *src = (const T *)a->q +
                               ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                T *dst = qbuf + (((size_t)hh * nt + t) * ng + g) * d;
                if (a->rope) FN(rope_one)(dst, src, a->rope, rank0 + t, d);
                else memcpy(dst, src, sizeof(T) * d);
                for (int j = 0; j < d; j++) dst[j] *= sc;
            }
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < ng; g++) lim[t * ng + g] = rank0 + t;
}

/* out rows (same layout as load_queries) = acc / l */
static inline void FN(store_out)(const pkv_attn_args *a, int h0, int nh, int64_t t0, int nt,
                                 int g0, int ng, const T *acc, const double *l) {
    const int d = a->d, gsz = a->hq / a->hkv;
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const size_t i = ((size_t)hh * nt + t) * ng + g;
                T *dst = (T *)a->out +
                         ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                const T inv = (T)(1.0 / l[i]);
                for (int j = 0; j < d; j++) dst[j] = acc[i * d + j] * inv;
            }
}

typedef struct {
    T *qbuf, *acc, *sbuf, *kbuf, *alpha;
    double *m, *l;
    int64_t *lim;
} FN(scratch_t);

static inline FN(scratch_t) FN(scratch)(const pkv_attn_args *a, int tid) {
    FN(scratch_t) sc;
    char *p = (char *)a->scratch + (size_t)tid * a->scratch_stride;
    const size_t nqd = (size_t)PKV_MAX_ROWS * a->d;
    sc.m = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.l = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.lim = (int64_t *)p;    p += sizeof(int64_t) * PKV_MAX_ROWS;
    sc.qbuf = (T *)p;         p += PKV_ALIGN_UP(sizeof(T) * nqd);
    sc.acc = (T *)p;          p += PKV_ALIGN_UP(sizeof(T) * nqd);
    sc.alpha = (T *)p;        p += PKV_ALIGN_UP(sizeof(T) * PKV_MAX_ROWS);
    sc.sbuf = (T *)p;         p += PKV_ALIGN_UP(sizeof(T) * PKV_MAX_ROWS * a->bs);
    sc.kbuf = (T *)p;
    return sc;
}

/* Batched decode: one query token per sequence, at its newest held rank.
 *
 * Work items are (sequence, head group, member chunk, key chunk).  A head
 * group is as many KV heads as fit PKV_MAX_ROWS query rows, split further
 * while there are fewer items than threads; if that is still too few (few
 * sequences, few KV heads), each sequence's keys are split into chunks whose
 * partial softmax states (m, l, acc) are merged by log-sum-exp afterwards. */
static void FN(decode)(const pkv_attn_args *a) {
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
        FN(attend_item)(a, b, h0, nh, sc.qbuf, ng, sc.lim, held * c / nchunk,
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
static void FN(prefill)(const pkv_attn_args *a) {
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
        FN(attend_item)(a, 0, h, 1, sc.qbuf, nt * ng, sc.lim, 0, rank0 + t0 + nt, sc.acc, sc.m,
                        sc.l, sc.sbuf, sc.kbuf, sc.alpha);
        FN(store_out)(a, h, 1, t0, nt, g0, ng, sc.acc, sc.l);
    }
}

/* Sum of n elements, read once front to back with four independent vector
 * accumulators: the read kernel `pagedkv bench` uses to measure the machine's
 * memory read bandwidth with the same instructions as the attention loops. */
static double FN(stream_sum)(const T *restrict p, size_t n) {
    VEC s0 = VZERO(), s1 = VZERO(), s2 = VZERO(), s3 = VZERO();
    size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
        s0 = VADD(s0, VLOAD(p + i));
        s1 = VADD(s1, VLOAD(p + i + W));
        s2 = VADD(s2, VLOAD(p + i + 2 * W));
        s3 = VADD(s3, VLOAD(p + i + 3 * W));
    }
    double s = (double)VREDUCE(VADD(VADD(s0, s1), VADD(s2, s3)));
    for (; i < n; i++) s += p[i];
    return s;
}

#undef PKV_EXP_LO
#undef PKV_EXP_HI
#undef PKV_LN2_HI
#undef PKV_LN2_LO
#undef PKV_EXP_POLY
