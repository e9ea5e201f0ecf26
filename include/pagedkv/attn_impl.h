/* pagedkv/attn_impl.h -- paged attention over stored K/V, written once and
 * instantiated by attn_instances.h for each (storage type, compute type,
 * instruction set) on top of attn_math.h.  A template: included after a
 * vocabulary (vocab_*.h) and attn_math.h's instance, once per storage type,
 * so no include guard.
 *
 * The includer defines, besides the vocabulary (vocab_scalar.h) and PKV_FN:
 *   PKV_S          storage type of K/V in the pool
 *   PKV_SLOAD(p)   PKV_W stored values at p -> PKV_VEC of the compute type
 *   PKV_SGET(p)    one stored value at p -> PKV_T
 *   PKV_LDSC(p)    PKV_W float32 scales at p -> PKV_VEC of the compute type
 *   PKV_KFN(name)  name mangling per (storage, compute, ISA)
 *   PKV_CFN(name)  the same function of the instance whose storage is the
 *                  compute type (keys rotated by RoPE are scored by it)
 *   PKV_STORE_SCALED  1 for int8: a float32 scale per PKV_I8_GROUP values of
 *                  a key or value; scores apply the keys' scales once per
 *                  group of dimensions, P.V folds the values' scales into
 *                  the weights (attn_tile.h)
 *
 * A new storage format is a load vocabulary (PKV_SLOAD / PKV_SGET) plus an
 * entry in attn_instances.h and attention.h's dispatch table; nothing in
 * the kernels changes.
 *
 * Layout (types.h): a->k / a->v point at the K / V plane of one layer in
 * block 0; each further block is a->block_stride bytes on.  K is stored
 * transposed inside a block-head ([dim][slot]), V row-major ([slot][dim]).
 *
 * The kernels come in three parts, each included here:
 *   attn_tile.h   one tile of keys: the register micro-kernels (scores,
 *                 P.V), RoPE of a tile's keys, the softmax step
 *   attn_item.h   one work item: kv heads of one sequence over a range of
 *                 ranks, tile after tile, with the prefetch stream
 *   attn_calls.h  the entry points decode and prefill: their work split
 *                 into items over threads, the merge of split-K partials
 */
#include <math.h>
#include <string.h>
#include "attn_args.h"
#include "prefetch.h"
#include "types.h"

#ifndef PKV_STORE_SCALED
#define PKV_STORE_SCALED 0
#define PKV_SCALED_DEFAULTED
#endif
/* 1: int8 keys scored with an integer dot product (attn_dot.h; AVX-512 +
 * VNNI, float32 compute) */
#ifndef PKV_I8_DOT
#define PKV_I8_DOT 0
#define PKV_DOT_DEFAULTED
#endif

/* 1: bfloat16 keys scored in AMX tiles (attn_amx.h; AVX-512 + AMX, float32
 * compute) */
#ifndef PKV_BF16_AMX
#define PKV_BF16_AMX 0
#define PKV_AMX_DEFAULTED
#endif

/* 1: bfloat16 keys scored with vdpbf16ps (attn_bf16dot.h; AVX-512 + VNNI +
 * BF16, float32 compute) */
#ifndef PKV_BF16_DOT
#define PKV_BF16_DOT 0
#define PKV_BDOT_DEFAULTED
#endif

#include "attn_tile.h"
#include "attn_item.h"
#include "attn_calls.h"
#undef PKV_WIDENS

#ifdef PKV_SCALED_DEFAULTED
#undef PKV_STORE_SCALED
#undef PKV_SCALED_DEFAULTED
#endif
#ifdef PKV_DOT_DEFAULTED
#undef PKV_I8_DOT
#undef PKV_DOT_DEFAULTED
#endif
#ifdef PKV_AMX_DEFAULTED
#undef PKV_BF16_AMX
#undef PKV_AMX_DEFAULTED
#endif
#ifdef PKV_BDOT_DEFAULTED
#undef PKV_BF16_DOT
#undef PKV_BDOT_DEFAULTED
#endif
