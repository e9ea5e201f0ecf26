/* pagedkv/simd.h -- run-time SIMD detection.
 *
 * The kernels are compiled once per instruction set with per-function target
 * pragmas (see attention.h); nothing here depends on the flags the extension
 * was built with, so one binary runs on any x86-64 and picks its path at
 * import.  Detection asks cpuid for the instructions *and* xgetbv for the OS
 * support of the wide registers (a CPU can report AVX-512 while the kernel
 * does not save zmm state).
 */
#pragma once
#include <stdint.h>

enum { PKV_SIMD_SCALAR = 0, PKV_SIMD_AVX2 = 1, PKV_SIMD_AVX512 = 2, PKV_NUM_SIMD = 3 };

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define PKV_X86 1
#include <cpuid.h>

static inline uint64_t pkv_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* Highest SIMD level this CPU and OS can run. */
static inline int pkv_detect_simd(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return PKV_SIMD_SCALAR;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1;
    const int f16c = (c >> 29) & 1; /* half-precision loads of float16 storage */
    if (!(osxsave && avx && fma && f16c)) return PKV_SIMD_SCALAR;
    const uint64_t xcr0 = pkv_xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return PKV_SIMD_SCALAR;           /* xmm + ymm state */
    if (__get_cpuid_max(0, 0) < 7) return PKV_SIMD_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1;
    if (!avx2) return PKV_SIMD_SCALAR;
    const int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1;
    const int avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    if (avx512f && avx512dq && avx512bw && avx512vl && (xcr0 & 0xE0) == 0xE0)
        return PKV_SIMD_AVX512;                                   /* opmask + zmm state */
    return PKV_SIMD_AVX2;
}
#else
#define PKV_X86 0
static inline int pkv_detect_simd(void) { return PKV_SIMD_SCALAR; }
#endif
