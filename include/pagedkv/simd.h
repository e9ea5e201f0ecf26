/* pagedkv/simd.h -- run-time SIMD detection.
 *
 * The kernels are compiled once per instruction set (see attention.h);
 * nothing here depends on the flags the extension was built with, so one
 * binary runs on any CPU of its architecture and picks its path at import.
 *
 * x86-64: scalar, AVX2+FMA, AVX-512, and AVX-512 with VNNI (the same
 * kernels, except that int8 keys are scored with the integer dot product
 * vpdpbusd: attn_dot.h), compiled with per-function target pragmas.
 * Detection asks cpuid for the instructions *and* xgetbv for the OS support
 * of the wide registers (a CPU can report AVX-512 while the kernel does not
 * save zmm state).
 *
 * aarch64: scalar and NEON (Advanced SIMD, 128-bit, with FMA and f64 lanes).
 * Advanced SIMD is part of the base AArch64 architecture, so its kernels
 * need no target pragma; on Linux the path is still confirmed with
 * HWCAP_ASIMD (a kernel can hide it), elsewhere it is assumed.
 */
#pragma once
#include <stdint.h>

enum {
    PKV_SIMD_SCALAR = 0,
    PKV_SIMD_AVX2 = 1,
    PKV_SIMD_AVX512 = 2,
    PKV_SIMD_NEON = 3,
    PKV_SIMD_AVX512VNNI = 4, /* AVX-512 + AVX512_VNNI */
    PKV_NUM_SIMD = 5
};

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define PKV_X86 1
#define PKV_ARM64 0
#include <cpuid.h>

static inline uint64_t pkv_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* 1 on an Intel CPU (cpuid vendor "GenuineIntel"; prefetch.h), cached */
static inline int pkv_cpu_is_intel(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu; /* Genu ineI ntel */
}

/* Best SIMD path this CPU and OS can run. */
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
    const int vnni = (c >> 11) & 1;                               /* AVX512_VNNI */
    if (avx512f && avx512dq && avx512bw && avx512vl && (xcr0 & 0xE0) == 0xE0)
        return vnni ? PKV_SIMD_AVX512VNNI : PKV_SIMD_AVX512;      /* opmask + zmm state */
    return PKV_SIMD_AVX2;
}

#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define PKV_X86 0
#define PKV_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
static inline int pkv_detect_simd(void) {
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) ? PKV_SIMD_NEON : PKV_SIMD_SCALAR;
}
#else
static inline int pkv_detect_simd(void) { return PKV_SIMD_NEON; }
#endif
static inline int pkv_cpu_is_intel(void) { return 0; }

#else
#define PKV_X86 0
#define PKV_ARM64 0
static inline int pkv_detect_simd(void) { return PKV_SIMD_SCALAR; }
static inline int pkv_cpu_is_intel(void) { return 0; }
#endif

/* 1 when path `simd` runs here and was built: scalar always, plus the
 * detected path and (x86) the narrower ones below it: AVX2 below AVX-512,
 * AVX-512 below AVX-512 + VNNI. */
static inline int pkv_simd_supported(int simd) {
    const int best = pkv_detect_simd();
    return simd == PKV_SIMD_SCALAR || simd == best ||
           (simd == PKV_SIMD_AVX2 && (best == PKV_SIMD_AVX512 || best == PKV_SIMD_AVX512VNNI)) ||
           (simd == PKV_SIMD_AVX512 && best == PKV_SIMD_AVX512VNNI);
}

/* The path whose kernels path `simd` shares outside the int8 scores (the
 * read, linear and peak helpers of AVX-512 + VNNI are AVX-512's). */
static inline int pkv_simd_base(int simd) {
    return simd == PKV_SIMD_AVX512VNNI ? PKV_SIMD_AVX512 : simd;
}
