/* pagedkv/attn_math.h -- the compute-type half of the attention kernels:
 * vector exp, RoPE, query staging, output, scratch, the read kernel.  It is
 * instantiated by attention.h once per (compute type, instruction set) and
 * knows nothing of the storage type; attn_impl.h (instantiated per storage
 * type) builds the kernels on top of it.  No include guard on purpose.
 *
 * The includer defines the SIMD vocabulary:
 *   T         compute type (float / double); PKV_F64 1 for double, 0 for float
 *   FN(name)  name mangling per (compute, ISA), e.g. name##_f32_avx2
 *   VEC, W    vector type and its number of lanes
 *   VLOAD(p) VSTORE(p, x) VSET1(s) VZERO() VADD(a, b) VMUL(a, b)
 *   VSUB(a, b) VMAX(a, b) VMIN(a, b)
 *   VFMA(a, b, c)  a * b + c
 *   VREDUCE(x)     horizontal sum -> T
 *   VHMAX(x)       horizontal max -> T
 *   PKV_SC_NV, PKV_PV_NV  key / output vectors per register tile (attn_impl.h)
 *   VROUND(x)      round to nearest integer (as T)
 *   VSCALE2K(p, k) p * 2^k for integral k in the normal exponent range
 */

/* ---- vector helpers ----------------------------------------------------- */

/* exp(x) for the softmax: 2^k * p(r) with k = round(x / ln 2) and a Cody-Waite
 * split of ln 2; x is clamped so that 2^k stays a normal number.  f32: a
 * degree-6 minimax polynomial (~1 ulp); f64: Taylor to degree 12 (~1e-16).
 * Every path, the scalar one included, computes this same function. */
#if PKV_F64
#define PKV_EXP_LO (-708.0)
#define PKV_EXP_HI (709.0)
#define PKV_LN2_HI 6.93145751953125E-1
#define PKV_LN2_LO 1.42860682030941723212E-6
#define PKV_EXP_POLY(r, P)                                                        \
    P = VFMA(VSET1((T)(1.0 / 479001600.0)), r, VSET1((T)(1.0 / 39916800.0)));    \
    P = VFMA(P, r, VSET1((T)(1.0 / 3628800.0)));                                 \
    P = VFMA(P, r, VSET1((T)(1.0 / 362880.0)));                                  \
    P = VFMA(P, r, VSET1((T)(1.0 / 40320.0)));                                   \
    P = VFMA(P, r, VSET1((T)(1.0 / 5040.0)));                                    \
    P = VFMA(P, r, VSET1((T)(1.0 / 720.0)));                                     \
    P = VFMA(P, r, VSET1((T)(1.0 / 120.0)));                                     \
    P = VFMA(P, r, VSET1((T)(1.0 / 24.0)));                                      \
    P = VFMA(P, r, VSET1((T)(1.0 / 6.0)));                                       \
    P = VFMA(P, r, VSET1((T)0.5));                                               \
    P = VFMA(P, r, VSET1((T)1.0));                                               \
    P = VFMA(P, r, VSET1((T)1.0));
#else
#define PKV_EXP_LO (-87.0f)
#define PKV_EXP_HI (88.0f)
#define PKV_LN2_HI 0.693359375f
#define PKV_LN2_LO (-2.12194440e-4f)
#define PKV_EXP_POLY(r, P)                                                        \
    P = VFMA(VSET1(1.9875691500E-4f), r, VSET1(1.3981999507E-3f));               \
    P = VFMA(P, r, VSET1(8.3334519073E-3f));                                     \
    P = VFMA(P, r, VSET1(4.1665795894E-2f));                                     \
    P = VFMA(P, r, VSET1(1.6666665459E-1f));                                     \
    P = VFMA(P, r, VSET1(5.0000001201E-1f));                                     \
    P = VFMA(P, VMUL(r, r), VADD(r, VSET1(1.0f)));
#endif

static inline VEC FN(vexp)(VEC x) {
    x = VMAX(x, VSET1((T)PKV_EXP_LO));
    x = VMIN(x, VSET1((T)PKV_EXP_HI));
    const VEC k = VROUND(VMUL(x, VSET1((T)1.44269504088896340736)));
    VEC r = VFMA(k, VSET1((T)-PKV_LN2_HI), x);
    r = VFMA(k, VSET1((T)-PKV_LN2_LO), r);
    VEC P;
    PKV_EXP_POLY(r, P)
    return VSCALE2K(P, k);
}

/* the same function one lane at a time (vector tails) */
static inline T FN(sexp)(T x) {
    x = x < (T)PKV_EXP_LO ? (T)PKV_EXP_LO : (x > (T)PKV_EXP_HI ? (T)PKV_EXP_HI : x);
    const T k = (T)nearbyint((double)(x * (T)1.44269504088896340736));
    T r = x - k * (T)PKV_LN2_HI;
    r = r - k * (T)PKV_LN2_LO;
#if PKV_F64
    T P = (T)(1.0 / 479001600.0) * r + (T)(1.0 / 39916800.0);
    P = P * r + (T)(1.0 / 3628800.0);
    P = P * r + (T)(1.0 / 362880.0);
    P = P * r + (T)(1.0 / 40320.0);
    P = P * r + (T)(1.0 / 5040.0);
    P = P * r + (T)(1.0 / 720.0);
    P = P * r + (T)(1.0 / 120.0);
    P = P * r + (T)(1.0 / 24.0);
    P = P * r + (T)(1.0 / 6.0);
    P = P * r + (T)0.5;
    P = P * r + (T)1.0;
    P = P * r + (T)1.0;
#else
    T P = 1.9875691500E-4f * r + 1.3981999507E-3f;
    P = P * r + 8.3334519073E-3f;
    P = P * r + 4.1665795894E-2f;
    P = P * r + 1.6666665459E-1f;
    P = P * r + 5.0000001201E-1f;
    P = P * (r * r) + (r + 1.0f);
#endif
    /* P * 2^k with 2^k built from its bits (k is in the normal range after the
     * clamp): the same single rounding as ldexp, without a library call */
#if PKV_F64
    const uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52;
    double two_k;
#else
    const uint32_t bits = (uint32_t)((int32_t)k + 127) << 23;
    float two_k;
#endif
    memcpy(&two_k, &bits, sizeof two_k);
    return P * two_k;
}

/* p[j] = exp(s[j] - mx) for j < n, in place; returns the sum in double. */
static inline double FN(exp_shift)(T *restrict s, int n, T mx) {
    int j = 0;
    double sum = 0.0;
    const VEC vm = VSET1(mx);
    if (n >= W) {
        VEC acc = VZERO();
        for (; j + W <= n; j += W) {
            const VEC p = FN(vexp)(VSUB(VLOAD(s + j), vm));
            VSTORE(s + j, p);
            acc = VADD(acc, p);
        }
        sum = (double)VREDUCE(acc);
    }
    for (; j < n; j++) {
        s[j] = FN(sexp)(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* max of s[0, n), n >= 1 */
static inline T FN(row_max)(const T *restrict s, int n) {
    int j = 0;
    T mx = s[0];
    if (n >= W) {
        VEC vm = VLOAD(s);
        for (j = W; j + W <= n; j += W) vm = VMAX(vm, VLOAD(s + j));
        mx = VHMAX(vm);
    }
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* Rotate-half RoPE of one vector at position pos (dims past 2*half copied);
 * dst may be src. */
static inline void FN(rope_one)(T *dst, const T *src, const pkv_rope *rope,
                                int64_t pos, int d) {
    const int half = rope->half;
    const T *c = (const T *)rope->cos + (size_t)pos * half;
    const T *s = (const T *)rope->sin + (size_t)pos * half;
    int i = 0;
    for (; i + W <= half; i += W) {
        const VEC x0 = VLOAD(src + i), x1 = VLOAD(src + i + half);
        const VEC cv = VLOAD(c + i), sv = VLOAD(s + i);
        VSTORE(dst + i, VSUB(VMUL(x0, cv), VMUL(x1, sv)));
        VSTORE(dst + i + half, VFMA(x0, sv, VMUL(x1, cv)));
    }
    for (; i < half; i++) {
        const T x0 = src[i], x1 = src[i + half];
        dst[i] = x0 * c[i] - x1 * s[i];
        dst[i + half] = x1 * c[i] + x0 * s[i];
    }
    for (i = 2 * half; i < d; i++) dst[i] = src[i];
}

/* Query rows of heads [h0, h0 + nh), tokens t0 + [0, nt), group members
 * g0 + [0, ng) into qbuf (head-major, then token, then member), scaled and,
 * with RoPE, rotated to rank rank0 + t.  lim[t * ng + g] = rank0 + t. */
static inline void FN(load_queries)(const pkv_attn_args *a, int h0, int nh, int64_t t0, int nt,
                                    int g0, int ng, int64_t rank0, T *restrict qbuf,
                                    int64_t *lim) {
    const int d = a->d, gsz = a->hq / a->hkv;
    const T sc = (T)a->scale;
    const VEC scv = VSET1(sc);
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const size_t at = ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                T *dst = qbuf + (((size_t)hh * nt + t) * ng + g) * d;
                const T *src = (const T *)a->q + at;
                if (a->qo16) { /* 16-bit queries: widen into dst, then go on from there */
                    const uint16_t *s16 = (const uint16_t *)a->q + at;
                    int j = 0;
                    if (a->qo16 == PKV_BF16) {
                        for (; j + W <= d; j += W) VSTORE(dst + j, LD_BF16(s16 + j));
                        for (; j < d; j++) dst[j] = (T)pkv_bf16_to_f32(s16[j]);
                    } else {
                        for (; j + W <= d; j += W) VSTORE(dst + j, LD_F16(s16 + j));
                        for (; j < d; j++) dst[j] = (T)pkv_f16_to_f32(s16[j]);
                    }
                    src = dst;
                }
                if (a->rope) {
                    FN(rope_one)(dst, src, a->rope, rank0 + t, d);
                    for (int j = 0; j < d; j++) dst[j] *= sc;
                } else { /* one pass (a copy then a scale in place stalls on the copy's stores) */
                    int j = 0;
                    for (; j + W <= d; j += W) VSTORE(dst + j, VMUL(VLOAD(src + j), scv));
                    for (; j < d; j++) dst[j] = src[j] * sc;
                }
            }
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < ng; g++) lim[t * ng + g] = rank0 + t;
}

/* out rows (same layout as load_queries) = acc / l, rounded once to 16 bits
 * when the arrays are */
static inline void FN(store_out)(const pkv_attn_args *a, int h0, int nh, int64_t t0, int nt,
                                 int g0, int ng, const T *acc, const double *l) {
    const int d = a->d, gsz = a->hq / a->hkv;
    for (int hh = 0; hh < nh; hh++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < ng; g++) {
                const size_t i = ((size_t)hh * nt + t) * ng + g;
                const size_t at = ((size_t)(t0 + t) * a->hq + (size_t)(h0 + hh) * gsz + g0 + g) * d;
                const T inv = (T)(1.0 / l[i]);
                if (a->qo16 == PKV_BF16) {
                    uint16_t *dst = (uint16_t *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = pkv_f32_to_bf16((float)(acc[i * d + j] * inv));
                } else if (a->qo16 == PKV_F16) {
                    uint16_t *dst = (uint16_t *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = pkv_f32_to_f16((float)(acc[i * d + j] * inv));
                } else {
                    T *dst = (T *)a->out + at;
                    for (int j = 0; j < d; j++) dst[j] = acc[i * d + j] * inv;
                }
            }
}

typedef struct {
    T *qbuf, *acc, *sbuf, *kbuf, *alpha;
    double *m, *l;
    int64_t *lim;
} FN(scratch_t);

static inline FN(scratch_t) FN(scratch)(const pkv_attn_args *a, int tid) {
    FN(scratch_t) sc;
    char *p = (char *)a->scratch + (size_t)tid * a->scratch_stride;
    const size_t nqd = (size_t)PKV_MAX_ROWS * a->d;
    sc.m = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.l = (double *)p;       p += sizeof(double) * PKV_MAX_ROWS;
    sc.lim = (int64_t *)p;    p += sizeof(int64_t) * PKV_MAX_ROWS;
    sc.qbuf = (T *)p;         p += PKV_ALIGN_UP(sizeof(T) * nqd);
    sc.acc = (T *)p;          p += PKV_ALIGN_UP(sizeof(T) * nqd);
    sc.alpha = (T *)p;        p += PKV_ALIGN_UP(sizeof(T) * PKV_MAX_ROWS);
    sc.sbuf = (T *)p;         p += PKV_ALIGN_UP(sizeof(T) * PKV_MAX_ROWS * (size_t)pkv_tile_cols(a->bs));
    sc.kbuf = (T *)p;
    return sc;
}

/* Sum of n elements, read once front to back with four independent vector
 * accumulators: the read kernel `pagedkv bench` uses to measure the machine's
 * memory read bandwidth with the same instructions as the attention loops. */
static double FN(stream_sum)(const T *restrict p, size_t n) {
    VEC s0 = VZERO(), s1 = VZERO(), s2 = VZERO(), s3 = VZERO();
    size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
        s0 = VADD(s0, VLOAD(p + i));
        s1 = VADD(s1, VLOAD(p + i + W));
        s2 = VADD(s2, VLOAD(p + i + 2 * W));
        s3 = VADD(s3, VLOAD(p + i + 3 * W));
    }
    double s = (double)VREDUCE(VADD(VADD(s0, s1), VADD(s2, s3)));
    for (; i < n; i++) s += p[i];
    return s;
}

#undef PKV_EXP_LO
#undef PKV_EXP_HI
#undef PKV_LN2_HI
#undef PKV_LN2_LO
#undef PKV_EXP_POLY
