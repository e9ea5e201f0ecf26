/* pagedkv/attn_instances.h -- instantiate the kernels of one (compute type,
 * instruction set) for every storage type they read.  Included by
 * attention.h once per pair, after it has defined the SIMD vocabulary, T,
 * PKV_F64 and PKV_TAG (the pair's name suffix, e.g. _f32_avx2).  No include
 * guard on purpose.
 *
 * Adding a storage format: its load vocabulary (an LD_* macro per
 * instruction set in attention.h, a scalar reader in convert.h), one block
 * below, one line in attention.h's table.
 */
#define FN(name) PKV_CAT(name, PKV_TAG)
#include "attn_math.h"

/* W float32 scales (int8 storage; RoPE'd int8 keys) as the compute type */
#if PKV_F64
#define LDSC(p) LD_F32(p)
#else
#define LDSC(p) VLOAD(p)
#endif

/* storage = the compute type */
#define S T
#define SLOAD(p) VLOAD(p)
#define SGET(p) (*(p))
#if PKV_F64
#define CFN(name) PKV_CAT(PKV_CAT(name, _kvf64), PKV_TAG)
#else
#define CFN(name) PKV_CAT(PKV_CAT(name, _kvf32), PKV_TAG)
#endif
/* CFN stays defined: the int8 kernels fold dequantized runs with this
 * instance's functions */
#define KFN(name) CFN(name)
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD
#undef S

#if PKV_F64
/* float32 storage read by float64 compute */
#define S float
#define SLOAD(p) LD_F32(p)
#define SGET(p) ((T) * (p))
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvf32), PKV_TAG)
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD
#undef S
#endif

/* bfloat16 */
#define S uint16_t
#define SLOAD(p) LD_BF16(p)
#define SGET(p) ((T)pkv_bf16_to_f32(*(p)))
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvbf16), PKV_TAG)
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD

/* float16 (S is still uint16_t) */
#define SLOAD(p) LD_F16(p)
#define SGET(p) ((T)pkv_f16_to_f32(*(p)))
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvf16), PKV_TAG)
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD
#undef S

/* int8 with a float32 scale per PKV_I8_GROUP values: SLOAD/SGET read the
 * raw integers, attn_impl.h applies the group scales */
#define PKV_STORE_SCALED 1
#define S int8_t
#define SLOAD(p) LD_I8(p)
#define SGET(p) ((T) * (p))
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvi8), PKV_TAG)
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD
#undef S
#undef PKV_STORE_SCALED
#undef CFN
#undef LDSC

#undef FN
