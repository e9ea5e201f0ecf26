/* pagedkv/attn_args.h -- what the attention kernels are called with and how
 * they split their work: the argument struct, RoPE tables, the tile
 * geometry, the plans of a decode / prefill call, and the scratch and
 * split-K sizes a caller allocates.  Shared by the kernel templates
 * (attn_math.h, attn_impl.h), the dispatch (attention.h) and the callers.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include "types.h"
#include "prefetch.h"

#ifndef restrict
#define restrict __restrict__
#endif

/* name##suffix after both are expanded (the templates' name mangling) */
#define PKV_CAT_(a, b) a##b
#define PKV_CAT(a, b) PKV_CAT_(a, b)

/* Query rows handled together against one kv head (GQA group x query tile). */
#ifndef PKV_MAX_ROWS
#define PKV_MAX_ROWS 64
#endif

typedef struct {
    const void *cos, *sin;     /* [max_pos][half], cache dtype (queries) */
    const void *cos_t, *sin_t; /* the same transposed, [half][max_pos] (keys: a vector
                                  takes consecutive positions, as K^T takes keys) */
    int64_t max_pos;
    int half; /* rotary_dim / 2 */
} pkv_rope;

/* Keys per tile: a work item folds its blocks this many keys at a time
 * (one softmax step per tile and head; the score micro-kernel gathers its
 * key vectors across the tile's blocks).  Decode: 64.  Measured
 * (decode_ceiling, f32, bs=16, 1 thread): 32 and 128 keys both slower than
 * 64, in cache (59-66 / 65-75 vs 69-76 G FMA lanes/s) and out of DRAM
 * (58-59% / 58-64% vs 64-65% of the pattern read).  Causal prefill: 128
 * on the AVX-512 and NEON kernels (attn_calls.h: prefill_tile_keys), whose 64
 * query rows per head then take half as many softmax steps, score tile calls
 * and P.V passes per key; on an Intel Xeon (Emerald Rapids class,
 * avx512vnni, f32 L=2048, alternated processes) 138.2 -> 141.8 useful
 * GFLOP/s on one thread and 276.8 -> 283.7 on two, f64 L=1024 the same; 32
 * keys gave 117 against 137.  PKV_TILE_KEYS, the larger, sizes the arrays and
 * the scratch; prefetch.h's stream holds one tile's blocks. */
#define PKV_DECODE_TILE_KEYS 64
#define PKV_PREFILL_TILE_KEYS 128
/* Decode's tile, and int8 storage's prefill tile, where P.V of int8 values
 * rounds the weights to int16 (attn_tile.h: tile_keys) */
#define PKV_I16_TILE_KEYS 128
#define PKV_TILE_KEYS \
    (PKV_DECODE_TILE_KEYS > PKV_PREFILL_TILE_KEYS ? PKV_DECODE_TILE_KEYS : PKV_PREFILL_TILE_KEYS)
_Static_assert(PKV_I16_TILE_KEYS <= PKV_TILE_KEYS, "PKV_TILE_KEYS sizes every tile's arrays");
_Static_assert(PKV_TILE_KEYS <= (int)(sizeof(((pkv_pfs *)0)->p) / sizeof(char *)),
               "a tile's blocks must fit the prefetch stream (prefetch.h)");
/* 0 turns the kernels' software prefetch off (for measurements) */
#ifndef PKV_PREFETCH_UNITS
#define PKV_PREFETCH_UNITS 1
#endif
#define PKV_MAX_KVECS (2 * PKV_TILE_KEYS + 2)

/* blocks per tile of tk keys, and the columns of a tile's score rows (>= its
 * keys, a multiple of 16 so every vector width divides it; never fewer for a
 * larger tk, so PKV_TILE_KEYS sizes the scratch) */
static inline int pkv_tile_blocks(int bs, int tk) { return bs >= tk ? 1 : tk / bs; }
static inline int pkv_tile_cols(int bs, int tk) {
    return (pkv_tile_blocks(bs, tk) * bs + 15) / 16 * 16;
}

/* One key vector of a tile: PKV_W consecutive keys' K^T at dimension 0 of lane
 * 0 (the next dimension `stride` items on), int8 scales at group 0 of lane
 * 0; lanes [lo, hi) are keys of the tile, lane l its column col + l. */
typedef struct {
    const void *k;
    const float *sc;
    int col, lo, hi;
} pkv_kvec;

/* Key vectors of one run (n keys from slot off of a K^T whose rows are
 * `stride` items long, stride >= w): windows of w lanes that stay inside
 * the row, the last one shifted back to end at the row's end if needed.
 * Returns the number written to e. */
static inline int pkv_kvecs_of(pkv_kvec *e, const void *kt, size_t item, const float *sc,
                               size_t stride, int off, int n, int col, int w) {
    int ne = 0;
    for (int j0 = 0; j0 < n; j0 += w) {
        size_t s = (size_t)(off + j0);
        if (s + (size_t)w > stride) s = stride - (size_t)w;
        const int lo = off + j0 - (int)s;
        const int hi = off + n - (int)s < w ? off + n - (int)s : w;
        e[ne].k = (const char *)kt + s * item;
        e[ne].sc = sc ? sc + s : NULL;
        e[ne].lo = lo;
        e[ne].hi = hi;
        e[ne].col = col + j0 - lo;
        ne++;
    }
    return ne;
}

typedef struct {
    const void *k, *v;            /* K / V plane of one layer in block 0 (layout: types.h) */
    size_t block_stride;          /* bytes from one block to the next */
    size_t scale_offset;          /* int8 storage: from a plane to its scales (types.h) */
    int bs, hkv, hq, d;
    int64_t nseq;                 /* decode: batch; prefill: 1 */
    const int32_t *const *tables; /* per sequence */
    const pkv_segs *segs;         /* per sequence */
    const void *q;                /* [nseq or nq][hq][d] */
    void *out;                    /* same shape as q */
    int qo16;                     /* 0: q and out are of the compute type; PKV_BF16 or
                                   * PKV_F16: 16-bit (compute float32, out rounded once) */
    int64_t nq;                   /* prefill: query tokens (the newest held) */
    double scale;
    const pkv_rope *rope;         /* NULL: keys and queries used as given */
    void *scratch;                /* nthreads * scratch_stride bytes, 64-aligned */
    size_t scratch_stride;
    void *partial;                /* split-K partial states: partial_slots slots */
    int64_t partial_slots;
    int nthreads;                 /* threads allowed */
    int64_t *plan_out;            /* NULL or 3 slots: threads used, heads per item, key chunks */
    /* options (0 / NULL: off; a zeroed struct is plain causal attention) */
    int64_t window;               /* sliding window: the query at rank i sees ranks
                                     (i - window, i]; blocks before it are never read */
    double softcap;               /* scores s (scaled) become softcap * tanh(s / softcap) */
    const double *sinks;          /* [hq]: a learned logit per query head that joins the
                                     softmax denominator and carries no value */
} pkv_attn_args;

/* First rank a query at rank `last` sees (0 without a window). */
static inline int64_t pkv_window_lo(int64_t last, int64_t window) {
    return window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
}

/* Whether a query at rank `last` sees every one of the n keys at ranks r .. r + n - 1. */
static inline int pkv_sees_all(int64_t last, int64_t window, int64_t r, int n) {
    return last - r + 1 >= n && pkv_window_lo(last, window) <= r;
}

/* Keys a decode query (at the newest held rank) sees. */
static inline int64_t pkv_decode_visible(const pkv_segs *sg, int64_t window) {
    const int64_t held = (sg->a1 - sg->a0) + (sg->b1 - sg->b0);
    return window > 0 && held > window ? window : held;
}

/* The work split of one decode / prefill call (attn_calls.h), shared by its items. */
typedef struct {
    int gsz, ng_max, ngc, hpg, ngroups;
    int64_t nchunk;
    size_t slot_bytes;
    int pf; /* the items' prefetch stream: 0 none, 1 V units, 2 K units too (prefetch.h) */
    int l1k; /* their K units' own rows into L1 as the score tile walks them (pkv_pf_l1k) */
} pkv_decode_plan;

/* A decode call that reads less than this many bytes of K+V runs without the
 * prefetch stream (prefetch.h): its blocks are few, the hardware prefetchers
 * follow them, and where they are in cache the stream's instructions only
 * cost.  Measured on an Intel Xeon (Emerald Rapids class, f32, Hq=32 Hkv=8
 * D=128, block size 16, benchmarks/c/decode_ceiling.c, builds alternated
 * three times, medians): called again and again, B=1 L=16 (128 KiB) 3.6-4.5
 * -> 3.1-3.7 us and L=64 8.6-8.8 -> 7.7-8.0 us on one thread; flushed from
 * the caches before each call, L=16 to L=96 within the noise either way
 * (L=16 32-34 -> 29-35 us), L=128 (1 MiB, which keeps the stream) 2-3%
 * slower without it, L=256 13% and L=512 16% slower. */
#ifndef PKV_PF_MIN_BYTES
#define PKV_PF_MIN_BYTES (1 << 20)
#endif
/* A decode call that reads at least this many bytes of K+V prefetches its
 * K units too where the CPU prefetches into L2 (pkv_pf_into_l2): below it
 * the data is mostly in cache, where the prefetch instructions only cost
 * (Intel Xeon, f32 B=1 L=128, 1 MiB: 7-9% slower with them). */
#ifndef PKV_PF_K_MIN_BYTES /* -D overrides it (measurements) */
#define PKV_PF_K_MIN_BYTES (4 << 20)
#endif
/* A decode call of float32 or float64 storage that reads at least this many
 * bytes of K+V runs the AVX2 kernels on an AVX-512 path where
 * pkv_big_decode_avx2 says so (prefetch.h); below it the data is mostly in
 * cache, where the AVX-512 kernels are faster (Zen 4 class, f32 B=1 L=512,
 * 4 MiB, called again and again: 94 us against 109-110). */
#ifndef PKV_AVX2_DECODE_MIN_BYTES
#define PKV_AVX2_DECODE_MIN_BYTES (8 << 20)
#endif
/* 1 when a decode call reading kv_bytes of float32 or float64 K+V runs the
 * AVX2 kernels on an AVX-512 path (attn_calls.h), and the read ceilings of
 * that size read with AVX2's loads (kvread.h) */
static inline int pkv_decode_on_avx2(double kv_bytes) {
    return kv_bytes >= PKV_AVX2_DECODE_MIN_BYTES && pkv_big_decode_avx2();
}
/* Items with this many query rows per head or more (prefill) widen a tile's
 * bfloat16 or float16 keys and values once into the compute type (widen_tile,
 * widen_values in attn_tile.h).  Measured on an Intel Xeon (Emerald Rapids
 * class, one thread): prefill items of 64 rows 9-14% faster; decode items of
 * 8 rows (8 query heads per KV head) 1.6x slower with it, of 32 rows 0-20%
 * slower (the widened tile's stores and loads cost more than converting it
 * once per group of four rows saves). */
#ifndef PKV_WIDEN_ROWS
#define PKV_WIDEN_ROWS 48
#endif
/* A decode call that reads at least this many bytes (more than this core's
 * L2 holds on the machines measured) prefetches its K units' own rows into
 * L1 where pkv_pf_l1k says so (prefetch.h), beside the K units' stream into
 * L2 where it has one (PKV_PF_K_MIN_BYTES); smaller calls, most often in
 * cache, run as before (Intel Xeon, K/V in L2: B=1 L=16 and L=128 2-3%
 * slower with the prefetches, L=256 over 64 layers 15% faster). */
#ifndef PKV_L1K_MIN_BYTES
#define PKV_L1K_MIN_BYTES (2 << 20)
#endif

/* A work item whose heads have at least this many query rows each (prefill
 * tiles: tokens x group members) runs no prefetch stream, and its 4-row
 * tiles run loops without the stream's state (attn_tile.h): each K/V value
 * it loads feeds that many multiply-adds, so it is bound by arithmetic and a
 * tile's blocks stay in cache for all its rows.  Measured (Intel Xeon, f32
 * causal prefill L=2048, Hq=32 Hkv=8 D=128, C harness, medians of 5 / 4
 * alternated runs): 261 -> 254 ms on 1 thread, 129 -> 125 ms on 2; 8 query
 * tokens over 16,384 keys (32 rows per head, which keeps the stream) ran
 * 4% slower without it. */
#define PKV_PF_ROWS_MAX 64

typedef struct {
    int gsz, ng_max, ngc, tq, nthreads;
    int64_t ntile, rank0;
} pkv_prefill_plan;

/* A sequence is split over several threads only if each key chunk gets at
 * least this many tokens. */
#define PKV_SPLIT_MIN 256

/* Decode work items wanted on `nthreads` threads: two a thread on 8 threads
 * or more, so that the dynamic schedule can even out a thread that falls
 * behind (a busy core, a descheduled vCPU); one a thread below that, and one
 * in all on one thread (no split).  On a 16-vCPU Intel Xeon, decode B=8
 * L=2048 on 16 threads (8 sequences: 16 items with one a thread, 32 with
 * two) took 0.96 / 0.84 ms with two against 1.25 / 1.07 ms in f32, 2.12 /
 * 1.94 against 2.59 / 2.85 ms in f64, 8 threads within that host's noise;
 * on the 2-vCPU AMD EPYC (Zen 4 class) two a thread made 2-thread calls on
 * one or two sequences 1-5% slower (the extra chunks restart the prefetch
 * stream and add partial states to merge).  -DPKV_DECODE_ITEMS_MIN=N sets
 * the items a thread for every thread count (tests, measurements). */
static inline int64_t pkv_decode_items_wanted(int nthreads) {
    if (nthreads <= 1) return 1;
#ifdef PKV_DECODE_ITEMS_MIN
    return (int64_t)nthreads * PKV_DECODE_ITEMS_MIN;
#else
    return (int64_t)nthreads * (nthreads >= 8 ? 2 : 1);
#endif
}

/* Key chunks per sequence for `base` decode work items where `want` are
 * wanted (pkv_decode_items_wanted; attn_calls.h): enough for `want` where
 * the keys allow it, at most `slots` partial states in all, at least
 * PKV_SPLIT_MIN keys of the shortest sequence (`held_min` visible keys) per
 * chunk; 1 is no split. */
static inline int64_t pkv_decode_chunks(int64_t base, int64_t want, int64_t slots,
                                        int64_t held_min) {
    if (base >= want || slots <= 0) return 1;
    int64_t n = (want + base - 1) / base;
    if (n * base > slots) n = slots / base;
    if (n > held_min / PKV_SPLIT_MIN) n = held_min / PKV_SPLIT_MIN;
    return n < 1 ? 1 : n;
}

/* Calls with fewer multiply-adds than this run on one thread: below it the
 * fork/join of a parallel region costs more than it saves (~10-20 us of
 * work), and on a busy machine a descheduled worker would stall the call. */
#define PKV_PARALLEL_MIN (1 << 21)

/* Under OMP_WAIT_POLICY=passive OpenMP's workers sleep between parallel
 * regions, and a call that needs them waits for them to wake and, at its
 * end, to wake it.  Decode calls reading less than this many bytes of K+V
 * then run on one thread (pkv_omp_passive).  Measured on an Intel Xeon
 * (Emerald Rapids class VM, benchmarks/c/decode_ceiling.c, B=1, Hq=32 Hkv=8
 * D=128, K/V in cache, two runs each, 1 against 2 threads): f32 L=256 (2 MiB)
 * 48-79 against 73-82 us, bfloat16 L=512 (2 MiB) 88-94 against 103, int8
 * L=1024 (2 MiB) 122-123 against 166-170; from 3 MiB the second thread pays:
 * f32 L=384 115-118 against 95-98 us, bfloat16 L=768 142 against 129-132,
 * int8 L=1536 187-188 against 157-160.  With OpenMP's default policy the
 * workers spin a while after a region and the threshold does not apply. */
#ifndef PKV_PASSIVE_PARALLEL_MIN_BYTES
#define PKV_PASSIVE_PARALLEL_MIN_BYTES (3 << 20)
#endif

/* 1 where OMP_WAIT_POLICY says passive (as libgomp reads it: any case,
 * blanks around it), read once: OpenMP reads it once, when it starts. */
static inline int pkv_omp_passive(void) {
    static int passive = -1;
    int p = __atomic_load_n(&passive, __ATOMIC_RELAXED);
    if (p < 0) {
        const char *e = getenv("OMP_WAIT_POLICY"), *w = "passive";
        p = e != NULL;
        while (p && (*e == ' ' || *e == '\t')) e++;
        for (; p && *w; e++, w++) p = (*e | 0x20) == *w;
        while (p && (*e == ' ' || *e == '\t')) e++;
        p = p && *e == '\0';
        __atomic_store_n(&passive, p, __ATOMIC_RELAXED);
    }
    return p;
}

/* Bytes of one split-K partial state (m, l, acc of PKV_MAX_ROWS rows). */
static inline size_t pkv_partial_slot_bytes(int d, size_t itemsize) {
    return PKV_ALIGN_UP(2 * sizeof(double) * PKV_MAX_ROWS + (size_t)PKV_MAX_ROWS * d * itemsize);
}

/* Where the integer scores of attn_dot.h run in their instances (int8 keys,
 * float32 compute, an integer dot path): blocks whose K^T rows hold a whole
 * vector of w keys (PKV_W), keys scored as stored (RoPE rotates them into
 * float32 first).  attn_item.h takes that branch; pkv_quantizes_queries
 * (attention.h) tells the callers. */
static inline int pkv_dot_scores_apply(int bs, int rope, int w) { return bs >= w && !rope; }

/* The query rows quantized for integer scores (attn_dot.h): int8 values,
 * whole groups of PKV_I8_GROUP per row, then a float32 scale and an int32
 * starting sum per row and group. */
static inline size_t pkv_qdot_ldq(int d) {
    return (size_t)(d + PKV_I8_GROUP - 1) / PKV_I8_GROUP * PKV_I8_GROUP;
}
/* ... or staged for AMX tiles (attn_amx.h): three rows of bfloat16 values
 * per query row, d rounded up to 32, and room for a 16-row tile read from
 * the last row on (which also holds the rows rounded to bfloat16 for
 * vdpbf16ps, attn_bf16dot.h: one such row per query row) */
static inline size_t pkv_qdot_bytes(int d) {
    const size_t i8 = (size_t)PKV_MAX_ROWS * (pkv_qdot_ldq(d) + 8 * ((size_t)(d + PKV_I8_GROUP - 1) / PKV_I8_GROUP));
    const size_t amx = ((size_t)PKV_MAX_ROWS * 3 + 16) * ((size_t)(d + 31) / 32 * 32) * 2;
    return i8 > amx ? i8 : amx;
}

/* Bytes of scratch one thread needs (attn_math.h lays it out): m, l, lim,
 * query rows, accumulators, alpha, a tile's scores (PKV_MAX_ROWS rows of
 * pkv_tile_cols), the quantized query rows (int8 keys on an integer dot
 * product), and kbuf: a tile's keys rotated by RoPE or widened, [d][tile
 * cols], which P.V reuses as its work space (a padding row of d values, then
 * int8 V's folded weights, PKV_MAX_ROWS + 4 rows of tile cols, or the tile's
 * values widened, [tile cols][d]; attn_tile.h). */
static inline size_t pkv_scratch_bytes(int bs, int d, size_t itemsize) {
    const size_t nqd = (size_t)PKV_MAX_ROWS * d * itemsize;
    const size_t cols = (size_t)pkv_tile_cols(bs, PKV_TILE_KEYS);
    const size_t rope = (size_t)d * cols + (size_t)(d + 15) / 16 * 16; /* + widen_values' offset */
    const size_t values = (size_t)(d + 15) / 16 * 16 + (size_t)(PKV_MAX_ROWS + 4) * cols;
    return 3 * 8 * PKV_MAX_ROWS + 2 * PKV_ALIGN_UP(nqd) + PKV_ALIGN_UP(PKV_MAX_ROWS * itemsize) +
           PKV_ALIGN_UP((size_t)PKV_MAX_ROWS * cols * itemsize) + PKV_ALIGN_UP(pkv_qdot_bytes(d)) +
           PKV_ALIGN_UP((rope > values ? rope : values) * itemsize) + PKV_ALIGN;
}
