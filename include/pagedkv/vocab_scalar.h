/* pagedkv/vocab_scalar.h -- the SIMD vocabulary of the kernel templates
 * (attn_math.h, attn_impl.h) on plain C scalars: one lane, so a "vector" is
 * a value of the compute type.  Built on every architecture; the compiler
 * picks its instructions (it may pack lanes into SSE2 / Advanced SIMD).
 *
 * The vocabulary (the same names in every vocab_*.h):
 *   PKV_T         compute type (float / double); PKV_TAG its name suffix
 *   PKV_VEC, PKV_W             vector type and its number of lanes
 *   PKV_VLOAD(p) PKV_VSTORE(p, x) PKV_VSET1(s) PKV_VZERO()
 *   PKV_VADD(a, b) PKV_VSUB(a, b) PKV_VMUL(a, b) PKV_VDIV(a, b)
 *   PKV_VMAX(a, b) PKV_VMIN(a, b)
 *   PKV_VFMA(a, b, c)  a * b + c
 *   PKV_VREDUCE(x)     horizontal sum -> PKV_T
 *   PKV_VHMAX(x)       horizontal max -> PKV_T
 *   PKV_VROUND(x)      round to nearest integer, ties to even (as PKV_T)
 *   PKV_VSCALE2K(p, k) p * 2^k for integral k in the normal exponent range
 *   PKV_VFRAC(x)       x - floor(x), in [0, 1) (exact)
 *   PKV_VSCALE2FL(p, x) p * 2^floor(x), floor(x) in the normal exponent range
 *   PKV_SC_NV, PKV_PV_NV  key / output vectors per register tile (attn_tile.h)
 * and the loads of the storage types (PKV_W stored values at p -> PKV_VEC):
 *   PKV_LD_F32(p)   float    (compute double only)
 *   PKV_LD_BF16(p)  bfloat16 (uint16_t bits)
 *   PKV_LD_F16(p)   float16  (uint16_t bits)
 *   PKV_LD_I8(p)    int8, unscaled (the int8 kernels apply the group scale)
 *
 * Included by attention.h with PKV_T_F64 defined (0: PKV_T is float, 1:
 * double; a name of its own, apart from the dtype code PKV_F64 of types.h)
 * and undone by attn_vocab_end.h, once per compute type: no include guard.
 */
#include <math.h>
#include "convert.h"

#define PKV_VEC PKV_T
#define PKV_W 1
#define PKV_SC_NV 2
#define PKV_PV_NV 2
#define PKV_VLOAD(p) (*(p))
#define PKV_VSTORE(p, x) (*(p) = (x))
#define PKV_VSET1(s) (s)
#define PKV_VZERO() ((PKV_T)0)
#define PKV_VADD(a, b) ((a) + (b))
#define PKV_VSUB(a, b) ((a) - (b))
#define PKV_VMUL(a, b) ((a) * (b))
#define PKV_VDIV(a, b) ((a) / (b))
#define PKV_VMAX(a, b) ((a) > (b) ? (a) : (b))
#define PKV_VMIN(a, b) ((a) < (b) ? (a) : (b))
#define PKV_VFMA(a, b, c) ((a) * (b) + (c))
#define PKV_VREDUCE(x) (x)
#define PKV_VHMAX(x) (x)
#define PKV_VROUND(x) ((PKV_T)nearbyint(x))
#define PKV_VSCALE2K(p, k) ((PKV_T)ldexp((double)(p), (int)(k)))
#define PKV_VFRAC(x) ((x) - (PKV_T)floor(x))
#define PKV_VSCALE2FL(p, x) ((PKV_T)ldexp((double)(p), (int)floor(x)))
#define PKV_LD_F32(p) ((PKV_T) * (p))
#define PKV_LD_BF16(p) ((PKV_T)pkv_bf16_to_f32(*(p)))
#define PKV_LD_F16(p) ((PKV_T)pkv_f16_to_f32(*(p)))
#define PKV_LD_I8(p) ((PKV_T) * (p))
#if PKV_T_F64
#define PKV_T double
#define PKV_TAG _f64_scalar
#else
#define PKV_T float
#define PKV_TAG _f32_scalar
#endif
