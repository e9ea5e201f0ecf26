"""The append suite of `pagedkv bench`: one token per call, time and tracemalloc bytes.

Usage: python benchmarks/bench_append.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from _entry import bench

if __name__ == "__main__":
    sys.exit(bench("--suites", "append"))
