/* pagedkv/layout.h -- moving tokens and blocks in and out of the pool
 * (layout in types.h).
 *
 * Every entry point here and in attention.h trusts its arguments; the
 * callers (pagedkv/_core.pyx) check them first with pkv_check_seq().
 */
#pragma once
#include <string.h>
#include "types.h"
#include "convert.h"

/* 0 when the view is consistent: segments ordered and inside the blocks
 * held, every block id inside the pool. */
static inline int pkv_check_seq(const int32_t *table, int64_t nblk, const pkv_segs *s, int bs,
                                int64_t num_blocks) {
    if (!(0 <= s->a0 && s->a0 <= s->a1 && s->a1 <= s->b0 && s->b0 <= s->b1)) return -1;
    if (s->b1 > nblk * (int64_t)bs) return -1;
    for (int64_t i = 0; i < nblk; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return -1;
    return 0;
}

/* Where one head's stored vector of slot `at` lives inside a plane: its
 * first value, the item stride between its values, and its scales (types.h). */
typedef struct {
    size_t value, vstride, scale, sstride;
} pkv_row_at;

static inline pkv_row_at pkv_row_of(const pkv_geom *g, int is_k, int h, size_t at) {
    pkv_row_at r;
    const size_t item = (size_t)g->store.itemsize;
    r.value = (size_t)h * g->head_bytes + (is_k ? at * item : at * g->row_bytes);
    r.vstride = is_k ? (size_t)g->bs : 1;
    r.scale = g->scale_offset + ((size_t)h * g->bs * g->scale_row) + at * sizeof(float);
    r.sstride = (size_t)g->bs;
    return r;
}

/* Write n tokens' K and V, each src[n][hkv][d] of the arrays' type `compute`
 * (PKV_F32 / PKV_F64 / PKV_BF16 / PKV_F16), into slots [slot0, slot0 + n) of one layer,
 * converting to the storage type (convert.h).
 * (Streaming stores were measured and dropped: no faster for pools larger
 * than the caches, slower for pools that fit.) */
static inline void pkv_write_tokens(const pkv_geom *g, char *arena, const int32_t *table, int layer,
                                    int64_t slot0, int64_t n, const char *k, const char *v,
                                    int compute) {
    const size_t srow = (size_t)g->d * pkv_dtype_size(compute);
    const size_t tok = (size_t)g->hkv * srow, koff = pkv_k_offset(g, layer);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot0 + t;
        char *kplane = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff;
        char *vplane = kplane + g->plane_bytes;
        const size_t at = (size_t)(slot % g->bs);
        for (int h = 0; h < g->hkv; h++) {
            const pkv_row_at rk = pkv_row_of(g, 1, h, at), rv = pkv_row_of(g, 0, h, at);
            pkv_store_row(g, compute, kplane + rk.value, (float *)(kplane + rk.scale),
                          k + (size_t)t * tok + (size_t)h * srow, rk.vstride, rk.sstride);
            pkv_store_row(g, compute, vplane + rv.value, (float *)(vplane + rv.scale),
                          v + (size_t)t * tok + (size_t)h * srow, rv.vstride, rv.sstride);
        }
    }
}

/* Copy the K and V of held slots [slot0, slot1) of one layer into
 * k, v [slot1 - slot0][hkv][d] of the arrays' type, converting from storage. */
static inline void pkv_read_tokens(const pkv_geom *g, const char *arena, const int32_t *table,
                                   int layer, int64_t slot0, int64_t slot1, char *k, char *v,
                                   int compute) {
    const size_t srow = (size_t)g->d * pkv_dtype_size(compute);
    const size_t tok = (size_t)g->hkv * srow, koff = pkv_k_offset(g, layer);
    for (int64_t slot = slot0; slot < slot1; slot++) {
        const char *kplane = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff;
        const char *vplane = kplane + g->plane_bytes;
        const size_t at = (size_t)(slot % g->bs), t = (size_t)(slot - slot0);
        for (int h = 0; h < g->hkv; h++) {
            const pkv_row_at rk = pkv_row_of(g, 1, h, at), rv = pkv_row_of(g, 0, h, at);
            pkv_load_row(g, compute, k + t * tok + (size_t)h * srow, kplane + rk.value,
                         (const float *)(kplane + rk.scale), rk.vstride, rk.sstride);
            pkv_load_row(g, compute, v + t * tok + (size_t)h * srow, vplane + rv.value,
                         (const float *)(vplane + rv.scale), rv.vstride, rv.sstride);
        }
    }
}

/* Copy block src to dst: K and V of every layer (copy-on-write). */
static inline void pkv_copy_block(const pkv_geom *g, char *arena, int32_t dst, int32_t src) {
    memcpy(arena + (size_t)dst * g->block_bytes, arena + (size_t)src * g->block_bytes,
           g->block_bytes);
}
