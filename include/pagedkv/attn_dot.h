/* pagedkv/attn_dot.h -- int8 keys scored with an integer dot product,
 * float32 compute.  Included by attn_tile.h when PKV_I8_DOT is 1 (attention.h
 * instantiates that once per integer path, PKV_DOT_ISA naming it: vpdpbusd
 * of AVX-512 + VNNI on 16 keys a vector, of AVX-VNNI on 8, sdot of NEON +
 * dot product on 4): the
 * quantized query rows, their row handle (PKV_KFN(qrow_t)) and the score
 * micro-kernels (PKV_DOT_MK), which attn_tile.h instantiates and its
 * tile_scores calls in place of the float ones; a template like
 * attn_tile.h, no include guard.
 *
 * The query is quantized like the keys: each work item turns its rows
 * (as given: the softmax step applies the scale, attn_tile.h) into int8
 * with a float32 scale per group of PKV_I8_GROUP dimensions, scale = the
 * group's largest magnitude / 127, values rounded to nearest (ties to
 * even).  A score is then
 *
 *     sum over groups g of  kscale[g] * qscale[g] * sum_{i in g} k_i * q_i
 *
 * with the inner sums exact in int32 (32 products of at most 127 * 128).
 * That is the accuracy cost of these paths: the query's rounding, the same
 * on each of them (their scores are the same bits), documented in
 * docs/performance.md; PAGEDKV_SIMD=avx512 or avx2 computes with the query
 * as it is.  NaN or infinity in a query group makes
 * its row's scores NaN.
 *
 * Four dimensions of one key share an int32 lane, while K^T holds one
 * dimension of consecutive keys per row (types.h): each load of 4 rows x
 * PKV_W keys is transposed in registers (kquad), shared by every query row
 * of the register tile.  The stored layout is the same on every path, so
 * pools and files move between machines unchanged.  Dimensions past the
 * last multiple of 4 are folded in float32 (their int8 values are exact in
 * float32).
 *
 * vpdpbusd multiplies unsigned by signed bytes, four consecutive bytes per
 * int32 lane.  The keys are the unsigned side: a stored key byte k is read
 * as k + 128 (its top bit flipped), and each group's sum starts at -128 *
 * (the sum of the row's int8 values over the group) to take the offset off
 * again (PKV_DOT_KOFF).  sdot multiplies signed by signed bytes: no offset.
 *
 * Plain AVX2 keeps the float scores: vpmaddubsw (unsigned x signed bytes
 * into saturating int16 pairs, so |k| times q with k's sign, then vpmaddwd
 * to int32: four instructions per vector of products where vpdpbusd takes
 * one) measured no faster than converting the keys to float32 on an Intel
 * Xeon (docs/performance.md).
 */
#define PKV_DOT_VNNI512 1
#define PKV_DOT_VNNI256 2
#define PKV_DOT_SDOT 3

/* the integer vocabulary of the path: PKV_DI a vector of PKV_W int32 lanes,
 * PKV_DOT4(acc, k, b) = acc + the 4-byte dot products of lanes k (keys, as
 * kquad leaves them) and b (4 query values), PKV_DOT_KOFF the keys' offset */
#if PKV_DOT_ISA == PKV_DOT_VNNI512
_Static_assert(PKV_W == 16, "AVX-512 vectors are 16 keys");
#define PKV_DI __m512i
#define PKV_DI_SET1(x) _mm512_set1_epi32(x)
#define PKV_DI_ZERO() _mm512_setzero_si512()
#define PKV_DI_ADD(a, b) _mm512_add_epi32(a, b)
#define PKV_DI_TOF(x) _mm512_cvtepi32_ps(x)
/* an instruction rather than the intrinsic: with _mm512_dpbusd_epi32 GCC
 * (11, 12) copied each accumulator to another register and back around
 * every vpdpbusd of the score tile and kept some on the stack */
#if defined(__GNUC__)
static inline __m512i PKV_KFN(dot4)(__m512i acc, __m512i k, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(k), "v"(b));
    return acc;
}
#define PKV_DOT4(acc, k, b) PKV_KFN(dot4)(acc, k, b)
#else
#define PKV_DOT4(acc, k, b) _mm512_dpbusd_epi32(acc, k, b)
#endif
#define PKV_DOT_KOFF 128
#elif PKV_DOT_ISA == PKV_DOT_SDOT
_Static_assert(PKV_W == 4, "NEON vectors are 4 keys");
#define PKV_DI int32x4_t
#define PKV_DI_SET1(x) vdupq_n_s32(x)
#define PKV_DI_ZERO() vdupq_n_s32(0)
#define PKV_DI_ADD(a, b) vaddq_s32(a, b)
#define PKV_DI_TOF(x) vcvtq_f32_s32(x)
#define PKV_DOT4(acc, k, b) vdotq_s32(acc, vreinterpretq_s8_s32(k), vreinterpretq_s8_s32(b))
#define PKV_DOT_KOFF 0
#else
_Static_assert(PKV_W == 8, "AVX2 vectors are 8 keys");
#define PKV_DI __m256i
#define PKV_DI_SET1(x) _mm256_set1_epi32(x)
#define PKV_DI_ZERO() _mm256_setzero_si256()
#define PKV_DI_ADD(a, b) _mm256_add_epi32(a, b)
#define PKV_DI_TOF(x) _mm256_cvtepi32_ps(x)
#define PKV_DOT4(acc, k, b) _mm256_dpbusd_avx_epi32(acc, k, b)
#define PKV_DOT_KOFF 128
#endif

/* The quantized query rows of one head: row a's int8 values at q + a * ldq
 * (ldq >= d, the tail zeroed), its scales and starting sums at sc / corr +
 * a * ng. */
typedef struct {
    const int8_t *q;
    const float *sc;
    const int32_t *corr;
    int ldq, ng;
} PKV_KFN(qrows_t);

#if PKV_DOT_ISA == PKV_DOT_VNNI512
_Static_assert(PKV_I8_GROUP == 32 && PKV_DOT_KOFF == 128, "a group is two 16-lane vectors; keys offset by 2^7");
/* Four 16-lane vectors reduced at once, one per group: every lane of
 * 128-bit lane j of the result holds the largest (quant_max4) or the sum
 * (quant_add4) of vector j's lanes.  Two 128-bit lane shuffles and two
 * in-lane ones in all, where four separate reductions take sixteen. */
static inline __m512 PKV_KFN(quant_max4)(__m512 a, __m512 b, __m512 c, __m512 e) {
    const __m512 ab = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 ce = _mm512_max_ps(_mm512_shuffle_f32x4(c, e, 0x44), _mm512_shuffle_f32x4(c, e, 0xEE));
    __m512 x = _mm512_max_ps(_mm512_shuffle_f32x4(ab, ce, 0x88), _mm512_shuffle_f32x4(ab, ce, 0xDD));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}
static inline __m512i PKV_KFN(quant_add4)(__m512i a, __m512i b, __m512i c, __m512i e) {
    const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
    const __m512i ce = _mm512_add_epi32(_mm512_shuffle_i32x4(c, e, 0x44), _mm512_shuffle_i32x4(c, e, 0xEE));
    __m512i x = _mm512_add_epi32(_mm512_shuffle_i32x4(ab, ce, 0x88), _mm512_shuffle_i32x4(ab, ce, 0xDD));
    x = _mm512_add_epi32(x, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x4E));
    return _mm512_add_epi32(x, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xB1));
}

/* lanes [0, n) of a 16-lane vector (n may be <= 0 or > 16) */
static inline __mmask16 PKV_KFN(quant_lanes)(int n) {
    return (__mmask16)(n >= 16 ? 0xFFFF : n > 0 ? (1u << n) - 1 : 0);
}

/* One row (d floats at xr) quantized: its int8 values to qr (whole groups,
 * zeros past d), scales and starting sums to sc[g], corr[g].  Four groups
 * at a time, their largest magnitudes and sums reduced together and their
 * scales kept in vectors; the arithmetic is the scalar branch's
 * (quantize_rows), bit for bit. */
static inline void PKV_KFN(quantize_row512)(const float *restrict xr, int d, int d4, int ng, int8_t *qr,
                                            float *sc, int32_t *corr) {
    const __m512i first4 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    for (int g0 = 0; g0 < ng; g0 += 4) {
        const int i0 = g0 * PKV_I8_GROUP, gn = ng - g0 < 4 ? ng - g0 : 4;
        __m512 x[8], m[4];
        __mmask16 badl = 0; /* lanes 4j .. 4j + 3: group g0 + j holds a NaN or an infinity */
        for (int j = 0; j < 4; j++) {
            x[2 * j] = _mm512_maskz_loadu_ps(PKV_KFN(quant_lanes)(d - i0 - 32 * j), xr + i0 + 32 * j);
            x[2 * j + 1] = _mm512_maskz_loadu_ps(PKV_KFN(quant_lanes)(d - i0 - 32 * j - 16), xr + i0 + 32 * j + 16);
            m[j] = _mm512_max_ps(_mm512_abs_ps(x[2 * j]), _mm512_abs_ps(x[2 * j + 1]));
            if (_mm512_cmp_ps_mask(x[2 * j], x[2 * j], _CMP_UNORD_Q) |
                _mm512_cmp_ps_mask(x[2 * j + 1], x[2 * j + 1], _CMP_UNORD_Q))
                badl |= (__mmask16)(0xF << 4 * j);
        }
        const __m512 amax = PKV_KFN(quant_max4)(m[0], m[1], m[2], m[3]);
        badl |= _mm512_cmp_ps_mask(amax, _mm512_set1_ps(3.402823466e38f), _CMP_GT_OQ);
        const __mmask16 okl = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ) & (__mmask16)~badl;
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(127.0f), amax);
        __m512i t[4];
        for (int j = 0; j < 4; j++) {
            /* bad or all-zero groups quantize to zeros */
            const __mmask16 ok = (__mmask16)(okl >> 4 * j & 1 ? 0xFFFF : 0);
            const __m512 iv = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * j), inv);
            __m512i qv[2];
            for (int h = 0; h < 2; h++) {
                qv[h] = _mm512_maskz_cvt_roundps_epi32(ok, _mm512_mul_ps(x[2 * j + h], iv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                if (j < gn) /* saturating pack: |x| * 127 / amax rounds to at most 127 */
                    _mm_storeu_si128((__m128i *)(qr + i0 + 32 * j + 16 * h), _mm512_cvtsepi32_epi8(qv[h]));
            }
            /* the starting sum covers the dimensions the integer loop takes (< d4) */
            const int nd = d4 - (i0 + 32 * j);
            t[j] = _mm512_add_epi32(_mm512_maskz_mov_epi32(PKV_KFN(quant_lanes)(nd), qv[0]),
                                    _mm512_maskz_mov_epi32(PKV_KFN(quant_lanes)(nd - 16), qv[1]));
        }
        __m512 s = _mm512_maskz_div_ps(okl, amax, _mm512_set1_ps(127.0f));
        s = _mm512_mask_mov_ps(s, badl, _mm512_set1_ps(NAN));
        const __m512i sum = PKV_KFN(quant_add4)(t[0], t[1], t[2], t[3]);
        const __mmask16 out = (__mmask16)((1u << gn) - 1);
        _mm512_mask_storeu_ps(sc + g0, out, _mm512_permutexvar_ps(first4, s));
        /* -PKV_DOT_KOFF * sum, PKV_DOT_KOFF being 2^7 */
        const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
        _mm512_mask_storeu_epi32(corr + g0, out, _mm512_permutexvar_epi32(first4, c));
    }
}
#endif

/* Row count rows of x (d floats apart) quantized into mem (pkv_qdot_bytes
 * bytes); *out describes them. */
static inline void PKV_KFN(quantize_rows)(const float *restrict x, int rows, int d, char *mem,
                                          PKV_KFN(qrows_t) *out) {
    const int ldq = (int)pkv_qdot_ldq(d), ng = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP;
    const int d4 = d & ~3;
    int8_t *q = (int8_t *)mem;
    float *sc = (float *)(mem + (size_t)PKV_MAX_ROWS * ldq);
    int32_t *corr = (int32_t *)(sc + (size_t)PKV_MAX_ROWS * ng);
    for (int a = 0; a < rows; a++) {
        const float *xr = x + (size_t)a * d;
        int8_t *qr = q + (size_t)a * ldq;
#if PKV_DOT_ISA == PKV_DOT_VNNI512
        PKV_KFN(quantize_row512)(xr, d, d4, ng, qr, sc + (size_t)a * ng, corr + (size_t)a * ng);
#else /* one value at a time (float32 products, nearest-even) */
        for (int i0 = 0, g = 0; i0 < d; i0 += PKV_I8_GROUP, g++) {
            const int n = d - i0 < PKV_I8_GROUP ? d - i0 : PKV_I8_GROUP;
            /* the starting sum covers the dimensions the integer loop takes (< d4) */
            const int nd = d4 - i0 < PKV_I8_GROUP ? (d4 > i0 ? d4 - i0 : 0) : PKV_I8_GROUP;
            int32_t sum = 0;
            float amax = 0.0f;
            int bad = 0;
            for (int i = 0; i < n; i++) {
                const float v = fabsf(xr[i0 + i]);
                bad |= !(v <= 3.402823466e38f); /* NaN or infinite */
                amax = v > amax ? v : amax;
            }
            const float inv = bad || !(amax > 0.0f) ? 0.0f : 127.0f / amax;
            const float s = bad ? NAN : amax > 0.0f ? amax / 127.0f : 0.0f;
            for (int i = 0; i < PKV_I8_GROUP; i++) {
                float r = i < n && !bad ? nearbyintf(xr[i0 + i] * inv) : 0.0f;
                r = r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r;
                qr[i0 + i] = (int8_t)r;
                if (i < nd) sum += (int32_t)r;
            }
            sc[(size_t)a * ng + g] = s;
            corr[(size_t)a * ng + g] = -PKV_DOT_KOFF * sum;
        }
#endif
        for (int i = (d + PKV_I8_GROUP - 1) / PKV_I8_GROUP * PKV_I8_GROUP; i < ldq; i++) qr[i] = 0;
    }
    out->q = q;
    out->sc = sc;
    out->corr = corr;
    out->ldq = ldq;
    out->ng = ng;
}

/* One quantized row as the micro-kernels take it (attn_tile.h's row handle) */
typedef struct {
    const int8_t *q;
    const float *sc;
    const int32_t *corr;
} PKV_KFN(qrow_t);

static inline PKV_KFN(qrow_t) PKV_KFN(qrow)(const PKV_KFN(qrows_t) *h, int row, int d) {
    (void)d;
    PKV_KFN(qrow_t) r;
    r.q = h->q + (size_t)row * h->ldq;
    r.sc = h->sc + (size_t)row * h->ng;
    r.corr = h->corr + (size_t)row * h->ng;
    return r;
}

/* The rows of one head: rows [first, ...) of all */
static inline PKV_KFN(qrows_t) PKV_KFN(qrows_from)(const PKV_KFN(qrows_t) *all, int first) {
    PKV_KFN(qrows_t) h = *all;
    h.q += (size_t)first * all->ldq;
    h.sc += (size_t)first * all->ng;
    h.corr += (size_t)first * all->ng;
    return h;
}

/* K^T rows i .. i + 3 of PKV_W keys (rows `stride` bytes apart) as PKV_W
 * int32 lanes of 4 bytes, one key's 4 dimensions each (unsigned, top bits
 * flipped, for vpdpbusd; as stored for sdot) */
#if PKV_DOT_ISA == PKV_DOT_VNNI512
static inline __m512i PKV_KFN(kquad)(const int8_t *p, size_t stride) {
    __m512i x;
    if (stride == 16) {
        x = _mm512_loadu_si512(p);
    } else {
        x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
    }
    /* dword p of the result = dword (p % 4) * 4 + p / 4: 128-bit lane m holds
     * keys 4m .. 4m + 3 of the four rows; then byte b of a lane = byte
     * (b % 4) * 4 + b / 4: a 4 x 4 byte transpose inside each lane */
    const __m512i didx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i bidx = _mm512_set4_epi32(0x0F0B0703, 0x0E0A0602, 0x0D090501, 0x0C080400);
    x = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(didx, x), bidx);
    return _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80));
}
#elif PKV_DOT_ISA == PKV_DOT_SDOT
static inline int32x4_t PKV_KFN(kquad)(const int8_t *p, size_t stride) {
    /* the four rows' 4 bytes each (r0 k0..k3, r1 k0..k3, ...), then a 4 x 4
     * byte transpose: key j's bytes r0 r1 r2 r3 */
    uint32_t w[4];
    for (int r = 0; r < 4; r++) memcpy(w + r, p + (size_t)r * stride, 4);
    static const uint8_t idx[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    const uint8x16_t x = vreinterpretq_u8_u32(vld1q_u32(w));
    return vreinterpretq_s32_u8(vqtbl1q_u8(x, vld1q_u8(idx)));
}
#else
static inline __m256i PKV_KFN(kquad)(const int8_t *p, size_t stride) {
    /* rows 0 and 1 byte-interleaved (key j: r0 r1), rows 2 and 3 too, then
     * the pairs word-interleaved: key j's 4 bytes r0 r1 r2 r3, keys 0-3 in
     * the low half, 4-7 in the high one */
    const __m128i r01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)p),
                                          _mm_loadl_epi64((const __m128i *)(p + stride)));
    const __m128i r23 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p + 2 * stride)),
                                          _mm_loadl_epi64((const __m128i *)(p + 3 * stride)));
    const __m256i x = _mm256_set_m128i(_mm_unpackhi_epi16(r01, r23), _mm_unpacklo_epi16(r01, r23));
    return _mm256_xor_si256(x, _mm256_set1_epi8((char)0x80));
}
#endif

/* four int8 values of a query row as one int32 (for a broadcast) */
static inline int32_t PKV_KFN(q4)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Scores of R rows x NV key vectors (as PKV_SCORES_MK in attn_tile.h):
 * q the rows (int8 values, scales and starting sums), e the key vectors
 * (int8 K^T, scales), results to out[r * NV + v].  Per group, DS
 * independent int32 sets over alternate quads of dimensions. */
#define PKV_DOT_MK(NAME, R, NV, DS, PF)                                                           \
    static inline void PKV_KFN(NAME)(const PKV_KFN(qrow_t) *q, const pkv_kvec *e, size_t stride,  \
                                     int d, PKV_VEC *out, pkv_pfs *ps) {                            \
        PKV_VEC tot[R][NV];                                                                            \
        const int8_t *kp[NV];                                                                      \
        for (int v = 0; v < NV; v++) kp[v] = (const int8_t *)e[v].k;                               \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < NV; v++) tot[r][v] = PKV_VZERO();                                 \
        const int d4 = d & ~3;                                                                     \
        PKV_PFS_BEGIN(PF ? ps : NULL)                                                              \
        const int l1k_ = ps != NULL && ps->l1k; /* as attn_tile.h's PKV_SC_SWEEP */                \
        for (int i0 = 0, g = 0; i0 < d4; i0 += PKV_I8_GROUP, g++) {                                \
            const int i1 = d4 - i0 < PKV_I8_GROUP ? d4 : i0 + PKV_I8_GROUP;                        \
            PKV_DI acc[DS][R][NV];                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                const PKV_DI c0 = PKV_DI_SET1(q[r].corr[g]);                                          \
                for (int v = 0; v < NV; v++) {                                                     \
                    acc[0][r][v] = c0;                                                             \
                    for (int u = 1; u < DS; u++) acc[u][r][v] = PKV_DI_ZERO();                     \
                }                                                                                  \
            }                                                                                      \
            ptrdiff_t i = i0;                                                                      \
            for (; i + 4 * DS <= i1; i += 4 * DS) {                                                \
                PKV_PFS_STEP((DS) * (NV))                                                          \
                PKV_L1K_ROWS(l1k_, kp, NV, i + 4 * PKV_L1K_AHEAD, DS, 4, stride)                    \
                for (int u = 0; u < DS; u++) PKV_DOT_STEP(acc[u], R, NV, i + 4 * u)                \
            }                                                                                      \
            for (; i < i1; i += 4) PKV_DOT_STEP(acc[0], R, NV, i)                                  \
            PKV_VEC ks[NV];                                                                         \
            for (int v = 0; v < NV; v++) ks[v] = PKV_VLOAD(e[v].sc + (size_t)g * stride);          \
            for (int r = 0; r < R; r++) {                                                          \
                const PKV_VEC s = PKV_VSET1(q[r].sc[g]);                                               \
                for (int v = 0; v < NV; v++) {                                                     \
                    PKV_DI t = acc[0][r][v];                                                       \
                    for (int u = 1; u < DS; u++) t = PKV_DI_ADD(t, acc[u][r][v]);                  \
                    tot[r][v] = PKV_VFMA(PKV_DI_TOF(t), PKV_VMUL(ks[v], s), tot[r][v]);                \
                                                                                                      \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        PKV_PFS_END(ps)                                                                            \
        for (int i = d4; i < d; i++) { /* dimensions past the last quad, in float32 */             \
            const int g = i / PKV_I8_GROUP;                                                        \
            PKV_VEC kf[NV];                                                                         \
            for (int v = 0; v < NV; v++)                                                           \
                kf[v] = PKV_VMUL(PKV_LD_I8(kp[v] + (size_t)i * stride),                             \
                                PKV_VLOAD(e[v].sc + (size_t)g * stride));                    \
            for (int r = 0; r < R; r++) {                                                          \
                const PKV_VEC b = PKV_VSET1((float)q[r].q[i] * q[r].sc[g]);                              \
                for (int v = 0; v < NV; v++) tot[r][v] = PKV_VFMA(b, kf[v], tot[r][v]);            \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int v = 0; v < NV; v++) out[r * NV + v] = tot[r][v];                              \
    }
/* one quad of dimensions i .. i + 3: NV transposed key loads, then a
 * broadcast of each row's 4 values and NV dot products per row */
#define PKV_DOT_STEP(acc, R, NV, i)                                                                \
    {                                                                                              \
        PKV_DI kq[NV];                                                                             \
        for (int v = 0; v < NV; v++) kq[v] = PKV_KFN(kquad)(kp[v] + (size_t)(i) * stride, stride); \
        for (int r = 0; r < R; r++) {                                                              \
            const PKV_DI b = PKV_DI_SET1(PKV_KFN(q4)(q[r].q + (i)));                                 \
            for (int v = 0; v < NV; v++) (acc)[r][v] = PKV_DOT4((acc)[r][v], kq[v], b);            \
        }                                                                                          \
    }

/* (instantiated by attn_tile.h: PKV_REGISTER_TILES(PKV_DOT_MK, sc, PKV_SC_NV)) */
