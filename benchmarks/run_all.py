"""Every suite of `pagedkv bench`: bandwidth, decode, prefill, append, streaming.

Usage: python benchmarks/run_all.py [--quick] [--json PATH] [--plot PATH] ...
(the options of `pagedkv bench`; see benchmarks/README.md)
"""
import os
import sys

try:
    from pagedkv.cli import main
except ImportError:  # a source checkout built in place, run without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
