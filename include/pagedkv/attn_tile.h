/* pagedkv/attn_tile.h -- the steps of one tile of keys, per (storage type,
 * compute type, instruction set): scores of a tile's keys, the softmax step,
 * P.V, and the keys rotated by RoPE.
 *
 * ---- the micro-kernels ----------------------------------------------------
 * Scores: a register tile of R query rows x NV key vectors (PKV_W keys each,
 * the same dimension of consecutive keys, one vector load from K^T), walked
 * down the head dimension: broadcast q[r][i], one vertical multiply-add per
 * (row, key vector).  No horizontal sum anywhere.
 * P.V: a register tile of R rows x NV dimension vectors of the output,
 * walked over the keys of the tile: broadcast p[r][j], multiply-add the
 * vector of V row j.
 * Both tiles are sized so their accumulators and operands fit the
 * registers of the instruction set (PKV_SC_NV, PKV_PV_NV: vocab_*.h).
 *
 * A template, like attn_impl.h that includes it (its vocabulary and
 * PKV_STORE_SCALED: there): no include guard.
 */

/* Items with many rows per head (prefill tiles, run without the prefetch
 * stream) take their rows six at a time where the registers allow: 24
 * accumulators, four operand vectors and a broadcast of the 32 AVX-512 / NEON
 * registers.  Each loaded key or value vector then serves 6 rows, not 4.
 * Scores of int8 keys keep 4 rows (their tile holds group sums as well). */
#define PKV_SIX_ROWS (PKV_SC_NV == 4 && !PKV_STORE_SCALED && !PKV_I8_DOT)

/* One step of a register tile, shared by both micro-kernels: NV vectors
 * x[v] = LOAD(v, k), and for each of the R rows acc[r][v] += BCAST(r, k) *
 * x[v] (a broadcast, then one vertical multiply-add per vector). */
#define PKV_MK_STEP(acc, R, NV, LOAD, BCAST, k)                                        \
    {                                                                                  \
        PKV_VEC x[NV];                                                                 \
        for (int v = 0; v < NV; v++) x[v] = LOAD(v, k);                                \
        for (int r = 0; r < R; r++) {                                                  \
            const PKV_VEC b = PKV_VSET1(BCAST(r, k));                                  \
            for (int v = 0; v < NV; v++) (acc)[r][v] = PKV_VFMA(b, x[v], (acc)[r][v]); \
        }                                                                              \
    }

/* Cache lines of the prefetch stream per step of a sweep that reads `vecs`
 * vectors of storage: as many as the step reads (prefetch.h). */
#define PKV_PF_STEP_LINES(vecs) (((vecs) * PKV_W * (int)sizeof(PKV_S) + 63) / 64)

/* The walk of a micro-kernel over its steps k .. end - 1 (k an lvalue):
 * PKV_MK_ROUND(NS) steps at a time, step u into acc[u % NS] (NS independent
 * sets of accumulators), with one prefetch step of the lines those steps
 * read; the rest one at a time into acc[0].  A round of 2 NS steps, at least
 * 4: one prefetch check per round (with K/V in L2 on AVX2, two steps a round
 * instead of one took B=1 L=32/64 from 3-10% slower than a 4-line step every
 * round to 1-3% faster), and the one-set tiles (the 4 x NV tile of a GQA
 * group, NS = 1) 4 steps a round rather than 2, which took f32 decode on
 * AVX2 (AMD Zen 4 class, alternated builds) 3-24% faster with K/V in L2 (B=1
 * L=64) and 12-64% at B=1 L=512 (docs/performance.md). */
#ifndef PKV_MK_ROUND
#define PKV_MK_ROUND(NS) ((NS) < 2 ? 4 : 2 * (NS))
#endif
/* k is a ptrdiff_t: under -fwrapv (Python's own compiler flags, which
 * setuptools passes on; setup.py now undoes it, a build with other flags
 * may not) an int index cannot be widened once for the loop, so every
 * (size_t)(k + u) * stride became a sign extension and a multiply per step
 * (objdump of avx512 float32 tile_values: 93 imul and 209 movslq with int,
 * 50 and 83 with ptrdiff_t; docs/performance-history.md has the timings). */
#define PKV_MK_SWEEP(acc, R, NV, NS, LOAD, BCAST, k, end)                                \
    for (; k + PKV_MK_ROUND(NS) <= (end); k += PKV_MK_ROUND(NS)) {                       \
        PKV_PFS_STEP(PKV_PF_STEP_LINES(PKV_MK_ROUND(NS) * (NV)))                         \
        for (int u = 0; u < PKV_MK_ROUND(NS); u++)                                       \
            PKV_MK_STEP((acc)[u % (NS)], R, NV, LOAD, BCAST, k + u)                      \
    }                                                                                    \
    for (; k < (end); k++) PKV_MK_STEP((acc)[0], R, NV, LOAD, BCAST, k)

/* The score sweep of a tile whose unit has no prefetch stream but a pkv_pfs
 * marked l1k (prefetch.h): each round also prefetches into L1 the key vectors
 * PKV_L1K_AHEAD steps on (the hardware prefetchers alone leave the tile
 * waiting on L2 and L3 for its several K^T rows at once). */
#define PKV_SC_SWEEP(acc, R, NV, NS, k, end, l1k)                                               \
    for (; k + PKV_MK_ROUND(NS) <= (end); k += PKV_MK_ROUND(NS)) {                             \
        PKV_PFS_STEP(PKV_PF_STEP_LINES(PKV_MK_ROUND(NS) * (NV)))                               \
        PKV_L1K_ROWS(l1k, kp, NV, k + PKV_L1K_AHEAD, PKV_MK_ROUND(NS), 1, stride)              \
        for (int u = 0; u < PKV_MK_ROUND(NS); u++)                                             \
            PKV_MK_STEP((acc)[u % (NS)], R, NV, PKV_SC_K, PKV_SC_Q, k + u)                     \
    }                                                                                          \
    for (; k < (end); k++) PKV_MK_STEP((acc)[0], R, NV, PKV_SC_K, PKV_SC_Q, k)

/* PUT(r, v, NV, t) for every accumulator of the tile, t = acc[0][r][v] + ...
 * + acc[NS - 1][r][v] (the sum of its NS independent sets) */
#define PKV_MK_REDUCE(acc, R, NV, NS, PUT)                                               \
    for (int r = 0; r < R; r++)                                                          \
        for (int v = 0; v < NV; v++) {                                                   \
            PKV_VEC t = (acc)[0][r][v];                                                  \
            for (int u = 1; u < (NS); u++) t = PKV_VADD(t, (acc)[u][r][v]);              \
            PUT(r, v, NV, t);                                                            \
        }

/* Scores of R rows x NV key vectors.  q[r] are the rows (scaled queries),
 * e[v] the key vectors (pkv_kvec: K^T at dim 0 of lane 0, int8 scales at
 * group 0 of lane 0), stride = items from one dimension to the next.  The
 * results go to out[r * NV + v].
 *
 * int8 keys: each scale group of dimensions is summed on its own (the key
 * values as stored, converted) and multiplied by its keys' scales once, at
 * the group's end, instead of every loaded vector being scaled: one
 * multiply per group and key vector rather than per dimension.  The group's
 * sums take a second register tile; the running totals are touched once a
 * group, so where registers run out (AVX2) they are the ones that wait in
 * L1. */
/* A query row as the score micro-kernels take it (a row handle): a pointer
 * to the row (scaled, as the compute type), or, for integer scores, the
 * row quantized (attn_dot.h) */
#if PKV_I8_DOT
#include "attn_dot.h"
#define PKV_QVEC PKV_KFN(qrows_t)
#elif PKV_BF16_DOT
#include "attn_bf16dot.h"
#define PKV_QVEC PKV_KFN(qrows_t)
#else
#define PKV_QVEC PKV_T
typedef const PKV_T *PKV_KFN(qrow_t);
/* row `row` of the head's rows q (d values apart) */
static inline PKV_KFN(qrow_t) PKV_KFN(qrow)(const PKV_T *q, int row, int d) { return q + (size_t)row * d; }
#endif

#if PKV_STORE_SCALED
#define PKV_SCORES_MK(NAME, R, NV, DS, PF)                                                         \
    static inline void PKV_KFN(NAME)(const PKV_KFN(qrow_t) *q, const pkv_kvec *e, size_t stride,   \
                                     int d, PKV_VEC *out, pkv_pfs *ps) {                           \
        PKV_VEC tot[R][NV];                                                                        \
        const PKV_S *kp[NV];                                                                       \
        for (int v = 0; v < NV; v++) kp[v] = (const PKV_S *)e[v].k;                                \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < NV; v++) tot[r][v] = PKV_VZERO();                                  \
        PKV_PFS_BEGIN(PF ? ps : NULL)                                                              \
        for (int i0 = 0; i0 < d; i0 += PKV_I8_GROUP) {                                             \
            const int i1 = d - i0 < PKV_I8_GROUP ? d : i0 + PKV_I8_GROUP;                          \
            PKV_VEC acc[DS][R][NV];                                                                \
            for (int u = 0; u < DS; u++)                                                           \
                for (int r = 0; r < R; r++)                                                        \
                    for (int v = 0; v < NV; v++) acc[u][r][v] = PKV_VZERO();                       \
            ptrdiff_t i = i0;                                                                      \
            PKV_MK_SWEEP(acc, R, NV, DS, PKV_SC_K, PKV_SC_Q, i, i1)                                \
            PKV_VEC scv[NV];                                                                       \
            for (int v = 0; v < NV; v++)                                                           \
                scv[v] = PKV_LDSC(e[v].sc + (size_t)(i0 / PKV_I8_GROUP) * stride);                 \
            PKV_MK_REDUCE(acc, R, NV, DS, PKV_SC_GROUP_PUT)                                        \
        }                                                                                          \
        PKV_PFS_END(ps)                                                                            \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < NV; v++) out[r * NV + v] = tot[r][v];                              \
    }
/* a group's sum t of row r, key vector v into the row's total */
#define PKV_SC_GROUP_PUT(r, v, nv, t) tot[r][v] = PKV_VFMA(t, scv[v], tot[r][v])
#else
#define PKV_SCORES_MK(NAME, R, NV, DS, PF)                                                         \
    static inline void PKV_KFN(NAME)(const PKV_KFN(qrow_t) *q, const pkv_kvec *e, size_t stride,   \
                                     int d, PKV_VEC *out, pkv_pfs *ps) {                           \
        PKV_VEC acc[DS][R][NV];                                                                    \
        const PKV_S *kp[NV];                                                                       \
        for (int v = 0; v < NV; v++) kp[v] = (const PKV_S *)e[v].k;                                \
        for (int u = 0; u < DS; u++)                                                               \
            for (int r = 0; r < R; r++)                                                            \
                for (int v = 0; v < NV; v++) acc[u][r][v] = PKV_VZERO();                           \
        PKV_PFS_BEGIN(PF ? ps : NULL)                                                              \
        const int l1k_ = ps != NULL && ps->l1k;                                                    \
        ptrdiff_t i = 0;                                                                           \
        PKV_SC_SWEEP(acc, R, NV, DS, i, d, l1k_)                                                   \
        PKV_PFS_END(ps)                                                                            \
        PKV_MK_REDUCE(acc, R, NV, DS, PKV_SC_PUT)                                                  \
    }
#endif
/* key vector v at dimension k (as stored, converted), query row r's value
 * there, and a row's result */
#define PKV_SC_K(v, k) PKV_SLOAD(kp[v] + (size_t)(k) * stride)
#define PKV_SC_Q(r, k) q[r][k]
#define PKV_SC_PUT(r, v, nv, t) out[r * nv + v] = t

/* The register tiles of a micro-kernel MK(NAME, R, NV, DS, PF), named
 * pfx_4xn, pfx_4x1, pfx_1xn, pfx_1x1: 4 or 1 rows x NV or 1 vectors, and DS
 * independent sets of accumulators (over alternate dimensions for scores,
 * alternate keys for P.V) where the tile alone would give fewer than 8
 * chains of multiply-adds (the FMA latency x the FMA units).  PF 0 compiles
 * the prefetch stream out: pfx_4xn_np, the 4 x NV tile for items with many
 * rows per head (PKV_PF_ROWS_MAX), whose loop is better off without the
 * stream's state in its registers. */
#define PKV_REGISTER_TILES(MK, pfx, NV) \
    MK(pfx##_4xn, 4, NV, 1, 1)          \
    MK(pfx##_4xn_np, 4, NV, 1, 0)       \
    MK(pfx##_4x1, 4, 1, 2, 1)           \
    MK(pfx##_1xn, 1, NV, 2, 1)          \
    MK(pfx##_1x1, 1, 1, 4, 1)

/* the six-row tile of prefill items, built where it is used */
#if PKV_SIX_ROWS
#define PKV_SIX_TILE(MK, pfx, NV) MK(pfx##_6xn_np, 6, NV, 1, 0)
#else
#define PKV_SIX_TILE(MK, pfx, NV)
#endif

#if PKV_I8_DOT /* the integer scores of attn_dot.h */
PKV_REGISTER_TILES(PKV_DOT_MK, sc, PKV_SC_NV)
#elif PKV_BF16_DOT /* the bfloat16 dot products of attn_bf16dot.h */
PKV_REGISTER_TILES(PKV_BDOT_MK, sc, PKV_SC_NV)
PKV_SIX_TILE(PKV_BDOT_MK, sc, PKV_SC_NV)
#else
PKV_REGISTER_TILES(PKV_SCORES_MK, sc, PKV_SC_NV)
PKV_SIX_TILE(PKV_SCORES_MK, sc, PKV_SC_NV)
#endif
#undef PKV_SCORES_MK
#undef PKV_DOT_MK
#undef PKV_DOT_STEP
#undef PKV_BDOT_MK
#undef PKV_BDOT_STEP
#undef PKV_DI
#undef PKV_DI_SET1
#undef PKV_DI_ZERO
#undef PKV_DI_ADD
#undef PKV_DI_TOF
#undef PKV_DOT4
#undef PKV_DOT_KOFF
#undef PKV_SC_GROUP_PUT
#undef PKV_SC_SWEEP
#undef PKV_SC_K
#undef PKV_SC_Q
#undef PKV_SC_PUT

/* Scatter a result vector's valid lanes [lo, hi) to row s at column col. */
static inline void PKV_KFN(put_lanes)(PKV_T *restrict s, const pkv_kvec *e, PKV_VEC x) {
    if (e->lo == 0 && e->hi == PKV_W) {
        PKV_VSTORE(s + e->col, x);
    } else {
        PKV_T t[PKV_W];
        PKV_VSTORE(t, x);
        for (int l = e->lo; l < e->hi; l++) s[e->col + l] = t[l];
    }
}

/* Rows [0, nr) of a register tile's results (res[r * PKV_SC_NV + u]: row r,
 * key vector e[u]) to s, rows ldc apart; full: every lane of the vectors is
 * a key of the tile (plain stores). */
static inline void PKV_KFN(put_tile)(PKV_T *restrict s, int ldc, const pkv_kvec *e,
                                     const PKV_VEC *res, int nr, int full) {
    if (full)
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < PKV_SC_NV; u++)
                PKV_VSTORE(s + (size_t)r * ldc + e[u].col, res[r * PKV_SC_NV + u]);
    else
        for (int r = 0; r < nr; r++)
            for (int u = 0; u < PKV_SC_NV; u++)
                PKV_KFN(put_lanes)(s + (size_t)r * ldc, e + u, res[r * PKV_SC_NV + u]);
}

/* Scores of rows[0, na) of q (one head: rows d apart, or quantized) against
 * the key vectors e[0, ne) into sbuf [na][ldc].  Rows go four at a time (a last
 * group of two or three repeats its first row and drops the extra results:
 * one pass over the keys costs less than a pass per row); a single row
 * (multi-head attention decode) has its own tile. */
#if PKV_BF16_AMX /* attn_amx.h's tile_scores scores in AMX tiles, falling back to this one */
#define PKV_TILE_SCORES_VEC tile_scores_vec
#else
#define PKV_TILE_SCORES_VEC tile_scores
#endif
static inline void PKV_KFN(PKV_TILE_SCORES_VEC)(const PKV_QVEC *restrict q, const int *rows, int na,
                                                const pkv_kvec *e, int ne, size_t stride, int d,
                                                PKV_T *restrict sbuf, int ldc, pkv_pfs *ps) {
    PKV_VEC res[6 * PKV_SC_NV];
    if (na == 1) {
        const PKV_KFN(qrow_t) qr = PKV_KFN(qrow)(q, rows[0], d);
        int v = 0;
        for (; v + PKV_SC_NV <= ne; v += PKV_SC_NV) {
            PKV_KFN(sc_1xn)(&qr, e + v, stride, d, res, ps);
            for (int u = 0; u < PKV_SC_NV; u++) PKV_KFN(put_lanes)(sbuf, e + v + u, res[u]);
        }
        for (; v < ne; v++) {
            PKV_KFN(sc_1x1)(&qr, e + v, stride, d, res, ps);
            PKV_KFN(put_lanes)(sbuf, e + v, res[0]);
        }
        return;
    }
    /* key vectors outer, row groups inner: the NV key vectors' K^T slices stay in
     * L1 while every group of rows reuses them (see tile_values) */
    const int n6 = ps == NULL && PKV_SIX_ROWS ? na / 6 : 0, b4 = 6 * n6;
    const int ngr = (na - b4 + 3) / 4;
    PKV_KFN(qrow_t) qr[PKV_MAX_ROWS + 4];
    for (int a = 0; a < b4; a++) qr[a] = PKV_KFN(qrow)(q, rows[a], d);
    for (int a = b4; a < b4 + ngr * 4; a++) /* a short last group repeats its first row */
        qr[a] = PKV_KFN(qrow)(q, rows[a < na ? a : a - (a - b4) % 4], d);
    int v = 0;
    for (; v + PKV_SC_NV <= ne; v += PKV_SC_NV) {
        int full = 1; /* every lane of the NV vectors is a key of the tile */
        for (int u = 0; u < PKV_SC_NV; u++) full &= e[v + u].lo == 0 && e[v + u].hi == PKV_W;
#if PKV_SIX_ROWS
        for (int g = 0; g < n6; g++) {
            PKV_KFN(sc_6xn_np)(qr + 6 * g, e + v, stride, d, res, ps);
            PKV_KFN(put_tile)(sbuf + (size_t)(6 * g) * ldc, ldc, e + v, res, 6, full);
        }
#endif
        for (int g = 0; g < ngr; g++) {
            const int a0 = b4 + 4 * g, nr = na - a0 < 4 ? na - a0 : 4;
            if (ps && ps->n > 0) PKV_KFN(sc_4xn)(qr + a0, e + v, stride, d, res, ps); /* a stream */
            else PKV_KFN(sc_4xn_np)(qr + a0, e + v, stride, d, res, ps);
            PKV_KFN(put_tile)(sbuf + (size_t)a0 * ldc, ldc, e + v, res, nr, full);
        }
    }
    for (; v < ne; v++)
        for (int a0 = 0; a0 < na; a0 += 4) {
            const int nr = na - a0 < 4 ? na - a0 : 4;
            PKV_KFN(qrow_t) q4[4];
            for (int r = 0; r < 4; r++) q4[r] = qr[r < nr ? a0 + r : a0];
            PKV_KFN(sc_4x1)(q4, e + v, stride, d, res, ps);
            for (int r = 0; r < nr; r++) PKV_KFN(put_lanes)(sbuf + (size_t)(a0 + r) * ldc, e + v, res[r]);
        }
}

#undef PKV_TILE_SCORES_VEC

/* The query rows as tile_scores takes them (through score_runs): as the
 * vector kernels take them, or staged for AMX tiles (attn_amx.h) */
#if PKV_BF16_AMX
#include "attn_amx.h"
#define PKV_QROWS PKV_KFN(qrows_t)
#else
#define PKV_QROWS PKV_QVEC
#endif

/* Scores of one key at a time, for blocks narrower than a vector (bs < PKV_W):
 * key slot j of K^T kt is kt[i * stride + j]. */
static inline void PKV_KFN(narrow_scores)(const PKV_T *restrict q, const int *rows, int na,
                                          const PKV_S *restrict kt, const float *restrict ksc,
                                          size_t stride, int off, int n, int col, int d,
                                          PKV_T *restrict sbuf, int ldc) {
    for (int a = 0; a < na; a++) {
        const PKV_T *qi = q + (size_t)rows[a] * d;
        for (int j = off; j < off + n; j++) {
            PKV_T s = 0;
#if PKV_STORE_SCALED
            for (int i0 = 0; i0 < d; i0 += PKV_I8_GROUP) {
                const int i1 = d - i0 < PKV_I8_GROUP ? d : i0 + PKV_I8_GROUP;
                PKV_T g = 0;
                for (int i = i0; i < i1; i++) g += qi[i] * PKV_SGET(kt + (size_t)i * stride + j);
                s += g * (PKV_T)ksc[(size_t)(i0 / PKV_I8_GROUP) * stride + j];
            }
#else
            (void)ksc;
            for (int i = 0; i < d; i++) s += qi[i] * PKV_SGET(kt + (size_t)i * stride + j);
#endif
            sbuf[(size_t)a * ldc + col + (j - off)] = s;
        }
    }
}

/* One run of a tile: n keys from slot `off` of one block-head. */
typedef struct {
    const PKV_S *k, *v;     /* K^T / V of the head in the block (slot 0) */
    const float *ksc, *vsc; /* int8: the head's scales in the block ([group][slot]) */
    int off, n, col;        /* slots [off, off + n) -> tile columns [col, col + n) */
} PKV_KFN(run_t);

/* int8 V: where a micro-kernel's NV vectors of dimensions lie in one scale
 * group, tile_values folds the values' scales of that group into the
 * weights (fold_weights) and the micro-kernels take the values as stored,
 * converted: the tile's rows x keys multiplies per group instead of one per
 * loaded vector.  A wider chunk (AVX-512 float32: 4 x 16 dimensions, two
 * groups) scales each loaded vector by its key's scale. */
#if PKV_STORE_SCALED && PKV_PV_NV * PKV_W <= PKV_I8_GROUP
#define PKV_PV_FOLD 1
#else
#define PKV_PV_FOLD 0
#endif

/* acc rows (one head) = acc * alpha + P . V over the tile's runs; p [na][ldc]
 * (with PKV_PV_FOLD, the weights times the chunk's group of V scales).  A row
 * whose alpha is 0 is at its first tile: its acc is set, never read (it is
 * not cleared before; tile_softmax's alpha is never 0 after a first tile).
 * Paired (PKV_PV_PAIRED: storage with a PKV_SLOAD_PAIR, an even NV), vectors
 * v and v + 1 of the tile hold the even and the odd dimensions of their 2W
 * values, split from acc on entry and merged back on exit. */
#ifdef PKV_SLOAD_PAIR
#define PKV_PV_PAIRED(NV) ((NV) % 2 == 0)
#else
#define PKV_PV_PAIRED(NV) 0
#endif
#define PKV_PV_MK(NAME, R, NV, JS, PF)                                                             \
    static inline void PKV_KFN(NAME)(PKV_T *const *y, const PKV_T *alpha, const PKV_T *const *p,   \
                                     const PKV_KFN(run_t) *runs, int nr, size_t bs, int d, int i,  \
                                     pkv_pfs *ps) {                                                \
        const int pair_ = PKV_PV_PAIRED(NV);                                                       \
        PKV_VEC acc[JS][R][NV];                                                                    \
        for (int r = 0; r < R; r++) {                                                              \
            const PKV_VEC al = PKV_VSET1(alpha[r]);                                                \
            for (int v = 0; v < NV; v++) {                                                         \
                acc[0][r][v] = alpha[r] == 0 ? PKV_VZERO()                                         \
                                             : PKV_VMUL(PKV_VLOAD(y[r] + i + v * PKV_W), al);      \
                for (int u = 1; u < JS; u++) acc[u][r][v] = PKV_VZERO();                           \
            }                                                                                      \
            if (pair_) { PKV_PV_SPLIT(acc[0][r], NV) }                                             \
        }                                                                                          \
        PKV_PFS_BEGIN(PF ? ps : NULL)                                                              \
        for (int ru = 0; ru < nr; ru++) {                                                          \
            const PKV_S *vr = runs[ru].v + (size_t)runs[ru].off * d + i;                           \
            const int n = runs[ru].n, col = runs[ru].col;                                          \
            PKV_PV_SCALES(NV)                                                                      \
            ptrdiff_t j = 0;                                                                       \
            PKV_MK_SWEEP(acc, R, NV, JS, PKV_PV_V, PKV_PV_P, j, n)                                 \
        }                                                                                          \
        PKV_PFS_END(ps)                                                                            \
        PKV_VEC fin[R][NV];                                                                        \
        PKV_MK_REDUCE(acc, R, NV, JS, PKV_PV_FIN)                                                  \
        for (int r = 0; r < R; r++) {                                                              \
            if (pair_) { PKV_PV_MERGE(fin[r], NV) }                                                \
            for (int v = 0; v < NV; v++) PKV_VSTORE(y[r] + i + v * PKV_W, fin[r][v]);              \
        }                                                                                          \
    }
/* output vector v of V row k of the run (paired: the even or odd dimensions
 * of the pair v / 2), row r's weight of that key, and a finished vector */
#define PKV_PV_P(r, k) p[r][col + k]
#define PKV_PV_FIN(r, v, nv, t) fin[r][v] = t
#ifdef PKV_SLOAD_PAIR
#define PKV_PV_V(v, k)                                                                  \
    (pair_ ? PKV_SLOAD_PAIR(vr + (size_t)(k) * d + ((v) & ~1) * PKV_W, (v) & 1)          \
           : PKV_PV_LOADV(vr + (size_t)(k) * d + v * PKV_W, v, k))
/* x[0, NV) as consecutive values -> pairs of (even, odd) dimensions, and back */
#define PKV_PV_SPLIT(x, NV)                                                                       \
    for (int v = 0; v + 1 < NV; v += 2) {                                                         \
        const PKV_VEC lo_ = (x)[v], hi_ = (x)[v + 1];                                             \
        (x)[v] = PKV_VEVEN(lo_, hi_);                                                             \
        (x)[v + 1] = PKV_VODD(lo_, hi_);                                                          \
    }
#define PKV_PV_MERGE(x, NV)                                                                       \
    for (int v = 0; v + 1 < NV; v += 2) {                                                         \
        const PKV_VEC e_ = (x)[v], o_ = (x)[v + 1];                                               \
        (x)[v] = PKV_VILO(e_, o_);                                                                \
        (x)[v + 1] = PKV_VIHI(e_, o_);                                                            \
    }
#else
#define PKV_PV_V(v, k) PKV_PV_LOADV(vr + (size_t)(k) * d + v * PKV_W, v, k)
#define PKV_PV_SPLIT(x, NV)
#define PKV_PV_MERGE(x, NV)
#endif

#if PKV_STORE_SCALED && !PKV_PV_FOLD
/* a vector of PKV_W dimensions lies in one scale group (PKV_W divides PKV_I8_GROUP) */
#define PKV_PV_SCALES(NV)                                                                   \
    const float *vs[NV];                                                                    \
    for (int v = 0; v < NV; v++)                                                            \
        vs[v] = runs[ru].vsc + (size_t)((i + v * PKV_W) / PKV_I8_GROUP) * bs + runs[ru].off;
#define PKV_PV_LOADV(p, v, j) PKV_VMUL(PKV_SLOAD(p), PKV_VSET1((PKV_T)vs[v][j]))
#else
#define PKV_PV_SCALES(NV) (void)bs;
#define PKV_PV_LOADV(p, v, j) PKV_SLOAD(p)
#endif

PKV_REGISTER_TILES(PKV_PV_MK, pv, PKV_PV_NV)
PKV_SIX_TILE(PKV_PV_MK, pv, PKV_PV_NV)
#undef PKV_SIX_TILE
#undef PKV_PV_SCALES
#undef PKV_PV_LOADV
#undef PKV_PV_V
#undef PKV_PV_P
#undef PKV_PV_FIN
#undef PKV_PV_PAIRED
#undef PKV_PV_SPLIT
#undef PKV_PV_MERGE

/* one stored V value as PKV_T (dimension i of slot j of a run) */
static inline PKV_T PKV_KFN(vget)(const PKV_KFN(run_t) *u, int j, int i, size_t bs, int d) {
    const PKV_T x = PKV_SGET(u->v + (size_t)(u->off + j) * d + i);
#if PKV_STORE_SCALED
    return x * (PKV_T)u->vsc[(size_t)(i / PKV_I8_GROUP) * bs + u->off + j];
#else
    (void)bs;
    return x;
#endif
}

/* y[i0, i1) of one row = y * alpha + P . V, one value at a time (p: the
 * row's weights by tile column) */
static inline void PKV_KFN(values_scalar)(PKV_T *y, PKV_T alpha, const PKV_T *p,
                                          const PKV_KFN(run_t) *runs, int nr, size_t bs, int d,
                                          int i0, int i1) {
    for (int i = i0; i < i1; i++) {
        PKV_T s = alpha == 0 ? 0 : y[i] * alpha;
        for (int u = 0; u < nr; u++)
            for (int j = 0; j < runs[u].n; j++) s += p[runs[u].col + j] * PKV_KFN(vget)(runs + u, j, i, bs, d);
        y[i] = s;
    }
}

#if PKV_I8_DOT /* P.V of int8 values on vpdpwssd (AVX-512 + VNNI) */
#include "attn_pvdot.h"
#else
#define PKV_PVI 0
#endif

#if PKV_PV_FOLD
/* f [row][ldc] = the weights of rows pr[0, nrows) times the V scales of
 * group g of each key of the runs */
static inline void PKV_KFN(fold_weights)(PKV_T *restrict f, int ldc, const PKV_T *const *pr, int nrows,
                                         const PKV_KFN(run_t) *runs, int nr, size_t bs, int g) {
    for (int u = 0; u < nr; u++) {
        const float *sc = runs[u].vsc + (size_t)g * bs + runs[u].off;
        const int n = runs[u].n, col = runs[u].col;
        for (int a = 0; a < nrows; a++) {
            const PKV_T *restrict src = pr[a] + col;
            PKV_T *restrict dst = f + (size_t)a * ldc + col;
            for (int j = 0; j < n; j++) dst[j] = src[j] * (PKV_T)sc[j];
        }
    }
}
#endif

/* acc rows = acc * alpha + P . V over the tile's runs; rows as in
 * tile_scores.  `work` is scratch (pkv_scratch_bytes): a short last group
 * writes its extra rows to its first d values; with PKV_PV_FOLD the folded
 * weights follow ([rows][ldc]).  The dimension chunk is the outer loop and the row
 * groups the inner one, so the chunk's V slice (the tile's keys x NV
 * vectors) is reused by every group of rows while it is in L1: with the row
 * groups outer, a prefill tile (64 rows) read the whole V tile from L2 once
 * per group (AVX2, D=64: prefill 13% faster this way; the same at D=128). */
static inline void PKV_KFN(tile_values)(PKV_T *restrict acc, const int *rows, int na,
                                        const PKV_T *restrict p, int ldc, const PKV_T *restrict alpha,
                                        const PKV_KFN(run_t) *runs, int nr, size_t bs, int d,
                                        PKV_T *restrict work, pkv_pfs *ps) {
    const int R = na == 1 ? 1 : 4, ngr = (na + R - 1) / R;
    PKV_T *spare = work;
    PKV_T *y[PKV_MAX_ROWS + 4];
    const PKV_T *pr[PKV_MAX_ROWS + 4];
    PKV_T al[PKV_MAX_ROWS + 4];
    const int npad = na == 1 ? 1 : na + 3; /* rows and padding of any grouping */
    for (int a = 0; a < npad; a++) {
        if (a < na) {
            y[a] = acc + (size_t)rows[a] * d;
            pr[a] = p + (size_t)a * ldc;
            al[a] = alpha[a];
        } else { /* padding rows of a short last group: results dropped */
            y[a] = spare;
            pr[a] = p;
            al[a] = 0;
        }
    }
#if PKV_PV_FOLD
    /* pw: the weights the micro-kernels take, folded with the V scales of
     * group fg (refolded when a chunk starts a new group) */
    PKV_T *fold = work + (d + 15) / 16 * 16;
    const PKV_T *pw[PKV_MAX_ROWS + 4];
    for (int a = 0; a < ngr * R; a++) pw[a] = fold + (size_t)a * ldc;
    int fg = -1;
#define PKV_PV_WEIGHTS(i)                                                          \
    if ((i) / PKV_I8_GROUP != fg) {                                               \
        fg = (i) / PKV_I8_GROUP;                                                   \
        PKV_KFN(fold_weights)(fold, ldc, pr, ngr * R, runs, nr, bs, fg);           \
    }
#else
    const PKV_T *const *pw = pr;
#define PKV_PV_WEIGHTS(i)
#endif
    int i = 0;
#if PKV_PVI
    if (R == 4 && pkv_pv_int16()) i = PKV_KFN(values_i16)(y, al, pr, ngr, runs, nr, bs, d, ps);
#endif
    if (R == 4) {
        for (; i + PKV_PV_NV * PKV_W <= d; i += PKV_PV_NV * PKV_W) {
            PKV_PV_WEIGHTS(i)
            if (ps)
                for (int g = 0; g < ngr; g++)
                    PKV_KFN(pv_4xn)(y + 4 * g, al + 4 * g, pw + 4 * g, runs, nr, bs, d, i, ps);
            else {
                int b4 = 0; /* rows six at a time, the rest four at a time */
#if PKV_SIX_ROWS
                for (; b4 + 6 <= na; b4 += 6)
                    PKV_KFN(pv_6xn_np)(y + b4, al + b4, pw + b4, runs, nr, bs, d, i, ps);
#endif
                for (int a0 = b4; a0 < na; a0 += 4)
                    PKV_KFN(pv_4xn_np)(y + a0, al + a0, pw + a0, runs, nr, bs, d, i, ps);
            }
        }
        for (; i + PKV_W <= d; i += PKV_W) {
            PKV_PV_WEIGHTS(i)
            for (int g = 0; g < ngr; g++)
                PKV_KFN(pv_4x1)(y + 4 * g, al + 4 * g, pw + 4 * g, runs, nr, bs, d, i, ps);
        }
    } else {
        for (; i + PKV_PV_NV * PKV_W <= d; i += PKV_PV_NV * PKV_W) {
            PKV_PV_WEIGHTS(i)
            PKV_KFN(pv_1xn)(y, al, pw, runs, nr, bs, d, i, ps);
        }
        for (; i + PKV_W <= d; i += PKV_W) {
            PKV_PV_WEIGHTS(i)
            PKV_KFN(pv_1x1)(y, al, pw, runs, nr, bs, d, i, ps);
        }
    }
#undef PKV_PV_WEIGHTS
    for (int r = 0; i < d && r < na; r++) /* dimensions past the last whole vector */
        PKV_KFN(values_scalar)(y[r], al[r], pr[r], runs, nr, bs, d, i, d);
}

/* Keys per tile of decode, and of prefill where it takes decode's tile
 * (attn_calls.h: prefill_tile_keys): PKV_I16_TILE_KEYS (attn_args.h) where
 * P.V of int8 values rounds the weights to int16 (values_i16), else
 * PKV_DECODE_TILE_KEYS.  values_i16 does per tile and head what the float
 * path does not: the rows' and the value scales' maxima, the weights
 * rounded into int16, the int32 sums converted and scaled; perf put more
 * than half of int8 decode's time in values_i16 with K/V in L2, and there
 * its inner loop only about half of that (benchmarks/c/overlap_probe.c i8:
 * that loop's instructions alone keep up with the read).  On an Intel Xeon
 * (Emerald Rapids class, avx512vnni), 128 keys against 64, builds
 * alternated three times: decode_ceiling i8, B=1 L=455 (K/V in L2)
 * 51.0-52.8 -> 48.8-51.1 ms a round, B=8 L=2048 42.8-44.0 -> 40.9-41.3 ms
 * (one thread), 22.9-23.5 -> 21.9-22.2 ms (two); causal prefill over int8
 * storage through Python (medians of 5-15 calls), L=2048 209-211 -> 197-199
 * ms (one thread), 112-113 -> 103 ms (two), L=512 14.9-15.9 -> 14.1-14.2 ms.
 * The other storages' decode, 128 keys against 64, measured no faster
 * (float32 slower, attn_args.h). */
static inline int PKV_KFN(tile_keys)(void) {
#if PKV_PVI
    if (pkv_pv_int16()) return PKV_I16_TILE_KEYS;
#endif
    return PKV_DECODE_TILE_KEYS;
}

/* The tile's keys of one head rotated by RoPE at ranks r0 + column, into
 * kbuf [d][ks] of the compute type (ks >= the tile's keys, a multiple of PKV_W). */
static inline void PKV_KFN(rope_tile)(PKV_T *restrict kbuf, int ks, const PKV_KFN(run_t) *runs, int nr,
                                      size_t bs, int64_t r0, const pkv_rope *rope, int d) {
    const int half = rope->half;
    const int64_t mp = rope->max_pos;
    const PKV_T *ct = (const PKV_T *)rope->cos_t, *st = (const PKV_T *)rope->sin_t;
    for (int u = 0; u < nr; u++) {
        const PKV_KFN(run_t) *ru = runs + u;
        const int n = ru->n;
        for (int i = 0; i < d; i++) {
            if (i >= half && i < 2 * half) continue; /* written with their partner i - half */
            const PKV_S *x0 = ru->k + (size_t)i * bs + ru->off;
            PKV_T *y0 = kbuf + (size_t)i * ks + ru->col;
#if PKV_STORE_SCALED
            const float *s0 = ru->ksc + (size_t)(i / PKV_I8_GROUP) * bs + ru->off;
#define PKV_KX(p, sp, j) PKV_VMUL(PKV_SLOAD((p) + (j)), PKV_LDSC((sp) + (j)))
#define PKV_KXS(p, sp, j) (PKV_SGET((p) + (j)) * (PKV_T)(sp)[j])
#else
            const float *s0 = NULL;
            (void)s0;
#define PKV_KX(p, sp, j) PKV_SLOAD((p) + (j))
#define PKV_KXS(p, sp, j) PKV_SGET((p) + (j))
#endif
            if (i >= half) { /* past the rotary dimensions: copied */
                int j = 0;
                for (; j + PKV_W <= n; j += PKV_W) PKV_VSTORE(y0 + j, PKV_KX(x0, s0, j));
                for (; j < n; j++) y0[j] = PKV_KXS(x0, s0, j);
                continue;
            }
            const PKV_S *x1 = x0 + (size_t)half * bs;
            PKV_T *y1 = y0 + (size_t)half * ks;
#if PKV_STORE_SCALED
            const float *s1 = ru->ksc + (size_t)((i + half) / PKV_I8_GROUP) * bs + ru->off;
#else
            const float *s1 = NULL;
            (void)s1;
#endif
            const PKV_T *c = ct + (size_t)i * mp + r0 + ru->col;
            const PKV_T *s = st + (size_t)i * mp + r0 + ru->col;
            int j = 0;
            for (; j + PKV_W <= n; j += PKV_W) {
                const PKV_VEC a = PKV_KX(x0, s0, j), b = PKV_KX(x1, s1, j);
                const PKV_VEC cv = PKV_VLOAD(c + j), sv = PKV_VLOAD(s + j);
                PKV_VSTORE(y0 + j, PKV_VSUB(PKV_VMUL(a, cv), PKV_VMUL(b, sv)));
                PKV_VSTORE(y1 + j, PKV_VFMA(a, sv, PKV_VMUL(b, cv)));
            }
            for (; j < n; j++) {
                const PKV_T a = PKV_KXS(x0, s0, j), b = PKV_KXS(x1, s1, j);
                y0[j] = a * c[j] - b * s[j];
                y1[j] = b * c[j] + a * s[j];
            }
#undef PKV_KX
#undef PKV_KXS
        }
    }
}

/* One run over n keys staged in the compute type by rope_tile, widen_tile
 * (K^T rows ks apart) or widen_values (V rows d apart), as the compute
 * type's kernels take it. */
static inline PKV_CFN(run_t) PKV_KFN(staged_run)(const PKV_T *buf, int n) {
    PKV_CFN(run_t) r;
    r.k = r.v = buf;
    r.ksc = r.vsc = NULL;
    r.off = r.col = 0;
    r.n = n;
    return r;
}

/* Whether widen_tile and widen_values serve this instance: bfloat16 and
 * float16 storage (attn_item.h; undefined again by attn_impl.h) */
#if !defined(PKV_STORE_NATIVE) && !PKV_STORE_SCALED
#define PKV_WIDENS 1
#else
#define PKV_WIDENS 0
#endif

/* The tile's keys of one head widened to the compute type, into kbuf [d][ks]
 * (rope_tile without the rotation).  Items with many query rows (prefill)
 * then score them, and multiply-add the values widened by widen_values,
 * with the compute type's kernels: each stored value is converted once per
 * item and tile instead of once per group of rows. */
static inline void PKV_KFN(widen_tile)(PKV_T *restrict kbuf, int ks, const PKV_KFN(run_t) *runs, int nr,
                                       size_t bs, int d) {
    for (int u = 0; u < nr; u++) {
        const PKV_KFN(run_t) *ru = runs + u;
        const int n = ru->n;
        for (int i = 0; i < d; i++) {
            const PKV_S *x = ru->k + (size_t)i * bs + ru->off;
            PKV_T *y = kbuf + (size_t)i * ks + ru->col;
            int j = 0;
            for (; j + PKV_W <= n; j += PKV_W) PKV_VSTORE(y + j, PKV_SLOAD(x + j));
            for (; j < n; j++) y[j] = PKV_SGET(x + j);
        }
    }
}

/* ... and their values, into vbuf [keys][d] (row col + k: the run's key k) */
static inline void PKV_KFN(widen_values)(PKV_T *restrict vbuf, const PKV_KFN(run_t) *runs, int nr, int d) {
    for (int u = 0; u < nr; u++) {
        const PKV_KFN(run_t) *ru = runs + u;
        const PKV_S *x = ru->v + (size_t)ru->off * d;
        PKV_T *y = vbuf + (size_t)ru->col * d;
        const size_t n = (size_t)ru->n * d; /* the run's rows are contiguous */
        size_t j = 0;
        for (; j + PKV_W <= n; j += PKV_W) PKV_VSTORE(y + j, PKV_SLOAD(x + j));
        for (; j < n; j++) y[j] = PKV_SGET(x + j);
    }
}

/* Scores of rows[0, na) against the tile's runs (K^T rows `stride` items
 * long, stride >= PKV_W) into sh [na][ldc].  Key vectors are gathered across
 * runs so a register tile takes PKV_SC_NV of them even when a block holds
 * one vector's worth of keys.  qh: the head's query rows (quantized for
 * integer scores). */
static inline void PKV_KFN(score_runs)(const PKV_QROWS *restrict qh, const int *rows, int na,
                                       const PKV_KFN(run_t) *runs, int cnt, size_t stride, int d,
                                       PKV_T *restrict sh, int ldc, pkv_pfs *ps) {
    pkv_kvec ents[PKV_MAX_KVECS];
    int ne = 0;
    for (int u = 0; u < cnt; u++) {
        for (int p0 = 0; p0 < runs[u].n; p0 += PKV_TILE_KEYS) {
            const int n = runs[u].n - p0 < PKV_TILE_KEYS ? runs[u].n - p0 : PKV_TILE_KEYS;
            if (ne + PKV_TILE_KEYS / PKV_W + 1 > PKV_MAX_KVECS) {
                PKV_KFN(tile_scores)(qh, rows, na, ents, ne, stride, d, sh, ldc, ps);
                ne = 0;
            }
            ne += pkv_kvecs_of(ents + ne, runs[u].k, sizeof(PKV_S), runs[u].ksc, stride,
                               runs[u].off + p0, n, runs[u].col + p0, PKV_W);
        }
    }
    if (ne) PKV_KFN(tile_scores)(qh, rows, na, ents, ne, stride, d, sh, ldc, ps);
}

/* The softmax step of a tile whose rows all see its n columns, the scale c > 0
 * applied inside the exp (no softcap): most tiles (in prefill all but those at
 * a row's causal or window edge).  The same arithmetic as tile_softmax below without
 * its per-row bounds; the running maxima (float32 values in m where the compute
 * type is float32) compared in the compute type.  Returns 0, having changed
 * nothing, when a row's largest score is NaN or +inf (tile_softmax's case). */
static inline int PKV_KFN(softmax_full)(PKV_T *restrict s, int ldc, const int *rows, int na, int n,
                                        PKV_T c, double *m, double *l, PKV_T *restrict alpha) {
    PKV_T mnew[PKV_MAX_ROWS], ea[PKV_MAX_ROWS];
    /* whole: the columns are whole vectors (n is a constant for whole tiles,
     * so this folds).  Then one horizontal max a row, and for all rows at once
     * one sum of x - x (0 for a finite score, NaN for a NaN or an infinity):
     * row_max's own check takes a second horizontal reduction per row.  An
     * infinite score, -inf included, goes to tile_softmax's path, which tells
     * them apart. */
    const int whole = n % PKV_W == 0;
    PKV_VEC vz = PKV_VZERO();
    int nan = 0;
    for (int a = 0; a < na; a++) {
        const PKV_T *sa = s + (size_t)a * ldc;
        PKV_T mx;
        if (whole) {
            PKV_VEC vm = PKV_VLOAD(sa), z = PKV_VSUB(vm, vm);
            for (int j = PKV_W; j < n; j += PKV_W) {
                const PKV_VEC x = PKV_VLOAD(sa + j);
                vm = PKV_VMAX(vm, x);
                z = PKV_VADD(z, PKV_VSUB(x, x));
            }
            vz = PKV_VADD(vz, z);
            mx = PKV_VHMAX(vm) * c;
        } else {
            mx = PKV_FN(row_max)(sa, n) * c;
            nan |= !(mx < (PKV_T)INFINITY); /* NaN or +inf: tile_softmax's case */
        }
        const PKV_T mo = (PKV_T)m[rows[a]];
        mnew[a] = mo > mx ? mo : mx;
        ea[a] = mo - mnew[a]; /* -inf at a row's first tile: its alpha is 0 below */
    }
    if (whole) {
        const PKV_T z = PKV_VREDUCE(vz);
        nan = z != z;
    }
    if (nan) return 0;
    const PKV_T c2 = c * (PKV_T)PKV_LOG2E;
    PKV_FN(exp_inplace)(ea, na);
    for (int a = 0; a < na; a++) {
        const double psum = PKV_FN(exp2_shift)(s + (size_t)a * ldc, n, c2, mnew[a] * (PKV_T)PKV_LOG2E);
        const int i = rows[a];
        const PKV_T al = m[i] == -INFINITY ? (PKV_T)0 : ea[a];
        l[i] = l[i] * (double)al + psum;
        m[i] = (double)mnew[a];
        alpha[a] = al;
    }
    return 1;
}

/* softmax_full with a whole tile's n as a constant (fixed trip counts once inlined) */
static inline int PKV_KFN(softmax_whole)(PKV_T *restrict s, int ldc, const int *rows, int na, int n,
                                         PKV_T c, double *m, double *l, PKV_T *restrict alpha) {
    return n == PKV_DECODE_TILE_KEYS    ? PKV_KFN(softmax_full)(s, ldc, rows, na, PKV_DECODE_TILE_KEYS, c, m, l, alpha)
           : n == PKV_PREFILL_TILE_KEYS ? PKV_KFN(softmax_full)(s, ldc, rows, na, PKV_PREFILL_TILE_KEYS, c, m, l, alpha)
                                        : PKV_KFN(softmax_full)(s, ldc, rows, na, n, c, m, l, alpha);
}

/* Softmax step of rows[0, na) (one head) over the tile's scores s [na][ldc]
 * (n columns at ranks r, r + 1, ...), query . key not yet multiplied by the
 * softmax scale.  Row i sees ranks (lim[i] - window, lim[i]] (window 0:
 * [0, lim[i]]), at least one of them in this tile (the caller selects the
 * rows); softcap > 0 caps the visible scaled scores first.  A positive scale
 * goes into the exp's argument (the max of the scaled scores is the scale
 * times the max: rounding is monotone); otherwise the scores are scaled in
 * place first.  A row that sees a NaN score (a NaN in a key, in any column;
 * a NaN or infinite query value makes every score of its head NaN) or a
 * +inf one gets NaN weights and sums, so its output is NaN on every path, as
 * the softmax in exact arithmetic gives (the exp's clamp alone would turn a
 * NaN score into a tiny weight and drop it).  A tile that every row sees
 * whole goes to softmax_full. */
static inline void PKV_KFN(tile_softmax)(PKV_T *restrict s, int ldc, const int *rows, int na,
                                         const int64_t *lim, int64_t r, int n, int64_t window,
                                         PKV_T scale, PKV_T softcap, double *m, double *l,
                                         PKV_T *restrict alpha) {
    const int prescale = softcap > 0 || !(scale > 0);
    const PKV_T c = prescale ? (PKV_T)1 : scale; /* the scale still to apply */
    if (!prescale) {
        int full = 1; /* every row sees every column */
        for (int a = 0; a < na; a++) full &= pkv_sees_all(lim[rows[a]], window, r, n);
        if (full && PKV_KFN(softmax_whole)(s, ldc, rows, na, n, c, m, l, alpha)) return;
    }
    /* in three passes over the rows, so that no row waits on another's scalar
     * chains: each row's visible columns [st, cnt) and new running max, the
     * rescale factors of all rows as vector exps, then the weights and sums */
    int st[PKV_MAX_ROWS], cnt[PKV_MAX_ROWS];
    double mnew[PKV_MAX_ROWS];
    PKV_T ea[PKV_MAX_ROWS]; /* exponents of the rescale factors, then the factors */
    PKV_T *sa = s;
    for (int a = 0; a < na; a++, sa += ldc) {
        const int i = rows[a];
        const int64_t c64 = lim[i] - r + 1;
        cnt[a] = c64 < n ? (int)c64 : n;
        const int64_t s64 = pkv_window_lo(lim[i], window) - r;
        st[a] = s64 > 0 ? (int)s64 : 0;
        PKV_T *sv = sa + st[a];
        PKV_T mx = 0; /* NaN when a score is NaN before the cap (then kept) */
        if (prescale) {
            PKV_FN(scale_row)(sv, cnt[a] - st[a], scale);
            if (softcap > 0) { /* the cap would turn a NaN score into -softcap */
                mx = PKV_FN(row_max)(sv, cnt[a] - st[a]);
                PKV_FN(softcap)(sv, cnt[a] - st[a], softcap);
            }
        }
        if (mx == mx) mx = PKV_FN(row_max)(sv, cnt[a] - st[a]) * c;
        if (!(mx < (PKV_T)INFINITY)) { /* a NaN or +inf score: a NaN row on every path */
            for (int j = 0; j < n; j++) sa[j] = (PKV_T)NAN;
            alpha[a] = m[i] == -INFINITY ? 0 : 1; /* acc becomes NaN either way */
            if (m[i] == -INFINITY) m[i] = 0;       /* finite, so later tiles' alpha keeps acc */
            l[i] = NAN;
            cnt[a] = -1; /* done */
            ea[a] = 0;
            continue;
        }
        mnew[a] = m[i] > (double)mx ? m[i] : (double)mx;
        ea[a] = m[i] == -INFINITY ? (PKV_T)0 : (PKV_T)(m[i] - mnew[a]);
    }
    PKV_FN(exp_inplace)(ea, na);
    const PKV_T c2 = c * (PKV_T)PKV_LOG2E;
    sa = s;
    for (int a = 0; a < na; a++, sa += ldc) {
        if (cnt[a] < 0) continue;
        const int i = rows[a];
        const PKV_T al = m[i] == -INFINITY ? (PKV_T)0 : ea[a]; /* 0: the row's first tile */
        const double psum = PKV_FN(exp2_shift)(sa + st[a], cnt[a] - st[a], c2, (PKV_T)mnew[a] * (PKV_T)PKV_LOG2E);
        for (int j = 0; j < st[a]; j++) sa[j] = 0;  /* before the window */
        for (int j = cnt[a]; j < n; j++) sa[j] = 0; /* causally masked */
        l[i] = l[i] * (double)al + psum;
        m[i] = mnew[a];
        alpha[a] = al;
    }
}
#undef PKV_PV_FOLD
#undef PKV_PVI
#undef PKV_QROWS
#undef PKV_QVEC
#undef PKV_SIX_ROWS
