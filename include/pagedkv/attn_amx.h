/* pagedkv/attn_amx.h -- bfloat16 keys scored in AMX tiles (tdpbf16ps),
 * float32 compute.  Included by attn_tile.h when PKV_BF16_AMX is 1
 * (attention.h instantiates that once, for the AVX-512 + AMX path): the
 * staged query rows, their handle (PKV_KFN(qrows_t)) and tile_scores, which
 * replaces the vector one (kept as tile_scores_vec, its fallback).  A
 * template like attn_tile.h, no include guard.
 *
 * tdpbf16ps multiplies a tile A of M rows x 32 bfloat16 values by a tile B of
 * 16 rows x 16 pairs and adds the float32 sums into a tile C of M rows x 16
 * columns: C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1].
 * Here A is 32 dimensions of the query rows, B 32 dimensions of 16 keys (K^T
 * rows 2k and 2k + 1 interleaved: packed per call from the stored K^T, so
 * the pool's layout is the same on every path), C their scores.  The
 * measured cost on an Intel Xeon with AMX: one tdpbf16ps per 4.5 ns
 * whatever M, 16 x the f32 FMA peak for full tiles (docs/performance.md).
 *
 * The query is not rounded to bfloat16: each value is split into three
 * bfloat16 parts (x truncated to bfloat16, the rest truncated, the rest of
 * that rounded to nearest: every subtraction exact), staged as three rows of
 * A, so the scores see the query to float32's precision (24 significant
 * bits; two parts, 16 bits, measured errors of 2^-16 of the scores, above
 * the float32 tests' tolerance).  A row's three parts give three rows of C,
 * summed when the tile is stored.  Five query rows fill 15 rows of an A
 * tile; M costs nothing.  A NaN or infinite query value makes its row's
 * scores NaN.
 *
 * Tile state: attn_item.h loads the tile configuration at the start of each
 * work item (another library on the thread may have set its own) and
 * releases it at the end (amx_begin / amx_end): 50 ns a pair.
 */
#include <immintrin.h>

/* query rows per A tile (their three parts fill 15 of its 16 rows), and the
 * dimensions one staged set of packed keys covers (d above it: the vector
 * kernels score the keys) */
#define PKV_AMX_ROWS 5
#define PKV_AMX_MAX_D 256
/* Tiles of at most this many rows are scored by the vector kernels (one pass
 * of their 4-row tile): on an Intel Xeon, B=1 L=2048 decode with GQA 4 took
 * 531 us in AMX tiles against 392 us (no variant tried beat the vector
 * kernels there), while with 8 rows (two query tokens) this kernel took 774
 * against 826 us and with 64 query tokens 14.0 against 16.0 ms
 * (docs/performance-history.md). */
#define PKV_AMX_MIN_ROWS 4

/* The staged rows of the item (or of one head: qrows_from): row i's parts
 * at qb + (3 i + p) ldb, p = 0, 1, 2 (bfloat16 values, ldb = d rounded up
 * to 32, the tail zero); qf the rows as float32 (d apart), for the vector
 * fallback. */
typedef struct {
    const float *qf;
    const uint16_t *qb;
    int ldb;
} PKV_KFN(qrows_t);

/* Stage rows [0, rows) of x (d floats apart) into mem (pkv_qdot_bytes). */
static inline void PKV_KFN(stage_rows)(const float *restrict x, int rows, int d, char *mem,
                                       PKV_KFN(qrows_t) *out) {
    const int ldb = (d + 31) / 32 * 32;
    uint16_t *qb = (uint16_t *)mem;
    const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int a = 0; a < rows; a++) {
        const float *xr = x + (size_t)a * d;
        uint16_t *hi = qb + (size_t)(3 * a) * ldb, *mid = hi + ldb, *lo = mid + ldb;
        for (int i = 0; i < ldb; i += 16) {
            const __mmask16 m = (__mmask16)(d - i >= 16 ? 0xFFFF : d > i ? (1u << (d - i)) - 1 : 0);
            const __m512 x = _mm512_maskz_loadu_ps(m, xr + i);
            /* truncations: x - hi and r1 - mb are exact */
            const __m512i hb = _mm512_and_si512(_mm512_castps_si512(x), himask);
            const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(hb));
            const __m512i mb = _mm512_and_si512(_mm512_castps_si512(r1), himask);
            const __m512i rb = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(mb)));
            /* the rest rounded to nearest even (finite, or NaN from a non-finite x) */
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(rb, 16), _mm512_set1_epi32(1));
            const __m512i rr = _mm512_add_epi32(rb, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
            _mm256_storeu_si256((__m256i *)(hi + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hb, 16)));
            _mm256_storeu_si256((__m256i *)(mid + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mb, 16)));
            _mm256_storeu_si256((__m256i *)(lo + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rr, 16)));
        }
    }
    out->qf = x;
    out->qb = qb;
    out->ldb = ldb;
}

/* The rows of one head: rows [first, ...) of all */
static inline PKV_KFN(qrows_t) PKV_KFN(qrows_from)(const PKV_KFN(qrows_t) *all, int first, int d) {
    PKV_KFN(qrows_t) h = *all;
    h.qf += (size_t)first * d;
    h.qb += (size_t)(3 * first) * all->ldb;
    return h;
}

/* The tile configuration, each tile 16 rows of 64 bytes: C of PKV_AMX_NC = 2
 * key vectors (tiles 0, 1: two independent chains of tdpbf16ps); A of even
 * and odd 32-dimension chunks (tiles 4, 5); B alternating between tiles 6
 * and 7.  Tile registers are not renamed: a load into a tile waits until the
 * instructions before it have read it, hence the alternation (reusing one A
 * and one B tile, decode with GQA 4 measured within 10% of the vector
 * kernels with K/V in L2 and 12-58% slower out of it).  Four C tiles measured
 * 5-11% slower for 2-16 query tokens of GQA 4, the same for 64. */
#define PKV_AMX_NC 2
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} pkv_amx_cfg;

static inline void PKV_KFN(amx_begin)(void) {
    pkv_amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

static inline void PKV_KFN(amx_end)(void) { _tile_release(); }

/* 32 dimensions [i0, i0 + 32) of the key vector at kp (K^T rows `stride`
 * values apart, 16 keys from kp on) as a B tile: row k holds, per key, its
 * dimensions i0 + 2k and i0 + 2k + 1.  Dimensions from d on are zero. */
static inline void PKV_KFN(amx_pack)(uint16_t *restrict b, const uint16_t *kp, size_t stride, int i0, int d) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                         7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int k = 0; k < 16; k++) {
        const int i = i0 + 2 * k;
        __m512i x;
        if (i + 1 < d) {
            const uint16_t *r = kp + (size_t)i * stride;
            x = stride == 16 ? _mm512_loadu_si512(r)
                             : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r)),
                                                  _mm256_loadu_si256((const __m256i *)(r + stride)), 1);
        } else if (i < d) {
            x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(kp + (size_t)i * stride)));
            x = _mm512_inserti64x4(x, _mm256_setzero_si256(), 1);
        } else {
            x = _mm512_setzero_si512();
        }
        _mm512_store_si512(b + 32 * k, _mm512_permutexvar_epi16(idx, x));
    }
}

/* Scores of rows[0, na) of q against the key vectors e[0, ne) into sbuf
 * [na][ldc], as tile_scores_vec (attn_tile.h).  Rows that are not one run
 * of consecutive rows, or heads wider than PKV_AMX_MAX_D, go to the vector
 * kernels. */
static inline void PKV_KFN(tile_scores)(const PKV_KFN(qrows_t) *restrict q, const int *rows, int na,
                                        const pkv_kvec *e, int ne, size_t stride, int d,
                                        PKV_T *restrict sbuf, int ldc, pkv_pfs *ps) {
    int run = q->qb != NULL && na > PKV_AMX_MIN_ROWS && d <= PKV_AMX_MAX_D;
    for (int a = 1; a < na && run; a++) run = rows[a] == rows[0] + a;
    if (!run) {
        PKV_KFN(tile_scores_vec)(q->qf, rows, na, e, ne, stride, d, sbuf, ldc, ps);
        return;
    }
    const int nch = (d + 31) / 32;
    /* two sets of packed keys: the next group's are packed between the tile
     * instructions of this one's (so their stores are long done when the
     * tiles load them, and the vector work overlaps the tile work) */
    _Alignas(64) uint16_t kb[2][PKV_AMX_NC][PKV_AMX_MAX_D / 32][16 * 32];
    _Alignas(64) float c[PKV_AMX_NC][16 * 16];
    const size_t lda = (size_t)q->ldb * sizeof(uint16_t); /* bytes from one staged row to the next */
    PKV_PFS_BEGIN(ps)
    for (int v = 0; v < ne && v < PKV_AMX_NC; v++)
        for (int ch = 0; ch < nch; ch++) {
            PKV_PFS_STEP(PKV_PF_STEP_LINES(32))
            PKV_KFN(amx_pack)(kb[0][v][ch], (const uint16_t *)e[v].k, stride, 32 * ch, d);
        }
    for (int v0 = 0, cur = 0; v0 < ne; v0 += PKV_AMX_NC, cur ^= 1) { /* PKV_AMX_NC key vectors, one C tile each */
        const int nv = ne - v0 < PKV_AMX_NC ? ne - v0 : PKV_AMX_NC;
        const int v1 = v0 + PKV_AMX_NC, nn = ne - v1 < PKV_AMX_NC ? ne - v1 : PKV_AMX_NC; /* the next group */
        for (int a0 = 0; a0 < na; a0 += PKV_AMX_ROWS) {
            const int nr = na - a0 < PKV_AMX_ROWS ? na - a0 : PKV_AMX_ROWS;
            const uint16_t *qa = q->qb + (size_t)(3 * rows[a0]) * q->ldb;
            /* tile numbers must be constants: the tiles spelled out */
            _tile_zero(0);
            _tile_zero(1);
            for (int ch = 0; ch < nch; ch++) {
#define PKV_AMX_STEP(ta)                                      \
    _tile_loadd(ta, qa + 32 * ch, lda);                       \
    _tile_loadd(6, kb[cur][0][ch], 64);                       \
    _tile_dpbf16ps(0, ta, 6);                                 \
    if (nv > 1) {                                             \
        _tile_loadd(7, kb[cur][1][ch], 64);                   \
        _tile_dpbf16ps(1, ta, 7);                             \
    }
                if (ch % 2 == 0) {
                    PKV_AMX_STEP(4)
                } else {
                    PKV_AMX_STEP(5)
                }
#undef PKV_AMX_STEP
                for (int v = 0; a0 == 0 && v < nn; v++) {
                    PKV_PFS_STEP(PKV_PF_STEP_LINES(32))
                    PKV_KFN(amx_pack)(kb[cur ^ 1][v][ch], (const uint16_t *)e[v1 + v].k, stride, 32 * ch, d);
                }
            }
            _tile_stored(0, c[0], 64);
            if (nv > 1) _tile_stored(1, c[1], 64);
            for (int v = 0; v < nv; v++)
                for (int r = 0; r < nr; r++) {
                    const float *cr = c[v] + 48 * r;
                    const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(cr), _mm512_load_ps(cr + 16)),
                                                   _mm512_load_ps(cr + 32));
                    PKV_KFN(put_lanes)(sbuf + (size_t)(a0 + r) * ldc, e + v0 + v, s);
                }
        }
    }
    PKV_PFS_END(ps)
}
