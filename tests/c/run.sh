#!/usr/bin/env bash
# Builds tests/c/test_kernels.c (with fixture.c) and runs it on every SIMD path it can reach:
#   native    with $CC (default cc): scalar, and AVX2 / AVX-VNNI / AVX-512 / AVX-512 VNNI /
#             AVX-512 BF16 / AVX-512 AMX where this CPU has them; then again with the prefetch stream forced into L2
#             two units ahead (with decode's K units prefetching their rows into L1) and into L1
#             one unit ahead (with two decode items a thread)
#   aarch64   cross-compiled static with aarch64-linux-gnu-gcc and run under
#             qemu-aarch64-static: scalar, NEON and NEON + dot product, then again as
#             a Cortex-A53, which lacks the dot product (skipped, saying so, when the
#             tools are missing: apt-get install gcc-aarch64-linux-gnu qemu-user-static)
# Usage: tests/c/run.sh [--native-only] [test_kernels options, e.g. --trials 20 --seed 7]
# Exit status: 0 when every run passed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
native_only=0
if [ "${1:-}" = "--native-only" ]; then native_only=1; shift; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# decode's threads do not depend on OMP_WAIT_POLICY here (attn_args.h: PKV_PASSIVE_PARALLEL_MIN_BYTES):
# the tests' long decode calls must run on 2 threads under any policy
flags=(-O2 -std=c11 -Wall -Wextra -I"$root/include" -DPKV_PASSIVE_PARALLEL_MIN_BYTES=0
       "$here/test_kernels.c" "$here/fixture.c" -lm)

# compile: $1 compiler, $2 output, rest extra flags; OpenMP when the compiler has it
build() {
    local cc="$1" exe="$2"
    shift 2
    if ! "$cc" "${flags[@]}" -fopenmp "$@" -o "$exe" 2>"$out/cc.log"; then
        echo "($cc: no OpenMP, building single-threaded)"
        "$cc" "${flags[@]}" "$@" -o "$exe" 2>"$out/cc.log" || { cat "$out/cc.log" >&2; return 1; }
    fi
    # static libgomp warns that it links dlopen; everything else is shown
    grep -v -e "dlopen" -e "goacc_profiling" -e "in function" "$out/cc.log" >&2 || true
}

cc="${CC:-cc}"
require=(--require scalar)
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
    require+=(--require avx2)
    if grep -qw avx_vnni /proc/cpuinfo; then require+=(--require avxvnni); fi
fi
if grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qw avx512vl /proc/cpuinfo \
    && grep -qw avx512bw /proc/cpuinfo && grep -qw avx512dq /proc/cpuinfo; then
    require+=(--require avx512)
    if grep -qw avx512_vnni /proc/cpuinfo; then
        require+=(--require avx512vnni)
        if grep -qw avx512_bf16 /proc/cpuinfo; then require+=(--require avx512bf16); fi
        # AMX: the kernel lists amx_tile / amx_bf16 only where it supports them (Linux)
        if grep -qw amx_tile /proc/cpuinfo && grep -qw amx_bf16 /proc/cpuinfo; then
            require+=(--require avx512amx)
        fi
    fi
fi
echo "== native ($("$cc" -dumpmachine 2>/dev/null || echo "$cc"))"
build "$cc" "$out/test_kernels"
"$out/test_kernels" "${require[@]}" "$@"
# the prefetch stream goes into L1 or L2, one or two units ahead, by CPU (prefetch.h): run
# forced choices, so those this CPU does not take are tested too, and with every decode call
# running the stream (by default only calls of 1 MiB or more), its K units too where it goes
# into L2 (by default calls of 4 MiB or more): into L2 two units ahead, with
# every smaller decode call's K units prefetching their own rows into L1 (l1k, by default only
# on Intel and for calls of 2 MiB or more), float32 and float64 decode on an AVX-512 path
# running the AVX2 kernels (by default only calls of 8 MiB or more) and int8 values' P.V on
# int16 weights (both by default only on AMD family 0x19), and into L1 one
# unit ahead without any of them; the second also makes two decode work items a thread
# (attn_args.h; by default only on 8 threads or more), so its key split runs on these tests' 2
# threads
for loc in 2 3; do
    ahead=$((4 - loc))
    items=$((loc - 1))
    l1k=$((3 - loc))
    avx2dec=$((3 - loc))
    pvi=$((3 - loc))
    echo "== native, the prefetch stream forced into L$((4 - loc)), $ahead unit(s) ahead," \
         "$items decode item(s) a thread, l1k $l1k, AVX-512 decode on AVX2 $avx2dec, int16 P.V $pvi" \
         "(-DPKV_PF_LOCALITY=$loc -DPKV_PF_DIST=$ahead -DPKV_DECODE_ITEMS_MIN=$items" \
         "-DPKV_PF_L1K=$l1k -DPKV_L1K_MIN_BYTES=0 -DPKV_AVX2_DECODE=$avx2dec -DPKV_AVX2_DECODE_MIN_BYTES=0" \
         "-DPKV_PF_MIN_BYTES=0 -DPKV_PF_K_MIN_BYTES=0" \
         "-DPKV_PV_INT16=$pvi)"
    build "$cc" "$out/test_kernels_pf$loc" -DPKV_PF_LOCALITY=$loc -DPKV_PF_DIST=$ahead \
        -DPKV_DECODE_ITEMS_MIN=$items -DPKV_PF_L1K=$l1k -DPKV_L1K_MIN_BYTES=0 -DPKV_AVX2_DECODE=$avx2dec \
        -DPKV_AVX2_DECODE_MIN_BYTES=0 -DPKV_PF_MIN_BYTES=0 -DPKV_PF_K_MIN_BYTES=0 -DPKV_PV_INT16=$pvi
    "$out/test_kernels_pf$loc" "${require[@]}" --trials 12 "$@"
done

[ "$native_only" = 1 ] && exit 0
if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null; then
    echo "== aarch64 under qemu-aarch64-static"
    build aarch64-linux-gnu-gcc "$out/test_kernels_aarch64" -static
    qemu-aarch64-static "$out/test_kernels_aarch64" --require scalar --require neon --require neondot "$@"
    echo "== aarch64 under qemu-aarch64-static, a Cortex-A53 (no dot product: NEON's int8 kernels)"
    QEMU_CPU=cortex-a53 qemu-aarch64-static "$out/test_kernels_aarch64" --require scalar --require neon \
        --trials 12 "$@"
else
    echo "== aarch64: skipped (aarch64-linux-gnu-gcc or qemu-aarch64-static not installed;" \
         "apt-get install gcc-aarch64-linux-gnu qemu-user-static)"
fi
