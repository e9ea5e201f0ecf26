/* pagedkv/alloc.h -- memory for the pool's arena, its per-block arrays and
 * the kernels' scratch.
 *
 * Allocations of 2 MiB or more are aligned to 2 MiB and, on Linux, marked
 * MADV_HUGEPAGE before they are first written, so the kernel may back them
 * with transparent huge pages where its policy is "madvise" (a common
 * default).  A decode work item reads one head's slice of each block (4 KiB
 * for 16 tokens of a 64-wide f32 head): with 4 KiB pages every slice is a
 * page of its own, and a TLB miss once the pool outgrows the TLB's reach.
 * Measured (AMD EPYC Zen 3, AVX2, cold decode over a pool of two
 * interleaved sequences, paired rounds): 2.5-5% faster with huge pages.
 * The advice is only a hint; where it is refused the memory works the same
 * (so do builds that hide MADV_HUGEPAGE, e.g. -D_POSIX_C_SOURCE alone).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define PKV_HUGE ((size_t)2 << 20)

/* n bytes aligned to 64 (to 2 MiB when n >= 2 MiB), not yet written; NULL
 * when out of memory.  *raw receives the pointer to free().  The slack
 * before the aligned start is never written, so it costs address space,
 * not memory. */
static inline void *pkv_alloc(size_t n, void **raw) {
    const size_t align = n >= PKV_HUGE ? PKV_HUGE : 64;
    if (n > SIZE_MAX - align) return NULL;
    char *p = (char *)malloc(n + align);
    if (p == NULL) return NULL;
    *raw = p;
    p = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == PKV_HUGE) (void)madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}
