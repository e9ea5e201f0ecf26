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

/* Write n tokens' K and V, each src[n][hkv][d] of the compute type `compute`
 * (PKV_F32 / PKV_F64), into slots [slot0, slot0 + n) of one layer,
 * converting to the storage type (convert.h).
 * (Streaming stores were measured and dropped: no faster for pools larger
 * than the caches, slower for pools that fit.) */
static inline void pkv_write_tokens(const pkv_geom *g, char *arena, const int32_t *table, int layer,
                                    int64_t slot0, int64_t n, const char *k, const char *v,
                                    int compute) {
    const size_t row = g->row_bytes, srow = (size_t)g->d * (compute == PKV_F64 ? 8 : 4);
    const size_t tok = (size_t)g->hkv * srow, koff = pkv_k_offset(g, layer);
    const size_t hscales = (size_t)g->bs * g->scale_row; /* one head's scales */
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot0 + t;
        char *kplane = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff;
        char *vplane = kplane + g->plane_bytes;
        const size_t at = (size_t)(slot % g->bs);
        for (int h = 0; h < g->hkv; h++) {
            const size_t vo = (size_t)h * g->head_bytes + at * row;
            const size_t so = g->scale_offset + (size_t)h * hscales + at * g->scale_row;
            pkv_store_row(g, compute, kplane + vo, (float *)(kplane + so),
                          k + (size_t)t * tok + (size_t)h * srow);
            pkv_store_row(g, compute, vplane + vo, (float *)(vplane + so),
                          v + (size_t)t * tok + (size_t)h * srow);
        }
    }
}

/* Copy the K and V of held slots [slot0, slot1) of one layer into
 * k, v [slot1 - slot0][hkv][d] of the compute type, converting from storage. */
static inline void pkv_read_tokens(const pkv_geom *g, const char *arena, const int32_t *table,
                                   int layer, int64_t slot0, int64_t slot1, char *k, char *v,
                                   int compute) {
    const size_t row = g->row_bytes, srow = (size_t)g->d * (compute == PKV_F64 ? 8 : 4);
    const size_t tok = (size_t)g->hkv * srow, koff = pkv_k_offset(g, layer);
    const size_t hscales = (size_t)g->bs * g->scale_row;
    for (int64_t slot = slot0; slot < slot1; slot++) {
        const char *kplane = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff;
        const char *vplane = kplane + g->plane_bytes;
        const size_t at = (size_t)(slot % g->bs), t = (size_t)(slot - slot0);
        for (int h = 0; h < g->hkv; h++) {
            const size_t vo = (size_t)h * g->head_bytes + at * row;
            const size_t so = g->scale_offset + (size_t)h * hscales + at * g->scale_row;
            pkv_load_row(g, compute, k + t * tok + (size_t)h * srow, kplane + vo,
                         (const float *)(kplane + so));
            pkv_load_row(g, compute, v + t * tok + (size_t)h * srow, vplane + vo,
                         (const float *)(vplane + so));
        }
    }
}

/* Copy block src to dst: K and V of every layer (copy-on-write). */
static inline void pkv_copy_block(const pkv_geom *g, char *arena, int32_t dst, int32_t src) {
    memcpy(arena + (size_t)dst * g->block_bytes, arena + (size_t)src * g->block_bytes,
           g->block_bytes);
}
