/* pagedkv/attn_item.h -- one work item of the attention kernels, per
 * (storage type, compute type, instruction set): kv heads of one sequence
 * against their query rows over a range of held ranks, a tile at a time
 * (attn_tile.h), with the prefetch stream of the next unit (prefetch.h).
 *
 * A template, like attn_impl.h that includes it (its vocabulary and
 * PKV_STORE_SCALED: there): no include guard.
 */

/* The only tile's weights of head hh divided by their rows' softmax sums,
 * which are final then (attend_item's out) */
static inline void PKV_KFN(scale_rows)(const pkv_attn_args *a, PKV_T *sh, int ldc, int na, int nk,
                                       const double *m, const double *l, int h0, int hh, int nqh) {
    for (int r = 0; r < na; r++)
        PKV_FN(scale_row)(sh + (size_t)r * ldc, nk,
                          PKV_FN(inv_denominator)(a, h0 + hh, r, l[hh * nqh + r], m[hh * nqh + r]));
}

/* The softmax step of head hh's rows over the tile's scores sh (and, where
 * scale, the division by the sums of attend_item's only tile) */
static inline void PKV_KFN(head_softmax)(const pkv_attn_args *a, PKV_T *sh, int ldc, const int *rows, int na,
                                         const int64_t *lim, int64_t tile_r0, int nk, double *m, double *l,
                                         PKV_T *alpha, int h0, int hh, int nqh, int scale) {
    PKV_KFN(tile_softmax)(sh, ldc, rows, na, lim, tile_r0, nk, a->window, (PKV_T)a->scale, (PKV_T)a->softcap,
                          m + (size_t)hh * nqh, l + (size_t)hh * nqh, alpha + hh * na);
    if (scale) PKV_KFN(scale_rows)(a, sh, ldc, na, nk, m, l, h0, hh, nqh);
}

/* One work item: kv heads [h0, h0 + nh) of sequence s against their query
 * rows over held ranks [rbeg, rend).  Rows are laid out head-major: head hh
 * owns rows [hh * nqh, (hh + 1) * nqh) of q / acc / m / l, and row i of every
 * head sees ranks <= lim[i].
 *
 * The item's blocks (each with the run of held slots it contributes) are
 * taken a tile of tk keys at a time (attn_args.h: PKV_DECODE_TILE_KEYS, or
 * PKV_I16_TILE_KEYS where P.V rounds the weights to int16, or
 * PKV_PREFILL_TILE_KEYS): for each head of the item,
 * scores of its rows against the tile's keys (K of the tile's blocks) and
 * one softmax step (of all heads' rows at once where every row sees the
 * whole tile); then for each head P.V (V of the tile's blocks).  Each
 * (phase, head) is a unit of the prefetch stream (prefetch.h).  pf: 0 no
 * stream (small decode calls, PKV_PF_MIN_BYTES); 1 V units prefetch the next
 * unit; 2 K units too (decode out of memory, where the stream goes into L2).
 * The stream runs only in items of fewer than PKV_PF_ROWS_MAX rows per head.
 * l1k (prefetch.h: pkv_pf_l1k): K units prefetch their own K^T rows into L1
 * as the score tile walks them, beside the stream where there is one.
 *
 * reverse: take the tiles last to first (items without the prefetch stream;
 * see prefill_item).
 *
 * out: where the item's finished rows may go (decode of whole GQA groups, no
 * key split: the output rows, or acc), or NULL.  When the item's keys make
 * one tile that every row sees, each head's softmax sums are final before
 * its P.V: the weights are divided by them and P.V writes finished rows to
 * out (no pass over acc afterwards); returns 1 then, else 0 (acc holds the
 * unnormalized rows, m and l their softmax state).  q, acc and out are not
 * restrict: q may be the caller's query array and out the output array, which
 * may be the same (attend_batch(..., out=q)); out may be acc.  Every read of
 * q (the scores of the tile's heads) comes before the first write to out
 * (their P.V). */
static int PKV_KFN(attend_item)(const pkv_attn_args *a, int64_t s, int h0, int nh,
                                const PKV_T *q, int nqh, const int64_t *lim, int64_t rbeg,
                                int64_t rend, PKV_T *acc, double *m, double *l,
                                PKV_T *restrict sbuf, PKV_T *restrict kbuf, PKV_T *restrict alpha,
                                char *restrict qdot, int pf, int l1k, int reverse, int tk,
                                PKV_T *out) {
    const int bs = a->bs, d = a->d;
    const size_t hstride = (size_t)bs * d * sizeof(PKV_S); /* one head of a block */
    const size_t bstride = a->block_stride;             /* one block */
    const char *kb = (const char *)a->k + (size_t)h0 * hstride;
    const char *vb = (const char *)a->v + (size_t)h0 * hstride;
    const int32_t *table = a->tables[s];
    const pkv_segs sg = a->segs[s];
    const int nq = nh * nqh;
    const int tb = pkv_tile_blocks(bs, tk), ldc = pkv_tile_cols(bs, tk);
#if PKV_STORE_SCALED
    const size_t hscales = (size_t)bs * sizeof(float) * ((d + PKV_I8_GROUP - 1) / PKV_I8_GROUP);
    const char *ksc = (const char *)a->k + a->scale_offset + (size_t)h0 * hscales;
    const char *vsc = (const char *)a->v + a->scale_offset + (size_t)h0 * hscales;
#endif
    /* acc is not cleared: a row's first P.V step (alpha 0) sets it without
     * reading it, and rows that no tile reaches are cleared at the end */
    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0;
    }
#if PKV_I8_DOT
    /* the rows quantized once for the integer scores (keys scored as stored) */
    PKV_KFN(qrows_t) qd = {0};
    if (pkv_dot_scores_apply(bs, a->rope != NULL, PKV_W)) PKV_KFN(quantize_rows)(q, nq, d, qdot, &qd);
#elif PKV_BF16_DOT
    /* the rows rounded to bfloat16 once for the dot-product scores */
    PKV_KFN(qrows_t) qd = {0};
    if (pkv_dot_scores_apply(bs, a->rope != NULL, PKV_W)) PKV_KFN(round_rows)(q, nq, d, qdot, &qd);
#elif PKV_BF16_AMX
    /* the rows staged once for the AMX scores, the tiles configured */
    PKV_KFN(qrows_t) qd = {q, NULL, 0};
    const int amx = pkv_dot_scores_apply(bs, a->rope != NULL, PKV_W) && nqh > PKV_AMX_MIN_ROWS;
    if (amx) {
        PKV_KFN(stage_rows)(q, nq, d, qdot, &qd);
        PKV_KFN(amx_begin)();
    }
#else
    (void)qdot;
#endif

    /* held ranks map to slots: [0, n0) -> [a0, a1), [n0, ...) -> [b0, b1) */
    const int64_t n0 = sg.a1 - sg.a0;
    const int64_t seg_slot[2] = {sg.a0, sg.b0};
    const int64_t seg_rank[2] = {0, n0};
    const int64_t seg_end[2] = {n0, n0 + sg.b1 - sg.b0};
    /* the slots each segment contributes, [slo, shi), and their blocks [blo, bhi) */
    int64_t slo[2], shi[2], blo[2], bhi[2];
    for (int sgi = 0; sgi < 2; sgi++) {
        const int64_t rfirst = seg_rank[sgi] > rbeg ? seg_rank[sgi] : rbeg;
        int64_t rlast = seg_end[sgi] < rend ? seg_end[sgi] : rend;
        if (rlast < rfirst) rlast = rfirst;
        slo[sgi] = seg_slot[sgi] + (rfirst - seg_rank[sgi]);
        shi[sgi] = seg_slot[sgi] + (rlast - seg_rank[sgi]);
        pkv_blocks_of(slo[sgi], shi[sgi], bs, &blo[sgi], &bhi[sgi]);
    }
    const int64_t nent = (bhi[0] - blo[0]) + (bhi[1] - blo[1]);
    const int64_t nent0 = bhi[0] - blo[0];
    const int ntiles = (int)((nent + tb - 1) / tb);
    if (ntiles != 1) out = NULL;
    int rows[PKV_MAX_ROWS];
    int all_rows[PKV_MAX_ROWS]; /* 0, 1, ...: every head's rows, for the joint softmax step */
    for (int i = 0; i < nq && i < PKV_MAX_ROWS; i++) all_rows[i] = i;
    PKV_KFN(run_t) runs[PKV_TILE_KEYS];
    int64_t bidx[PKV_TILE_KEYS];
    /* prefetch stream of the unit after the one being read; unit
     * (tile t, phase ph (0: K, 1: V), head hh) is number (t * 2 + ph) * nh + hh.
     * PKV_UNIT_SLICES: the slices of the unit `ahead` units after (t, ph, hh),
     * found by stepping on from there (no 64-bit division). */
    pkv_pfs pfs;
    pfs.l2 = pkv_pf_into_l2();
    const int pfk = pf > 1;
    pfs.l1k = pfk && l1k && !a->rope; /* the stream's K units walk their own rows into L1 too */
#define PKV_UNIT_SLICES(t, ph, hh, ahead, ps)                                              \
    do {                                                                                   \
        int64_t t_ = (t), k_ = (int64_t)(ph) * nh + (hh) + (ahead);                        \
        for (; k_ >= 2 * nh; k_ -= 2 * nh) t_++;                                           \
        const int ph_ = k_ >= nh;                                                          \
        const int64_t hh_ = k_ - ph_ * nh;                                                 \
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
    const int stream = PKV_PREFETCH_UNITS && pf > 0 && nqh < PKV_PF_ROWS_MAX;
    /* units the stream runs ahead: where it takes every unit (pfk), the CPU's choice */
    const int ahead = pfk ? pkv_pf_ahead() : 1;
    for (int64_t u0 = 0; stream && u0 < ahead && u0 < nunits; u0++) { /* the first ones, at once */
        PKV_UNIT_SLICES(0, 0, 0, u0, &pfs);
        pkv_pfs_finish(&pfs);
    }
    if (stream) reverse = 0; /* the stream's units run forward */
    /* l1k: K units without the stream prefetch their own rows into L1 */
    pkv_pfs pf_l1k;
    pf_l1k.n = pf_l1k.cur = 0;
    pf_l1k.len = 0;
    pf_l1k.at = pf_l1k.end = NULL;
    pf_l1k.l2 = 0;
    pf_l1k.l1k = 1;
    for (int ti = 0; ti < ntiles; ti++) {
        const int t = reverse ? ntiles - 1 - ti : ti;
        const int64_t g0 = (int64_t)t * tb;
        const int cnt = nent - g0 < tb ? (int)(nent - g0) : tb;
        int64_t tile_r0 = -1;
        int nk = 0;
        for (int u = 0; u < cnt; u++) { /* entry g0 + u: block bi, its slots [lo, hi) */
            const int64_t e = g0 + u;
            const int sg = e >= nent0;
            const int64_t bi = sg ? blo[1] + (e - nent0) : blo[0] + e;
            const int64_t lo = bi * bs > slo[sg] ? bi * bs : slo[sg];
            const int64_t hi = bi * bs + bs < shi[sg] ? bi * bs + bs : shi[sg];
            if (tile_r0 < 0) tile_r0 = seg_rank[sg] + (lo - seg_slot[sg]);
            bidx[u] = bi;
            runs[u].off = (int)(lo - bi * bs);
            runs[u].n = (int)(hi - lo);
            runs[u].col = nk;
            nk += runs[u].n;
        }
        int na = 0;
        for (int i = 0; i < nqh; i++)
            if (lim[i] >= tile_r0 && pkv_window_lo(lim[i], a->window) < tile_r0 + nk) rows[na++] = i;
        if (na < nqh) out = NULL; /* a row this tile does not reach: acc it is */
        if (na == 0) continue;
        /* joint: the softmax step of every head's rows at once, after the
         * tile's K units, where every row of the item sees the whole tile
         * (no softcap, a positive scale): the heads' rows lie one after
         * another in sbuf, alpha, m and l, so softmax_full takes them as
         * one run of nh * na rows instead of one call per head (decode of a
         * GQA group: one vector exp for the rescale factors of four heads'
         * rows instead of four, and the rows' chains side by side) */
        int joint = na == nqh && nq <= PKV_MAX_ROWS && !((PKV_T)a->softcap > 0) && (PKV_T)a->scale > 0;
        for (int r = 0; joint && r < na; r++) joint = pkv_sees_all(lim[r], a->window, tile_r0, nk);
#if PKV_STORE_SCALED
        const int tn = reverse ? t - 1 : t + 1;
        /* the next tile's scales (the streams fetch the values), in one burst
         * when the tile starts, into the cache level the stream fills: into
         * L1 they took int8 decode B=8 L=2048 from 2.76-2.80 to 2.86-2.91 ms
         * on the Zen 4 class (one thread, alternated builds, 3 rounds) */
        if (tn >= 0 && tn < ntiles) {
            for (int64_t e = (int64_t)tn * tb, e1 = e + tb < nent ? e + tb : nent; e < e1; e++) {
                const int64_t ti = e < nent0 ? blo[0] + e : blo[1] + (e - nent0);
                const size_t o = (size_t)table[ti] * bstride;
                pkv_pf_range(ksc + o, ksc + o + (size_t)nh * hscales, pfs.l2);
                pkv_pf_range(vsc + o, vsc + o + (size_t)nh * hscales, pfs.l2);
            }
        }
#endif
        for (int ph = 0; ph < 2; ph++) {
            for (int hh = 0; hh < nh; hh++) {
                const int64_t unit = ((int64_t)t * 2 + ph) * nh + hh;
                pkv_pfs *ps = NULL;
                /* software prefetch where the hardware prefetcher does not follow:
                 * the next unit (`ahead` units on) while a V unit is read (P.V
                 * walks each V slice in passes of part of a row; the tile's last
                 * V unit takes the jump to the next tile's blocks).
                 * K units read K^T rows front to back, which the hardware streamer
                 * follows; on AMD prefetching them too measured no faster out of
                 * DRAM and 15-20% slower in cache, on Intel with the stream into L2
                 * it takes f32 decode out of DRAM from 88-92% to 97% of the pattern
                 * read (pfk; benchmarks/c/decode_ceiling.c, prefetch.h). */
                if (stream && unit + ahead < nunits && (ph == 1 || pfk)) {
                    PKV_UNIT_SLICES(t, ph, hh, ahead, &pfs);
                    ps = &pfs;
                } else if (ph == 0 && l1k && stream && !a->rope) {
                    ps = &pf_l1k;
                }
                for (int u = 0; u < cnt; u++) {
                    const size_t o = (size_t)table[bidx[u]] * bstride + (size_t)hh * hstride;
                    runs[u].k = (const PKV_S *)(kb + o);
                    runs[u].v = (const PKV_S *)(vb + o);
#if PKV_STORE_SCALED
                    const size_t so = (size_t)table[bidx[u]] * bstride + (size_t)hh * hscales;
                    runs[u].ksc = (const float *)(ksc + so);
                    runs[u].vsc = (const float *)(vsc + so);
#else
                    runs[u].ksc = runs[u].vsc = NULL;
#endif
                }
#if PKV_STORE_SCALED
                /* the scales into L1 before their loads wait on L2: a K
                 * unit's own (read when its scores are summed, after its
                 * integer products), and the next V unit's (read first of
                 * all by P.V); the next tile's came into the stream's level
                 * in a burst (above).  On the Zen 4 class (avx512bf16 path)
                 * perf put about a tenth of int8 decode's time on those
                 * loads; after it, benchmarks/c/decode_ceiling i8, the two
                 * builds alternated six times, B=8 L=2048 one thread
                 * 12.8-15.4 -> 13.6-17.2 GB/s (CPU time 68-85% -> 70-90% of
                 * the pattern read's), B=2 L=4096 14.2-19.0 -> 19.0-20.0
                 * GB/s, K/V in L2 (B=1 L=227) within 2% either way. */
                if (stream) {
                    if (ph == 0 && !a->rope) /* this K unit's */
                        pkv_pf_blocks_l1(ksc + (size_t)hh * hscales, table, bidx, cnt, bstride, hscales);
                    const int vh = ph == 0 ? (hh + 1 == nh ? 0 : -1) : (hh + 1 < nh ? hh + 1 : -1);
                    if (vh >= 0) /* the next V unit's: the first after the last K unit */
                        pkv_pf_blocks_l1(vsc + (size_t)vh * hscales, table, bidx, cnt, bstride, hscales);
                }
#endif
                PKV_T *sh = sbuf + (size_t)hh * na * ldc;
                /* 16-bit K/V of a prefill tile widened once (PKV_WIDEN_ROWS) */
                const int widen = PKV_WIDENS && na >= PKV_WIDEN_ROWS;
                if (ph == 0) {
                    const PKV_T *qh = q + (size_t)hh * nqh * d;
                    if (a->rope || (widen && bs >= PKV_W && !PKV_BF16_DOT && !PKV_BF16_AMX)) {
                        /* the tile's keys in the compute type, rotated or widened */
                        const int ks = (nk + PKV_W - 1) / PKV_W * PKV_W;
                        if (a->rope) PKV_KFN(rope_tile)(kbuf, ks, runs, cnt, (size_t)bs, tile_r0, a->rope, d);
                        else PKV_KFN(widen_tile)(kbuf, ks, runs, cnt, (size_t)bs, d);
                        const PKV_CFN(run_t) kr = PKV_KFN(staged_run)(kbuf, nk);
                        PKV_CFN(score_runs)(qh, rows, na, &kr, 1, (size_t)ks, d, sh, ldc, ps);
                    } else if (bs >= PKV_W) {
#if PKV_I8_DOT || PKV_BF16_DOT
                        const PKV_KFN(qrows_t) qdh = PKV_KFN(qrows_from)(&qd, hh * nqh);
                        PKV_KFN(score_runs)(&qdh, rows, na, runs, cnt, (size_t)bs, d, sh, ldc, ps);
#elif PKV_BF16_AMX
                        const PKV_KFN(qrows_t) qdh = PKV_KFN(qrows_from)(&qd, hh * nqh, d);
                        PKV_KFN(score_runs)(&qdh, rows, na, runs, cnt, (size_t)bs, d, sh, ldc, ps);
#else
                        PKV_KFN(score_runs)(qh, rows, na, runs, cnt, (size_t)bs, d, sh, ldc, ps);
#endif
                    } else {
                        for (int u = 0; u < cnt; u++)
                            PKV_KFN(narrow_scores)(qh, rows, na, runs[u].k, runs[u].ksc, (size_t)bs,
                                               runs[u].off, runs[u].n, runs[u].col, d, sh, ldc);
                    }
                    if (!joint) PKV_KFN(head_softmax)(a, sh, ldc, rows, na, lim, tile_r0, nk, m, l, alpha,
                                                      h0, hh, nqh, out != NULL);
                } else if (widen) {
                    PKV_T *vw = kbuf + (size_t)(d + 15) / 16 * 16; /* after tile_values' spare row */
                    PKV_KFN(widen_values)(vw, runs, cnt, d);
                    const PKV_CFN(run_t) vr = PKV_KFN(staged_run)(vw, nk);
                    PKV_CFN(tile_values)((out ? out : acc) + (size_t)hh * nqh * d, rows, na, sh, ldc,
                                         alpha + hh * na, &vr, 1, (size_t)bs, d, kbuf, ps);
                } else {
                    PKV_KFN(tile_values)((out ? out : acc) + (size_t)hh * nqh * d, rows, na, sh, ldc,
                                     alpha + hh * na, runs, cnt, (size_t)bs, d, kbuf, ps);
                }
                if (ps) pkv_pfs_finish(ps);
            }
            if (ph == 0 && joint) {
                const int done = PKV_KFN(softmax_whole)(sbuf, ldc, all_rows, nq, nk, (PKV_T)a->scale, m, l, alpha);
                for (int hh = 0; hh < nh; hh++) {
                    PKV_T *sh = sbuf + (size_t)hh * na * ldc;
                    if (!done) /* a NaN or infinite score somewhere: each head on its own */
                        PKV_KFN(head_softmax)(a, sh, ldc, rows, na, lim, tile_r0, nk, m, l, alpha, h0, hh, nqh, 0);
                    if (out) PKV_KFN(scale_rows)(a, sh, ldc, na, nk, m, l, h0, hh, nqh);
                }
            }
        }
    }
#undef PKV_UNIT_SLICES
#if PKV_BF16_AMX
    if (amx) PKV_KFN(amx_end)();
#endif
    if (out) return 1;
    for (int i = 0; i < nq; i++)
        if (m[i] == -INFINITY) memset(acc + (size_t)i * d, 0, sizeof(PKV_T) * (size_t)d);
    return 0;
}
