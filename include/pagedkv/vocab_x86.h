/* pagedkv/vocab_x86.h -- what the x86-64 vocabularies (vocab_avx2.h,
 * vocab_avx512.h) share: the per-function target pragmas that let one
 * translation unit without -m flags hold AVX2 and AVX-512 code (a region
 * between PKV_TARGET_BEGIN("isa,...") and PKV_TARGET_END is compiled for
 * those instruction sets), and the rounding mode of PKV_VROUND.
 */
#pragma once
#include <immintrin.h>

#define PKV_STR(x) #x
#if defined(__clang__)
#define PKV_TARGET_BEGIN(s) _Pragma(PKV_STR(clang attribute push(__attribute__((target(s))), apply_to = function)))
#define PKV_TARGET_END _Pragma("clang attribute pop")
#else
#define PKV_TARGET_BEGIN(s) _Pragma("GCC push_options") _Pragma(PKV_STR(GCC target(s)))
#define PKV_TARGET_END _Pragma("GCC pop_options")
#endif

/* round to nearest, ties to even, no exceptions (as nearbyint) */
#define PKV_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* round down, no exceptions (vreduce: x - floor(x)) */
#define PKV_RD (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
