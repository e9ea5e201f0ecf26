/* pagedkv/attn_instances.h -- instantiate the kernels of one (compute type,
 * instruction set) for every storage type they read, and the row-batch
 * linear kernel of linear_impl.h.  Included by
 * attention.h once per pair, after one vocabulary (vocab_*.h: PKV_T, PKV_VEC,
 * PKV_W, ..., PKV_T_F64 and PKV_TAG, the pair's name suffix, e.g. _f32_avx2)
 * and before attn_vocab_end.h.  No include guard on purpose.
 *
 * Adding a storage format: its load vocabulary (a PKV_LD_* macro in every
 * vocab_*.h, a scalar reader in convert.h), one block below, one line in
 * attention.h's table.
 *
 * With PKV_I8_DOT defined to 1 (and PKV_DOT_ISA, the dot instruction, and
 * PKV_DOT_TAG, the name suffix of the instance) only the int8 kernels are
 * instantiated, their keys scored with an integer dot product
 * (attn_dot.h); everything else they call is the instance of PKV_TAG,
 * included before (attention.h: AVX-512 + VNNI on AVX-512's float32
 * instance, AVX2 + AVX-VNNI on AVX2's).  With PKV_BF16_AMX defined to 1 (and
 * PKV_DOT_TAG) only the bfloat16 kernels are, their keys scored in AMX tiles
 * (attn_amx.h), on AVX-512's float32 instance; with PKV_BF16_DOT defined to 1
 * (and PKV_DOT_TAG) likewise, their keys scored with vdpbf16ps
 * (attn_bf16dot.h).
 */
#if defined(PKV_I8_DOT) || defined(PKV_BF16_AMX) || defined(PKV_BF16_DOT)
#define PKV_ONE_STORAGE 1 /* the instance of one storage type on PKV_TAG's */
#endif
#define PKV_FN(name) PKV_CAT(name, PKV_TAG)
#ifndef PKV_ONE_STORAGE
#include "attn_math.h"
#endif

/* PKV_W float32 scales (int8 storage; RoPE'd int8 keys) as the compute type */
#if PKV_T_F64
#define PKV_LDSC(p) PKV_LD_F32(p)
#else
#define PKV_LDSC(p) PKV_VLOAD(p)
#endif

/* PKV_CFN: the instance whose storage is the compute type; the int8
 * kernels fold dequantized runs with its functions.  PKV_CFN_AT: the same
 * instance of the vocabulary tagged `tag` (attn_calls.h) */
#if PKV_T_F64
#define PKV_CFN_AT(name, tag) PKV_CAT(PKV_CAT(name, _kvf64), tag)
#else
#define PKV_CFN_AT(name, tag) PKV_CAT(PKV_CAT(name, _kvf32), tag)
#endif
#define PKV_CFN(name) PKV_CFN_AT(name, PKV_TAG)

#ifndef PKV_ONE_STORAGE
/* storage = the compute type */
#define PKV_S PKV_T
#define PKV_STORE_NATIVE 1 /* (attn_calls.h: big decode calls on AVX2's kernels) */
#define PKV_SLOAD(p) PKV_VLOAD(p)
#define PKV_SGET(p) (*(p))
#define PKV_KFN(name) PKV_CFN(name)
#include "attn_impl.h"
#undef PKV_KFN
#undef PKV_SGET
#undef PKV_SLOAD
#undef PKV_STORE_NATIVE
#undef PKV_S

#if PKV_T_F64
/* float32 storage read by float64 compute */
#define PKV_S float
#define PKV_SLOAD(p) PKV_LD_F32(p)
#define PKV_SGET(p) ((PKV_T) * (p))
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvf32), PKV_TAG)
#include "attn_impl.h"
#undef PKV_KFN
#undef PKV_SGET
#undef PKV_SLOAD
#undef PKV_S
#endif
#endif /* !PKV_ONE_STORAGE */

#ifndef PKV_I8_DOT
/* bfloat16 */
#define PKV_S uint16_t
#define PKV_SLOAD(p) PKV_LD_BF16(p)
#define PKV_SGET(p) ((PKV_T)pkv_bf16_to_f32(*(p)))
#ifdef PKV_LD_BF16_PAIR /* the even or odd dimensions of two vectors (attn_tile.h) */
#define PKV_SLOAD_PAIR(p, odd) PKV_LD_BF16_PAIR(p, odd)
#endif
#if defined(PKV_BF16_AMX) || defined(PKV_BF16_DOT)
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvbf16), PKV_DOT_TAG)
#else
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvbf16), PKV_TAG)
#endif
#include "attn_impl.h"
#undef PKV_SLOAD_PAIR
#undef PKV_KFN
#undef PKV_SGET
#undef PKV_SLOAD
#undef PKV_S
#endif

#ifndef PKV_ONE_STORAGE
/* float16 */
#define PKV_S uint16_t
#define PKV_SLOAD(p) PKV_LD_F16(p)
#define PKV_SGET(p) ((PKV_T)pkv_f16_to_f32(*(p)))
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvf16), PKV_TAG)
#include "attn_impl.h"
#undef PKV_KFN
#undef PKV_SGET
#undef PKV_SLOAD
#undef PKV_S
#endif /* !PKV_ONE_STORAGE */

#if !defined(PKV_BF16_AMX) && !defined(PKV_BF16_DOT)
/* int8 with a float32 scale per PKV_I8_GROUP values: PKV_SLOAD / PKV_SGET
 * read the raw integers, attn_impl.h applies the group scales */
#define PKV_STORE_SCALED 1
#define PKV_S int8_t
#define PKV_SLOAD(p) PKV_LD_I8(p)
#define PKV_SGET(p) ((PKV_T) * (p))
#ifdef PKV_I8_DOT
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvi8), PKV_DOT_TAG)
#else
#define PKV_KFN(name) PKV_CAT(PKV_CAT(name, _kvi8), PKV_TAG)
#endif
#include "attn_impl.h"
#undef PKV_KFN
#undef PKV_SGET
#undef PKV_SLOAD
#undef PKV_S
#undef PKV_STORE_SCALED
#endif /* !PKV_BF16_AMX && !PKV_BF16_DOT */
#undef PKV_CFN
#undef PKV_CFN_AT
#undef PKV_LDSC

/* the row-batch linear kernel (compute type only; dispatched by linear.h) */
#ifndef PKV_ONE_STORAGE
#include "linear_impl.h"
#endif

#undef PKV_ONE_STORAGE
#undef PKV_FN
