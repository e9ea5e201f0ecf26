"""The decode suite of `pagedkv bench` (the read bandwidth, its yardstick, is measured first).

Usage: python benchmarks/bench_decode.py [--quick] [--json PATH] [--threads 1,all] [--dtypes f32,f64] ...
(every option of `pagedkv bench`; see benchmarks/README.md)
"""
import os
import sys

try:
    from pagedkv.cli import main
except ImportError:  # a source checkout built in place, run without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--suites", "decode", *sys.argv[1:]]))
