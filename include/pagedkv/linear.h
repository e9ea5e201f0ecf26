/* pagedkv/linear.h -- y = x W^T (+ bias) for a few rows of x: dispatch and
 * threads of the row-batch linear kernel (linear_impl.h, instantiated per
 * compute type and instruction set by attention.h).
 *
 * Made for a decode step's matrix products, where every running request
 * contributes one row and the weight is read once for all of them.  The
 * output columns (rows of W) are split over the threads in equal contiguous
 * parts, a multiple of the kernel's 4-row tile each, so every thread streams
 * its own part of W once.
 */
#pragma once
#include <stdint.h>
#include "attention.h"
#include "simd.h"

typedef void (*pkv_linear_fn)(const void *x, int64_t M, const void *w, const void *bias,
                              int64_t K, int64_t n0, int64_t n1, void *y, int64_t ldy);

#define PKV_LINEAR_FN(ct, isa) ((pkv_linear_fn)linear_rows_##ct##_##isa)

/* The kernel of (compute type f64 = 0 / 1, SIMD path); the scalar one for a
 * path not built here. */
static inline pkv_linear_fn pkv_linear_for(int f64, int simd) {
    simd = pkv_simd_base(simd);
#if PKV_X86
    if (simd == PKV_SIMD_AVX512) return f64 ? PKV_LINEAR_FN(f64, avx512) : PKV_LINEAR_FN(f32, avx512);
    if (simd == PKV_SIMD_AVX2) return f64 ? PKV_LINEAR_FN(f64, avx2) : PKV_LINEAR_FN(f32, avx2);
#endif
#if PKV_ARM64
    if (simd == PKV_SIMD_NEON) return f64 ? PKV_LINEAR_FN(f64, neon) : PKV_LINEAR_FN(f32, neon);
#endif
    (void)simd;
    return f64 ? PKV_LINEAR_FN(f64, scalar) : PKV_LINEAR_FN(f32, scalar);
}

/* y[m * ldy + n] = sum_k x[m * K + k] * w[n * K + k] (+ bias[n]) for m < M,
 * n < N, on up to nthreads threads (one below PKV_PARALLEL_MIN multiply-adds,
 * as the attention kernels).  x [M][K], w [N][K], bias [N] or NULL, y rows
 * ldy >= N apart; all of the compute type.  Arguments are trusted (the
 * caller checked shapes and strides). */
static inline void pkv_linear(int f64, int simd, int nthreads, const void *x, int64_t M,
                              const void *w, const void *bias, int64_t K, int64_t N, void *y,
                              int64_t ldy) {
    const pkv_linear_fn f = pkv_linear_for(f64, simd);
    const int64_t tiles = (N + 3) / 4;
    if ((double)M * (double)N * (double)K < (double)PKV_PARALLEL_MIN) nthreads = 1;
    if (nthreads > tiles) nthreads = tiles > 0 ? (int)tiles : 1;
    if (nthreads <= 1) { /* no OpenMP region, as the kernels */
        f(x, M, w, bias, K, 0, N, y, ldy);
        return;
    }
    int t;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (t = 0; t < nthreads; t++) {
        const int64_t n0 = tiles * t / nthreads * 4, n1 = tiles * (t + 1) / nthreads * 4;
        f(x, M, w, bias, K, n0, n1 < N ? n1 : N, y, ldy);
    }
}
