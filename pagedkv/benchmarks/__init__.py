"""The benchmark suite behind ``pagedkv bench`` (see benchmarks/README.md).

Suites: ``bandwidth`` (this machine's read bandwidth, the yardstick),
``decode``, ``prefill``, ``append`` and, when its module is present,
``streaming``.  ``run_bench(argv)`` is what the CLI calls; ``run_suites``
returns the results as a dict (the ``--json`` document).
"""
from pagedkv.benchmarks.runner import SUITES, run_bench, run_suites

__all__ = ["SUITES", "run_bench", "run_suites"]
