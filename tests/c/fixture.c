/* tests/c/fixture.c -- random numbers, failure count and random pools for
 * the C kernel tests (declared in fixture.h).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"

/* ---- random numbers (xorshift64*, reproducible on every platform) ------ */
uint64_t rng_s = 88172645463325252ull;
uint64_t rnd_u64(void) {
    rng_s ^= rng_s >> 12;
    rng_s ^= rng_s << 25;
    rng_s ^= rng_s >> 27;
    return rng_s * 2685821657736338717ull;
}
int rnd_int(int lo, int hi) { /* inclusive */
    return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1));
}
double rnd_unif(void) { return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0); }
double rnd_normal(void) {
    const double u = rnd_unif() + 1e-300, v = rnd_unif();
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

long failures = 0;

void *xalloc(size_t n) {
    void *p = aligned_alloc(PKV_ALIGN, PKV_ALIGN_UP(n ? n : 1));
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* value i of an array of dtype dt, as double */
double get(const void *p, size_t i, int dt) {
    return dt == PKV_F64 ? (double)((const double *)p)[i] : (double)((const float *)p)[i];
}
void put(void *p, size_t i, int dt, double x) {
    if (dt == PKV_F64) ((double *)p)[i] = x;
    else ((float *)p)[i] = (float)x;
}



/* slot of held rank r */
static int64_t slot_of(const pkv_segs *sg, int64_t r) {
    const int64_t n0 = sg->a1 - sg->a0;
    return r < n0 ? sg->a0 + r : sg->b0 + (r - n0);
}

/* byte offset of one stored value, straight from the layout in types.h:
 * block = [layer][K | V][kv head], K of a head [dim][slot] (transposed),
 * V of a head [slot][dim] (storage = compute only) */
static size_t layout_offset(const config *c, int32_t block, int layer, int kv, int h, int slot,
                            int j) {
    const size_t per_head = (size_t)c->bs * c->d;
    const size_t in_head = kv ? (size_t)slot * c->d + j : (size_t)j * c->bs + slot;
    const size_t idx = (((size_t)(2 * layer + kv) * c->hkv + h) * per_head) + in_head;
    return (size_t)block * c->g.block_bytes + idx * c->item;
}

void config_free(config *c) {
    for (int s = 0; s < c->nseq; s++) {
        free(c->tables[s]);
        free(c->kref[s]);
        free(c->vref[s]);
    }
    free(c->tables);
    free(c->nblk);
    free(c->segs);
    free(c->kref);
    free(c->vref);
    free(c->arena);
    free(c->expect);
    free(c->cos);
    free(c->sin);
    free(c->cos_t);
    free(c->sin_t);
}

static const int head_dims[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 67, 80, 96, 128, 130};
static const int ratios[] = {1, 1, 2, 3, 4, 5, 8, 16};

/* Worst allowed |stored - written| for x written into storage st from
 * compute dt, where amax is the largest |value| of x's head vector (int8's
 * scale group lies inside it): round to nearest in the storage's precision,
 * plus f16's subnormal spacing; int8: half a scale step (scale = amax / 127
 * rounded to float32) plus the float32 rounding of q * scale. */
static double store_tol(int st, double x, double amax) {
    switch (st) {
    case PKV_F32: return ldexp(fabs(x), -24);
    case PKV_BF16: return ldexp(fabs(x), -8);
    case PKV_F16: return ldexp(fabs(x), -11) + ldexp(1.0, -25);
    case PKV_I8: return amax / 254.0 * (1 + 1e-6) + ldexp(fabs(x), -23); /* + the product's rounding */
    default: return 0;
    }
}

/* A random pool with nseq sequences written through pkv_write_tokens.
 * `big`: one long MQA sequence with 32 query heads: enough work for 2
 * threads (PKV_PARALLEL_MIN) and keys for two chunks (PKV_SPLIT_MIN), so
 * decode splits its keys. */
void config_make(config *c, int st, int dt, int big) {
    memset(c, 0, sizeof *c);
    c->st = st;
    c->dt = dt;
    c->item = dt == PKV_F64 ? 8 : 4;
    c->bs = rnd_int(0, 3) == 0 ? rnd_int(1, 4) : rnd_int(1, 64);
    c->d = big ? 64 + rnd_int(0, 1) : head_dims[rnd_int(0, (int)(sizeof head_dims / sizeof *head_dims) - 1)];
    c->hkv = big ? 1 : rnd_int(1, 4);
    c->hq = c->hkv * (big ? 32 : ratios[rnd_int(0, (int)(sizeof ratios / sizeof *ratios) - 1)]);
    c->layers = rnd_int(1, 3);
    c->nseq = big ? 1 : rnd_int(1, 4);
    c->g = pkv_geom_make(c->layers, c->hkv, c->bs, c->d, (pkv_dtype)st);
    c->tables = calloc(c->nseq, sizeof *c->tables);
    c->nblk = calloc(c->nseq, sizeof *c->nblk);
    c->segs = calloc(c->nseq, sizeof *c->segs);
    c->kref = calloc(c->nseq, sizeof *c->kref);
    c->vref = calloc(c->nseq, sizeof *c->vref);

    /* segments: lengths end mid-block more often than not; a third of the
     * sequences carry a StreamingLLM gap [a1, b0) of evicted slots */
    int64_t total_blocks = 0;
    for (int s = 0; s < c->nseq; s++) {
        pkv_segs *sg = &c->segs[s];
        const int64_t len = big ? 600 + rnd_int(0, 200) : rnd_int(1, 5 * c->bs + 40);
        if (!big && len > 4 && rnd_int(0, 2) == 0) {
            sg->a0 = 0;
            sg->a1 = rnd_int(1, 4);
            sg->b0 = sg->a1 + rnd_int(1, 2 * c->bs + 3);
            sg->b1 = sg->b0 + len - sg->a1;
        } else {
            sg->a0 = sg->a1 = sg->b0 = 0;
            sg->b1 = len;
        }
        c->nblk[s] = (sg->b1 + c->bs - 1) / c->bs;
        total_blocks += c->nblk[s];
    }
    c->num_blocks = total_blocks + rnd_int(0, 3);

    /* block ids: a random permutation, dealt out to the sequences */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)c->num_blocks);
    for (int64_t i = 0; i < c->num_blocks; i++) perm[i] = (int32_t)i;
    for (int64_t i = c->num_blocks - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rnd_u64() % (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int64_t next = 0;
    for (int s = 0; s < c->nseq; s++) {
        c->tables[s] = malloc(sizeof(int32_t) * (size_t)(c->nblk[s] ? c->nblk[s] : 1));
        for (int64_t i = 0; i < c->nblk[s]; i++) c->tables[s][i] = perm[next++];
    }
    free(perm);

    /* the pool and its expected image start as all-ones bytes: NaN in f32 and f64 */
    const size_t pool_bytes = (size_t)c->num_blocks * c->g.block_bytes;
    c->arena = xalloc(pool_bytes);
    c->expect = xalloc(pool_bytes);
    memset(c->arena, 0xFF, pool_bytes);
    memset(c->expect, 0xFF, pool_bytes);

    /* random K/V per held rank, written in random chunks per segment and layer */
    const size_t tok = (size_t)c->hkv * c->d;
    for (int s = 0; s < c->nseq; s++) {
        const pkv_segs *sg = &c->segs[s];
        const int64_t held = held_of(c, s);
        const size_t per_layer = (size_t)held * tok;
        c->kref[s] = xalloc(per_layer * c->layers * c->item);
        c->vref[s] = xalloc(per_layer * c->layers * c->item);
        for (size_t i = 0; i < per_layer * c->layers; i++) {
            put(c->kref[s], i, dt, rnd_normal());
            put(c->vref[s], i, dt, rnd_normal());
        }
        for (int layer = 0; layer < c->layers; layer++) {
            const char *kl = (const char *)c->kref[s] + (size_t)layer * per_layer * c->item;
            const char *vl = (const char *)c->vref[s] + (size_t)layer * per_layer * c->item;
            const int64_t seg_lo[2] = {sg->a0, sg->b0}, seg_hi[2] = {sg->a1, sg->b1};
            int64_t rank = 0;
            for (int k = 0; k < 2; k++) {
                for (int64_t slot = seg_lo[k]; slot < seg_hi[k];) {
                    int64_t n = rnd_int(1, 2 * c->bs + 1);
                    if (n > seg_hi[k] - slot) n = seg_hi[k] - slot;
                    pkv_write_tokens(&c->g, c->arena, c->tables[s], layer, slot, n,
                                     kl + (size_t)rank * tok * c->item,
                                     vl + (size_t)rank * tok * c->item, dt);
                    slot += n;
                    rank += n;
                }
            }
            if (st != dt) {
                /* narrower storage: what was stored is within the storage's
                 * rounding of what was written, and becomes the reference */
                char *kl_w = (char *)kl, *vl_w = (char *)vl;
                const size_t bytes = (size_t)held * tok * c->item;
                char *k = xalloc(bytes ? bytes : 1), *v = xalloc(bytes ? bytes : 1);
                const int64_t n0 = sg->a1 - sg->a0;
                pkv_read_tokens(&c->g, c->arena, c->tables[s], layer, sg->a0, sg->a1, k, v, dt);
                pkv_read_tokens(&c->g, c->arena, c->tables[s], layer, sg->b0, sg->b1,
                                k + (size_t)n0 * tok * c->item, v + (size_t)n0 * tok * c->item, dt);
                for (int kv = 0; kv < 2; kv++) {
                    const char *w = kv ? vl : kl, *got = kv ? v : k;
                    for (size_t i = 0; i < (size_t)held * tok; i += c->d) {
                        double amax = 0;
                        for (int j = 0; j < c->d; j++)
                            if (fabs(get(w, i + j, dt)) > amax) amax = fabs(get(w, i + j, dt));
                        for (int j = 0; j < c->d; j++) {
                            const double x = get(w, i + j, dt), y = get(got, i + j, dt);
                            CHECK(fabs(x - y) <= store_tol(st, x, amax),
                                  "storage %d: wrote %.9g, read back %.9g (d=%d, head amax %.9g, j=%d, compute %d)", st, x, y, c->d, amax, j, dt);
                        }
                    }
                }
                memcpy(kl_w, k, bytes);
                memcpy(vl_w, v, bytes);
                free(k);
                free(v);
                continue;
            }
            /* the expected image, value by value */
            for (int64_t r = 0; r < held; r++) {
                const int64_t slot = slot_of(sg, r);
                const int32_t blk = c->tables[s][slot / c->bs];
                for (int h = 0; h < c->hkv; h++)
                    for (int j = 0; j < c->d; j++) {
                        const size_t src = ((size_t)r * c->hkv + h) * c->d + j;
                        memcpy(c->expect + layout_offset(c, blk, layer, 0, h, (int)(slot % c->bs), j),
                               kl + src * c->item, c->item);
                        memcpy(c->expect + layout_offset(c, blk, layer, 1, h, (int)(slot % c->bs), j),
                               vl + src * c->item, c->item);
                    }
            }
        }
    }

    /* RoPE tables in the compute type for half of the configurations */
    int64_t max_held = 1;
    for (int s = 0; s < c->nseq; s++)
        if (held_of(c, s) > max_held) max_held = held_of(c, s);
    c->rope_half = c->d >= 2 && rnd_int(0, 1) ? rnd_int(1, c->d / 2) : 0;
    if (c->rope_half) {
        c->max_pos = max_held + rnd_int(0, 5);
        c->cos = xalloc((size_t)c->max_pos * c->rope_half * c->item);
        c->sin = xalloc((size_t)c->max_pos * c->rope_half * c->item);
        c->cos_t = xalloc((size_t)c->max_pos * c->rope_half * c->item);
        c->sin_t = xalloc((size_t)c->max_pos * c->rope_half * c->item);
        const double theta = rnd_int(0, 1) ? 10000.0 : 500000.0;
        for (int64_t p = 0; p < c->max_pos; p++)
            for (int i = 0; i < c->rope_half; i++) {
                const double ang = (double)p * pow(theta, -2.0 * i / (2.0 * c->rope_half));
                put(c->cos, (size_t)p * c->rope_half + i, dt, cos(ang));
                put(c->sin, (size_t)p * c->rope_half + i, dt, sin(ang));
                put(c->cos_t, (size_t)i * c->max_pos + p, dt, cos(ang));
                put(c->sin_t, (size_t)i * c->max_pos + p, dt, sin(ang));
            }
    }
}

/* ---- checks of the layout code ------------------------------------------ */
void check_layout(const config *c) {
    const size_t pool_bytes = (size_t)c->num_blocks * c->g.block_bytes;
    size_t bad = 0;
    if (c->st != c->dt) bad = pool_bytes; /* narrower storage: checked by value in config_make */
    while (bad < pool_bytes && c->arena[bad] == c->expect[bad]) bad++;
    CHECK(bad == pool_bytes, "pool byte %zu differs from the layout (bs=%d d=%d hkv=%d layers=%d)",
          bad, c->bs, c->d, c->hkv, c->layers);

    const size_t tok = (size_t)c->hkv * c->d;
    for (int s = 0; s < c->nseq; s++) {
        const pkv_segs *sg = &c->segs[s];
        CHECK(pkv_check_seq(c->tables[s], c->nblk[s], sg, c->bs, c->num_blocks) == 0,
              "pkv_check_seq rejected a consistent sequence");
        /* read back both segments of a random layer */
        const int layer = rnd_int(0, c->layers - 1);
        const int64_t held = held_of(c, s), n0 = sg->a1 - sg->a0;
        char *k = xalloc((size_t)held * tok * c->item), *v = xalloc((size_t)held * tok * c->item);
        pkv_read_tokens(&c->g, c->arena, c->tables[s], layer, sg->a0, sg->a1, k, v, c->dt);
        pkv_read_tokens(&c->g, c->arena, c->tables[s], layer, sg->b0, sg->b1,
                        k + (size_t)n0 * tok * c->item, v + (size_t)n0 * tok * c->item, c->dt);
        const size_t off = (size_t)layer * held * tok * c->item;
        CHECK(memcmp(k, (const char *)c->kref[s] + off, (size_t)held * tok * c->item) == 0 &&
              memcmp(v, (const char *)c->vref[s] + off, (size_t)held * tok * c->item) == 0,
              "pkv_read_tokens did not return what was written");
        free(k);
        free(v);
        /* inconsistent views are refused */
        pkv_segs badseg = *sg;
        badseg.b1 = c->nblk[s] * c->bs + 1;
        CHECK(pkv_check_seq(c->tables[s], c->nblk[s], &badseg, c->bs, c->num_blocks) != 0,
              "pkv_check_seq accepted segments past the blocks held");
        badseg = *sg;
        badseg.a1 = badseg.b0 + 1;
        if (badseg.b0 > 0)
            CHECK(pkv_check_seq(c->tables[s], c->nblk[s], &badseg, c->bs, c->num_blocks) != 0,
                  "pkv_check_seq accepted overlapping segments");
        if (c->nblk[s] > 0) {
            const int32_t keep = c->tables[s][0];
            c->tables[s][0] = (int32_t)c->num_blocks;
            CHECK(pkv_check_seq(c->tables[s], c->nblk[s], sg, c->bs, c->num_blocks) != 0,
                  "pkv_check_seq accepted a block id past the pool");
            c->tables[s][0] = -1;
            CHECK(pkv_check_seq(c->tables[s], c->nblk[s], sg, c->bs, c->num_blocks) != 0,
                  "pkv_check_seq accepted a negative block id");
            c->tables[s][0] = keep;
        }
    }
}
