/* pagedkv/attn_instances.h -- instantiate the kernels of one (compute type,
 * instruction set) for every storage type they read.  Included by
 * attention.h once per pair, after it has defined the SIMD vocabulary, T,
 * PKV_F64 and PKV_TAG (the pair's name suffix, e.g. _f32_avx2).  No include
 * guard on purpose.
 *
 * Adding a storage format: its load vocabulary (SLOAD / SGET for each
 * instruction set), one block below, one line in attention.h's table.
 */
#define FN(name) PKV_CAT(name, PKV_TAG)
#include "attn_math.h"

#define PKV_STORE_IS_COMPUTE 1
#define S T
#define SLOAD(p) VLOAD(p)
#define SGET(p) (*(p))
#if PKV_F64
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvf64), PKV_TAG)
#else
#define KFN(name) PKV_CAT(PKV_CAT(name, _kvf32), PKV_TAG)
#endif
#include "attn_impl.h"
#undef KFN
#undef SGET
#undef SLOAD
#undef S
#undef PKV_STORE_IS_COMPUTE

#undef FN
