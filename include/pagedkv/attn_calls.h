/* pagedkv/attn_calls.h -- the entry points of the attention kernels, per
 * (storage type, compute type, instruction set): decode (one query per
 * sequence) and prefill (the newest ranks of one sequence), each split into
 * work items (attn_item.h) over threads; decode merges split-K partials.
 *
 * A template, like attn_impl.h that includes it (its vocabulary and
 * PKV_STORE_SCALED: there): no include guard.
 */

/* One decode work item `it` of the plan (see decode). */
static inline void PKV_KFN(decode_item)(const pkv_attn_args *a, const pkv_decode_plan *pl, int64_t it) {
    const int gsz = pl->gsz, ng_max = pl->ng_max, ngc = pl->ngc, hpg = pl->hpg;
    const int ngroups = pl->ngroups, d = a->d;
    const int64_t nchunk = pl->nchunk;
    const size_t slot_bytes = pl->slot_bytes;
    PKV_FN(scratch_t) sc = PKV_FN(scratch)(a, pkv_thread_id());
    const int64_t c = it % nchunk, rest = it / nchunk;
    const int gc = (int)(rest % ngc);
    const int grp = (int)((rest / ngc) % ngroups);
    const int64_t b = rest / ((int64_t)ngc * ngroups);
    const int h0 = grp * hpg, nh = a->hkv - h0 < hpg ? a->hkv - h0 : hpg;
    const int g0 = gc * ng_max, ng = gsz - g0 < ng_max ? gsz - g0 : ng_max;
    const pkv_segs sg = a->segs[b];
    const int64_t held = (sg.a1 - sg.a0) + (sg.b1 - sg.b0);
    const int64_t lo = pkv_window_lo(held - 1, a->window), vis = held - lo;
    /* the query token is token b of q: load_queries/store_out index tokens from t0 = b;
     * key chunks split the visible ranks [lo, held) (the window's blocks only) */
    const PKV_T *qrows = PKV_FN(load_queries)(a, h0, nh, b, 1, g0, ng, held - 1, sc.qbuf, sc.lim);
    /* where P.V may write the finished rows (attend_item): the output, or acc
     * for 16-bit outputs (rounded from there: the same float32 values) */
    PKV_T *orows = NULL;
    if (nchunk == 1 && ng == gsz)
        orows = a->qo16 ? sc.acc : (PKV_T *)a->out + ((size_t)b * a->hq + (size_t)h0 * gsz) * d;
    const int done = PKV_KFN(attend_item)(a, b, h0, nh, qrows, ng, sc.lim, lo + vis * c / nchunk,
                                          lo + vis * (c + 1) / nchunk, sc.acc, sc.m, sc.l, sc.sbuf,
                                          sc.kbuf, sc.alpha, sc.qdot, pl->pf, pl->l1k, 0,
                                          PKV_KFN(tile_keys)(), orows);
    if (done) {
        if (a->qo16) PKV_FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, NULL, NULL);
    } else if (nchunk == 1) {
        PKV_FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l, sc.m);
    } else {
        char *p = (char *)a->partial + (size_t)it * slot_bytes;
        const int nq = nh * ng;
        memcpy(p, sc.m, sizeof(double) * nq);
        memcpy(p + sizeof(double) * PKV_MAX_ROWS, sc.l, sizeof(double) * nq);
        memcpy(p + 2 * sizeof(double) * PKV_MAX_ROWS, sc.acc, sizeof(PKV_T) * (size_t)nq * d);
    }
}

/* Batched decode: one query token per sequence, at its newest held rank.
 *
 * Work items are (sequence, head group, member chunk, key chunk).  A head
 * group is as many KV heads as fit PKV_MAX_ROWS query rows.  With fewer items
 * than threads (on 8 or more, than two a thread; few sequences), each
 * sequence's keys are split into chunks whose partial softmax states (m, l,
 * acc) are merged by log-sum-exp afterwards; only where the keys are too few
 * for that are the head groups split too.  Key chunks first: an item then
 * reads the whole K and V planes of its blocks (one contiguous run each per
 * block and layer), where a head split gives each item a part of every
 * plane.  Measured (AMD EPYC Zen 3, AVX2, 2 threads, B=1, Hq=16 Hkv=4 D=64, a
 * 4-layer pool, inside a model's decode): attention 15-20% faster than heads
 * first. */
static void PKV_KFN(decode)(const pkv_attn_args *a) {
    const int gsz = a->hq / a->hkv, d = a->d;
    double work = 0.0; /* multiply-adds */
    for (int64_t b = 0; b < a->nseq; b++)
        work += (double)pkv_decode_visible(&a->segs[b], a->window);
    work *= 2.0 * a->hq * d;
    /* bytes of K+V the call reads: work / (2 * hq) visible keys per kv head and dimension */
    const double kv_bytes = work / a->hq * a->hkv * sizeof(PKV_S);
#if defined(PKV_TAG_AVX2) && defined(PKV_STORE_NATIVE)
    /* an AVX-512 instance over storage of its compute type: big calls run the
     * AVX2 kernels where the CPU reads memory faster with them (prefetch.h) */
    if (pkv_decode_on_avx2(kv_bytes)) {
        PKV_CFN_AT(decode, PKV_TAG_AVX2)(a);
        return;
    }
#endif
    int nthreads = work < PKV_PARALLEL_MIN ? 1 : a->nthreads;
    if (nthreads > 1 && kv_bytes < PKV_PASSIVE_PARALLEL_MIN_BYTES && pkv_omp_passive()) nthreads = 1;
    const int ng_max = gsz < PKV_MAX_ROWS ? gsz : PKV_MAX_ROWS;
    const int ngc = (gsz + ng_max - 1) / ng_max;
    int hpg = PKV_MAX_ROWS / ng_max;
    if (hpg > a->hkv) hpg = a->hkv;
    int64_t held_min = -1; /* the shortest visible keys, read once a split is in question */
    const int64_t want = pkv_decode_items_wanted(nthreads);
    int64_t base, nchunk;
    for (;;) {
        base = a->nseq * ((a->hkv + hpg - 1) / hpg) * ngc;
        if (base < want && held_min < 0) {
            held_min = INT64_MAX;
            for (int64_t b = 0; b < a->nseq; b++) {
                const int64_t h = pkv_decode_visible(&a->segs[b], a->window);
                if (h < held_min) held_min = h;
            }
        }
        nchunk = pkv_decode_chunks(base, want, a->partial_slots, held_min);
        if (hpg == 1 || base * nchunk >= nthreads) break;
        hpg = (hpg + 1) / 2; /* keys too few to split: smaller head groups too */
    }
    const int ngroups = (a->hkv + hpg - 1) / hpg;
    const int64_t items = base * nchunk;
    const size_t slot_bytes = pkv_partial_slot_bytes(d, sizeof(PKV_T));
    if (a->plan_out) {
        a->plan_out[0] = nthreads;
        a->plan_out[1] = hpg;
        a->plan_out[2] = nchunk;
    }
    /* the items' prefetch stream (attend_item's pf): none in small calls, K units too in big ones */
    const int pf = kv_bytes < PKV_PF_MIN_BYTES                             ? 0
                   : pkv_pf_into_l2() && kv_bytes >= PKV_PF_K_MIN_BYTES ? 2
                                                                          : 1;
    const int l1k = kv_bytes >= PKV_L1K_MIN_BYTES && pkv_pf_l1k();
    const pkv_decode_plan pl = {gsz, ng_max, ngc, hpg, ngroups, nchunk, slot_bytes, pf, l1k};
    int64_t it;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (it = 0; it < items; it++) PKV_KFN(decode_item)(a, &pl, it);
    } else { /* no OpenMP region: even with if(0) it costs ~0.4 us a call */
        for (it = 0; it < items; it++) PKV_KFN(decode_item)(a, &pl, it);
    }
    if (nchunk == 1) return;
    /* merge the key chunks of each (sequence, head group, member chunk); fewer
     * groups than threads merge on this one: a second parallel region costs a
     * wake-up of the workers, which with OMP_WAIT_POLICY=passive made B=1 L=512
     * (2 threads, Intel Xeon) 187 us against 125 us merged here */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && base >= nthreads)
    for (it = 0; it < base; it++) {
        PKV_FN(scratch_t) sc = PKV_FN(scratch)(a, pkv_thread_id());
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
            PKV_T *dst = sc.acc + (size_t)i * d;
            for (int j = 0; j < d; j++) dst[j] = 0;
            for (int64_t c = 0; c < nchunk; c++) {
                const char *p = (const char *)a->partial + (size_t)(it * nchunk + c) * slot_bytes;
                const double pm = ((const double *)p)[i];
                if (pm == -INFINITY) continue; /* empty chunk */
                const double w = exp(pm - mx);
                lsum += w * ((const double *)(p + sizeof(double) * PKV_MAX_ROWS))[i];
                const PKV_T *pa = (const PKV_T *)(p + 2 * sizeof(double) * PKV_MAX_ROWS) + (size_t)i * d;
                for (int j = 0; j < d; j++) dst[j] += (PKV_T)w * pa[j];
            }
            sc.l[i] = lsum;
            sc.m[i] = mx;
        }
        PKV_FN(store_out)(a, h0, nh, b, 1, g0, ng, sc.acc, sc.l, sc.m);
    }
}

/* Prefill item `it`: kv head h, group members g0 + [0, ng), query tokens t0
 * + [0, nt).  Head-major, each head's latest tiles (most keys) first: an item
 * reads much of the K/V its predecessor read (from L2), and the last items are
 * the smallest (balance). */
static inline void PKV_KFN(prefill_where)(const pkv_attn_args *a, const pkv_prefill_plan *pl, int64_t it,
                                         int *h, int *g0, int *ng, int64_t *t0, int *nt) {
    const int64_t tile = pl->ntile - 1 - it % pl->ntile;
    const int gc = (int)((it / pl->ntile) % pl->ngc);
    *h = (int)(it / (pl->ntile * pl->ngc));
    *g0 = gc * pl->ng_max;
    *ng = pl->gsz - *g0 < pl->ng_max ? pl->gsz - *g0 : pl->ng_max;
    *t0 = tile * pl->tq;
    *nt = (int)(a->nq - *t0 < pl->tq ? a->nq - *t0 : pl->tq);
}

/* Ask for the lines of rows (kv head h, members g0 + [0, ng), tokens t0 + [0,
 * nt)) of the query or output array at base, into L2, for writing or reading:
 * both arrays are too large to stay in cache, and an item's rows are short
 * runs one token's heads apart, which the hardware prefetcher does not follow. */
static inline void PKV_KFN(prefetch_rows)(const pkv_attn_args *a, const char *base, size_t esz, int h,
                                          int g0, int ng, int64_t t0, int nt, int write) {
    const int gsz = a->hq / a->hkv, d = a->d;
    const size_t run = (size_t)ng * d * esz;
    for (int t = 0; t < nt; t++) {
        const char *p = base + ((size_t)(t0 + t) * a->hq + (size_t)h * gsz + g0) * d * esz;
        for (size_t x = 0; x < run; x += 64) {
            if (write) __builtin_prefetch(p + x, 1, 2);
            else __builtin_prefetch(p + x, 0, 2);
        }
    }
}

/* Keys per prefill tile (attn_args.h): the longer tile where the register
 * tiles are 4 key vectors wide (32 vector registers: AVX-512, NEON).  On the
 * AVX2 kernels (forced on an Intel Xeon, f32 L=2048, one thread, alternated
 * processes) 128 keys were slower: 66.5 -> 63.8 useful GFLOP/s.  Storage
 * with scales (int8) takes decode's tile (attn_tile.h: tile_keys): where P.V
 * rounds the weights to int16 (attn_pvdot.h) it does so per tile, with an
 * error bound of (keys of a tile) / 65534 of max |v|.  So do the bfloat16
 * dot-product and AMX scores (attn_bf16dot.h, attn_amx.h): not yet measured
 * with the longer tile. */
static inline int PKV_KFN(prefill_tile_keys)(void) {
#if PKV_SC_NV == 4 && !PKV_STORE_SCALED && !PKV_BF16_DOT && !PKV_BF16_AMX
    return PKV_PREFILL_TILE_KEYS;
#else
    return PKV_KFN(tile_keys)();
#endif
}

/* One prefill work item `it` of the plan (see prefill). */
static inline void PKV_KFN(prefill_item)(const pkv_attn_args *a, const pkv_prefill_plan *pl,
                                         int64_t it) {
    PKV_FN(scratch_t) sc = PKV_FN(scratch)(a, pkv_thread_id());
    int h, g0, ng, nt;
    int64_t t0;
    PKV_KFN(prefill_where)(a, pl, it, &h, &g0, &ng, &t0, &nt);
    const PKV_T *qrows = PKV_FN(load_queries)(a, h, 1, t0, nt, g0, ng, pl->rank0 + t0, sc.qbuf, sc.lim);
    /* the lines this item's output rows go to, and the query rows of this
     * thread's next item (under an even dynamic schedule) */
    const size_t esz = a->qo16 ? 2 : sizeof(PKV_T);
    PKV_KFN(prefetch_rows)(a, (const char *)a->out, esz, h, g0, ng, t0, nt, 1);
    if (it + pl->nthreads < (int64_t)a->hkv * pl->ngc * pl->ntile) {
        int hn, g0n, ngn, ntn;
        int64_t t0n;
        PKV_KFN(prefill_where)(a, pl, it + pl->nthreads, &hn, &g0n, &ngn, &t0n, &ntn);
        PKV_KFN(prefetch_rows)(a, (const char *)a->q, esz, hn, g0n, ngn, t0n, ntn, 0);
    }
    /* from the first rank the tile's first query sees: with a window, the blocks
     * before it are never read; every other item on this thread walks its
     * tiles last to first, starting on the K/V its predecessor read last.
     * pf 1: the stream of V units in items of few rows (PKV_PF_ROWS_MAX) */
    PKV_KFN(attend_item)(a, 0, h, 1, qrows, nt * ng, sc.lim, pkv_window_lo(pl->rank0 + t0, a->window),
                     pl->rank0 + t0 + nt, sc.acc, sc.m, sc.l, sc.sbuf, sc.kbuf, sc.alpha, sc.qdot, 1,
                     0, (int)((it / pl->nthreads) & 1), PKV_KFN(prefill_tile_keys)(), NULL);
    PKV_FN(store_out)(a, h, 1, t0, nt, g0, ng, sc.acc, sc.l, sc.m);
}

/* Causal prefill of one sequence: a->nq query tokens are its newest held ranks.
 * Items are (kv head, member chunk, query tile); a tile of tq tokens x ng
 * members reads each key block once and skips the blocks past its last
 * query's rank (the causal mask costs no work beyond the diagonal blocks). */
static void PKV_KFN(prefill)(const pkv_attn_args *a) {
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
    const pkv_prefill_plan pl = {gsz, ng_max, ngc, tq, nthreads, ntile, rank0};
    int64_t it;
    if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (it = 0; it < items; it++) PKV_KFN(prefill_item)(a, &pl, it);
    } else { /* no OpenMP region (see decode) */
        for (it = 0; it < items; it++) PKV_KFN(prefill_item)(a, &pl, it);
    }
}
