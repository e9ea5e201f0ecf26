"""The decode suite of `pagedkv bench` (the read bandwidth, its yardstick, is measured first).

Usage: python benchmarks/bench_decode.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--suites", "decode", *sys.argv[1:]]))
