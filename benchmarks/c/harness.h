/* harness.h -- what the C benchmarks next to this file share: a wall clock,
 * a seeded generator, a comparison for qsort, a median and a shuffled block order.
 * Each program includes it once (static functions, no include guard needed
 * beyond this one). */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* seconds of a monotonic clock */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* the median of x[0, n), n >= 1, sorting x in place */
static double median(double *x, int n) {
    qsort(x, n, sizeof(double), cmp_d);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* ids[0, n) = 0 .. n - 1 in a random order (Fisher-Yates): blocks lying
 * where no hardware prefetcher follows, as in a pool after much churn */
static void shuffled_ids(int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)i;
    for (int64_t i = n - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rng() % (uint64_t)(i + 1));
        const int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
}
