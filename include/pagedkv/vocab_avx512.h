/* pagedkv/vocab_avx512.h -- the SIMD vocabulary (names: vocab_scalar.h) on
 * AVX-512 F + DQ + BW + VL: 512-bit registers, 16 float / 8 double lanes;
 * horizontal sums and maxima and 2^k are single intrinsics.  Built without
 * -m flags: attention.h instantiates the kernels between
 * PKV_TARGET_BEGIN(PKV_AVX512_TARGET) and PKV_TARGET_END.
 *
 * Included by attention.h with PKV_T_F64 defined (0: float, 1: double) and
 * undone by attn_vocab_end.h, once per compute type.
 */
#include "simd.h"
#if !PKV_X86
#error "vocab_avx512.h: x86-64 only"
#endif
#include "vocab_x86.h"

#define PKV_AVX512_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c"
/* AVX-512 + VNNI (attention.h): the int8 scores' vpdpbusd */
#define PKV_AVX512VNNI_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni"
/* AVX-512 + VNNI + BF16 (attention.h): the bfloat16 scores' vdpbf16ps */
#define PKV_AVX512BF16_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni,avx512bf16"
/* AVX-512 + VNNI + AMX (attention.h): the bfloat16 scores' tdpbf16ps */
#define PKV_AVX512AMX_TARGET "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni,amx-tile,amx-bf16"

#if PKV_T_F64
#define PKV_T double
#define PKV_TAG _f64_avx512
#define PKV_TAG_AVX2 _f64_avx2 /* the same compute type's AVX2 kernels (attn_calls.h) */
#define PKV_VEC __m512d
#define PKV_W 8
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define PKV_VLOAD(p) _mm512_loadu_pd(p)
#define PKV_VSTORE(p, x) _mm512_storeu_pd(p, x)
#define PKV_VSET1(s) _mm512_set1_pd(s)
#define PKV_VZERO() _mm512_setzero_pd()
#define PKV_VADD(a, b) _mm512_add_pd(a, b)
#define PKV_VSUB(a, b) _mm512_sub_pd(a, b)
#define PKV_VMUL(a, b) _mm512_mul_pd(a, b)
#define PKV_VDIV(a, b) _mm512_div_pd(a, b)
#define PKV_VMAX(a, b) _mm512_max_pd(a, b)
#define PKV_VMIN(a, b) _mm512_min_pd(a, b)
#define PKV_VFMA(a, b, c) _mm512_fmadd_pd(a, b, c)
#define PKV_VREDUCE(x) _mm512_reduce_add_pd(x)
#define PKV_VHMAX(x) _mm512_reduce_max_pd(x)
#define PKV_VROUND(x) _mm512_roundscale_pd(x, PKV_RN)
#define PKV_VSCALE2K(p, k) _mm512_scalef_pd(p, k)
#define PKV_VFRAC(x) _mm512_reduce_pd(x, PKV_RD)
#define PKV_VSCALE2FL(p, x) _mm512_scalef_pd(p, x)
/* the first n lanes (0 < n < PKV_W): loaded (the rest 0), stored, summed */
#define PKV_VMASKN(n) ((__mmask8)((1u << (n)) - 1))
#define PKV_VLOADN(p, n) _mm512_maskz_loadu_pd(PKV_VMASKN(n), p)
#define PKV_VSTOREN(p, x, n) _mm512_mask_storeu_pd(p, PKV_VMASKN(n), x)
#define PKV_VREDUCEN(x, n) _mm512_mask_reduce_add_pd(PKV_VMASKN(n), x)
/* p where x is a number, x (NaN) where it is not: the vector exps clamp a
 * NaN argument away, the scalar ones keep it (attn_math.h's tails) */
#define PKV_VKEEPNAN(p, x) _mm512_mask_mov_pd(p, _mm512_cmp_pd_mask(x, x, _CMP_UNORD_Q), x)
#define PKV_LD_F32(p) _mm512_cvtps_pd(_mm256_loadu_ps(p))
#define PKV_LD_BF16(p) _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16)))
#define PKV_LD_F16(p) _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#define PKV_LD_I8(p) _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#else
#define PKV_T float
#define PKV_TAG _f32_avx512
#define PKV_TAG_AVX2 _f32_avx2
#define PKV_VEC __m512
#define PKV_W 16
#define PKV_SC_NV 4
#define PKV_PV_NV 4
#define PKV_VLOAD(p) _mm512_loadu_ps(p)
#define PKV_VSTORE(p, x) _mm512_storeu_ps(p, x)
#define PKV_VSET1(s) _mm512_set1_ps(s)
#define PKV_VZERO() _mm512_setzero_ps()
#define PKV_VADD(a, b) _mm512_add_ps(a, b)
#define PKV_VSUB(a, b) _mm512_sub_ps(a, b)
#define PKV_VMUL(a, b) _mm512_mul_ps(a, b)
#define PKV_VDIV(a, b) _mm512_div_ps(a, b)
#define PKV_VMAX(a, b) _mm512_max_ps(a, b)
#define PKV_VMIN(a, b) _mm512_min_ps(a, b)
#define PKV_VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PKV_VREDUCE(x) _mm512_reduce_add_ps(x)
#define PKV_VHMAX(x) _mm512_reduce_max_ps(x)
#define PKV_VROUND(x) _mm512_roundscale_ps(x, PKV_RN)
#define PKV_VSCALE2K(p, k) _mm512_scalef_ps(p, k)
#define PKV_VFRAC(x) _mm512_reduce_ps(x, PKV_RD)
#define PKV_VSCALE2FL(p, x) _mm512_scalef_ps(p, x)
#define PKV_VMASKN(n) ((__mmask16)((1u << (n)) - 1))
#define PKV_VLOADN(p, n) _mm512_maskz_loadu_ps(PKV_VMASKN(n), p)
#define PKV_VSTOREN(p, x, n) _mm512_mask_storeu_ps(p, PKV_VMASKN(n), x)
#define PKV_VREDUCEN(x, n) _mm512_mask_reduce_add_ps(PKV_VMASKN(n), x)
#define PKV_VKEEPNAN(p, x) _mm512_mask_mov_ps(p, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x)
/* 16 bfloat16 into the high halves of 16 float32 lanes with one zero-masked
 * word permute (vpermw): 1 shuffle a vector where a zero extension and a
 * shift take 2 (a 4-row x 2-vector FMA tile on bfloat16 in L1, Intel Xeon:
 * 73-79 G FMA lanes/s against 67-69, float32 79-81) */
#define PKV_LD_BF16(p)                                                                             \
    _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(                                           \
        (__mmask32)0xAAAAAAAAu,                                                                    \
        _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, \
                         5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),                                         \
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p)))))
#define PKV_LD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* P.V reads bfloat16 V rows two vectors at a time (attn_tile.h): one 64-byte
 * load of 2W values, whose even dimensions are one shift away from float32
 * and odd ones one mask away -- no word permute, which shares port 5 with the
 * FMAs (a 4-row x 4-vector P.V tile in L1, Intel Xeon: 69 G multiply-adds/s
 * against 57 with PKV_LD_BF16, float32 86).  The tile keeps its even and odd
 * dimensions in separate accumulators: PKV_VEVEN / PKV_VODD split two vectors
 * of consecutive values that way, PKV_VILO / PKV_VIHI put them back. */
#define PKV_LD_BF16_PAIR(p, odd)                                                              \
    ((odd) ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512((const void *)(p)),     \
                                                  _mm512_set1_epi32((int)0xFFFF0000u)))      \
           : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(p)), 16)))
#define PKV_VEVEN(a, b) \
    _mm512_permutex2var_ps(a, _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), b)
#define PKV_VODD(a, b) \
    _mm512_permutex2var_ps(a, _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1), b)
#define PKV_VILO(e, o) \
    _mm512_permutex2var_ps(e, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), o)
#define PKV_VIHI(e, o) \
    _mm512_permutex2var_ps(e, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8), o)
#define PKV_LD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#endif
