"""The decode suite of `pagedkv bench` (the read bandwidth, its yardstick, is measured first).

Usage: python benchmarks/bench_decode.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from _entry import bench

if __name__ == "__main__":
    sys.exit(bench("--suites", "decode"))
