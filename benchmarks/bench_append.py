"""The append suite of `pagedkv bench`: one token per call, time and tracemalloc bytes.

Usage: python benchmarks/bench_append.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--suites", "append", *sys.argv[1:]]))
