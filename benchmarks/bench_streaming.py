#!/usr/bin/env python
"""StreamingLLM benchmark: a 100,000-token stream with S=4, R=1020 (per-token time and held
blocks over the stream, against NumPy re-rotating the window).  The code is
pagedkv/benchmarks/streaming.py, which `pagedkv bench --suites streaming` runs too.

Usage: python benchmarks/bench_streaming.py [--tokens N] [--sink S] [--window R] [--quick]
                                            [--threads N] [--naive-tokens N]
"""
import sys

from _entry import importable

importable()
from pagedkv.benchmarks.streaming import main, report, run  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
