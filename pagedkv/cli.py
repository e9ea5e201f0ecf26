"""Command line: ``pagedkv bench`` (the benchmark suite) and ``pagedkv demo``."""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import numpy as np


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="pagedkv",
                                description="pagedkv: a paged KV cache for CPU LLM inference")
    sub = p.add_subparsers(dest="command", metavar="{bench,demo}")
    sub.add_parser("bench", add_help=False,
                   help="benchmark against NumPy and torch on this machine "
                        "(pagedkv bench --help)")
    d = sub.add_parser("demo", help="a tiny decode loop printing cache statistics")
    d.add_argument("--steps", type=int, default=32, help="decode steps (default 32)")
    d.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    d.add_argument("--prompt", type=int, default=100, help="prompt tokens per sequence")
    if argv and argv[0] == "bench":
        from pagedkv.benchmarks import run_bench  # noqa: PLC0415 - keep `demo` light

        return run_bench(argv[1:])
    args = p.parse_args(argv)
    if args.command == "demo":
        return demo(args.steps, args.batch, args.prompt)
    p.print_help()
    return 2


def demo(steps: int = 32, batch: int = 4, prompt: int = 100) -> int:
    """Prefill `batch` sequences with random K/V, then decode `steps` tokens:
    each step appends one token per sequence and attends with one query."""
    import pagedkv

    hq, hkv, d, bs = 8, 2, 64, 16
    rng = np.random.default_rng(0)
    blocks = batch * (-(-(prompt + steps) // bs))
    cache = pagedkv.PagedKVCache(num_blocks=blocks, block_size=bs, num_kv_heads=hkv,
                                 head_dim=d, dtype="float32", max_seqs=batch)
    print(f"pagedkv {pagedkv.__version__} demo: {batch} sequences, prompt {prompt} tokens, "
          f"{steps} decode steps; SIMD {pagedkv.simd_backend()}, "
          f"{pagedkv.get_num_threads()} thread(s)")
    print(f"  new cache:    {cache}")
    sids = [cache.add_sequence() for _ in range(batch)]
    for sid in sids:
        n = prompt
        k = rng.standard_normal((n, hkv, d), dtype=np.float32)
        cache.append(sid, k, rng.standard_normal((n, hkv, d), dtype=np.float32))
        cache.attend(sid, rng.standard_normal((n, hq, d), dtype=np.float32))  # causal prefill
    print(f"  after prefill: {cache}")
    out = np.empty((batch, hq, d), dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(steps):
        k = rng.standard_normal((batch, hkv, d), dtype=np.float32)
        v = rng.standard_normal((batch, hkv, d), dtype=np.float32)
        q = rng.standard_normal((batch, hq, d), dtype=np.float32)
        cache.append_batch(sids, k, v)
        cache.attend_batch(sids, q, out=out)
    dt = time.perf_counter() - t0
    print(f"  decoded {steps} steps in {dt * 1e3:.1f} ms ({dt / steps * 1e6:.0f} µs per step, "
          "random inputs included)")
    cache.free(sids[0])
    st = cache.stats()
    print(f"  freed sequence {sids[0]}: {cache}")
    print(f"  stats: {st.blocks_used}/{st.blocks_total} blocks used, "
          f"{st.tokens_held} tokens held in {st.token_slots_allocated} slots "
          f"({st.internal_fragmentation:.1%} internal fragmentation), "
          f"{st.bytes_used / 2**20:.2f} MiB of {st.bytes_total / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
