"""Memory read bandwidth of this machine, measured with the core's SIMD read
kernel (``pagedkv._core.read_bandwidth``): the yardstick of the decode suite,
whose kernels are memory-bound."""
from __future__ import annotations

from typing import Dict, List

from pagedkv.benchmarks.common import Settings
from pagedkv.benchmarks.report import fmt_num, section


def buffer_bytes(settings: Settings) -> int:
    """Far above any L3 (except --tiny, where it only has to run)."""
    if settings.tiny:
        return 8 << 20
    return (256 << 20) if settings.quick else (512 << 20)


def run(settings: Settings) -> Dict[int, float]:
    """Measure bytes/s at every thread count of the run (best of the repeats)
    and store them in ``settings.bandwidth``; returns that dict."""
    from pagedkv._core import read_bandwidth

    nbytes = buffer_bytes(settings)
    repeats = 3 if (settings.quick or settings.tiny) else 5
    for t in settings.threads:
        with settings.stage(f"bandwidth t={t}"):
            settings.bandwidth[int(t)] = float(read_bandwidth(nbytes=nbytes, repeats=repeats,
                                                              threads=int(t)))
    return settings.bandwidth


def steps(settings: Settings) -> int:
    return len(settings.threads)


def records(settings: Settings) -> List[dict]:
    nbytes = buffer_bytes(settings)
    return [{"suite": "bandwidth", "threads": t, "bytes_per_s": bw, "gbps": bw / 1e9,
             "buffer_bytes": nbytes} for t, bw in sorted(settings.bandwidth.items())]


def report(settings: Settings) -> str:
    rows = [[str(t), fmt_num(bw / 1e9, 1)] for t, bw in sorted(settings.bandwidth.items())]
    head = (f"Read bandwidth (core SIMD read kernel, {buffer_bytes(settings) >> 20} MiB buffer, "
            "best of repeats)")
    return section(head, ["thr", "GB/s"], rows)
