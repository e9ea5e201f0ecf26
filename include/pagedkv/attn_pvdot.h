/* pagedkv/attn_pvdot.h -- P.V of int8 values with an int16 dot product
 * (vpdpwssd, AVX512_VNNI), float32 compute.  Included by attn_tile.h in the
 * int8 instance of AVX-512 + VNNI (PKV_I8_DOT, PKV_DOT_VNNI512); tile_values
 * takes it where pkv_pv_int16 (prefetch.h) says, for groups of four rows; a
 * template like attn_tile.h, no include guard.
 *
 * The float path widens every loaded vector of values, multiplies it by its
 * key's group scale and multiply-adds it into each row: a multiply-add per
 * value and row.  Here, per tile, row and scale group of 32 dimensions, the
 * weights times their keys' scales are rounded to int16 against the largest
 * of them:
 *
 *     w[k] = rint(p[k] / pmax * s[k] / smax * 32767),  unit = pmax * smax / 32767
 *
 * (pmax the row's largest weight in the tile, smax the group's largest value
 * scale), the values of two consecutive keys interleaved into int16 pairs on
 * load, and one vpdpwssd per row and 16 dimensions multiply-adds both keys
 * exactly in int32 (a pair's two weights broadcast as one int32).  At the
 * tile's end each row's sums are converted once and multiplied by the unit.
 * vpdpwssd does 32 multiply-adds where the FMA does 16, at the same rate on
 * AMD Zen 4, whose 512-bit FMA is two 256-bit halves.
 *
 * What it costs in accuracy: each weight moves by at most half a unit, so a
 * row moves by at most (keys of a tile) / 65534 of max |v| and, the
 * roundings being independent, in practice by 5e-6 to 4e-5 of it
 * (docs/performance.md).  A row whose weights hold a NaN or an infinity, or
 * whose largest is under 1e-30 (its unit would underflow), takes the float
 * path on its own, so it changes no other row; a tile whose value scales do
 * is left to the float path whole, as are tiles of more than
 * PKV_PVI_MAX_KEYS keys with their odd runs' padding (the weights' buffer;
 * the int32 sums could not overflow below 512 keys: 512 x 32767 x 127 <
 * 2^31) and the dimensions past the last multiple of 64.
 */
#if PKV_DOT_ISA == PKV_DOT_VNNI512
#define PKV_PVI 1
#define PKV_PVI_MAX_KEYS 256 /* a tile's keys and odd runs' padding: w's row stride */
#define PKV_PVI_MAX_GROUPS 16 /* head_dim up to 512 */

/* m = the lanewise maximum of m and x[0, n) (values >= 0 or NaN), nan |= the
 * lanes that held a NaN */
static inline __m512 PKV_KFN(pvi_max)(__m512 m, __mmask16 *nan, const float *x, int n) {
    for (int j = 0; j < n; j += 16) {
        const __m512 x16 = _mm512_maskz_loadu_ps(PKV_KFN(quant_lanes)(n - j), x + j);
        *nan |= _mm512_cmp_ps_mask(x16, x16, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, x16);
    }
    return m;
}

/* the largest of a tile's weights or scales as the int16 path takes it:
 * 0 or in [1e-30, 1e30]; -1 otherwise (NaN, infinity, tiny) */
static inline float PKV_KFN(pvi_top)(__m512 m, __mmask16 nan) {
    const float x = _mm512_reduce_max_ps(m);
    return nan == 0 && (x == 0.0f || (x >= 1e-30f && x <= 1e30f)) ? x : -1.0f;
}

/* acc += x . the int16 pair at w broadcast to every lane (vpdpwssd with an
 * embedded broadcast).  Written as an instruction: with the intrinsic GCC
 * copied each accumulator to another register and back around every
 * vpdpwssd and kept some on the stack. */
#if defined(__GNUC__)
#define PKV_PVI_DOT(acc, x, w) \
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*(const char(*)[4])(const void *)(w)))
#else
#define PKV_PVI_DOT(acc, x, w) ((acc) = _mm512_dpwssd_epi32((acc), (x), _mm512_set1_epi32(*(const int32_t *)(const void *)(w))))
#endif

/* Rows y[0, 4 ngr) (weights pr[], alphas al[] as tile_values has them) =
 * y * alpha + P . V over dimensions [0, the returned count) of the tile's
 * runs (tile columns [0, nk), runs in column order); 0 when the tile is
 * left to the float path (nothing written). */
static inline int PKV_KFN(values_i16)(float *const *y, const float *al, const float *const *pr,
                                      int ngr, const PKV_KFN(run_t) *runs, int nr, size_t bs,
                                      int d, pkv_pfs *ps) {
    const int dc = d & ~63, ng = dc / 32, nrows = 4 * ngr;
    const int nk = runs[nr - 1].col + runs[nr - 1].n;
    if (dc == 0 || ng > PKV_PVI_MAX_GROUPS || nk + nr > PKV_PVI_MAX_KEYS) return 0;
    float pm[PKV_MAX_ROWS + 4], sm[PKV_PVI_MAX_GROUPS];
    /* a row whose weights hold a NaN, an infinity or only tiny ones takes
     * the float path on its own (below), so that it changes no other row */
    char bad[PKV_MAX_ROWS + 4];
    int nbad = 0;
    for (int a = 0; a < nrows; a++) {
        __mmask16 nan = 0;
        pm[a] = PKV_KFN(pvi_top)(PKV_KFN(pvi_max)(_mm512_setzero_ps(), &nan, pr[a], nk), nan);
        bad[a] = pm[a] < 0;
        if (bad[a]) {
            pm[a] = 0;
            nbad++;
        }
    }
    for (int g = 0; g < ng; g++) {
        __mmask16 nan = 0;
        __m512 m = _mm512_setzero_ps();
        for (int u = 0; u < nr; u++)
            m = PKV_KFN(pvi_max)(m, &nan, runs[u].vsc + (size_t)g * bs + runs[u].off, runs[u].n);
        sm[g] = PKV_KFN(pvi_top)(m, nan);
        if (sm[g] < 0) return 0;
    }
    /* pc[u]: where run u's weights start in a row of w, an even column (an
     * odd run's last key pairs with a weight of 0 after it) */
    int pc[PKV_TILE_KEYS + 1];
    pc[0] = 0;
    for (int u = 0; u < nr; u++) pc[u + 1] = pc[u] + ((runs[u].n + 1) & ~1);
    /* w[(g * 4 + r) * PKV_PVI_MAX_KEYS + pc[u] + j]: row r's weight of key j of run
     * u for group g (one stride for all, so a step addresses its rows' and
     * groups' weights at constant offsets from one pointer) */
    int16_t w[PKV_PVI_MAX_GROUPS * 4 * PKV_PVI_MAX_KEYS];
    float fs[PKV_PVI_MAX_GROUPS];
    for (int g = 0; g < ng; g++) fs[g] = sm[g] > 0 ? 1.0f / sm[g] : 0.0f;
    for (int gr = 0; gr < ngr; gr++) {
        __m512 fr[4];
        for (int r = 0; r < 4; r++) {
            const int a = 4 * gr + r;
            fr[r] = _mm512_set1_ps(pm[a] > 0 ? 32767.0f / pm[a] : 0.0f);
        }
        /* per 16 keys: the four rows' weights over their maxima once, then
         * each group's scales over theirs times each row's */
        for (int u = 0; u < nr; u++) {
            const int n = runs[u].n;
            for (int j = 0; j < n; j += 16) {
                const __mmask16 k = PKV_KFN(quant_lanes)(n - j);
                __m512 pf[4];
                for (int r = 0; r < 4; r++)
                    pf[r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, pr[4 * gr + r] + runs[u].col + j), fr[r]);
                const float *sc = runs[u].vsc + runs[u].off + j;
                int16_t *dst = w + pc[u] + j;
                for (int g = 0; g < ng; g++, sc += bs, dst += 4 * PKV_PVI_MAX_KEYS) {
                    const __m512 s16 = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sc), _mm512_set1_ps(fs[g]));
                    for (int r = 0; r < 4; r++) {
                        const __m512 x = _mm512_mul_ps(pf[r], s16);
                        _mm256_mask_storeu_epi16(dst + r * PKV_PVI_MAX_KEYS, k,
                                                 _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
                    }
                }
            }
            if (n & 1)
                for (int g = 0; g < ng; g++)
                    for (int r = 0; r < 4; r++) w[(size_t)(g * 4 + r) * PKV_PVI_MAX_KEYS + pc[u] + n] = 0;
        }
        for (int c = 0; c < dc; c += 64) {
            /* acc[r][v]: 16 dimensions of the chunk, the low (v even) or high
             * 8 of each 128-bit half of a key pair's 32 bytes (as
             * vpunpck{l,h}bw leave them); merged back at the end */
            __m512i acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_si512();
            const int16_t *wc = w + (size_t)(c / 32) * 4 * PKV_PVI_MAX_KEYS;
            PKV_PFS_BEGIN(gr == 0 ? ps : NULL)
            for (int u = 0; u < nr; u++) {
                const int8_t *v0 = runs[u].v + (size_t)runs[u].off * d + c;
                const int8_t *const vend = v0 + (size_t)runs[u].n * d;
                const int16_t *wp = wc + pc[u];
                for (; v0 < vend; v0 += 2 * (size_t)d, wp += 2) {
                    const int8_t *v1 = v0 + d < vend ? v0 + d : v0; /* (its weight is 0) */
                    PKV_PFS_STEP(2)
                    __m512i x[4];
                    for (int hh = 0; hh < 2; hh++) {
                        const __m256i a_ = _mm256_loadu_si256((const __m256i *)(v0 + 32 * hh));
                        const __m256i b_ = _mm256_loadu_si256((const __m256i *)(v1 + 32 * hh));
                        x[2 * hh] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a_, b_));
                        x[2 * hh + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a_, b_));
                    }
                    for (int r = 0; r < 4; r++) {
                        PKV_PVI_DOT(acc[r][0], x[0], wp + r * PKV_PVI_MAX_KEYS);
                        PKV_PVI_DOT(acc[r][1], x[1], wp + r * PKV_PVI_MAX_KEYS);
                        PKV_PVI_DOT(acc[r][2], x[2], wp + (4 + r) * PKV_PVI_MAX_KEYS);
                        PKV_PVI_DOT(acc[r][3], x[3], wp + (4 + r) * PKV_PVI_MAX_KEYS);
                    }
                }
            }
            PKV_PFS_END(ps)
            for (int r = 0; r < 4; r++) {
                const int a = 4 * gr + r;
                for (int h = 0; h < 2; h++) {
                    const __m512 un = _mm512_set1_ps(pm[a] * sm[c / 32 + h] * (1.0f / 32767.0f));
                    const __m512 lo = _mm512_cvtepi32_ps(acc[r][2 * h]), hi = _mm512_cvtepi32_ps(acc[r][2 * h + 1]);
                    /* dimensions 0-7 and 16-23 of the group are lo's halves, 8-15 and 24-31 hi's */
                    const __m512 t0 = _mm512_mul_ps(_mm512_shuffle_f32x4(lo, hi, 0x44), un);
                    const __m512 t1 = _mm512_mul_ps(_mm512_shuffle_f32x4(lo, hi, 0xEE), un);
                    float *yy = y[a] + c + 32 * h;
                    if (bad[a]) continue;
                    if (al[a] == 0) { /* a row's first tile: y is set, never read */
                        _mm512_storeu_ps(yy, t0);
                        _mm512_storeu_ps(yy + 16, t1);
                    } else {
                        const __m512 va = _mm512_set1_ps(al[a]);
                        _mm512_storeu_ps(yy, _mm512_fmadd_ps(_mm512_loadu_ps(yy), va, t0));
                        _mm512_storeu_ps(yy + 16, _mm512_fmadd_ps(_mm512_loadu_ps(yy + 16), va, t1));
                    }
                }
            }
        }
    }
    for (int a = 0; nbad && a < nrows; a++) /* the float path, one value at a time */
        if (bad[a]) PKV_KFN(values_scalar)(y[a], al[a], pr[a], runs, nr, bs, d, 0, dc);
    return dc;
}
#undef PKV_PVI_MAX_KEYS
#undef PKV_PVI_MAX_GROUPS
#undef PKV_PVI_DOT
#else
#define PKV_PVI 0
#endif
