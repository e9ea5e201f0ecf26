#!/bin/sh
# Build benchmarks/c/decode_ceiling with the flags of setup.py (portable: no
# -m flags, the SIMD path is chosen at run time) and run the decode cases
# at 1 and 2 threads (OMP_WAIT_POLICY=passive makes the CPU-time
# ratios meaningful).  Extra compiler flags (e.g. -DPKV_PREFETCH_UNITS=0 to try a
# variant of the kernel) go in CFLAGS.
#   benchmarks/c/run.sh [rounds]          PAGEDKV_SIMD=scalar|avx2|avx512 forces a path
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
exe=${EXE:-$here/decode_ceiling}   # ignored by git
${CC:-cc} -O3 -std=c11 -D_DEFAULT_SOURCE -fno-strict-aliasing -Wall -Wno-unused-function \
    -fopenmp $CFLAGS -I"$root/include" "$here/decode_ceiling.c" -o "$exe" -lm
rounds=${1:-9}
for dt in f32 f64; do
    for t in 1 2; do
        "$exe" $dt 8 2048 $t "$rounds"
        "$exe" $dt 1 8192 $t "$rounds"
    done
done
