/* pagedkv/attention.h -- paged attention: instantiation and dispatch.
 *
 * The kernels (attn_math.h + attn_impl.h) are written once over a SIMD
 * vocabulary mapped here per instruction set: scalar always; AVX2+FMA and
 * AVX-512 on x86-64 through per-function target pragmas, so the build needs
 * no -m flags; NEON on aarch64 (part of the base architecture, no pragma).  attn_instances.h instantiates each (compute type, ISA) for
 * the storage types it reads; pkv_kernels_for() looks them up in a table
 * indexed by [storage dtype][compute dtype][ISA] at run time.
 */
#pragma once
#include <math.h>
#include "convert.h"
#include "layout.h"
#include "types.h"
#include "simd.h"
#include "kvread.h"

#ifndef restrict
#define restrict __restrict__
#endif

/* Query rows handled together against one kv head (GQA group x query tile). */
#ifndef PKV_MAX_ROWS
#define PKV_MAX_ROWS 64
#endif

typedef struct {
    const void *cos, *sin;     /* [max_pos][half], cache dtype (queries) */
    const void *cos_t, *sin_t; /* the same transposed, [half][max_pos] (keys: a vector
                                  takes consecutive positions, as K^T takes keys) */
    int64_t max_pos;
    int half; /* rotary_dim / 2 */
} pkv_rope;

/* Keys per tile: a work item folds its blocks this many keys at a time
 * (one softmax step per tile and head; the score micro-kernel gathers its
 * key vectors across the tile's blocks).  Measured (decode_ceiling, f32,
 * bs=16, 1 thread): 32 and 128 keys both slower than 64, in cache (59-66 /
 * 65-75 vs 69-76 G FMA lanes/s) and out of DRAM (58-59% / 58-64% vs 64-65%
 * of the pattern read).  kvread.h's prefetch stream holds one tile's blocks. */
#define PKV_TILE_KEYS 64
_Static_assert(PKV_TILE_KEYS <= (int)(sizeof(((pkv_pfs *)0)->p) / sizeof(char *)),
               "a tile's blocks must fit the prefetch stream (kvread.h)");
/* 0 turns the kernels' software prefetch off (for measurements) */
#ifndef PKV_PREFETCH_UNITS
#define PKV_PREFETCH_UNITS 1
#endif
#define PKV_MAX_KVECS (2 * PKV_TILE_KEYS + 2)

/* blocks per tile, and the columns of a tile's score rows (>= its keys,
 * a multiple of 16 so every vector width divides it) */
static inline int pkv_tile_blocks(int bs) { return bs >= PKV_TILE_KEYS ? 1 : PKV_TILE_KEYS / bs; }
static inline int pkv_tile_cols(int bs) {
    return (pkv_tile_blocks(bs) * bs + 15) / 16 * 16;
}

/* One key vector of a tile: W consecutive keys' K^T at dimension 0 of lane
 * 0 (the next dimension `stride` items on), int8 scales at group 0 of lane
 * 0; lanes [lo, hi) are keys of the tile, lane l its column col + l. */
typedef struct {
    const void *k;
    const float *sc;
    int col, lo, hi;
} pkv_kvec;

/* Key vectors of one run (n keys from slot off of a K^T whose rows are
 * `stride` items long, stride >= w): windows of w lanes that stay inside
 * the row, the last one shifted back to end at the row's end if needed.
 * Returns the number written to e. */
static inline int pkv_kvecs_of(pkv_kvec *e, const void *kt, size_t item, const float *sc,
                               size_t stride, int off, int n, int col, int w) {
    int ne = 0;
    for (int j0 = 0; j0 < n; j0 += w) {
        size_t s = (size_t)(off + j0);
        if (s + (size_t)w > stride) s = stride - (size_t)w;
        const int lo = off + j0 - (int)s;
        const int hi = off + n - (int)s < w ? off + n - (int)s : w;
        e[ne].k = (const char *)kt + s * item;
        e[ne].sc = sc ? sc + s : NULL;
        e[ne].lo = lo;
        e[ne].hi = hi;
        e[ne].col = col + j0 - lo;
        ne++;
    }
    return ne;
}

typedef struct {
    const void *k, *v;            /* K / V plane of one layer in block 0 (layout: types.h) */
    size_t block_stride;          /* bytes from one block to the next */
    size_t scale_offset;          /* int8 storage: from a plane to its scales (types.h) */
    int bs, hkv, hq, d;
    int64_t nseq;                 /* decode: batch; prefill: 1 */
    const int32_t *const *tables; /* per sequence */
    const pkv_segs *segs;         /* per sequence */
    const void *q;                /* [nseq or nq][hq][d] */
    void *out;                    /* same shape as q */
    int qo16;                     /* 0: q and out are of the compute type; PKV_BF16 or
                                   * PKV_F16: 16-bit (compute float32, out rounded once) */
    int64_t nq;                   /* prefill: query tokens (the newest held) */
    double scale;
    const pkv_rope *rope;         /* NULL: keys and queries used as given */
    void *scratch;                /* nthreads * scratch_stride bytes, 64-aligned */
    size_t scratch_stride;
    void *partial;                /* split-K partial states: partial_slots slots */
    int64_t partial_slots;
    int nthreads;                 /* threads allowed */
    int64_t *plan_out;            /* NULL or 3 slots: threads used, heads per item, key chunks */
} pkv_attn_args;

/* The work split of one decode / prefill call (attn_impl.h), shared by its items. */
typedef struct {
    int gsz, ng_max, ngc, hpg, ngroups;
    int64_t nchunk;
    size_t slot_bytes;
} pkv_decode_plan;

typedef struct {
    int gsz, ng_max, ngc, tq;
    int64_t ntile, rank0;
} pkv_prefill_plan;

/* A sequence is split over several threads only if each key chunk gets at
 * least this many tokens. */
#define PKV_SPLIT_MIN 256

/* Calls with fewer multiply-adds than this run on one thread: below it the
 * fork/join of a parallel region costs more than it saves (~10-20 us of
 * work), and on a busy machine a descheduled worker would stall the call. */
#define PKV_PARALLEL_MIN (1 << 21)

/* Bytes of one split-K partial state (m, l, acc of PKV_MAX_ROWS rows). */
static inline size_t pkv_partial_slot_bytes(int d, size_t itemsize) {
    return PKV_ALIGN_UP(2 * sizeof(double) * PKV_MAX_ROWS + (size_t)PKV_MAX_ROWS * d * itemsize);
}

/* Bytes of scratch one thread needs (attn_math.h lays it out): m, l, lim,
 * query rows, accumulators, alpha, a tile's scores (PKV_MAX_ROWS rows of
 * pkv_tile_cols), and kbuf: a tile's keys rotated by RoPE, [d][tile cols]. */
static inline size_t pkv_scratch_bytes(int bs, int d, size_t itemsize) {
    const size_t nqd = (size_t)PKV_MAX_ROWS * d * itemsize;
    const size_t cols = (size_t)pkv_tile_cols(bs);
    return 3 * 8 * PKV_MAX_ROWS + 2 * PKV_ALIGN_UP(nqd) + PKV_ALIGN_UP(PKV_MAX_ROWS * itemsize) +
           PKV_ALIGN_UP((size_t)PKV_MAX_ROWS * cols * itemsize) +
           PKV_ALIGN_UP((size_t)d * cols * itemsize) + PKV_ALIGN;
}

#define PKV_CAT_(a, b) a##b
#define PKV_CAT(a, b) PKV_CAT_(a, b)

/* Each instruction set maps the vocabulary of attn_math.h once per compute
 * type, plus the load-and-convert vocabulary of the storage types (W stored
 * values at p -> VEC of the compute type; attn_instances.h):
 *   LD_F32(p)   float    (compute double only)
 *   LD_BF16(p)  bfloat16 (uint16_t bits)
 *   LD_F16(p)   float16  (uint16_t bits; F16C / AVX-512F conversion)
 *   LD_I8(p)    int8, unscaled (the int8 kernels apply the group scale)
 * attn_vocab_end.h undefines it again. */

/* ---- scalar ------------------------------------------------------------- */
#define VEC T
#define W 1
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define VLOAD(p) (*(p))
#define VSTORE(p, x) (*(p) = (x))
#define VSET1(s) (s)
#define VZERO() ((T)0)
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VMUL(a, b) ((a) * (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#define VMIN(a, b) ((a) < (b) ? (a) : (b))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VREDUCE(x) (x)
#define VHMAX(x) (x)
#define VROUND(x) ((T)nearbyint(x))
#define VSCALE2K(p, k) ((T)ldexp((double)(p), (int)(k)))
#define LD_F32(p) ((T) * (p))
#define LD_BF16(p) ((T)pkv_bf16_to_f32(*(p)))
#define LD_F16(p) ((T)pkv_f16_to_f32(*(p)))
#define LD_I8(p) ((T) * (p))
#define T float
#define PKV_F64 0
#define PKV_TAG _f32_scalar
#include "attn_instances.h"
#undef T
#undef PKV_F64
#undef PKV_TAG
#define T double
#define PKV_F64 1
#define PKV_TAG _f64_scalar
#include "attn_instances.h"
#include "attn_vocab_end.h"

#if PKV_X86
#include <immintrin.h>

#define PKV_STR(x) #x
#if defined(__clang__)
#define PKV_TARGET_BEGIN(s) _Pragma(PKV_STR(clang attribute push(__attribute__((target(s))), apply_to = function)))
#define PKV_TARGET_END _Pragma("clang attribute pop")
#else
#define PKV_TARGET_BEGIN(s) _Pragma("GCC push_options") _Pragma(PKV_STR(GCC target(s)))
#define PKV_TARGET_END _Pragma("GCC pop_options")
#endif

/* ---- AVX2 + FMA --------------------------------------------------------- */
PKV_TARGET_BEGIN("avx2,fma,f16c")
static inline float pkv_hsum256_ps(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float pkv_hmax256_ps(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline double pkv_hmax256_pd(__m256d x) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
static inline double pkv_hsum256_pd(__m256d x) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
static inline __m256 pkv_scale2k256_ps(__m256 p, __m256 k) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline __m256d pkv_scale2k256_pd(__m256d p, __m256d k) {
    const __m256i ki = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k));
    const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(ki, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}
/* 4 int8 values (32 bits) into the low lane of an xmm register */
static inline __m128i pkv_load4_i8(const int8_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return _mm_cvtsi32_si128(x);
}
#define PKV_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEC __m256
#define W 8
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VSET1(s) _mm256_set1_ps(s)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VREDUCE(x) pkv_hsum256_ps(x)
#define VHMAX(x) pkv_hmax256_ps(x)
#define VROUND(x) _mm256_round_ps(x, PKV_RN)
#define VSCALE2K(p, k) pkv_scale2k256_ps(p, k)
#define LD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define T float
#define PKV_F64 0
#define PKV_TAG _f32_avx2
#include "attn_instances.h"
#include "attn_vocab_end.h"
#define VEC __m256d
#define W 4
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define VLOAD(p) _mm256_loadu_pd(p)
#define VSTORE(p, x) _mm256_storeu_pd(p, x)
#define VSET1(s) _mm256_set1_pd(s)
#define VZERO() _mm256_setzero_pd()
#define VADD(a, b) _mm256_add_pd(a, b)
#define VSUB(a, b) _mm256_sub_pd(a, b)
#define VMUL(a, b) _mm256_mul_pd(a, b)
#define VMAX(a, b) _mm256_max_pd(a, b)
#define VMIN(a, b) _mm256_min_pd(a, b)
#define VFMA(a, b, c) _mm256_fmadd_pd(a, b, c)
#define VREDUCE(x) pkv_hsum256_pd(x)
#define VHMAX(x) pkv_hmax256_pd(x)
#define VROUND(x) _mm256_round_pd(x, PKV_RN)
#define VSCALE2K(p, k) pkv_scale2k256_pd(p, k)
#define LD_F32(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define LD_BF16(p) _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(p))), 16)))
#define LD_F16(p) _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p))))
#define LD_I8(p) _mm256_cvtepi32_pd(_mm_cvtepi8_epi32(pkv_load4_i8(p)))
#define T double
#define PKV_F64 1
#define PKV_TAG _f64_avx2
#include "attn_instances.h"
#include "attn_vocab_end.h"
PKV_TARGET_END

/* ---- AVX-512 (F, DQ, BW, VL) ------------------------------------------- */
PKV_TARGET_BEGIN("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")
#define VEC __m512
#define W 16
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VSET1(s) _mm512_set1_ps(s)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VREDUCE(x) _mm512_reduce_add_ps(x)
#define VHMAX(x) _mm512_reduce_max_ps(x)
#define VROUND(x) _mm512_roundscale_ps(x, PKV_RN)
#define VSCALE2K(p, k) _mm512_scalef_ps(p, k)
#define LD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define T float
#define PKV_F64 0
#define PKV_TAG _f32_avx512
#include "attn_instances.h"
#include "attn_vocab_end.h"
#define VEC __m512d
#define W 8
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define VLOAD(p) _mm512_loadu_pd(p)
#define VSTORE(p, x) _mm512_storeu_pd(p, x)
#define VSET1(s) _mm512_set1_pd(s)
#define VZERO() _mm512_setzero_pd()
#define VADD(a, b) _mm512_add_pd(a, b)
#define VSUB(a, b) _mm512_sub_pd(a, b)
#define VMUL(a, b) _mm512_mul_pd(a, b)
#define VMAX(a, b) _mm512_max_pd(a, b)
#define VMIN(a, b) _mm512_min_pd(a, b)
#define VFMA(a, b, c) _mm512_fmadd_pd(a, b, c)
#define VREDUCE(x) _mm512_reduce_add_pd(x)
#define VHMAX(x) _mm512_reduce_max_pd(x)
#define VROUND(x) _mm512_roundscale_pd(x, PKV_RN)
#define VSCALE2K(p, k) _mm512_scalef_pd(p, k)
#define LD_F32(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define LD_BF16(p) _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16)))
#define LD_F16(p) _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#define LD_I8(p) _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define T double
#define PKV_F64 1
#define PKV_TAG _f64_avx512
#include "attn_instances.h"
#include "attn_vocab_end.h"
PKV_TARGET_END
#endif /* PKV_X86 */

#if PKV_ARM64
/* ---- NEON (aarch64 Advanced SIMD, 128-bit) ------------------------------
 * Baseline on every AArch64 CPU, so no target pragma and no -march.  VMAX /
 * VMIN are the IEEE maxNum / minNum forms (vmaxnmq / vminnmq): with a NaN
 * operand they return the other one, like the x86 and scalar paths do for
 * the exp clamp.  VROUND rounds ties to even, as nearbyint and
 * _MM_FROUND_TO_NEAREST_INT do, so every path computes the same exp.
 *
 * Storage loads: bfloat16 widens the 16 bits into the top of a float32,
 * float16 converts with vcvt_f32_f16 (base AArch64), int8 widens twice; the
 * float64 instances read 2 values and widen once more.  Loads narrower than
 * 64 bits go through memcpy so no read passes the last stored value. */
#include <arm_neon.h>
#include <string.h>
static inline uint16x4_t pkv_ld2_u16(const uint16_t *p) { /* 2 values, rest 0 */
    uint32_t x;
    memcpy(&x, p, 4);
    return vreinterpret_u16_u32(vset_lane_u32(x, vdup_n_u32(0), 0));
}
static inline int8x8_t pkv_ld_i8_n(const int8_t *p, int n) { /* n = 2 or 4 */
    uint32_t x = 0;
    memcpy(&x, p, (size_t)n);
    return vreinterpret_s8_u32(vset_lane_u32(x, vdup_n_u32(0), 0));
}
static inline float32x4_t pkv_bf16x4_f32(uint16x4_t h) {
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}
static inline float32x4_t pkv_f16x4_f32(uint16x4_t h) {
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}
static inline float32x4_t pkv_i8x4_f32(int8x8_t b) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}
static inline float32x4_t pkv_scale2k_f32x4(float32x4_t p, float32x4_t k) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
static inline float64x2_t pkv_scale2k_f64x2(float64x2_t p, float64x2_t k) {
    const int64x2_t e = vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(k), vdupq_n_s64(1023)), 52);
    return vmulq_f64(p, vreinterpretq_f64_s64(e));
}
#define VEC float32x4_t
#define W 4
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, x) vst1q_f32(p, x)
#define VSET1(s) vdupq_n_f32(s)
#define VZERO() vdupq_n_f32(0.0f)
#define VADD(a, b) vaddq_f32(a, b)
#define VSUB(a, b) vsubq_f32(a, b)
#define VMUL(a, b) vmulq_f32(a, b)
#define VMAX(a, b) vmaxnmq_f32(a, b)
#define VMIN(a, b) vminnmq_f32(a, b)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VREDUCE(x) vaddvq_f32(x)
#define VHMAX(x) vmaxnmvq_f32(x)
#define VROUND(x) vrndnq_f32(x)
#define VSCALE2K(p, k) pkv_scale2k_f32x4(p, k)
#define LD_BF16(p) pkv_bf16x4_f32(vld1_u16(p))
#define LD_F16(p) pkv_f16x4_f32(vld1_u16(p))
#define LD_I8(p) pkv_i8x4_f32(pkv_ld_i8_n(p, 4))
#define T float
#define PKV_F64 0
#define PKV_TAG _f32_neon
#include "attn_instances.h"
#include "attn_vocab_end.h"
#define VEC float64x2_t
#define W 2
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define VLOAD(p) vld1q_f64(p)
#define VSTORE(p, x) vst1q_f64(p, x)
#define VSET1(s) vdupq_n_f64(s)
#define VZERO() vdupq_n_f64(0.0)
#define VADD(a, b) vaddq_f64(a, b)
#define VSUB(a, b) vsubq_f64(a, b)
#define VMUL(a, b) vmulq_f64(a, b)
#define VMAX(a, b) vmaxnmq_f64(a, b)
#define VMIN(a, b) vminnmq_f64(a, b)
#define VFMA(a, b, c) vfmaq_f64(c, a, b)
#define VREDUCE(x) vaddvq_f64(x)
#define VHMAX(x) vmaxnmvq_f64(x)
#define VROUND(x) vrndnq_f64(x)
#define VSCALE2K(p, k) pkv_scale2k_f64x2(p, k)
#define LD_F32(p) vcvt_f64_f32(vld1_f32(p))
#define LD_BF16(p) vcvt_f64_f32(vget_low_f32(pkv_bf16x4_f32(pkv_ld2_u16(p))))
#define LD_F16(p) vcvt_f64_f32(vget_low_f32(pkv_f16x4_f32(pkv_ld2_u16(p))))
#define LD_I8(p) vcvt_f64_f32(vget_low_f32(pkv_i8x4_f32(pkv_ld_i8_n(p, 2))))
#define T double
#define PKV_F64 1
#define PKV_TAG _f64_neon
#include "attn_instances.h"
#include "attn_vocab_end.h"
#endif /* PKV_ARM64 */

typedef void (*pkv_attn_fn)(const pkv_attn_args *);

typedef struct {
    pkv_attn_fn decode;  /* one query per sequence at its newest rank */
    pkv_attn_fn prefill; /* the newest n ranks of one sequence, causal */
} pkv_kernels;

#define PKV_KERNELS(st, ct, isa) {decode_kv##st##_##ct##_##isa, prefill_kv##st##_##ct##_##isa}
/* the vector paths built for this architecture, as designated entries */
#if PKV_X86
#define PKV_KERNELS_SIMD(st, ct) \
    [PKV_SIMD_AVX2] = PKV_KERNELS(st, ct, avx2), [PKV_SIMD_AVX512] = PKV_KERNELS(st, ct, avx512)
#elif PKV_ARM64
#define PKV_KERNELS_SIMD(st, ct) [PKV_SIMD_NEON] = PKV_KERNELS(st, ct, neon)
#else
#define PKV_KERNELS_SIMD(st, ct)
#endif
#define PKV_KERNELS_ALL(st, ct) {[PKV_SIMD_SCALAR] = PKV_KERNELS(st, ct, scalar), PKV_KERNELS_SIMD(st, ct)}

/* [storage][compute][ISA]; {NULL, NULL} where the triple is not built
 * (storage wider than compute: float64 storage with float32 compute) */
static const pkv_kernels pkv_kernel_table[PKV_NUM_DTYPES][PKV_NUM_COMPUTE][PKV_NUM_SIMD] = {
    [PKV_F32][PKV_F32] = PKV_KERNELS_ALL(f32, f32),
    [PKV_F32][PKV_F64] = PKV_KERNELS_ALL(f32, f64),
    [PKV_F64][PKV_F64] = PKV_KERNELS_ALL(f64, f64),
    [PKV_BF16][PKV_F32] = PKV_KERNELS_ALL(bf16, f32),
    [PKV_BF16][PKV_F64] = PKV_KERNELS_ALL(bf16, f64),
    [PKV_F16][PKV_F32] = PKV_KERNELS_ALL(f16, f32),
    [PKV_F16][PKV_F64] = PKV_KERNELS_ALL(f16, f64),
    [PKV_I8][PKV_F32] = PKV_KERNELS_ALL(i8, f32),
    [PKV_I8][PKV_F64] = PKV_KERNELS_ALL(i8, f64),
};

/* The kernels for (storage, compute, simd), or NULL when not built. */
static inline const pkv_kernels *pkv_kernels_for(int storage, int compute, int simd) {
    if (storage < 0 || storage >= PKV_NUM_DTYPES || compute < 0 || compute >= PKV_NUM_COMPUTE ||
        simd < 0 || simd >= PKV_NUM_SIMD)
        return NULL;
    const pkv_kernels *k = &pkv_kernel_table[storage][compute][simd];
    return k->decode ? k : NULL;
}

/* Read n elements of p (dtype 0 = f32, 1 = f64) split over nthreads threads;
 * returns their sum (so the reads cannot be optimized away). */
static inline double pkv_read_sum(const void *p, size_t n, int dtype, int simd, int nthreads) {
    typedef double (*sum_fn)(const void *, size_t);
    sum_fn f = dtype ? (sum_fn)stream_sum_f64_scalar : (sum_fn)stream_sum_f32_scalar;
#if PKV_X86
    if (simd == PKV_SIMD_AVX512) f = dtype ? (sum_fn)stream_sum_f64_avx512 : (sum_fn)stream_sum_f32_avx512;
    else if (simd == PKV_SIMD_AVX2) f = dtype ? (sum_fn)stream_sum_f64_avx2 : (sum_fn)stream_sum_f32_avx2;
#endif
#if PKV_ARM64
    if (simd == PKV_SIMD_NEON) f = dtype ? (sum_fn)stream_sum_f64_neon : (sum_fn)stream_sum_f32_neon;
#endif
    const size_t item = dtype ? 8 : 4;
    if (nthreads <= 1) return f(p, n); /* no OpenMP region, as the kernels */
    double total = 0.0;
    int t;
#pragma omp parallel for num_threads(nthreads) reduction(+ : total) schedule(static)
    for (t = 0; t < nthreads; t++) {
        const size_t lo = n * (size_t)t / (size_t)nthreads, hi = n * (size_t)(t + 1) / (size_t)nthreads;
        total += f((const char *)p + lo * item, hi - lo);
    }
    return total;
}
