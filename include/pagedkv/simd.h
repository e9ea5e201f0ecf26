/* pagedkv/simd.h -- run-time SIMD detection.
 *
 * The kernels are compiled once per instruction set (see attention.h);
 * nothing here depends on the flags the extension was built with, so one
 * binary runs on any CPU of its architecture and picks its path at import.
 *
 * x86-64: scalar, AVX2+FMA, AVX2 with AVX-VNNI, AVX-512, AVX-512 with
 * VNNI, AVX-512 with VNNI and AVX512_BF16, and AVX-512 with VNNI and
 * AMX-BF16, compiled with per-function target pragmas.  The VNNI paths run
 * the kernels of the path below them, except that int8 keys in float32 are
 * scored with the integer dot product vpdpbusd (attn_dot.h); the BF16 and
 * AMX paths run AVX-512 + VNNI's kernels, except that bfloat16 keys in
 * float32 are scored with vdpbf16ps on a query rounded to bfloat16
 * (attn_bf16dot.h) or in AMX tiles (attn_amx.h).  AMX
 * needs the OS's leave to use its tile state: on Linux, granted per process
 * by arch_prctl(ARCH_REQ_XCOMP_PERM), asked once here; where it is refused
 * (or the OS is not Linux) the path is not offered.
 * Detection asks cpuid for the instructions *and* xgetbv for the OS support
 * of the wide registers (a CPU can report AVX-512 while the kernel does not
 * save zmm state).
 *
 * aarch64: scalar and NEON (Advanced SIMD, 128-bit, with FMA and f64 lanes).
 * Advanced SIMD is part of the base AArch64 architecture, so its kernels
 * need no target pragma; on Linux the path is still confirmed with
 * HWCAP_ASIMD (a kernel can hide it), elsewhere it is assumed.  NEON + dot
 * product (sdot, FEAT_DotProd, Armv8.2 and later) runs NEON's kernels but
 * scores int8 keys in float32 with sdot; it is built by GCC 8 or later on
 * Linux (a target pragma; detected with HWCAP_ASIMDDP), not elsewhere.
 */
#pragma once
#include <stdint.h>

enum {
    PKV_SIMD_SCALAR = 0,
    PKV_SIMD_AVX2 = 1,
    PKV_SIMD_AVX512 = 2,
    PKV_SIMD_NEON = 3,
    PKV_SIMD_AVX512VNNI = 4, /* AVX-512 + AVX512_VNNI */
    PKV_SIMD_AVXVNNI = 5,    /* AVX2 + AVX-VNNI (256-bit vpdpbusd, no AVX-512) */
    PKV_SIMD_NEONDOT = 6,    /* NEON + the dot product extension (sdot) */
    PKV_SIMD_AVX512AMX = 7,  /* AVX-512 + AVX512_VNNI + AMX-TILE + AMX-BF16 */
    PKV_SIMD_AVX512BF16 = 8, /* AVX-512 + AVX512_VNNI + AVX512_BF16 */
    PKV_NUM_SIMD = 9
};
/* their names (PAGEDKV_SIMD), indexed by PKV_SIMD_*: an initializer */
#define PKV_SIMD_NAMES {"scalar", "avx2", "avx512", "neon", "avx512vnni", "avxvnni", "neondot", "avx512amx", "avx512bf16"}

/* CPU vendors (pkv_cpu_vendor) */
enum { PKV_CPU_OTHER = 0, PKV_CPU_INTEL = 1, PKV_CPU_AMD = 2 };

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define PKV_X86 1
#define PKV_ARM64 0
#include <cpuid.h>

/* 1 when the compiler can build the AMX path (its tile intrinsics: GCC 11,
 * clang 12 on); older compilers build the others and never offer it */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define PKV_HAVE_AMX 1
#else
#define PKV_HAVE_AMX 0
#endif
/* ... and the AVX512_BF16 path (its intrinsics: GCC 10, clang 9 on) */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define PKV_HAVE_AVX512BF16 1
#else
#define PKV_HAVE_AVX512BF16 0
#endif

/* Ask the OS for the AMX tile data state (Linux 5.16 on: a process must
 * request it before its first tile instruction, or that instruction faults).
 * 1 when granted (asking again once granted is harmless). */
static inline int pkv_amx_permitted(void) {
#if defined(__linux__)
    /* the arch_prctl system call (158 on x86-64), made directly: no libc
     * feature macros needed */
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(158L), "D"(0x1023L /* ARCH_REQ_XCOMP_PERM */), "S"(18L /* XFEATURE_XTILEDATA */)
                     : "rcx", "r11", "memory");
    return ret == 0;
#else
    return 0;
#endif
}

static inline uint64_t pkv_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* The CPU's vendor (PKV_CPU_*), and its display family (base + extended,
 * cpuid leaf 1) into *family: the prefetch stream's choices (prefetch.h). */
static inline int pkv_cpu_vendor(int *family) {
    unsigned a, b, c, d;
    *family = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return PKV_CPU_OTHER;
    const int intel = b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu; /* Genu ineI ntel */
    const int amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;   /* Auth enti cAMD */
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        const int base = (a >> 8) & 0xF;
        *family = base == 0xF ? base + (int)((a >> 20) & 0xFF) : base;
    }
    return intel ? PKV_CPU_INTEL : amd ? PKV_CPU_AMD : PKV_CPU_OTHER;
}

/* The x86 paths this CPU and OS can run, one bit per PKV_SIMD_* (scalar
 * always), cached after the first call. */
static inline unsigned pkv_x86_paths(void) {
    static volatile unsigned cached = 0; /* 0: not asked yet (bit 0 is always set) */
    if (cached) return cached;
    unsigned paths = 1u << PKV_SIMD_SCALAR, a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1;
        const int f16c = (c >> 29) & 1; /* half-precision loads of float16 storage */
        const uint64_t xcr0 = osxsave ? pkv_xgetbv0() : 0;
        if (avx && fma && f16c && (xcr0 & 0x6) == 0x6 && __get_cpuid_max(0, 0) >= 7) { /* xmm + ymm state */
            __cpuid_count(7, 0, a, b, c, d);
            const int avx2 = (b >> 5) & 1;
            const int avx512 = ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) &&
                               (xcr0 & 0xE0) == 0xE0; /* F, DQ, BW, VL; opmask + zmm state */
            const int vnni512 = (c >> 11) & 1;        /* AVX512_VNNI */
            unsigned a1, b1, c1, d1;
            __cpuid_count(7, 1, a1, b1, c1, d1);
            const int avxvnni = (a1 >> 4) & 1; /* AVX-VNNI (VEX-encoded vpdpbusd) */
            const int bf16 = (a1 >> 5) & 1;    /* AVX512_BF16 (vdpbf16ps) */
            /* AMX-BF16 and AMX-TILE (leaf 7 edx bits 22, 24), the OS saving
             * the tile config and data (XCR0 bits 17, 18) */
            const int amx = ((d >> 22) & 1) && ((d >> 24) & 1) && ((xcr0 >> 17) & 3) == 3;
            if (avx2) {
                paths |= 1u << PKV_SIMD_AVX2;
                if (avxvnni) paths |= 1u << PKV_SIMD_AVXVNNI;
                if (avx512) paths |= 1u << PKV_SIMD_AVX512;
                if (avx512 && vnni512) paths |= 1u << PKV_SIMD_AVX512VNNI;
                if (PKV_HAVE_AVX512BF16 && avx512 && vnni512 && bf16) paths |= 1u << PKV_SIMD_AVX512BF16;
                if (PKV_HAVE_AMX && avx512 && vnni512 && amx && pkv_amx_permitted())
                    paths |= 1u << PKV_SIMD_AVX512AMX;
            }
        }
    }
    cached = paths;
    return paths;
}

/* Best SIMD path this CPU and OS can run: AVX-512 (+ VNNI, + BF16 or AMX)
 * before AVX2 (+ AVX-VNNI). */
static inline int pkv_detect_simd(void) {
    static const int order[] = {PKV_SIMD_AVX512AMX, PKV_SIMD_AVX512BF16, PKV_SIMD_AVX512VNNI, PKV_SIMD_AVX512, PKV_SIMD_AVXVNNI,
                                PKV_SIMD_AVX2};
    const unsigned paths = pkv_x86_paths();
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (paths & (1u << order[i])) return order[i];
    return PKV_SIMD_SCALAR;
}

#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define PKV_X86 0
#define PKV_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8 /* +dotprod: GCC 8 on */
#define PKV_HAVE_NEONDOT 1 /* attention.h builds the sdot kernels */
#else
#define PKV_HAVE_NEONDOT 0
#endif
static inline int pkv_detect_simd(void) {
    const unsigned long hw = getauxval(AT_HWCAP);
    if (!(hw & HWCAP_ASIMD)) return PKV_SIMD_SCALAR;
    return PKV_HAVE_NEONDOT && (hw & HWCAP_ASIMDDP) ? PKV_SIMD_NEONDOT : PKV_SIMD_NEON;
}
#else
#define PKV_HAVE_NEONDOT 0
static inline int pkv_detect_simd(void) { return PKV_SIMD_NEON; }
#endif

#else
#define PKV_X86 0
#define PKV_ARM64 0
static inline int pkv_detect_simd(void) { return PKV_SIMD_SCALAR; }
#endif

#if !PKV_X86
static inline int pkv_cpu_vendor(int *family) { /* not asked off x86 */
    *family = 0;
    return PKV_CPU_OTHER;
}
#endif

/* 1 when path `simd` runs here and was built: scalar always; on x86-64
 * each path whose instructions the CPU and OS have; on aarch64 the detected
 * path and NEON below NEON + dot product. */
static inline int pkv_simd_supported(int simd) {
    if (simd == PKV_SIMD_SCALAR) return 1;
#if PKV_X86
    return simd > 0 && simd < PKV_NUM_SIMD && simd != PKV_SIMD_NEON && simd != PKV_SIMD_NEONDOT &&
           ((pkv_x86_paths() >> simd) & 1);
#else
    const int best = pkv_detect_simd();
    return simd == best || (simd == PKV_SIMD_NEON && best == PKV_SIMD_NEONDOT);
#endif
}

/* The path whose kernels path `simd` shares outside the int8 and bfloat16
 * scores (the read, linear and peak helpers of AVX-512 + VNNI and of
 * AVX-512 + BF16 and of AVX-512 + AMX are AVX-512's, those of AVX2 + AVX-VNNI AVX2's, those of NEON
 * + dot product NEON's). */
static inline int pkv_simd_base(int simd) {
    switch (simd) {
    case PKV_SIMD_AVX512VNNI: return PKV_SIMD_AVX512;
    case PKV_SIMD_AVX512AMX: return PKV_SIMD_AVX512;
    case PKV_SIMD_AVX512BF16: return PKV_SIMD_AVX512;
    case PKV_SIMD_AVXVNNI: return PKV_SIMD_AVX2;
    case PKV_SIMD_NEONDOT: return PKV_SIMD_NEON;
    default: return simd;
    }
}

/* 1 for the paths that run AVX-512 + VNNI's int8 kernels: avx512vnni and the
 * bfloat16 and AMX paths built on it */
static inline int pkv_simd_avx512_vnni(int simd) {
    return simd == PKV_SIMD_AVX512VNNI || simd == PKV_SIMD_AVX512AMX || simd == PKV_SIMD_AVX512BF16;
}

/* Key lanes of one vector of path `simd`'s float32 kernels (PKV_W) */
static inline int pkv_simd_f32_lanes(int simd) {
    switch (pkv_simd_base(simd)) {
    case PKV_SIMD_AVX2: return 8;
    case PKV_SIMD_AVX512: return 16;
    case PKV_SIMD_NEON: return 4;
    default: return 1;
    }
}
