"""The prefill suite of `pagedkv bench`: causal attention, useful GFLOP/s.

Usage: python benchmarks/bench_prefill.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--suites", "prefill", *sys.argv[1:]]))
