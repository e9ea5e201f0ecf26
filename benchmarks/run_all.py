"""Every suite of `pagedkv bench`: bandwidth, decode, prefill, append, streaming.

Usage: python benchmarks/run_all.py [--quick] [--json PATH] [--plot PATH] ...
(the options of `pagedkv bench`; see benchmarks/README.md)
"""
import sys

from _entry import bench

if __name__ == "__main__":
    sys.exit(bench())
