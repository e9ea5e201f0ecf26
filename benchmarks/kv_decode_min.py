"""Decode time per kv_dtype, best of many interleaved calls (robust on a busy machine).

Usage: python benchmarks/kv_decode_min.py [--threads N] [--calls N]
Shapes: Hq=32, Hkv=8, D=128, block 16; B=8 L=2048 and B=1 L=8192 (issue 8's targets).
Prints the minimum time of each storage dtype and its ratio to float32 storage.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import pagedkv
except ImportError:  # a source checkout built in place, run without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pagedkv

KV = ("float32", "bfloat16", "float16", "int8")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args(argv)
    pagedkv.set_num_threads(args.threads)
    hq, hkv, d, bs = 32, 8, 128, 16
    print(f"SIMD {pagedkv.simd_backend()}, threads {args.threads}, best of {args.calls} calls")
    for B, L in ((8, 2048), (1, 8192)):
        rng = np.random.default_rng(0)
        k = rng.standard_normal((B, L, hkv, d), dtype=np.float32)
        v = rng.standard_normal((B, L, hkv, d), dtype=np.float32)
        q = rng.standard_normal((B, hq, d), dtype=np.float32)
        nblk = -(-L // bs)
        runs = {}
        for kv in KV:
            c = pagedkv.PagedKVCache(B * nblk, bs, hkv, d, kv_dtype=kv, max_seqs=B)
            sids = [c.add_sequence() for _ in range(B)]
            for s in range(0, L, bs):  # blocks of the sequences interleave in the pool
                for b, sid in enumerate(sids):
                    c.append(sid, k[b, s:s + bs], v[b, s:s + bs])
            runs[kv] = (c, sids, np.empty_like(q))
        best = {kv: float("inf") for kv in KV}
        for _ in range(args.calls):
            for kv, (c, sids, out) in runs.items():
                t0 = time.perf_counter()
                c.attend_batch(sids, q, out=out)
                best[kv] = min(best[kv], time.perf_counter() - t0)
        line = [f"B={B} L={L}:"]
        for kv in KV:
            nbytes = B * nblk * runs[kv][0].bytes_per_block
            line.append(f"{kv} {best[kv] * 1e3:.2f} ms ({nbytes / best[kv] / 1e9:.1f} GB/s, "
                        f"{best['float32'] / best[kv]:.2f}x)")
        print("  ".join(line))
        del runs


if __name__ == "__main__":
    main()
