/* tests/c/fixture.h -- what the C kernel tests build on (fixture.c): random
 * numbers, the failure count, and random pools written through the layout
 * code of include/pagedkv/layout.h, with the values they must hold.
 */
#pragma once
#include <stdint.h>
#include <stdio.h>

#include "pagedkv/layout.h"
#include "pagedkv/types.h"

/* reproducible random numbers (xorshift64*): rng_s is the state, never 0 */
extern uint64_t rng_s;
uint64_t rnd_u64(void); /* the next 64 random bits */

/* failed checks so far (the first 20 are printed) */
extern long failures;
#define CHECK(cond, ...)                                      \
    do {                                                      \
        if (!(cond)) {                                        \
            if (failures < 20) {                              \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                 \
                fputc('\n', stderr);                          \
            }                                                 \
            failures++;                                       \
        }                                                     \
    } while (0)

/* ---- one random configuration ----------------------------------------- */
typedef struct {
    int st, dt, item, bs, d, hkv, hq, layers, nseq; /* storage, compute, compute's itemsize */
    int64_t num_blocks;
    pkv_geom g;
    char *arena;         /* the pool */
    char *expect;        /* what the pool must hold, built from the layout formula */
    int32_t **tables;    /* per sequence */
    int64_t *nblk;
    pkv_segs *segs;
    void **kref, **vref; /* [seq] -> [layer][held rank][hkv][d], dtype dt: the
                          * values stored (read back when storage is narrower) */
    int rope_half;       /* 0: no RoPE */
    void *cos, *sin;     /* [max_pos][half] */
    void *cos_t, *sin_t; /* the same, [half][max_pos] */
    int64_t max_pos;
} config;

static inline int64_t held_of(const config *c, int s) { return pkv_held(&c->segs[s]); }

/* random numbers: an int in [lo, hi] (inclusive), uniform in [0, 1), standard normal */
int rnd_int(int lo, int hi);
double rnd_unif(void);
double rnd_normal(void);

/* 64-aligned (PKV_ALIGN) allocation of n bytes; exits when out of memory */
void *xalloc(size_t n);
/* value i of an array of compute dtype dt (PKV_F32 / PKV_F64), as double; and stored */
double get(const void *p, size_t i, int dt);
void put(void *p, size_t i, int dt, double x);

/* A random pool of storage st and compute dt written through pkv_write_tokens
 * (`big`: one long sequence, enough work for 2 threads and split keys); the
 * values it must hold checked on the way.  config_free releases it. */
void config_make(config *c, int st, int dt, int big);
void config_free(config *c);
/* the pool against its layout formula, byte for byte, and the sequence check */
void check_layout(const config *c);
