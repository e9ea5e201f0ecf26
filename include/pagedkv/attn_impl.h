/* pagedkv/attn_impl.h -- paged attention, written once over a small SIMD
 * vocabulary and instantiated by attention.h for each (dtype, instruction set).
 * No include guard on purpose.
 *
 * The includer defines:
 *   T         element type (float / double)
 *   FN(name)  name mangling, e.g. name##_f32_avx2
 *   VEC, W    vector type and its number of lanes
 *   VLOAD(p) VSTORE(p, x) VSET1(s) VZERO() VADD(a, b) VMUL(a, b)
 *   VFMA(a, b, c)  a * b + c
 *   VREDUCE(x)     horizontal sum -> T
 *
 * Layout of one layer of the pool, HND (see attention.h):
 *   block b, kv head h, slot j, dim i  ->  ((b * Hkv + h) * bs + j) * D + i
 */

/* ---- vector helpers ----------------------------------------------------- */

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

/* y = y * alpha + sum_j p[j] * x[j*d : j*d+d]  for j < n */
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
    for (int i = 0; i < half; i++) {
        const T x0 = src[i], x1 = src[i + half];
        dst[i] = x0 * c[i] - x1 * s[i];
        dst[i + half] = x1 * c[i] + x0 * s[i];
    }
    for (int i = 2 * half; i < d; i++) dst[i] = src[i];
}

/* ---- online softmax over a run of held keys -------------------------------
 * Folds keys of ranks [r, r + n) (stored contiguously at k / v) into the
 * running state (m, l, acc) of nq query rows.  Row i sees only ranks <= lim[i].
 */
static inline void FN(fold_run)(const T *restrict q, int nq, const int64_t *lim, int64_t r,
                                const T *restrict k, const T *restrict v, int n, int d,
                                T *restrict acc, double *m, double *l, T *restrict sbuf) {
    for (int i = 0; i < nq; i++) {
        const int64_t cnt64 = lim[i] - r + 1;
        if (cnt64 <= 0) continue;
        const int cnt = cnt64 < n ? (int)cnt64 : n;
        const T *qi = q + (size_t)i * d;
        T mx = -INFINITY;
        for (int j = 0; j < cnt; j++) {
            const T s = FN(dot)(qi, k + (size_t)j * d, d);
            sbuf[j] = s;
            if (s > mx) mx = s;
        }
        const double m_new = m[i] > (double)mx ? m[i] : (double)mx;
        const double alpha = m[i] == -INFINITY ? 0.0 : exp(m[i] - m_new);
        double psum = 0.0;
        for (int j = 0; j < cnt; j++) {
            const T p = (T)exp((double)sbuf[j] - m_new);
            sbuf[j] = p;
            psum += p;
        }
        l[i] = l[i] * alpha + psum;
        m[i] = m_new;
        FN(scale_axpy_n)(acc + (size_t)i * d, (T)alpha, sbuf, v, cnt, d);
    }
}

/* One work item: kv head h of one sequence against nq query rows (already
 * scaled and, with RoPE, rotated) over held ranks [0, rend). */
static void FN(attend_item)(const pkv_attn_args *a, int64_t s, int h, const T *restrict q,
                            int nq, const int64_t *lim, int64_t rend, T *restrict acc,
                            double *m, double *l, T *restrict sbuf, T *restrict kbuf) {
    const int bs = a->bs, d = a->d;
    const size_t bstride = (size_t)a->hkv * bs * d;
    const T *kb = (const T *)a->k + (size_t)h * bs * d;
    const T *vb = (const T *)a->v + (size_t)h * bs * d;
    const int32_t *table = a->tables[s];
    const pkv_segs sg = a->segs[s];
    for (int i = 0; i < nq; i++) { m[i] = -INFINITY; l[i] = 0.0; }
    memset(acc, 0, sizeof(T) * (size_t)nq * d);

    /* held ranks map to slots: [0, n0) -> [a0, a1), [n0, ...) -> [b0, b1) */
    const int64_t n0 = sg.a1 - sg.a0;
    const int64_t seg_slot[2] = {sg.a0, sg.b0};
    const int64_t seg_rank[2] = {0, n0};
    const int64_t seg_len[2] = {n0, sg.b1 - sg.b0};
    for (int sgi = 0; sgi < 2; sgi++) {
        int64_t rr = seg_rank[sgi], slot = seg_slot[sgi];
        int64_t rlast = seg_rank[sgi] + seg_len[sgi];
        if (rlast > rend) rlast = rend;
        while (rr < rlast) {
            const int64_t bi = slot / bs;
            const int off = (int)(slot - bi * bs);
            int n = bs - off;
            if (n > rlast - rr) n = (int)(rlast - rr);
            const size_t base = (size_t)table[bi] * bstride + (size_t)off * d;
            const T *kp = kb + base, *vp = vb + base;
            if (a->rope) {
                for (int j = 0; j < n; j++)
                    FN(rope_one)(kbuf + (size_t)j * d, kp + (size_t)j * d, a->rope, rr + j, d);
                kp = kbuf;
            }
            FN(fold_run)(q, nq, lim, rr, kp, vp, n, d, acc, m, l, sbuf);
            rr += n;
            slot += n;
        }
    }
}

/* Copy query rows (token t0.., heads hq0..hq0+ng) into qbuf, scaled and rotated. */
static inline void FN(load_queries)(const pkv_attn_args *a, const T *q, int64_t t0, int nt, int hq0,
                                    int ng, int64_t rank0, T *restrict qbuf, int64_t *lim) {
    const int d = a->d;
    const T sc = (T)a->scale;
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < ng; g++) {
            const int i = t * ng + g;
            const T *src = q + ((size_t)(t0 + t) * a->hq + hq0 + g) * d;
            T *dst = qbuf + (size_t)i * d;
            if (a->rope) FN(rope_one)(dst, src, a->rope, rank0 + t, d);
            else memcpy(dst, src, sizeof(T) * d);
            for (int j = 0; j < d; j++) dst[j] *= sc;
            lim[i] = rank0 + t;
        }
}

static inline void FN(store_out)(const pkv_attn_args *a, int64_t t0, int nt, int hq0, int ng,
                                 const T *acc, const double *l) {
    const int d = a->d;
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < ng; g++) {
            const int i = t * ng + g;
            T *dst = (T *)a->out + ((size_t)(t0 + t) * a->hq + hq0 + g) * d;
            const T inv = (T)(1.0 / l[i]);
            for (int j = 0; j < d; j++) dst[j] = acc[(size_t)i * d + j] * inv;
        }
}

typedef struct {
    T *qbuf, *acc, *sbuf, *kbuf;
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
    sc.sbuf = (T *)p;         p += PKV_ALIGN_UP(sizeof(T) * a->bs);
    sc.kbuf = (T *)p;
    return sc;
}

/* Batched decode: one query token per sequence, at its newest held rank. */
static void FN(decode)(const pkv_attn_args *a) {
    const int g_all = a->hq / a->hkv;
    const int ng_max = g_all < PKV_MAX_ROWS ? g_all : PKV_MAX_ROWS;
    const int nchunk = (g_all + ng_max - 1) / ng_max;
    const int64_t items = a->nseq * a->hkv * nchunk;
    int64_t it;
#pragma omp parallel for num_threads(a->nthreads) schedule(static) if (a->nthreads > 1)
    for (it = 0; it < items; it++) {
        FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
        const int64_t b = it / (a->hkv * nchunk);
        const int h = (int)((it / nchunk) % a->hkv);
        const int gc = (int)(it % nchunk);
        const int g0 = gc * ng_max;
        const int ng = g_all - g0 < ng_max ? g_all - g0 : ng_max;
        const pkv_segs sg = a->segs[b];
        const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
        FN(load_queries)(a, (const T *)a->q, b, 1, h * g_all + g0, ng, held - 1, sc.qbuf, sc.lim);
        FN(attend_item)(a, b, h, sc.qbuf, ng, sc.lim, held, sc.acc, sc.m, sc.l, sc.sbuf, sc.kbuf);
        FN(store_out)(a, b, 1, h * g_all + g0, ng, sc.acc, sc.l);
    }
}

/* Causal prefill of one sequence: a->nq query tokens are its newest held ranks. */
static void FN(prefill)(const pkv_attn_args *a) {
    const int g_all = a->hq / a->hkv;
    const int ng_max = g_all < PKV_MAX_ROWS ? g_all : PKV_MAX_ROWS;
    const int nchunk = (g_all + ng_max - 1) / ng_max;
    const int tq = PKV_MAX_ROWS / ng_max;
    const int64_t ntile = (a->nq + tq - 1) / tq;
    const int64_t items = (int64_t)a->hkv * nchunk * ntile;
    const pkv_segs sg = a->segs[0];
    const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
    const int64_t rank0 = held - a->nq;
    int64_t it;
#pragma omp parallel for num_threads(a->nthreads) schedule(dynamic, 1) if (a->nthreads > 1)
    for (it = 0; it < items; it++) {
        FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
        /* largest tiles (latest queries) first, for balance */
        const int64_t tile = ntile - 1 - it / ((int64_t)a->hkv * nchunk);
        const int h = (int)((it / nchunk) % a->hkv);
        const int gc = (int)(it % nchunk);
        const int g0 = gc * ng_max;
        const int ng = g_all - g0 < ng_max ? g_all - g0 : ng_max;
        const int64_t t0 = tile * tq;
        const int nt = (int)(a->nq - t0 < tq ? a->nq - t0 : tq);
        FN(load_queries)(a, (const T *)a->q, t0, nt, h * g_all + g0, ng, rank0 + t0, sc.qbuf, sc.lim);
        FN(attend_item)(a, 0, h, sc.qbuf, nt * ng, sc.lim, rank0 + t0 + nt, sc.acc, sc.m, sc.l,
                        sc.sbuf, sc.kbuf);
        FN(store_out)(a, t0, nt, h * g_all + g0, ng, sc.acc, sc.l);
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
