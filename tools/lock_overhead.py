"""Small-call overhead of append / attend / seq_len, for comparing two builds.

Usage: python tools/lock_overhead.py DIR_A DIR_B [rounds]
Each DIR holds an importable `pagedkv` package; the builds run in alternating
subprocesses (same machine state), and the medians of the per-round
best-of timings are printed in ns per call.
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import pagedkv
cache = pagedkv.PagedKVCache(num_blocks=4096, block_size=16, num_kv_heads=8, head_dim=128)
sid = cache.add_sequence()
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 8, 128), dtype=np.float32)
q = rng.standard_normal((1, 32, 128), dtype=np.float32)
out = np.empty((1, 32, 128), np.float32)
cache.append(sid, k, k)
def best(fn, n=2000, reps=7):
    b = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        b = min(b, (time.perf_counter() - t) / n)
    return b * 1e9
res = {}
app = cache.append
res["append"] = best(lambda: app(sid, k, k))      # grows by 7*2000*... tokens, pool is big enough
cache.truncate(sid, 16)
att = cache.attend
res["attend L=16"] = best(lambda: att(sid, q, out=out))
res["seq_len"] = best(lambda: cache.seq_len(sid))
print(json.dumps(res))
"""


def main():
    a, b = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    runs = {a: [], b: []}
    for _ in range(rounds):
        for d in (a, b):
            env = dict(os.environ, PYTHONPATH=d, OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                                 capture_output=True, text=True, cwd="/").stdout
            runs[d].append(json.loads(out))
    for d in (a, b):
        keys = runs[d][0].keys()
        med = {key: sorted(r[key] for r in runs[d])[len(runs[d]) // 2] for key in keys}
        print(d, " ".join(f"{key}: {v:.0f} ns" for key, v in med.items()))


if __name__ == "__main__":
    main()
