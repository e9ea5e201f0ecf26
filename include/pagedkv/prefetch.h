/* pagedkv/prefetch.h -- the kernels' software prefetch cursor.
 *
 * A work item of decode reads its blocks a tile at a time in units: the K
 * slices (one head of one block, hstride bytes) of the tile's blocks for
 * head 0, 1, ..., then their V slices head after head, then the next tile.
 * While the kernel works on a unit it can prefetch the next one, a few lines
 * per step of its inner loop (the next tile's blocks may be anywhere in the
 * pool, where no hardware prefetcher looks), so the requests are spread over
 * the unit's arithmetic instead of issued in a burst.  attn_item.h says which
 * units it prefetches.
 *
 * A step issues as many lines as the step itself reads of the unit in hand
 * (attn_tile.h: PKV_PF_STEP_LINES), so the next unit arrives at the pace the
 * current one is consumed, spread over the whole unit.  A V unit and the next
 * unit hold the same bytes, and a P.V step reads PKV_PV_NV vectors of one V
 * row: one line per step with AVX2 (2 x 8 floats), four with AVX-512 (4 x 16).
 *
 * Measured with benchmarks/c/decode_ceiling.c (decode CPU time as % of the
 * pattern read's, f32 B=8 L=2048, 1 thread, paired):
 *   AMD EPYC (Zen 5 class), AVX-512: one unit ahead 62-66%, two 55-59%, three
 *   55-58%, a whole phase (the next tile's K while V is read, and so on)
 *   58-63%; every line 62-73%, every other line 48-50%, every fourth 52%;
 *   into L1 (prefetcht0) 62%, into L2 55-57%; 4 lines per step 62-67%, 2
 *   lines 66%, 8 lines 57%.
 *   AMD EPYC (Zen 3 class), AVX2, alternated rounds: 4 lines per step 48-59%
 *   (B=1 L=8192: 50-59%), 2 lines 58-65% (55-69%), 1 line (the pace of the
 *   reading) 60-72% (53-74%); 2 threads 55-59% -> 66-68% (50-56% -> 71-73%);
 *   f64 38-39% -> 44-46%.
 */
#pragma once
#include <stddef.h>
#include "simd.h"

#define PKV_PF_STRIDE 64  /* every line */
typedef struct {
    /* the next unit's slices (a tile has at most PKV_TILE_KEYS = 64 blocks, attn_args.h) */
    const char *p[64];
    int n, cur;        /* slices; the one being prefetched */
    size_t len;        /* bytes per slice */
    const char *at, *end; /* next line to prefetch in slice cur, and its end */
    int l2;            /* 1: prefetch into L2 (prefetcht1), 0: into L1 (prefetcht0) */
} pkv_pfs;

/* Where the stream prefetches, chosen once per process by the CPU's vendor:
 * into L2 on Intel, into L1 elsewhere.  Measured (decode_ceiling, decode
 * time as % of the pattern read's, paired rounds):
 *   Intel Xeon (Emerald Rapids class, AVX-512), f32 B=8 L=2048, 1 thread:
 *   into L1, V units only 81-84%; into L2 88-92%; into L2 with the K units
 *   too 97%; 2 threads 81-84% -> 89-100%; f64 73-76% -> 94-95%.
 *   AMD EPYC (Zen 5 class): into L1 62%, into L2 55-57%; K units too no
 *   faster out of DRAM and 15-20% slower in cache.
 * -DPKV_PF_LOCALITY=2 or 3 forces one (measurements). */
static inline int pkv_pf_into_l2(void) {
#ifdef PKV_PF_LOCALITY
    return PKV_PF_LOCALITY == 2;
#else
    static int l2 = -1; /* cpuid traps to the hypervisor in a VM: asked once */
    int v = __atomic_load_n(&l2, __ATOMIC_RELAXED);
    if (v < 0) {
        v = pkv_cpu_is_intel();
        __atomic_store_n(&l2, v, __ATOMIC_RELAXED);
    }
    return v;
#endif
}

/* A kernel's inner loop steps a local copy (kept in registers) and writes it
 * back when done:  PKV_PFS_BEGIN(ps); loop { PKV_PFS_STEP(n); } PKV_PFS_END(ps);
 * A step issues n lines, a constant of the loop (the units' slices are whole
 * multiples of that in the common geometries; a step may run a little past a
 * slice's end, which a prefetch tolerates), with one branch when nothing is
 * left.  -DPKV_PF_LINES=N makes every step issue N lines (for measurements). */
#define PKV_PFS_BEGIN(ps)                                                          \
    pkv_pfs *pf_s_ = (ps);                                                         \
    const char *pf_at_ = pf_s_ ? pf_s_->at : NULL, *pf_end_ = pf_s_ ? pf_s_->end : NULL; \
    const int pf_l2_ = pf_s_ ? pf_s_->l2 : 0;
#ifdef PKV_PF_LINES
#define PKV_PFS_LINES_(n) (PKV_PF_LINES)
#else
#define PKV_PFS_LINES_(n) (n)
#endif
#define PKV_PFS_STEP(n)                                                            \
    if (pf_at_ < pf_end_) {                                                        \
        if (pf_l2_)                                                                \
            for (int pf_i_ = 0; pf_i_ < PKV_PFS_LINES_(n); pf_i_++)                \
                __builtin_prefetch(pf_at_ + pf_i_ * PKV_PF_STRIDE, 0, 2);          \
        else                                                                       \
            for (int pf_i_ = 0; pf_i_ < PKV_PFS_LINES_(n); pf_i_++)                \
                __builtin_prefetch(pf_at_ + pf_i_ * PKV_PF_STRIDE, 0, 3);          \
        pf_at_ += PKV_PFS_LINES_(n) * PKV_PF_STRIDE;                               \
        if (pf_at_ >= pf_end_) pkv_pfs_next(pf_s_, &pf_at_, &pf_end_);             \
    }
#define PKV_PFS_END(ps)                                                            \
    if (pf_s_) {                                                                   \
        pf_s_->at = pf_at_;                                                        \
        pf_s_->end = pf_end_;                                                      \
    }

/* move on to the next slice (none left: an empty range) */
static inline void pkv_pfs_next(pkv_pfs *s, const char **at, const char **end) {
    if (s->cur + 1 < s->n) {
        s->cur++;
        *at = s->p[s->cur];
        *end = *at + s->len;
    } else {
        *at = *end; /* done: at == end stops the steps */
    }
}

static inline void pkv_pfs_start(pkv_pfs *s) {
    s->cur = 0;
    s->at = s->n ? s->p[0] : NULL;
    s->end = s->n ? s->p[0] + s->len : NULL;
}

/* issue whatever the steps left (the unit ended before its estimate) */
static inline void pkv_pfs_finish(pkv_pfs *s) {
    const char *at = s->at, *end = s->end;
    while (at < end) {
        if (s->l2)
            for (; at < end; at += PKV_PF_STRIDE) __builtin_prefetch(at, 0, 2);
        else
            for (; at < end; at += PKV_PF_STRIDE) __builtin_prefetch(at, 0, 3);
        pkv_pfs_next(s, &at, &end);
    }
    s->at = at;
    s->end = end;
}
