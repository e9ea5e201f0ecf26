/* pagedkv/types.h -- the shared C types: element types, storage descriptor,
 * pool geometry, a sequence's held segments, threads.
 *
 * Pool layout: one 64-byte-aligned arena of num_blocks blocks.  A block holds
 * its tokens' K and V for every layer:
 *
 *   block b:  [layer][K | V][kv head] (+ scales, int8 only)
 *     K of one head:  [dim][slot]   transposed: a vector load takes the same
 *                                   dimension of consecutive keys
 *     V of one head:  [slot][dim]   row-major: a vector load takes consecutive
 *                                   dimensions of one value
 *     int8 scales:    after the Hkv heads (4-aligned), float32
 *                     [kv head][group][slot], K and V alike
 *
 *   K of (b, layer) = arena + b * block_bytes + (2 * layer) * plane_bytes
 *   V of (b, layer) = that + plane_bytes
 *
 * Why K is transposed: scores are then a small matrix product of (query rows
 * x keys) with vertical multiply-adds -- broadcast one query value, multiply
 * a vector of W keys' same dimension, accumulate -- and no horizontal sum per
 * key; P.V reads V rows the same way with the weights broadcast.  The cost is
 * a strided write per appended key (d stores, bs apart).
 *
 * Nothing here depends on the number of blocks, so the pool can grow or
 * shrink by moving whole blocks, and one memcpy of block_bytes copies a block
 * (copy-on-write, compaction).  The attention kernels read one layer's plane
 * of a block as one contiguous run per K and V (all heads of an item).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
static inline int pkv_thread_id(void) { return omp_get_thread_num(); }
static inline int pkv_max_threads(void) { return omp_get_max_threads(); }
static inline int pkv_have_openmp(void) { return 1; }
#else
static inline int pkv_thread_id(void) { return 0; }
static inline int pkv_max_threads(void) { return 1; }
static inline int pkv_have_openmp(void) { return 0; }
#endif

#define PKV_ALIGN 64
#define PKV_ALIGN_UP(x) (((size_t)(x) + PKV_ALIGN - 1) & ~(size_t)(PKV_ALIGN - 1))

/* Element types.  Compute (what the kernels accumulate in) is F32 or F64
 * (the first PKV_NUM_COMPUTE codes); the arrays users pass in and get back
 * are F32, F64, BF16 or F16 (16-bit arrays are computed in F32); storage
 * (what the pool holds) is any of them.  The kernels are dispatched on (storage, compute, instruction
 * set): see attention.h.  Conversions between them: convert.h. */
typedef enum {
    PKV_F32 = 0,
    PKV_F64 = 1,
    PKV_BF16 = 2, /* bfloat16: the top 16 bits of a float32 */
    PKV_F16 = 3,  /* IEEE binary16 */
    PKV_I8 = 4,   /* int8, symmetric, one float32 scale per PKV_I8_GROUP values */
    PKV_NUM_DTYPES = 5
} pkv_dtype;

#define PKV_NUM_COMPUTE 2
/* int8: consecutive values of one token's head vector that share a scale.
 * The kernels' vector widths (1, 4, 8, 16 lanes) divide it, so a vector load
 * at a multiple of its width never straddles two groups. */
#define PKV_I8_GROUP 32

/* How one storage type lays out a head vector of d values. */
typedef struct {
    pkv_dtype dtype;
    int itemsize;  /* bytes per stored value */
    int scaled;    /* 1: a float32 scale per PKV_I8_GROUP values (int8) */
} pkv_storage;

static inline int pkv_dtype_size(int t) {
    return t == PKV_F64 ? 8 : t == PKV_F32 ? 4 : t == PKV_I8 ? 1 : 2;
}

static inline pkv_storage pkv_storage_of(pkv_dtype t) {
    pkv_storage s;
    s.dtype = t;
    s.itemsize = pkv_dtype_size(t);
    s.scaled = t == PKV_I8;
    return s;
}

/* Geometry of the pool: everything that locates a stored value except the
 * block count. */
typedef struct {
    int num_layers, hkv, bs, d;
    pkv_storage store;
    size_t row_bytes;    /* one head vector of one token: d values */
    size_t head_bytes;   /* one head of one block: bs rows */
    size_t scale_row;    /* scale bytes of one head vector (0 unless scaled) */
    size_t scale_offset; /* from a plane's start to its scales [hkv][groups][bs] */
    size_t plane_bytes;  /* K (or V) of one layer of one block: hkv heads (+ scales) */
    size_t block_bytes;  /* a whole block, 64-aligned: 2 * num_layers planes */
} pkv_geom;

static inline pkv_geom pkv_geom_make(int num_layers, int hkv, int bs, int d, pkv_dtype store) {
    pkv_geom g;
    g.num_layers = num_layers;
    g.hkv = hkv;
    g.bs = bs;
    g.d = d;
    g.store = pkv_storage_of(store);
    g.row_bytes = (size_t)d * g.store.itemsize;
    g.head_bytes = (size_t)bs * g.row_bytes;
    g.scale_row = g.store.scaled ? sizeof(float) * (size_t)((d + PKV_I8_GROUP - 1) / PKV_I8_GROUP) : 0;
    /* a plane holds whole values (and, int8, 4-aligned whole scales), so every
     * plane starts aligned to its storage type's item */
    g.scale_offset = (size_t)hkv * g.head_bytes;
    if (g.store.scaled) g.scale_offset = (g.scale_offset + 3) & ~(size_t)3;
    g.plane_bytes = g.scale_offset + (size_t)hkv * bs * g.scale_row;
    g.block_bytes = PKV_ALIGN_UP(2 * (size_t)num_layers * g.plane_bytes);
    return g;
}

/* Offset of the K plane of `layer` inside a block (V follows at + plane_bytes). */
static inline size_t pkv_k_offset(const pkv_geom *g, int layer) {
    return 2 * (size_t)layer * g->plane_bytes;
}

/* The slots a sequence holds: [a0, a1) then [b0, b1) (appends go to b1).
 * Held token r (its rank) is slot a0 + r for r < a1 - a0, then the rest
 * follow from b0.  Without eviction a0 = a1 = b0 = 0. */
typedef struct {
    int64_t a0, a1, b0, b1;
} pkv_segs;

static inline int64_t pkv_held(const pkv_segs *s) { return (s->a1 - s->a0) + (s->b1 - s->b0); }

/* Blocks [*lo, *hi) of a table that slots [s0, s1) touch (empty when s0 == s1). */
static inline void pkv_blocks_of(int64_t s0, int64_t s1, int bs, int64_t *lo, int64_t *hi) {
    *lo = s0 / bs;
    *hi = s1 > s0 ? (s1 + bs - 1) / bs : *lo;
}
