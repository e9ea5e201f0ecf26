/* pagedkv/linear_impl.h -- the row-batch linear kernel over one (compute
 * type, instruction set) vocabulary: y = x W^T (+ bias) for a few rows of x.
 *
 * A model's decode step multiplies a handful of rows (one per running
 * request) by every weight matrix: y[m][n] = sum_k x[m][k] * W[n][k], W
 * stored as torch's nn.Linear keeps it, [N][K] row-major.  The kernel reads
 * W once, a tile of PKV_LIN_NR rows at a time, and folds each tile into
 * PKV_LIN_MR rows of x at a time with vertical FMAs over k: MR x NR vector
 * accumulators, one horizontal sum per output at the end of the tile.
 * The W tile (NR x K values) stays in L1/L2 while every row tile of x passes
 * over it, so W streams from memory once per call whatever M is.  While the
 * first row tile passes over a W tile, the next W tile is prefetched at the
 * same offsets (the 4 rows are 4 streams that the hardware prefetchers
 * follow too late: on this AMD EPYC, 1 thread, a 32000 x 512 weight and 24
 * rows, 14.0 ms without, 12.0 ms with).
 *
 * A single row (M = 1, or the last row of M = 3j + 1) has a loop of its own:
 * each W value is used once there, and two k phases of the 4 W rows make 8
 * independent chains.
 *
 * Edges: a tile that runs past the last row of x or of W points its missing
 * rows at the tile's first row and does not store them; the last K % PKV_W
 * values are summed in the compute type after the vector part.
 *
 * Instantiated by attn_instances.h after a vocabulary (PKV_T, PKV_VEC,
 * PKV_W, PKV_VLOAD, PKV_VADD, PKV_VFMA, PKV_VZERO, PKV_VREDUCE) with PKV_FN defined;
 * dispatched and threaded by linear.h.  No include guard on purpose.
 */
#define PKV_LIN_MR 3
#define PKV_LIN_NR 4

/* Rows [n0, n1) of the output columns, every row m of x: y[m * ldy + n].
 * x [M][K], w [N][K] (only rows n0..n1-1 read), bias [N] or NULL.
 * Arguments are trusted (linear.h's caller checked them). */
static void PKV_FN(linear_rows)(const PKV_T *restrict x, int64_t M, const PKV_T *restrict w,
                                const PKV_T *restrict bias, int64_t K, int64_t n0, int64_t n1,
                                PKV_T *restrict y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n += PKV_LIN_NR) {
        const int nn = n1 - n < PKV_LIN_NR ? (int)(n1 - n) : PKV_LIN_NR;
        const PKV_T *w0 = w + n * K;
        const PKV_T *w1 = nn > 1 ? w0 + K : w0, *w2 = nn > 2 ? w0 + 2 * K : w0,
                    *w3 = nn > 3 ? w0 + 3 * K : w0;
        /* the next W tile (when whole), prefetched during the first row tile */
        const PKV_T *pf = n + 2 * PKV_LIN_NR <= n1 ? w0 + PKV_LIN_NR * K : NULL;
        for (int64_t m = 0; m < M; m += PKV_LIN_MR) {
            const int mm = M - m < PKV_LIN_MR ? (int)(M - m) : PKV_LIN_MR;
            const PKV_T *x0 = x + m * K;
            const PKV_T *x1 = mm > 1 ? x0 + K : x0, *x2 = mm > 2 ? x0 + 2 * K : x0;
            PKV_T s[PKV_LIN_MR][PKV_LIN_NR];
            int64_t k = 0;
            const int prefetch = m == 0 && pf != NULL;
#define PKV_LIN_PREFETCH(k)                               \
    if (prefetch) {                                       \
        __builtin_prefetch(pf + (k), 0, 3);               \
        __builtin_prefetch(pf + K + (k), 0, 3);           \
        __builtin_prefetch(pf + 2 * K + (k), 0, 3);       \
        __builtin_prefetch(pf + 3 * K + (k), 0, 3);       \
    }
/* W row j of the tile at k into the accumulators a0j, a1j, a2j of the 3 rows of x */
#define PKV_LIN_COLUMN(j)                                 \
    {                                                     \
        const PKV_VEC v = PKV_VLOAD(w##j + k);            \
        a0##j = PKV_VFMA(u0, v, a0##j);                   \
        a1##j = PKV_VFMA(u1, v, a1##j);                   \
        a2##j = PKV_VFMA(u2, v, a2##j);                   \
    }
            if (mm == 1) {
                /* one row (M = 1, or the last of M = 3j + 1): every W value is used once, so
                 * two k phases give 8 independent chains instead of 3 copies of one row */
                PKV_VEC b00 = PKV_VZERO(), b01 = b00, b10 = b00, b11 = b00;
                PKV_VEC b20 = b00, b21 = b00, b30 = b00, b31 = b00;
                for (; k + 2 * PKV_W <= K; k += 2 * PKV_W) {
                    PKV_LIN_PREFETCH(k)
                    PKV_LIN_PREFETCH(k + PKV_W)
                    const PKV_VEC u = PKV_VLOAD(x0 + k), u2 = PKV_VLOAD(x0 + k + PKV_W);
                    b00 = PKV_VFMA(u, PKV_VLOAD(w0 + k), b00);
                    b01 = PKV_VFMA(u2, PKV_VLOAD(w0 + k + PKV_W), b01);
                    b10 = PKV_VFMA(u, PKV_VLOAD(w1 + k), b10);
                    b11 = PKV_VFMA(u2, PKV_VLOAD(w1 + k + PKV_W), b11);
                    b20 = PKV_VFMA(u, PKV_VLOAD(w2 + k), b20);
                    b21 = PKV_VFMA(u2, PKV_VLOAD(w2 + k + PKV_W), b21);
                    b30 = PKV_VFMA(u, PKV_VLOAD(w3 + k), b30);
                    b31 = PKV_VFMA(u2, PKV_VLOAD(w3 + k + PKV_W), b31);
                }
                for (; k + PKV_W <= K; k += PKV_W) {
                    const PKV_VEC u = PKV_VLOAD(x0 + k);
                    b00 = PKV_VFMA(u, PKV_VLOAD(w0 + k), b00);
                    b10 = PKV_VFMA(u, PKV_VLOAD(w1 + k), b10);
                    b20 = PKV_VFMA(u, PKV_VLOAD(w2 + k), b20);
                    b30 = PKV_VFMA(u, PKV_VLOAD(w3 + k), b30);
                }
                s[0][0] = PKV_VREDUCE(PKV_VADD(b00, b01));
                s[0][1] = PKV_VREDUCE(PKV_VADD(b10, b11));
                s[0][2] = PKV_VREDUCE(PKV_VADD(b20, b21));
                s[0][3] = PKV_VREDUCE(PKV_VADD(b30, b31));
            } else {
                PKV_VEC a00 = PKV_VZERO(), a01 = a00, a02 = a00, a03 = a00;
                PKV_VEC a10 = a00, a11 = a00, a12 = a00, a13 = a00;
                PKV_VEC a20 = a00, a21 = a00, a22 = a00, a23 = a00;
                for (; k + PKV_W <= K; k += PKV_W) {
                    PKV_LIN_PREFETCH(k)
                    const PKV_VEC u0 = PKV_VLOAD(x0 + k), u1 = PKV_VLOAD(x1 + k),
                                  u2 = PKV_VLOAD(x2 + k);
                    PKV_LIN_COLUMN(0)
                    PKV_LIN_COLUMN(1)
                    PKV_LIN_COLUMN(2)
                    PKV_LIN_COLUMN(3)
                }
                s[0][0] = PKV_VREDUCE(a00), s[0][1] = PKV_VREDUCE(a01);
                s[0][2] = PKV_VREDUCE(a02), s[0][3] = PKV_VREDUCE(a03);
                s[1][0] = PKV_VREDUCE(a10), s[1][1] = PKV_VREDUCE(a11);
                s[1][2] = PKV_VREDUCE(a12), s[1][3] = PKV_VREDUCE(a13);
                s[2][0] = PKV_VREDUCE(a20), s[2][1] = PKV_VREDUCE(a21);
                s[2][2] = PKV_VREDUCE(a22), s[2][3] = PKV_VREDUCE(a23);
            }
#undef PKV_LIN_PREFETCH
#undef PKV_LIN_COLUMN
            const PKV_T *xr[PKV_LIN_MR] = {x0, x1, x2};
            const PKV_T *wr[PKV_LIN_NR] = {w0, w1, w2, w3};
            for (int i = 0; i < mm; i++) {
                PKV_T *out = y + (m + i) * ldy + n;
                for (int j = 0; j < nn; j++) {
                    PKV_T t = s[i][j];
                    for (int64_t kk = k; kk < K; kk++) t += xr[i][kk] * wr[j][kk];
                    out[j] = bias ? t + bias[n + j] : t;
                }
            }
        }
    }
}

#undef PKV_LIN_MR
#undef PKV_LIN_NR
