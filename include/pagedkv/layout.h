/* pagedkv/layout.h -- moving tokens and blocks in and out of the pool
 * (layout in types.h).
 *
 * Every entry point here and in attention.h trusts its arguments; the
 * callers (pagedkv/_core.pyx) check them first with pkv_check_seq().
 */
#pragma once
#include <string.h>
#include "types.h"

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

/* Write n tokens' K and V, each src[n][hkv][d] (storage type), into slots
 * [slot0, slot0 + n) of one layer.
 * (Streaming stores were measured and dropped: no faster for pools larger
 * than the caches, slower for pools that fit.) */
static inline void pkv_write_tokens(const pkv_geom *g, char *arena, const int32_t *table, int layer,
                                    int64_t slot0, int64_t n, const char *k, const char *v) {
    const size_t row = g->row_bytes, tok = (size_t)g->hkv * row;
    const size_t koff = pkv_k_offset(g, layer);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot0 + t;
        char *kd = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff +
                   (size_t)(slot % g->bs) * row;
        char *vd = kd + g->plane_bytes;
        for (int h = 0; h < g->hkv; h++) {
            memcpy(kd + (size_t)h * g->head_bytes, k + (size_t)t * tok + (size_t)h * row, row);
            memcpy(vd + (size_t)h * g->head_bytes, v + (size_t)t * tok + (size_t)h * row, row);
        }
    }
}

/* Copy the K and V of held slots [slot0, slot1) of one layer into
 * k, v [slot1 - slot0][hkv][d]. */
static inline void pkv_read_tokens(const pkv_geom *g, const char *arena, const int32_t *table,
                                   int layer, int64_t slot0, int64_t slot1, char *k, char *v) {
    const size_t row = g->row_bytes, tok = (size_t)g->hkv * row;
    const size_t koff = pkv_k_offset(g, layer);
    for (int64_t slot = slot0; slot < slot1; slot++) {
        const char *ks = arena + (size_t)table[slot / g->bs] * g->block_bytes + koff +
                         (size_t)(slot % g->bs) * row;
        const char *vs = ks + g->plane_bytes;
        const size_t t = (size_t)(slot - slot0);
        for (int h = 0; h < g->hkv; h++) {
            memcpy(k + t * tok + (size_t)h * row, ks + (size_t)h * g->head_bytes, row);
            memcpy(v + t * tok + (size_t)h * row, vs + (size_t)h * g->head_bytes, row);
        }
    }
}

/* Copy block src to dst: K and V of every layer (copy-on-write). */
static inline void pkv_copy_block(const pkv_geom *g, char *arena, int32_t dst, int32_t src) {
    memcpy(arena + (size_t)dst * g->block_bytes, arena + (size_t)src * g->block_bytes,
           g->block_bytes);
}
