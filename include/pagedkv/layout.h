/* pagedkv/layout.h -- shared types and the block/slot copy kernels.
 *
 * Pool layout (one buffer for K, one for V, all layers), "HND" inside a block:
 *
 *   [layer][block][kv head][slot][dim]
 *            \______ one block: Hkv * bs * D elements per layer ______/
 *
 * A sequence is a block table (physical block ids, in order) over a slot
 * space; it holds the slots of at most two segments, [a0, a1) then [b0, b1)
 * (the second one is where appends go).  Its held tokens, in order, have
 * ranks 0, 1, ...: rank r < a1 - a0 is slot a0 + r, the rest follow from b0.
 * Without eviction a0 = a1 = 0 and b0 = 0.
 *
 * Every entry point here and in attention.h trusts its arguments; the
 * callers (pagedkv/_core.pyx) check them first with pkv_check_seq().
 */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

typedef struct {
    int64_t a0, a1, b0, b1;
} pkv_segs;

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

/* Write n tokens src[n][hkv][row] (row = D * itemsize bytes) into slots
 * [slot0, slot0 + n) of one layer (base = start of that layer's region).
 * (Streaming stores were measured and dropped: no faster for pools larger
 * than the caches, slower for pools that fit.) */
static inline void pkv_write_tokens(char *base, const int32_t *table, int bs, int hkv, size_t row,
                                    int64_t slot0, int64_t n, const char *src) {
    const size_t block_bytes = (size_t)hkv * bs * row;
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot0 + t;
        char *dst = base + (size_t)table[slot / bs] * block_bytes + (size_t)(slot % bs) * row;
        const char *s = src + (size_t)t * hkv * row;
        for (int h = 0; h < hkv; h++) memcpy(dst + (size_t)h * bs * row, s + (size_t)h * row, row);
    }
}

/* Copy held slots [slot0, slot1) of one layer into dst[..][hkv][row]. */
static inline void pkv_read_tokens(const char *base, const int32_t *table, int bs, int hkv,
                                   size_t row, int64_t slot0, int64_t slot1, char *dst) {
    const size_t block_bytes = (size_t)hkv * bs * row;
    for (int64_t slot = slot0; slot < slot1; slot++) {
        const char *src = base + (size_t)table[slot / bs] * block_bytes + (size_t)(slot % bs) * row;
        char *d = dst + (size_t)(slot - slot0) * hkv * row;
        for (int h = 0; h < hkv; h++) memcpy(d + (size_t)h * row, src + (size_t)h * bs * row, row);
    }
}

/* Copy physical block src to dst in every layer (copy-on-write). */
static inline void pkv_copy_block(char *buf, int64_t num_blocks, int num_layers, size_t block_bytes,
                                  int32_t dst, int32_t src) {
    for (int l = 0; l < num_layers; l++) {
        char *layer = buf + (size_t)l * num_blocks * block_bytes;
        memcpy(layer + (size_t)dst * block_bytes, layer + (size_t)src * block_bytes, block_bytes);
    }
}
