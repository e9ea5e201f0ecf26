"""The prefill suite of `pagedkv bench`: causal attention, useful GFLOP/s.

Usage: python benchmarks/bench_prefill.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from _entry import bench

if __name__ == "__main__":
    sys.exit(bench("--suites", "prefill"))
