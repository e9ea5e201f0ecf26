/* pagedkv/attention.h -- paged attention: instantiation and dispatch.
 *
 * The kernels (attn_math.h + attn_impl.h, over the arguments of
 * attn_args.h) are written once over a SIMD vocabulary, mapped once per
 * instruction set in vocab_*.h: scalar always; AVX2+FMA and AVX-512 on
 * x86-64 through per-function target pragmas, so the build needs no -m
 * flags; NEON on aarch64 (part of the base architecture, no pragma).  Here
 * each vocabulary is included per compute type and attn_instances.h
 * instantiates its kernels for the storage types they read;
 * pkv_kernels_for() looks them up in a table indexed by [storage dtype]
 * [compute dtype][ISA] at run time.
 */
#pragma once
#include "attn_args.h"
#include "simd.h"
#include "types.h"

/* ---- scalar ------------------------------------------------------------- */
#define PKV_T_F64 0
#include "vocab_scalar.h"
#include "attn_instances.h"
#include "attn_vocab_end.h"
#define PKV_T_F64 1
#include "vocab_scalar.h"
#include "attn_instances.h"
#include "attn_vocab_end.h"

#if PKV_X86
/* ---- AVX2 + FMA; AVX2 + AVX-VNNI: AVX2's kernels, but int8 keys in float32
 * scored with the VEX-encoded vpdpbusd on a quantized query (attn_dot.h) -- */
#define PKV_T_F64 0
#include "vocab_avx2.h"
PKV_TARGET_BEGIN(PKV_AVX2_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#define PKV_I8_DOT 1
#define PKV_DOT_ISA PKV_DOT_VNNI256
#define PKV_DOT_TAG _f32_avxvnni
PKV_TARGET_BEGIN(PKV_AVXVNNI_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#undef PKV_I8_DOT
#undef PKV_DOT_ISA
#undef PKV_DOT_TAG
#include "attn_vocab_end.h"
#define PKV_T_F64 1
#include "vocab_avx2.h"
PKV_TARGET_BEGIN(PKV_AVX2_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#include "attn_vocab_end.h"

/* ---- AVX-512 (F, DQ, BW, VL) ------------------------------------------- */
#define PKV_T_F64 0
#include "vocab_avx512.h"
PKV_TARGET_BEGIN(PKV_AVX512_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#include "attn_vocab_end.h"
#define PKV_T_F64 1
#include "vocab_avx512.h"
PKV_TARGET_BEGIN(PKV_AVX512_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#include "attn_vocab_end.h"

/* ---- AVX-512 + VNNI: AVX-512's kernels, but int8 keys scored with vpdpbusd
 * on a quantized query (attn_dot.h), float32 compute; float64 compute keeps
 * the exact float scores ------------------------------------------------- */
#define PKV_T_F64 0
#include "vocab_avx512.h"
#define PKV_I8_DOT 1
#define PKV_DOT_ISA PKV_DOT_VNNI512
#define PKV_DOT_TAG _f32_avx512vnni
PKV_TARGET_BEGIN(PKV_AVX512VNNI_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#undef PKV_I8_DOT
#undef PKV_DOT_ISA
#undef PKV_DOT_TAG
#include "attn_vocab_end.h"

/* ---- AVX-512 + VNNI + AMX: AVX-512 + VNNI's kernels, but bfloat16 keys in
 * float32 scored in AMX tiles (attn_amx.h); built where the compiler has the
 * tile intrinsics (PKV_HAVE_AMX), else never offered ------------------------ */
#if PKV_HAVE_AMX
#define PKV_AMX_KERNELS avx512amx
#define PKV_T_F64 0
#include "vocab_avx512.h"
#define PKV_BF16_AMX 1
#define PKV_DOT_TAG _f32_avx512amx
PKV_TARGET_BEGIN(PKV_AVX512AMX_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#undef PKV_BF16_AMX
#undef PKV_DOT_TAG
#include "attn_vocab_end.h"
#else
#define PKV_AMX_KERNELS avx512 /* a table entry for a path never offered */
#endif

/* ---- AVX-512 + VNNI + BF16: AVX-512 + VNNI's kernels, but bfloat16 keys in
 * float32 scored with vdpbf16ps on a query rounded to bfloat16
 * (attn_bf16dot.h); built where the compiler has the intrinsics
 * (PKV_HAVE_AVX512BF16), else never offered ---------------------------------- */
#if PKV_HAVE_AVX512BF16
#define PKV_BF16_KERNELS avx512bf16
#define PKV_T_F64 0
#include "vocab_avx512.h"
#define PKV_BF16_DOT 1
#define PKV_DOT_TAG _f32_avx512bf16
PKV_TARGET_BEGIN(PKV_AVX512BF16_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#undef PKV_BF16_DOT
#undef PKV_DOT_TAG
#include "attn_vocab_end.h"
#else
#define PKV_BF16_KERNELS avx512 /* a table entry for a path never offered */
#endif
#endif /* PKV_X86 */

#if PKV_ARM64
/* ---- NEON (aarch64 Advanced SIMD, 128-bit) ------------------------------ */
#define PKV_T_F64 0
#include "vocab_neon.h"
#include "attn_instances.h"
/* ---- NEON + dot product: NEON's kernels, but int8 keys in float32 scored
 * with sdot on a quantized query (attn_dot.h) ---------------------------- */
#if PKV_HAVE_NEONDOT
#define PKV_I8_DOT 1
#define PKV_DOT_ISA PKV_DOT_SDOT
#define PKV_DOT_TAG _f32_neondot
PKV_TARGET_BEGIN(PKV_NEONDOT_TARGET)
#include "attn_instances.h"
PKV_TARGET_END
#undef PKV_I8_DOT
#undef PKV_DOT_ISA
#undef PKV_DOT_TAG
#endif
#include "attn_vocab_end.h"
#define PKV_T_F64 1
#include "vocab_neon.h"
#include "attn_instances.h"
#include "attn_vocab_end.h"
#endif /* PKV_ARM64 */

typedef void (*pkv_attn_fn)(const pkv_attn_args *);

typedef struct {
    pkv_attn_fn decode;  /* one query per sequence at its newest rank */
    pkv_attn_fn prefill; /* the newest n ranks of one sequence, causal */
} pkv_kernels;

#define PKV_KERNELS(st, ct, isa) {decode_kv##st##_##ct##_##isa, prefill_kv##st##_##ct##_##isa}
/* the vector paths built for this architecture, as designated entries
 * (the VNNI paths run the kernels of the path below them, but for int8 keys
 * in float32; the BF16 and AMX paths AVX-512 + VNNI's, but for bfloat16 keys
 * in float32) */
#if PKV_X86
#define PKV_KERNELS_X86(st, ct, avx2, vnni256, avx512, vnni512, amx, bf16)                         \
    [PKV_SIMD_AVX2] = PKV_KERNELS(st, ct, avx2), [PKV_SIMD_AVXVNNI] = PKV_KERNELS(st, ct, vnni256), \
    [PKV_SIMD_AVX512] = PKV_KERNELS(st, ct, avx512), [PKV_SIMD_AVX512VNNI] = PKV_KERNELS(st, ct, vnni512), \
    [PKV_SIMD_AVX512AMX] = PKV_KERNELS(st, ct, amx), [PKV_SIMD_AVX512BF16] = PKV_KERNELS(st, ct, bf16)
#define PKV_KERNELS_SIMD(st, ct) PKV_KERNELS_X86(st, ct, avx2, avx2, avx512, avx512, avx512, avx512)
#elif PKV_ARM64 && PKV_HAVE_NEONDOT
#define PKV_KERNELS_ARM(st, ct, dot) [PKV_SIMD_NEON] = PKV_KERNELS(st, ct, neon), [PKV_SIMD_NEONDOT] = PKV_KERNELS(st, ct, dot)
#define PKV_KERNELS_SIMD(st, ct) PKV_KERNELS_ARM(st, ct, neon)
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
#if PKV_X86
    [PKV_BF16][PKV_F32] = {[PKV_SIMD_SCALAR] = PKV_KERNELS(bf16, f32, scalar),
                           PKV_KERNELS_X86(bf16, f32, avx2, avx2, avx512, avx512, PKV_AMX_KERNELS,
                                           PKV_BF16_KERNELS)},
#else
    [PKV_BF16][PKV_F32] = PKV_KERNELS_ALL(bf16, f32),
#endif
    [PKV_BF16][PKV_F64] = PKV_KERNELS_ALL(bf16, f64),
    [PKV_F16][PKV_F32] = PKV_KERNELS_ALL(f16, f32),
    [PKV_F16][PKV_F64] = PKV_KERNELS_ALL(f16, f64),
#if PKV_X86
    [PKV_I8][PKV_F32] = {[PKV_SIMD_SCALAR] = PKV_KERNELS(i8, f32, scalar),
                         PKV_KERNELS_X86(i8, f32, avx2, avxvnni, avx512, avx512vnni, avx512vnni, avx512vnni)},
#elif PKV_ARM64 && PKV_HAVE_NEONDOT
    [PKV_I8][PKV_F32] = {[PKV_SIMD_SCALAR] = PKV_KERNELS(i8, f32, scalar),
                         PKV_KERNELS_ARM(i8, f32, neondot)},
#else
    [PKV_I8][PKV_F32] = PKV_KERNELS_ALL(i8, f32),
#endif
    [PKV_I8][PKV_F64] = PKV_KERNELS_ALL(i8, f64),
};

/* 1 when path `simd` scores int8 keys in float32 with an integer dot
 * product (attn_dot.h): vpdpbusd of AVX2 + AVX-VNNI and AVX-512 + VNNI (also
 * on the BF16 and AMX paths, which run AVX-512 + VNNI's int8 kernels), sdot
 * of NEON + dot product */
static inline int pkv_simd_int8_dot(int simd) {
    return simd == PKV_SIMD_AVXVNNI || simd == PKV_SIMD_AVX512VNNI || simd == PKV_SIMD_AVX512AMX ||
           simd == PKV_SIMD_AVX512BF16 || simd == PKV_SIMD_NEONDOT;
}

/* 1 when the kernels of (storage, compute, simd) round the queries to int8 for
 * a pool of block size bs, with or without RoPE: the integer scores of
 * attn_dot.h, in their instances, where pkv_dot_scores_apply says. */
static inline int pkv_quantizes_queries(int storage, int compute, int simd, int bs, int rope) {
    return storage == PKV_I8 && compute == PKV_F32 && pkv_simd_int8_dot(simd) &&
           pkv_dot_scores_apply(bs, rope, pkv_simd_f32_lanes(simd));
}

/* 1 when the kernels of (storage, compute, simd) round the queries to
 * bfloat16 for a pool of block size bs, with or without RoPE: bfloat16 keys
 * scored with vdpbf16ps (attn_bf16dot.h), where pkv_dot_scores_apply says. */
static inline int pkv_rounds_queries_bf16(int storage, int compute, int simd, int bs, int rope) {
    return storage == PKV_BF16 && compute == PKV_F32 && simd == PKV_SIMD_AVX512BF16 &&
           pkv_dot_scores_apply(bs, rope, pkv_simd_f32_lanes(simd));
}

/* 1 when the kernels of (storage, compute, simd) round the attention weights
 * to int16 for P.V of int8 values (attn_pvdot.h: vpdpwssd), in tiles whose
 * rows come four at a time (several query heads per KV head, or prefill):
 * the AVX-512 + VNNI int8 kernels in float32 (the avx512vnni, avx512bf16
 * and avx512amx paths) where pkv_pv_int16 (prefetch.h) picks them. */
static inline int pkv_quantizes_weights(int storage, int compute, int simd) {
#if PKV_X86
    return storage == PKV_I8 && compute == PKV_F32 && pkv_simd_avx512_vnni(simd) && pkv_pv_int16();
#else
    (void)storage, (void)compute, (void)simd;
    return 0;
#endif
}

/* The kernels for (storage, compute, simd), or NULL when not built. */
static inline const pkv_kernels *pkv_kernels_for(int storage, int compute, int simd) {
    if (storage < 0 || storage >= PKV_NUM_DTYPES || compute < 0 || compute >= PKV_NUM_COMPUTE ||
        simd < 0 || simd >= PKV_NUM_SIMD)
        return NULL;
    const pkv_kernels *k = &pkv_kernel_table[storage][compute][simd];
    return k->decode ? k : NULL;
}
