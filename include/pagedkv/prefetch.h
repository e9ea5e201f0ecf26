/* pagedkv/prefetch.h -- the kernels' software prefetch cursor.
 *
 * A work item of decode reads its blocks a tile at a time in units: the K
 * slices (one head of one block, hstride bytes) of the tile's blocks for
 * head 0, 1, ..., then their V slices head after head, then the next tile.
 * While the kernel works on a unit it can prefetch the next one (or the one
 * after it: pkv_pf_ahead), a few lines
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
#include <stdint.h>
#include "simd.h"

#define PKV_PF_STRIDE 64  /* every line */
typedef struct {
    /* the next unit's slices (a tile has at most PKV_TILE_KEYS = 128 blocks, attn_args.h) */
    const char *p[128];
    int n, cur;        /* slices; the one being prefetched */
    size_t len;        /* bytes per slice */
    const char *at, *end; /* next line to prefetch in slice cur, and its end */
    int l2;            /* 1: prefetch into L2 (prefetcht1), 0: into L1 (prefetcht0) */
    int l1k;           /* no slices: the unit's own K^T rows into L1 (pkv_pf_l1k) */
} pkv_pfs;

/* pkv_cpu_vendor, asked once per process (cpuid traps to the hypervisor in a VM) */
static inline int pkv_pf_cpu(int *family) {
    static int vf = -1; /* vendor << 16 | family */
    int v = __atomic_load_n(&vf, __ATOMIC_RELAXED);
    if (v < 0) {
        int f;
        v = pkv_cpu_vendor(&f) << 16 | (f & 0xffff);
        __atomic_store_n(&vf, v, __ATOMIC_RELAXED);
    }
    *family = v & 0xffff;
    return v >> 16;
}

/* AMD family 0x19 (Zen 3 and Zen 4), where several choices below differ */
static inline int pkv_cpu_amd_19h(void) {
    int family;
    return pkv_pf_cpu(&family) == PKV_CPU_AMD && family == 0x19;
}

/* Where the stream prefetches, chosen once per process from the CPU
 * (pkv_cpu_vendor): into L2 (prefetcht1; decode calls of
 * PKV_PF_K_MIN_BYTES or more then prefetch their K units too, attn_args.h)
 * on Intel and on AMD before family 0x1A; into L1 (prefetcht0) on AMD
 * family 0x1A and later (Zen 5), other x86-64 vendors and aarch64 (not
 * measured there).  Measured (decode_ceiling, decode CPU time as % of the
 * pattern read's, paired rounds):
 *   Intel Xeon (Emerald Rapids class, AVX-512), f32 B=8 L=2048, 1 thread:
 *   into L1, V units only 81-84%; into L2 88-92%; into L2 with the K units
 *   too 97%; 2 threads 81-84% -> 89-100%; f64 73-76% -> 94-95%.
 *   AMD EPYC (Zen 5 class, family 0x1A): into L1 62%, into L2 55-57%; K
 *   units too no faster out of DRAM and 15-20% slower in cache.
 *   AMD EPYC (Zen 4 class, family 0x19 model 0x11, the AVX2 path: the VM
 *   hides AVX-512), 5 paired rounds, two to six times: f32 B=8 L=2048 1
 *   thread into L1 35-40%, into L2 43-48%, into L2 with the K units
 *   62-87%; B=1 L=8192 37-38% -> 68-82% (with the K units); 2 threads
 *   B=8 L=2048 50-52% -> 76-80%, B=1 L=8192 47-56% -> 67-81%; f64 B=8
 *   L=2048 34-36% -> 69-75%, B=1 L=8192 2 threads 47-50% -> 72-75%; in
 *   cache (B=1 L=64 and 512) the same time either way.  The Zen 3 class
 *   (family 0x19, 512 KiB L2) was measured only into L1 (60-72% after the
 *   stream took the reading's pace).
 * -DPKV_PF_LOCALITY=2 or 3 forces one (measurements). */
static inline int pkv_pf_into_l2(void) {
#ifdef PKV_PF_LOCALITY
    return PKV_PF_LOCALITY == 2;
#else
    int family;
    const int vendor = pkv_pf_cpu(&family);
    return vendor == PKV_CPU_INTEL || (vendor == PKV_CPU_AMD && family < 0x1A);
#endif
}

/* Whether decode calls of at least PKV_L1K_MIN_BYTES (attn_args.h) prefetch
 * each K unit's own K^T rows into L1, PKV_L1K_AHEAD steps of the score tile
 * ahead (PKV_L1K_ROWS below, in every score tile), beside the K units' stream
 * into L2 in calls big enough for it (PKV_PF_K_MIN_BYTES): on Intel, where the
 * score tile otherwise waits on L2 and L3 for its several K^T rows at once.
 * Measured on an Intel Xeon (AMX class; Hq=32 Hkv=8 D=128, block size 16,
 * alternated builds, medians of 4-5 rounds), B=1, a call per layer in turn:
 * f32 L=256 over 64 layers 135 -> 115 us on 1 thread and 57 -> 50 us on 2,
 * L=384 over 32 layers 158 -> 133 us and 72 -> 68 us; int8 storage L=1024
 * over 24 layers 149 -> 141 us.  Off on AMD: on the Zen 4 class (family
 * 0x19 model 0x11, avx512vnni path, alternated builds, 5 rounds) it made f32
 * L=256 over 64 layers 133-157 -> 155-164 us and L=384 over 6 layers
 * 132-187 -> 174-223 us.
 * Beside the stream, on an Intel Xeon of the Emerald Rapids class
 * (decode_ceiling, decode as % of the pattern read, paired rounds, two
 * builds alternated, one thread unless said): f32 B=1 L=8192 88.5-89.1% ->
 * 90.8-92.1%, B=8 L=2048 90.0-90.3% -> 92.5-93.4%, two threads 87.5-90.6%
 * -> 88.2-95.3%; f64 B=8 L=2048 92.0-92.5% -> 94.4-95.2% (the pool flushed
 * from the caches before each call); bfloat16 and int8 storage 1-4 points.
 * -DPKV_PF_L1K=0/1 forces it (tests, measurements). */
#ifndef PKV_L1K_AHEAD
#define PKV_L1K_AHEAD 16
#endif
static inline int pkv_pf_l1k(void) {
#ifdef PKV_PF_L1K
    return PKV_PF_L1K;
#else
    int family;
    return pkv_pf_cpu(&family) == PKV_CPU_INTEL;
#endif
}

/* That prefetch in a score tile's loop: where `on`, K^T rows first,
 * first + step, ... (n of them) of each of the NV key vectors kp[v], rows
 * `stride` items apart, into L1.  One text for the float, integer and
 * bfloat16 score tiles (attn_tile.h, attn_dot.h, attn_bf16dot.h), each
 * passing its own rows PKV_L1K_AHEAD steps ahead. */
#define PKV_L1K_ROWS(on, kp, NV, first, n, step, stride)                                      \
    if (on)                                                                                   \
        for (int l1k_u_ = 0; l1k_u_ < (n); l1k_u_++)                                          \
            for (int l1k_v_ = 0; l1k_v_ < (NV); l1k_v_++)                                     \
                __builtin_prefetch((kp)[l1k_v_] + (size_t)((first) + (step) * l1k_u_) * (stride), 0, 3);

/* Units the stream runs ahead of the one being read where it takes every
 * unit (decode calls that prefetch their K units too, attn_args.h): two on
 * AMD family 0x19, one elsewhere (the units ahead are issued at once when an
 * item starts).  Measured on the Zen 4 class (family 0x19 model 0x11, AVX2
 * path, into L2 with the K units), four builds in one process called in turn
 * over one pool (f32, Hq=32 Hkv=8 D=128, medians of 9-15 calls, twice):
 * one unit ahead against two, B=8 L=2048 1 thread 8.7 / 8.9 -> 8.1 / 8.0 ms,
 * 2 threads 6.2 / 6.5 -> 5.5 / 5.3 ms; B=1 L=8192 1 thread 4.4 / 3.9 ->
 * 3.9 / 3.8 ms, 2 threads 3.0 / 3.4 -> 2.5 / 2.8 ms; f64 B=8 L=2048 19.4 /
 * 21.2 -> 17.9 / 17.6 ms; three and four units ahead no better than two; B=1
 * L=512 (in cache) the same.  On the AMD Zen 5 class (into L1) two units
 * ahead were slower (55-59% against 62-66% of the pattern read, above); the
 * Intel Xeon reached 97% with one; the Zen 3 class (also family 0x19) was
 * not measured.  -DPKV_PF_DIST=N forces it (measurements). */
static inline int pkv_pf_ahead(void) {
#ifdef PKV_PF_DIST
    return PKV_PF_DIST;
#else
    return pkv_cpu_amd_19h() ? 2 : 1;
#endif
}

/* Whether decode calls of float32 or float64 storage that read
 * PKV_AVX2_DECODE_MIN_BYTES or more (attn_args.h) run the AVX2 kernels on an
 * AVX-512 path (attn_calls.h): on AMD family 0x19 (Zen 4; Zen 3 has no
 * AVX-512), elsewhere not.  Out of memory the AVX2 kernels decoded faster
 * there: `pagedkv bench --suites bandwidth,decode`, the two paths alternated
 * three times (Zen 4 class, family 0x19 model 0x11, one thread): f32 B=8
 * L=2048 5.97-6.64 ms against 7.05-8.17, B=1 L=8192 2.06-2.35 against
 * 3.36-3.71, f64 B=8 L=2048 12.9-14.0 against 13.9-16.2; two threads
 * 4.23-4.47 against 4.64-5.59 (f32 B=8 L=2048).  In cache the AVX-512
 * kernels are faster (K/V in L2 11.9-12.1 us against 13.4-13.9), hence the
 * size limit.  The sequential read of 512-bit loads is slower than that of
 * 256-bit ones on the same core (kvread.h); narrower P.V chunks and score
 * tiles in the AVX-512 kernels, and 512-bit loads split in two, did not
 * close the gap (docs/performance.md).  Not measured on Intel or Zen 5,
 * which keep their AVX-512 kernels.
 * -DPKV_AVX2_DECODE=0/1 forces it (tests, measurements). */
static inline int pkv_big_decode_avx2(void) {
#ifdef PKV_AVX2_DECODE
    return PKV_AVX2_DECODE;
#else
    return pkv_cpu_amd_19h();
#endif
}

/* Whether P.V of int8 values in float32 takes vpdpwssd on the weights rounded
 * to int16 (attn_pvdot.h), where the AVX-512 + VNNI int8 kernels run: on
 * Intel and on AMD family 0x19 (Zen 4).  vpdpwssd does 32 multiply-adds
 * where a 512-bit FMA does 16.  Measured faster on the Zen 4 class (family
 * 0x19 model 0x11: its 512-bit FMA is two 256-bit halves) and on an Intel
 * Xeon of the Emerald Rapids class (2026-11-29: int8 decode 15-20% faster,
 * docs/performance.md); Intel cores before Sapphire Rapids were not
 * measured.  AMD family 0x1A (Zen 5, full-width FMAs) keeps the float path:
 * not measured there.  -DPKV_PV_INT16=0/1 forces it (tests, measurements). */
static inline int pkv_pv_int16(void) {
#ifdef PKV_PV_INT16
    return PKV_PV_INT16;
#else
    int family;
    const int vendor = pkv_pf_cpu(&family);
    return vendor == PKV_CPU_INTEL || (vendor == PKV_CPU_AMD && family == 0x19);
#endif
}

/* The step's lines are addressed from one pointer the compiler may not see
 * through (an empty asm), so each prefetch is one instruction at a constant
 * offset from it.  Without it GCC made every line's address an induction
 * variable of its own: 16 of them in a round of P.V, kept in vector registers
 * and moved back for each prefetch (three instructions a line). */
#define PKV_PF_OPAQUE(p) __asm__("" : "+r"(p))

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
        const char *pf_b_ = pf_at_;                                                \
        PKV_PF_OPAQUE(pf_b_);                                                      \
        if (pf_l2_)                                                                \
            for (int pf_i_ = 0; pf_i_ < PKV_PFS_LINES_(n); pf_i_++)                \
                __builtin_prefetch(pf_b_ + pf_i_ * PKV_PF_STRIDE, 0, 2);           \
        else                                                                       \
            for (int pf_i_ = 0; pf_i_ < PKV_PFS_LINES_(n); pf_i_++)                \
                __builtin_prefetch(pf_b_ + pf_i_ * PKV_PF_STRIDE, 0, 3);           \
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

/* every line of [at, end) at once, into L2 (l2) or L1; a prefetch's cache
 * level is a constant of its instruction, hence the two loops */
static inline void pkv_pf_range(const char *at, const char *end, int l2) {
    if (l2)
        for (; at < end; at += PKV_PF_STRIDE) __builtin_prefetch(at, 0, 2);
    else
        for (; at < end; at += PKV_PF_STRIDE) __builtin_prefetch(at, 0, 3);
}

/* len bytes at base + table[bidx[u]] * bstride into L1, for u in [0, cnt):
 * one slice of each of a tile's blocks */
static inline void pkv_pf_blocks_l1(const char *base, const int32_t *table, const int64_t *bidx, int cnt,
                                    size_t bstride, size_t len) {
    for (int u = 0; u < cnt; u++) {
        const char *p = base + (size_t)table[bidx[u]] * bstride;
        pkv_pf_range(p, p + len, 0);
    }
}

/* issue whatever the steps left (the unit ended before its estimate) */
static inline void pkv_pfs_finish(pkv_pfs *s) {
    const char *at = s->at, *end = s->end;
    while (at < end) {
        pkv_pf_range(at, end, s->l2);
        at = end;
        pkv_pfs_next(s, &at, &end);
    }
    s->at = at;
    s->end = end;
}
