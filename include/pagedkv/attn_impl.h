/* pagedkv/attn_impl.h -- paged attention over stored K/V, written once and
 * instantiated by attention.h for each (storage type, compute type,
 * instruction set) on top of attn_math.h.  No include guard on purpose.
 *
 * The includer defines, besides attn_math.h's vocabulary:
 *   S          storage type of K/V in the pool
 *   SLOAD(p)   W stored values at p -> VEC of the compute type
 *   SGET(p)    one stored value at p -> T
 *   LDSC(p)    W float32 scales at p -> VEC of the compute type
 *   KFN(name)  name mangling per (storage, compute, ISA)
 *   CFN(name)  the same function of the instance whose storage is the
 *              compute type (keys rotated by RoPE are scored by it)
 *   PKV_STORE_SCALED  1 for int8: every loaded vector is multiplied by its
 *              group's scales (converted on load, like the other formats)
 *
 * A new storage format is a load vocabulary (SLOAD/SGET) plus an entry in
 * attention.h's instantiation list and dispatch table; nothing here changes.
 *
 * Layout (types.h): a->k / a->v point at the K / V plane of one layer in
 * block 0; each further block is a->block_stride bytes on.  K is stored
 * transposed inside a block-head ([dim][slot]), V row-major ([slot][dim]).
 *
 * ---- the micro-kernels ----------------------------------------------------
 * Scores: a register tile of R query rows x NV key vectors (W keys each, the
 * same dimension of consecutive keys, one vector load from K^T), walked
 * down the head dimension: broadcast q[r][i], one vertical multiply-add per
 * (row, key vector).  No horizontal sum anywhere.
 * P.V: a register tile of R rows x NV dimension vectors of the output,
 * walked over the keys of the tile: broadcast p[r][j], multiply-add the
 * vector of V row j.
 * Both tiles are sized so their accumulators and operands fit the
 * registers of the instruction set (PKV_SC_NV, PKV_PV_NV in attention.h).
 */

#ifndef PKV_STORE_SCALED
#define PKV_STORE_SCALED 0
#define PKV_SCALED_DEFAULTED
#endif

#if PKV_STORE_SCALED
#define PKV_KGROUP PKV_I8_GROUP
#else
#define PKV_KGROUP (1 << 30)
#endif

/* Scores of R rows x NV key vectors.  q[r] are the rows (scaled queries),
 * e[v] the key vectors (pkv_kvec: K^T at dim 0 of lane 0, int8 scales at
 * group 0 of lane 0), stride = items from one dimension to the next.  The
 * results go to out[r * NV + v]. */
#define PKV_SCORES_MK(NAME, R, NV, DS)                                                      \
    static inline void KFN(NAME)(const T *const *q, const pkv_kvec *e, size_t stride,       \
                                 int d, VEC *out, pkv_pfs *ps) {                            \
        VEC acc[DS][R][NV];                                                                 \
        const S *kp[NV];                                                                    \
        for (int v = 0; v < NV; v++) kp[v] = (const S *)e[v].k;                             \
        for (int u = 0; u < DS; u++)                                                        \
            for (int r = 0; r < R; r++)                                                     \
                for (int v = 0; v < NV; v++) acc[u][r][v] = VZERO();                        \
        PKV_PFS_BEGIN(ps)                                                                   \
        for (int i0 = 0; i0 < d; i0 += PKV_KGROUP) {                                        \
            const int i1 = d - i0 < PKV_KGROUP ? d : i0 + PKV_KGROUP;                       \
            PKV_SC_GROUP_SCALES(NV)                                                         \
            int i = i0;                                                                     \
            for (; i + DS <= i1; i += DS) {                                                 \
                PKV_PFS_STEP                                                                \
                for (int u = 0; u < DS; u++) {                                              \
                    VEC x[NV];                                                              \
                    for (int v = 0; v < NV; v++)                                            \
                        x[v] = PKV_SC_LOADK(kp[v] + (size_t)(i + u) * stride, v);           \
                    for (int r = 0; r < R; r++) {                                           \
                        const VEC qb = VSET1(q[r][i + u]);                                  \
                        for (int v = 0; v < NV; v++) acc[u][r][v] = VFMA(qb, x[v], acc[u][r][v]); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (; i < i1; i++) {                                                           \
                VEC x[NV];                                                                  \
                for (int v = 0; v < NV; v++) x[v] = PKV_SC_LOADK(kp[v] + (size_t)i * stride, v); \
                for (int r = 0; r < R; r++) {                                               \
                    const VEC qb = VSET1(q[r][i]);                                          \
                    for (int v = 0; v < NV; v++) acc[0][r][v] = VFMA(qb, x[v], acc[0][r][v]); \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        PKV_PFS_END(ps)                                                                     \
        for (int r = 0; r < R; r++)                                                         \
            for (int v = 0; v < NV; v++) {                                                  \
                VEC t = acc[0][r][v];                                                       \
                for (int u = 1; u < DS; u++) t = VADD(t, acc[u][r][v]);                     \
                out[r * NV + v] = t;                                                        \
            }                                                                               \
    }

#if PKV_STORE_SCALED
#define PKV_SC_GROUP_SCALES(NV)                                                             \
    VEC scv[NV];                                                                            \
    for (int v = 0; v < NV; v++) scv[v] = LDSC(e[v].sc + (size_t)(i0 / PKV_I8_GROUP) * stride);
#define PKV_SC_LOADK(p, v) VMUL(SLOAD(p), scv[v])
#else
#define PKV_SC_GROUP_SCALES(NV)
#define PKV_SC_LOADK(p, v) SLOAD(p)
#endif

/* register tiles: rows x key vectors, and DS independent sets of accumulators
 * over alternate dimensions where the tile alone would give fewer than 8
 * chains of multiply-adds (the FMA latency x the FMA units) */
PKV_SCORES_MK(sc_4xn, 4, PKV_SC_NV, 1)
PKV_SCORES_MK(sc_4x1, 4, 1, 2)
PKV_SCORES_MK(sc_1xn, 1, PKV_SC_NV, 2)
PKV_SCORES_MK(sc_1x1, 1, 1, 4)
#undef PKV_SC_GROUP_SCALES
#undef PKV_SC_LOADK

/* Scatter a result vector's valid lanes [lo, hi) to row s at column col. */
static inline void KFN(put_lanes)(T *restrict s, const pkv_kvec *e, VEC x) {
    if (e->lo == 0 && e->hi == W) {
        VSTORE(s + e->col, x);
    } else {
        T t[W];
        VSTORE(t, x);
        for (int l = e->lo; l < e->hi; l++) s[e->col + l] = t[l];
    }
}

/* Scores of rows[0, na) of q (one head, rows d apart) against the key
 * vectors e[0, ne) into sbuf [na][ldc].  Rows go four at a time (a last
 * group of two or three repeats its first row and drops the extra results:
 * one pass over the keys costs less than a pass per row); a single row
 * (multi-head attention decode) has its own tile. */
static inline void KFN(tile_scores)(const T *restrict q, const int *rows, int na,
                                    const pkv_kvec *e, int ne, size_t stride, int d,
                                    T *restrict sbuf, int ldc, pkv_pfs *ps) {
    VEC res[4 * PKV_SC_NV];
    if (na == 1) {
        const T *qr = q + (size_t)rows[0] * d;
        int v = 0;
        for (; v + PKV_SC_NV <= ne; v += PKV_SC_NV) {
            KFN(sc_1xn)(&qr, e + v, stride, d, res, ps);
            for (int u = 0; u < PKV_SC_NV; u++) KFN(put_lanes)(sbuf, e + v + u, res[u]);
        }
        for (; v < ne; v++) {
            KFN(sc_1x1)(&qr, e + v, stride, d, res, ps);
            KFN(put_lanes)(sbuf, e + v, res[0]);
        }
        return;
    }
    /* key vectors outer, row groups inner: the NV key vectors' K^T slices stay in
     * L1 while every group of rows reuses them (see tile_values) */
    const int ngr = (na + 3) / 4;
    const T *qr[PKV_MAX_ROWS + 4];
    for (int a = 0; a < ngr * 4; a++) /* a short last group repeats its first row */
        qr[a] = q + (size_t)rows[a < na ? a : a - a % 4] * d;
    int v = 0;
    for (; v + PKV_SC_NV <= ne; v += PKV_SC_NV)
        for (int g = 0; g < ngr; g++) {
            const int nr = na - 4 * g < 4 ? na - 4 * g : 4;
            KFN(sc_4xn)(qr + 4 * g, e + v, stride, d, res, ps);
            for (int r = 0; r < nr; r++)
                for (int u = 0; u < PKV_SC_NV; u++)
                    KFN(put_lanes)(sbuf + (size_t)(4 * g + r) * ldc, e + v + u, res[r * PKV_SC_NV + u]);
        }
    for (; v < ne; v++)
        for (int g = 0; g < ngr; g++) {
            const int nr = na - 4 * g < 4 ? na - 4 * g : 4;
            KFN(sc_4x1)(qr + 4 * g, e + v, stride, d, res, ps);
            for (int r = 0; r < nr; r++) KFN(put_lanes)(sbuf + (size_t)(4 * g + r) * ldc, e + v, res[r]);
        }
}

/* Scores of one key at a time, for blocks narrower than a vector (bs < W):
 * key slot j of K^T kt is kt[i * stride + j]. */
static inline void KFN(narrow_scores)(const T *restrict q, const int *rows, int na,
                                      const S *restrict kt, const float *restrict ksc,
                                      size_t stride, int off, int n, int col, int d,
                                      T *restrict sbuf, int ldc) {
    for (int a = 0; a < na; a++) {
        const T *qi = q + (size_t)rows[a] * d;
        for (int j = off; j < off + n; j++) {
            T s = 0;
#if PKV_STORE_SCALED
            for (int i0 = 0; i0 < d; i0 += PKV_I8_GROUP) {
                const int i1 = d - i0 < PKV_I8_GROUP ? d : i0 + PKV_I8_GROUP;
                T g = 0;
                for (int i = i0; i < i1; i++) g += qi[i] * SGET(kt + (size_t)i * stride + j);
                s += g * (T)ksc[(size_t)(i0 / PKV_I8_GROUP) * stride + j];
            }
#else
            (void)ksc;
            for (int i = 0; i < d; i++) s += qi[i] * SGET(kt + (size_t)i * stride + j);
#endif
            sbuf[(size_t)a * ldc + col + (j - off)] = s;
        }
    }
}

/* One run of a tile: n keys from slot `off` of one block-head. */
typedef struct {
    const S *k, *v;          /* K^T / V of the head in the block (slot 0) */
    const float *ksc, *vsc;  /* int8: the head's scales in the block ([group][slot]) */
    int off, n, col;         /* slots [off, off + n) -> tile columns [col, col + n) */
} KFN(run_t);

/* acc rows (one head) = acc * alpha + P . V over the tile's runs; p [na][ldc]. */
#define PKV_PV_MK(NAME, R, NV, JS)                                                          \
    static inline void KFN(NAME)(T *const *y, const T *alpha, const T *const *p,           \
                                 const KFN(run_t) *runs, int nr, size_t bs, int d, int i,   \
                                 pkv_pfs *ps) {                                             \
        VEC acc[JS][R][NV];                                                                 \
        for (int r = 0; r < R; r++) {                                                       \
            const VEC al = VSET1(alpha[r]);                                                 \
            for (int v = 0; v < NV; v++) {                                                  \
                acc[0][r][v] = VMUL(VLOAD(y[r] + i + v * W), al);                           \
                for (int u = 1; u < JS; u++) acc[u][r][v] = VZERO();                        \
            }                                                                               \
        }                                                                                   \
        PKV_PFS_BEGIN(ps)                                                                   \
        for (int ru = 0; ru < nr; ru++) {                                                   \
            const S *vr = runs[ru].v + (size_t)runs[ru].off * d + i;                        \
            const int n = runs[ru].n, col = runs[ru].col;                                   \
            PKV_PV_SCALES(NV)                                                               \
            int j = 0;                                                                      \
            for (; j + JS <= n; j += JS) {                                                  \
                PKV_PFS_STEP                                                                \
                for (int u = 0; u < JS; u++) {                                              \
                    VEC x[NV];                                                              \
                    for (int v = 0; v < NV; v++)                                            \
                        x[v] = PKV_PV_LOADV(vr + (size_t)(j + u) * d + v * W, v, j + u);    \
                    for (int r = 0; r < R; r++) {                                           \
                        const VEC pb = VSET1(p[r][col + j + u]);                            \
                        for (int v = 0; v < NV; v++) acc[u][r][v] = VFMA(pb, x[v], acc[u][r][v]); \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (; j < n; j++) {                                                            \
                VEC x[NV];                                                                  \
                for (int v = 0; v < NV; v++) x[v] = PKV_PV_LOADV(vr + (size_t)j * d + v * W, v, j); \
                for (int r = 0; r < R; r++) {                                               \
                    const VEC pb = VSET1(p[r][col + j]);                                    \
                    for (int v = 0; v < NV; v++) acc[0][r][v] = VFMA(pb, x[v], acc[0][r][v]); \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        PKV_PFS_END(ps)                                                                     \
        for (int r = 0; r < R; r++)                                                         \
            for (int v = 0; v < NV; v++) {                                                  \
                VEC t = acc[0][r][v];                                                       \
                for (int u = 1; u < JS; u++) t = VADD(t, acc[u][r][v]);                     \
                VSTORE(y[r] + i + v * W, t);                                                \
            }                                                                               \
    }

#if PKV_STORE_SCALED
/* a vector of W dimensions lies in one scale group (W divides PKV_I8_GROUP) */
#define PKV_PV_SCALES(NV)                                                                   \
    const float *vs[NV];                                                                    \
    for (int v = 0; v < NV; v++)                                                            \
        vs[v] = runs[ru].vsc + (size_t)((i + v * W) / PKV_I8_GROUP) * bs + runs[ru].off;
#define PKV_PV_LOADV(p, v, j) VMUL(SLOAD(p), VSET1((T)vs[v][j]))
#else
#define PKV_PV_SCALES(NV) (void)bs;
#define PKV_PV_LOADV(p, v, j) SLOAD(p)
#endif

PKV_PV_MK(pv_4xn, 4, PKV_PV_NV, 1)
PKV_PV_MK(pv_4x1, 4, 1, 2)
PKV_PV_MK(pv_1xn, 1, PKV_PV_NV, 2)
PKV_PV_MK(pv_1x1, 1, 1, 4)
#undef PKV_PV_SCALES
#undef PKV_PV_LOADV

/* one stored V value as T (dimension i of slot j of a run) */
static inline T KFN(vget)(const KFN(run_t) *u, int j, int i, size_t bs, int d) {
    const T x = SGET(u->v + (size_t)(u->off + j) * d + i);
#if PKV_STORE_SCALED
    return x * (T)u->vsc[(size_t)(i / PKV_I8_GROUP) * bs + u->off + j];
#else
    (void)bs;
    return x;
#endif
}

/* acc rows = acc * alpha + P . V over the tile's runs; rows as in
 * tile_scores (a short last group writes its extra rows to `spare`, d
 * values of scratch).  The dimension chunk is the outer loop and the row
 * groups the inner one, so the chunk's V slice (the tile's keys x NV
 * vectors) is reused by every group of rows while it is in L1: with the row
 * groups outer, a prefill tile (64 rows) read the whole V tile from L2 once
 * per group (AVX2, D=64: prefill 13% faster this way; the same at D=128). */
static inline void KFN(tile_values)(T *restrict acc, const int *rows, int na,
                                    const T *restrict p, int ldc, const T *restrict alpha,
                                    const KFN(run_t) *runs, int nr, size_t bs, int d,
                                    T *restrict spare, pkv_pfs *ps) {
    const int R = na == 1 ? 1 : 4, ngr = (na + R - 1) / R;
    T *y[PKV_MAX_ROWS + 4];
    const T *pr[PKV_MAX_ROWS + 4];
    T al[PKV_MAX_ROWS + 4];
    for (int a = 0; a < ngr * R; a++) {
        if (a < na) {
            y[a] = acc + (size_t)rows[a] * d;
            pr[a] = p + (size_t)a * ldc;
            al[a] = alpha[a];
        } else { /* padding rows of a short last group: results dropped */
            y[a] = spare;
            pr[a] = p + (size_t)(a - a % R) * ldc;
            al[a] = 0;
        }
    }
    if (ngr * R > na) memset(spare, 0, sizeof(T) * (size_t)d);
    int i = 0;
    if (R == 4) {
        for (; i + PKV_PV_NV * W <= d; i += PKV_PV_NV * W)
            for (int g = 0; g < ngr; g++)
                KFN(pv_4xn)(y + 4 * g, al + 4 * g, pr + 4 * g, runs, nr, bs, d, i, ps);
        for (; i + W <= d; i += W)
            for (int g = 0; g < ngr; g++)
                KFN(pv_4x1)(y + 4 * g, al + 4 * g, pr + 4 * g, runs, nr, bs, d, i, ps);
    } else {
        for (; i + PKV_PV_NV * W <= d; i += PKV_PV_NV * W)
            KFN(pv_1xn)(y, al, pr, runs, nr, bs, d, i, ps);
        for (; i + W <= d; i += W) KFN(pv_1x1)(y, al, pr, runs, nr, bs, d, i, ps);
    }
    for (; i < d; i++) /* dimensions past the last whole vector */
        for (int r = 0; r < na; r++) {
            T s = y[r][i] * al[r];
            for (int u = 0; u < nr; u++)
                for (int j = 0; j < runs[u].n; j++)
                    s += pr[r][runs[u].col + j] * KFN(vget)(runs + u, j, i, bs, d);
            y[r][i] = s;
        }
}

/* The tile's keys of one head rotated by RoPE at ranks r0 + column, into
 * kbuf [d][ks] of the compute type (ks >= the tile's keys, a multiple of W). */
static inline void KFN(rope_tile)(T *restrict kbuf, int ks, const KFN(run_t) *runs, int nr,
                                  size_t bs, int64_t r0, const pkv_rope *rope, int d) {
    const int half = rope->half;
    const int64_t mp = rope->max_pos;
    const T *ct = (const T *)rope->cos_t, *st = (const T *)rope->sin_t;
    for (int u = 0; u < nr; u++) {
        const KFN(run_t) *ru = runs + u;
        const int n = ru->n;
        for (int i = 0; i < d; i++) {
            if (i >= half && i < 2 * half) continue; /* written with their partner i - half */
            const S *x0 = ru->k + (size_t)i * bs + ru->off;
            T *y0 = kbuf + (size_t)i * ks + ru->col;
#if PKV_STORE_SCALED
            const float *s0 = ru->ksc + (size_t)(i / PKV_I8_GROUP) * bs + ru->off;
#define PKV_KX(p, sp, j) VMUL(SLOAD((p) + (j)), LDSC((sp) + (j)))
#define PKV_KXS(p, sp, j) (SGET((p) + (j)) * (T)(sp)[j])
#else
            const float *s0 = NULL;
            (void)s0;
#define PKV_KX(p, sp, j) SLOAD((p) + (j))
#define PKV_KXS(p, sp, j) SGET((p) + (j))
#endif
            if (i >= half) { /* past the rotary dimensions: copied */
                int j = 0;
                for (; j + W <= n; j += W) VSTORE(y0 + j, PKV_KX(x0, s0, j));
                for (; j < n; j++) y0[j] = PKV_KXS(x0, s0, j);
                continue;
            }
            const S *x1 = x0 + (size_t)half * bs;
            T *y1 = y0 + (size_t)half * ks;
#if PKV_STORE_SCALED
            const float *s1 = ru->ksc + (size_t)((i + half) / PKV_I8_GROUP) * bs + ru->off;
#else
            const float *s1 = NULL;
            (void)s1;
#endif
            const T *c = ct + (size_t)i * mp + r0 + ru->col;
            const T *s = st + (size_t)i * mp + r0 + ru->col;
            int j = 0;
            for (; j + W <= n; j += W) {
                const VEC a = PKV_KX(x0, s0, j), b = PKV_KX(x1, s1, j);
                const VEC cv = VLOAD(c + j), sv = VLOAD(s + j);
                VSTORE(y0 + j, VSUB(VMUL(a, cv), VMUL(b, sv)));
                VSTORE(y1 + j, VFMA(a, sv, VMUL(b, cv)));
            }
            for (; j < n; j++) {
                const T a = PKV_KXS(x0, s0, j), b = PKV_KXS(x1, s1, j);
                y0[j] = a * c[j] - b * s[j];
                y1[j] = b * c[j] + a * s[j];
            }
#undef PKV_KX
#undef PKV_KXS
        }
    }
}

/* Scores of rows[0, na) against the tile's runs (K^T rows `stride` items
 * long, stride >= W) into sh [na][ldc].  Key vectors are gathered across
 * runs so a register tile takes PKV_SC_NV of them even when a block holds
 * one vector's worth of keys. */
static inline void KFN(score_runs)(const T *restrict qh, const int *rows, int na,
                                   const KFN(run_t) *runs, int cnt, size_t stride, int d,
                                   T *restrict sh, int ldc, pkv_pfs *ps) {
    pkv_kvec ents[PKV_MAX_KVECS];
    int ne = 0;
    for (int u = 0; u < cnt; u++) {
        for (int p0 = 0; p0 < runs[u].n; p0 += PKV_TILE_KEYS) {
            const int n = runs[u].n - p0 < PKV_TILE_KEYS ? runs[u].n - p0 : PKV_TILE_KEYS;
            if (ne + PKV_TILE_KEYS / W + 1 > PKV_MAX_KVECS) {
                KFN(tile_scores)(qh, rows, na, ents, ne, stride, d, sh, ldc, ps);
                ne = 0;
            }
            ne += pkv_kvecs_of(ents + ne, runs[u].k, sizeof(S), runs[u].ksc, stride,
                               runs[u].off + p0, n, runs[u].col + p0, W);
        }
    }
    if (ne) KFN(tile_scores)(qh, rows, na, ents, ne, stride, d, sh, ldc, ps);
}

/* Softmax step of rows[0, na) (one head) over the tile's scores s [na][ldc]
 * (n columns at ranks r, r + 1, ...).  Row i sees ranks (lim[i] - window,
 * lim[i]] (window 0: [0, lim[i]]), at least one of them in this tile (the
 * caller selects the rows); softcap > 0 caps the visible scores first. */
static inline void KFN(tile_softmax)(T *restrict s, int ldc, const int *rows, int na,
                                     const int64_t *lim, int64_t r, int n, int64_t window,
                                     T softcap, double *m, double *l, T *restrict alpha) {
    for (int a = 0; a < na; a++, s += ldc) {
        const int i = rows[a];
        const int64_t c64 = lim[i] - r + 1;
        const int cnt = c64 < n ? (int)c64 : n;
        const int64_t s64 = pkv_window_lo(lim[i], window) - r;
        const int st = s64 > 0 ? (int)s64 : 0;
        T *sv = s + st;
        if (softcap > 0) FN(softcap)(sv, cnt - st, softcap);
        const T mx = FN(row_max)(sv, cnt - st);
        const double m_new = m[i] > (double)mx ? m[i] : (double)mx;
        const T al = m[i] == -INFINITY ? (T)0 : FN(sexp)((T)(m[i] - m_new));
        const double psum = FN(exp_shift)(sv, cnt - st, (T)m_new);
        for (int j = 0; j < st; j++) s[j] = 0;  /* before the window */
        for (int j = cnt; j < n; j++) s[j] = 0; /* causally masked */
        l[i] = l[i] * (double)al + psum;
        m[i] = m_new;
        alpha[a] = al;
    }
}

/* One work item: kv heads [h0, h0 + nh) of sequence s against their query
 * rows over held ranks [rbeg, rend).  Rows are laid out head-major: head hh
 * owns rows [hh * nqh, (hh + 1) * nqh) of q / acc / m / l, and row i of every
 * head sees ranks <= lim[i].
 *
 * The item's blocks (each with the run of held slots it contributes) are
 * taken a tile of PKV_TILE_KEYS keys at a time: for each head of the item,
 * scores of its rows against the tile's keys (K of the tile's blocks) and
 * one softmax step; then for each head P.V (V of the tile's blocks).  Each
 * (phase, head) is a unit of the prefetch stream (kvread.h). */
static void KFN(attend_item)(const pkv_attn_args *a, int64_t s, int h0, int nh,
                             const T *restrict q, int nqh, const int64_t *lim, int64_t rbeg,
                             int64_t rend, T *restrict acc, double *m, double *l,
                             T *restrict sbuf, T *restrict kbuf, T *restrict alpha) {
    const int bs = a->bs, d = a->d;
    const size_t hstride = (size_t)bs * d * sizeof(S); /* one head of a block */
    const size_t bstride = a->block_stride;             /* one block */
    const char *kb = (const char *)a->k + (size_t)h0 * hstride;
    const char *vb = (const char *)a->v + (size_t)h0 * hstride;
    const int32_t *table = a->tables[s];
    const pkv_segs sg = a->segs[s];
    const int nq = nh * nqh;
    const int tb = pkv_tile_blocks(bs), ldc = pkv_tile_cols(bs);
#if PKV_STORE_SCALED
    const size_t hscales = (size_t)bs * sizeof(float) * ((d + PKV_I8_GROUP - 1) / PKV_I8_GROUP);
    const char *ksc = (const char *)a->k + a->scale_offset + (size_t)h0 * hscales;
    const char *vsc = (const char *)a->v + a->scale_offset + (size_t)h0 * hscales;
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
    const int64_t nent = (bhi[0] - blo[0]) + (bhi[1] - blo[1]);
    const int64_t nent0 = bhi[0] - blo[0];
    const int ntiles = (int)((nent + tb - 1) / tb);
    int rows[PKV_MAX_ROWS];
    KFN(run_t) runs[PKV_TILE_KEYS];
    int64_t bidx[PKV_TILE_KEYS];
    /* prefetch stream of the unit after the one being read; unit
     * (tile t, phase ph (0: K, 1: V), head hh) is number (t * 2 + ph) * nh + hh */
    pkv_pfs pfs;
#define PKV_UNIT_SLICES(unit, ps)                                                          \
    do {                                                                                   \
        const int64_t t_ = (unit) / (2 * nh), ph_ = ((unit) / nh) % 2, hh_ = (unit) % nh;  \
        const int64_t e0_ = t_ * tb;                                                       \
        (ps)->n = 0;                                                                       \
        for (int64_t e_ = e0_; e_ < e0_ + tb && e_ < nent; e_++) {                         \
            const int64_t ti_ = e_ < nent0 ? blo[0] + e_ : blo[1] + (e_ - nent0);          \
            (ps)->p[(ps)->n++] = (ph_ ? vb : kb) + (size_t)table[ti_] * bstride +          \
                                 (size_t)hh_ * hstride;                                    \
        }                                                                                  \
        (ps)->len = hstride;                                                               \
        pkv_pfs_start(ps);                                                                 \
    } while (0)
    const int64_t nunits = (int64_t)ntiles * 2 * nh;
    if (PKV_PREFETCH_UNITS && nunits > 0) { /* the first unit, at once */
        PKV_UNIT_SLICES(0, &pfs);
        pkv_pfs_finish(&pfs);
    }
    int sgi = 0;
    int64_t rr = rfirst[0], slot = seg_slot[0] + (rfirst[0] - seg_rank[0]);
    for (int t = 0; t < ntiles; t++) {
        const int64_t g0 = (int64_t)t * tb;
        const int cnt = nent - g0 < tb ? (int)(nent - g0) : tb;
        int64_t tile_r0 = -1;
        int nk = 0;
        for (int u = 0; u < cnt; u++) {
            while (rr >= rlast[sgi]) { /* next segment */
                sgi++;
                rr = rfirst[sgi];
                slot = seg_slot[sgi] + (rfirst[sgi] - seg_rank[sgi]);
            }
            const int64_t bi = slot / bs;
            const int off = (int)(slot - bi * bs);
            int n = bs - off;
            if (n > rlast[sgi] - rr) n = (int)(rlast[sgi] - rr);
            if (tile_r0 < 0) tile_r0 = rr;
            bidx[u] = bi;
            runs[u].off = off;
            runs[u].n = n;
            runs[u].col = nk;
            nk += n;
            rr += n;
            slot += n;
        }
        int na = 0;
        for (int i = 0; i < nqh; i++)
            if (lim[i] >= tile_r0 && pkv_window_lo(lim[i], a->window) < tile_r0 + nk) rows[na++] = i;
        if (na == 0) continue;
#if PKV_STORE_SCALED
        if (g0 + cnt < nent) { /* the next tile's scales (the streams fetch the values) */
            for (int64_t e = g0 + cnt, e1 = e + tb < nent ? e + tb : nent; e < e1; e++) {
                const int64_t ti = e < nent0 ? blo[0] + e : blo[1] + (e - nent0);
                const size_t o = (size_t)table[ti] * bstride;
                for (size_t x = 0; x < (size_t)nh * hscales; x += 64) {
                    __builtin_prefetch(ksc + o + x, 0, 3);
                    __builtin_prefetch(vsc + o + x, 0, 3);
                }
            }
        }
#endif
        for (int ph = 0; ph < 2; ph++) {
            for (int hh = 0; hh < nh; hh++) {
                const int64_t unit = ((int64_t)t * 2 + ph) * nh + hh;
                pkv_pfs *ps = NULL;
                /* software prefetch where the hardware prefetcher does not follow:
                 * the next unit while a V unit is read (P.V walks each V slice in
                 * passes of part of a row), and the jump to the next tile's blocks.
                 * K units read K^T rows front to back, which the hardware streamer
                 * follows (prefetching them too measured no faster out of DRAM and
                 * 15-20% slower in cache; benchmarks/c/decode_ceiling.c). */
                if (PKV_PREFETCH_UNITS && unit + 1 < nunits &&
                    (ph == 1 || (unit + 1) % (2 * nh) == 0)) {
                    PKV_UNIT_SLICES(unit + 1, &pfs);
                    ps = &pfs;
                }
                for (int u = 0; u < cnt; u++) {
                    const size_t o = (size_t)table[bidx[u]] * bstride + (size_t)hh * hstride;
                    runs[u].k = (const S *)(kb + o);
                    runs[u].v = (const S *)(vb + o);
#if PKV_STORE_SCALED
                    const size_t so = (size_t)table[bidx[u]] * bstride + (size_t)hh * hscales;
                    runs[u].ksc = (const float *)(ksc + so);
                    runs[u].vsc = (const float *)(vsc + so);
#else
                    runs[u].ksc = runs[u].vsc = NULL;
#endif
                }
                T *sh = sbuf + (size_t)hh * na * ldc;
                if (ph == 0) {
                    const T *qh = q + (size_t)hh * nqh * d;
                    if (a->rope) {
                        const int ks = (nk + W - 1) / W * W;
                        KFN(rope_tile)(kbuf, ks, runs, cnt, (size_t)bs, tile_r0, a->rope, d);
                        CFN(run_t) kr;
                        kr.k = kr.v = kbuf;
                        kr.ksc = kr.vsc = NULL;
                        kr.off = kr.col = 0;
                        kr.n = nk;
                        CFN(score_runs)(qh, rows, na, &kr, 1, (size_t)ks, d, sh, ldc, ps);
                    } else if (bs >= W) {
                        KFN(score_runs)(qh, rows, na, runs, cnt, (size_t)bs, d, sh, ldc, ps);
                    } else {
                        for (int u = 0; u < cnt; u++)
                            KFN(narrow_scores)(qh, rows, na, runs[u].k, runs[u].ksc, (size_t)bs,
                                               runs[u].off, runs[u].n, runs[u].col, d, sh, ldc);
                    }
                    KFN(tile_softmax)(sh, ldc, rows, na, lim, tile_r0, nk, a->window,
                                      (T)a->softcap, m + (size_t)hh * nqh, l + (size_t)hh * nqh,
                                      alpha + hh * na);
                } else {
                    KFN(tile_values)(acc + (size_t)hh * nqh * d, rows, na, sh, ldc, alpha + hh * na,
                                     runs, cnt, (size_t)bs, d, kbuf, ps);
                }
                if (ps) pkv_pfs_finish(ps);
            }
        }
    }
#undef PKV_UNIT_SLICES
}

/* One decode work item `it` of the plan (see decode). */
static inline void KFN(decode_item)(const pkv_attn_args *a, const pkv_decode_plan *pl, int64_t it) {
    const int gsz = pl->gsz, ng_max = pl->ng_max, ngc = pl->ngc, hpg = pl->hpg;
    const int ngroups = pl->ngroups, d = a->d;
    const int64_t nchunk = pl->nchunk;
    const size_t slot_bytes = pl->slot_bytes;
    FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
    const int64_t c = it % nchunk, rest = it / nchunk;
    const int gc = (int)(rest % ngc);
    const int grp = (int)((rest / ngc) % ngroups);
    const int64_t b = rest / ((int64_t)ngc * ngroups);
    const int h0 = grp * hpg, nh = a->hkv - h0 < hpg ? a->hkv - h0 : hpg;
    const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
    const pkv_segs sg = a->segs[b];
    const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
    const int64_t lo = pkv_window_lo(held - 1, a->window), vis = held - lo;
    FN(load_queries)(a, h0, nh, b, 1, g0, ng, held - 1, sc.qbuf, sc.lim);
    /* the query token is token b of q: load_queries/store_out index tokens from t0 = b;
     * key chunks split the visible ranks [lo, held) (the window's blocks only) */
    KFN(attend_item)(a, b, h0, nh, sc.qbuf, ng, sc.lim, lo + vis * c / nchunk,
                     lo + vis * (c + 1) / nchunk, sc.acc, sc.m, sc.l, sc.sbuf, sc.kbuf, sc.alpha);
    if (nchunk == 1) {
        FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l, sc.m);
    } else {
        char *p = (char *)a->partial + (size_t)it * slot_bytes;
        const int nq = nh * ng;
        memcpy(p, sc.m, sizeof(double) * nq);
        memcpy(p + sizeof(double) * PKV_MAX_ROWS, sc.l, sizeof(double) * nq);
        memcpy(p + 2 * sizeof(double) * PKV_MAX_ROWS, sc.acc, sizeof(T) * (size_t)nq * d);
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
        work += (double)pkv_decode_visible(&a->segs[b], a->window);
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
            const int64_t h = pkv_decode_visible(&a->segs[b], a->window);
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
    const pkv_decode_plan pl = {gsz, ng_max, ngc, hpg, ngroups, nchunk, slot_bytes};
    int64_t it;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (it = 0; it < items; it++) KFN(decode_item)(a, &pl, it);
    } else { /* no OpenMP region: even with if(0) it costs ~0.4 us a call */
        for (it = 0; it < items; it++) KFN(decode_item)(a, &pl, it);
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
            sc.m[i] = mx;
        }
        FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l, sc.m);
    }
}

/* One prefill work item `it` of the plan (see prefill). */
static inline void KFN(prefill_item)(const pkv_attn_args *a, const pkv_prefill_plan *pl,
                                     int64_t it) {
    const int gsz = pl->gsz, ng_max = pl->ng_max, ngc = pl->ngc, tq = pl->tq;
    FN(scratch_t) sc = FN(scratch)(a, pkv_thread_id());
    /* latest tiles (most keys) first, for balance */
    const int64_t tile = pl->ntile - 1 - it / ((int64_t)a->hkv * ngc);
    const int h = (int)((it / ngc) % a->hkv);
    const int gc = (int)(it % ngc);
    const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
    const int64_t t0 = tile * tq;
    const int nt = (int)(a->nq - t0 < tq ? a->nq - t0 : tq);
    FN(load_queries)(a, h, 1, t0, nt, g0, ng, pl->rank0 + t0, sc.qbuf, sc.lim);
    /* from the first rank the tile's first query sees: with a window, the blocks
     * before it are never read */
    KFN(attend_item)(a, 0, h, 1, sc.qbuf, nt * ng, sc.lim, pkv_window_lo(pl->rank0 + t0, a->window),
                     pl->rank0 + t0 + nt, sc.acc, sc.m, sc.l, sc.sbuf, sc.kbuf, sc.alpha);
    FN(store_out)(a, h, 1, t0, nt, g0, ng, sc.acc, sc.l, sc.m);
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
    /* causal multiply-adds: query i sees rank0 + i + 1 keys (at most window) */
    double work = 2.0 * a->hq * a->d * (double)a->nq * ((double)rank0 + 0.5 * (a->nq + 1));
    if (a->window > 0 && work > 2.0 * a->hq * a->d * (double)a->nq * (double)a->window)
        work = 2.0 * a->hq * a->d * (double)a->nq * (double)a->window;
    const int nthreads = work < PKV_PARALLEL_MIN ? 1 : a->nthreads;
    if (a->plan_out) {
        a->plan_out[0] = nthreads;
        a->plan_out[1] = 1;
        a->plan_out[2] = 1;
    }
    const pkv_prefill_plan pl = {gsz, ng_max, ngc, tq, ntile, rank0};
    int64_t it;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (it = 0; it < items; it++) KFN(prefill_item)(a, &pl, it);
    } else { /* no OpenMP region (see decode) */
        for (it = 0; it < items; it++) KFN(prefill_item)(a, &pl, it);
    }
}

#undef PKV_KGROUP
#ifdef PKV_SCALED_DEFAULTED
#undef PKV_STORE_SCALED
#undef PKV_SCALED_DEFAULTED
#endif
