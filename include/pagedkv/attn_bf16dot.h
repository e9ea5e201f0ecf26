/* pagedkv/attn_bf16dot.h -- bfloat16 keys scored with vdpbf16ps (AVX512_BF16),
 * float32 compute.  Included by attn_tile.h when PKV_BF16_DOT is 1
 * (attention.h instantiates that once, for the AVX-512 + VNNI + BF16 path):
 * the query rows rounded to bfloat16, their row handle (PKV_KFN(qrow_t)) and
 * the score micro-kernels (PKV_BDOT_MK), which attn_tile.h instantiates and
 * its tile_scores calls in place of the float ones; a template like
 * attn_tile.h, no include guard.
 *
 * vdpbf16ps takes two bfloat16 values per float32 lane of each operand and
 * adds both products to the lane: acc[l] += a[2l] b[2l] + a[2l+1] b[2l+1].
 * A product of two bfloat16 values is exact in float32, so one instruction
 * does the work of two float32 FMAs on 16 lanes without converting the keys
 * (measured on an AMD EPYC Zen 4 class core: 115-117 G products/s against
 * 57-59 G float32 FMA lanes/s, docs/performance.md).
 *
 * The query is rounded to bfloat16 once per work item (each row as given:
 * the softmax step applies the scale, attn_tile.h), to nearest even, with
 * vcvtne2ps2bf16.  That is this path's accuracy cost, documented in
 * docs/performance.md: a query value's relative error is at most 2^-8, the
 * same rounding the keys took when stored.  Like every AVX512_BF16
 * instruction, the conversion and the dot product take subnormal inputs as
 * zero and flush subnormal results (values below 2^-126, far below any
 * score that survives the softmax).  A NaN query value stays NaN; an
 * infinite one stays infinite.  PAGEDKV_SIMD=avx512vnni scores the same keys
 * with the query as it is.
 *
 * Two dimensions of one key share a lane, while K^T holds one dimension of
 * consecutive keys per row (types.h): each pair of K^T rows is interleaved in
 * registers (kpair, one vpermt2w), shared by every query row of the register
 * tile.  The stored layout is the same on every path, so pools and files
 * move between machines unchanged.  An odd last dimension pairs its row with
 * zeros (the query's partner value is zero too).
 */
#include <immintrin.h>

/* The rounded query rows of one head: row a's bfloat16 values at q + a * ldq
 * pairs (ldq pairs >= d / 2, the tail zero), a pair per uint32. */
typedef struct {
    const uint32_t *q;
    int ldq;
} PKV_KFN(qrows_t);

/* Row count rows of x (d floats apart) rounded into mem (pkv_qdot_bytes
 * bytes); *out describes them. */
static inline void PKV_KFN(round_rows)(const float *restrict x, int rows, int d, char *mem,
                                       PKV_KFN(qrows_t) *out) {
    const int ldq = (d + 31) / 32 * 16;
    uint32_t *q = (uint32_t *)mem;
    for (int a = 0; a < rows; a++) {
        const float *xr = x + (size_t)a * d;
        uint32_t *qr = q + (size_t)a * ldq;
        for (int i = 0; i < 2 * ldq; i += 32) {
            const int n0 = d - i, n1 = d - i - 16;
            const __mmask16 m0 = (__mmask16)(n0 >= 16 ? 0xFFFF : n0 > 0 ? (1u << n0) - 1 : 0);
            const __mmask16 m1 = (__mmask16)(n1 >= 16 ? 0xFFFF : n1 > 0 ? (1u << n1) - 1 : 0);
            const __m512 x0 = _mm512_maskz_loadu_ps(m0, xr + i);
            const __m512 x1 = _mm512_maskz_loadu_ps(m1, xr + i + 16);
            /* values i .. i + 15 in the low half, i + 16 .. i + 31 in the high one */
            const __m512bh b = _mm512_cvtne2ps_pbh(x1, x0);
            _mm512_storeu_si512((void *)(qr + i / 2), (__m512i)b);
        }
    }
    out->q = q;
    out->ldq = ldq;
}

/* One rounded row as the micro-kernels take it (attn_tile.h's row handle):
 * its pairs */
typedef const uint32_t *PKV_KFN(qrow_t);

static inline PKV_KFN(qrow_t) PKV_KFN(qrow)(const PKV_KFN(qrows_t) *h, int row, int d) {
    (void)d;
    return h->q + (size_t)row * h->ldq;
}

/* The rows of one head: rows [first, ...) of all */
static inline PKV_KFN(qrows_t) PKV_KFN(qrows_from)(const PKV_KFN(qrows_t) *all, int first) {
    PKV_KFN(qrows_t) h = *all;
    h.q += (size_t)first * all->ldq;
    return h;
}

/* K^T rows i and i + 1 of 16 keys (rows `stride` values apart) as 16 lanes
 * of two bfloat16 values, key k's dimension i in the low half of lane k and
 * dimension i + 1 in the high half */
static inline __m512i PKV_KFN(kpair)(const uint16_t *p, size_t stride) {
    /* value 2k of the result = value k of the first operand, 2k + 1 = value
     * k of the second (index 32 + k); with adjacent rows (16 keys a block)
     * one load holds both (index 16 + k) */
    static const uint16_t two[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t one[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    if (stride == 16)
        return _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)one), _mm512_loadu_si512((const void *)p));
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + stride)));
    return _mm512_permutex2var_epi16(a, _mm512_loadu_si512((const void *)two), b);
}

/* Scores of R rows x NV key vectors (as PKV_SCORES_MK in attn_tile.h): q the
 * rows (bfloat16 pairs), e the key vectors (bfloat16 K^T), results to
 * out[r * NV + v].  DS independent sets over alternate pairs of dimensions,
 * PKV_MK_ROUND(DS) pairs a round (attn_tile.h's sweeps' rounds). */
#define PKV_BDOT_MK(NAME, R, NV, DS, PF)                                                          \
    static inline void PKV_KFN(NAME)(const PKV_KFN(qrow_t) *q, const pkv_kvec *e, size_t stride,  \
                                     int d, PKV_VEC *out, pkv_pfs *ps) {                          \
        PKV_VEC acc[DS][R][NV];                                                                   \
        const uint16_t *kp[NV];                                                                   \
        for (int v = 0; v < NV; v++) kp[v] = (const uint16_t *)e[v].k;                            \
        for (int u = 0; u < DS; u++)                                                              \
            for (int r = 0; r < R; r++)                                                           \
                for (int v = 0; v < NV; v++) acc[u][r][v] = PKV_VZERO();                          \
        const ptrdiff_t d2 = d & ~1;                                                              \
        PKV_PFS_BEGIN(PF ? ps : NULL)                                                             \
        const int l1k_ = ps != NULL && ps->l1k; /* as attn_tile.h's PKV_SC_SWEEP */               \
        ptrdiff_t i = 0;                                                                          \
        for (; i + 2 * PKV_MK_ROUND(DS) <= d2; i += 2 * PKV_MK_ROUND(DS)) {                   \
            PKV_PFS_STEP(PKV_MK_ROUND(DS) * (NV))                                               \
            PKV_L1K_ROWS(l1k_, kp, NV, i + 2 * PKV_L1K_AHEAD, 2 * PKV_MK_ROUND(DS), 1, stride)   \
            for (int u = 0; u < PKV_MK_ROUND(DS); u++)                                          \
                PKV_BDOT_STEP(acc[u % (DS)], R, NV, i + 2 * u, PKV_KFN(kpair)(kp[v] + (size_t)(i + 2 * u) * stride, stride)) \
        }                                                                                         \
        for (; i < d2; i += 2)                                                                    \
            PKV_BDOT_STEP(acc[0], R, NV, i, PKV_KFN(kpair)(kp[v] + (size_t)i * stride, stride))  \
        PKV_PFS_END(ps)                                                                           \
        if (d2 < d) /* an odd last dimension, paired with zeros */                                \
            PKV_BDOT_STEP(acc[0], R, NV, d2,                                                      \
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kp[v] + (size_t)d2 * stride)))) \
        PKV_MK_REDUCE(acc, R, NV, DS, PKV_SC_PUT)                                                 \
    }
/* one pair of dimensions i, i + 1: NV interleaved key loads (KLOAD, in terms
 * of v), then a broadcast of each row's pair and NV dot products per row */
#define PKV_BDOT_STEP(acc, R, NV, i, KLOAD)                                                       \
    {                                                                                             \
        __m512i kk[NV];                                                                           \
        for (int v = 0; v < NV; v++) kk[v] = KLOAD;                                               \
        for (int r = 0; r < R; r++) {                                                             \
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)q[r][(i) / 2]);                   \
            for (int v = 0; v < NV; v++) (acc)[r][v] = _mm512_dpbf16_ps((acc)[r][v], (__m512bh)kk[v], b); \
        }                                                                                         \
    }

/* (instantiated by attn_tile.h: PKV_REGISTER_TILES(PKV_BDOT_MK, sc, PKV_SC_NV)) */
