"""StreamingLLM over a long stream: per-token time and held memory stay flat.

One sequence decodes ``tokens`` tokens one at a time with
``StreamingLLM(sink, window)`` and in-cache RoPE: each step appends the token's
K/V and attends its query over the S + R + 1 held keys.  We record the time of
every append + attend and the blocks the sequence holds, and compare the first
10% of the stream with the last 10%.

Baselines (NumPy, the same shapes, one token per step over a full window):

* ``naive re-rotate``: what a contiguous cache without in-kernel RoPE must do
  for the paper's positions: keep pre-RoPE keys in an array, evict by shifting
  the window (the reference implementation concatenates), re-rotate every held
  key by its new rank, then attend.
* ``numpy plain``: the same window upkeep and attention without the
  re-rotation (keys used as stored): the cost of NumPy attention alone, so the
  ratio to the re-rotating baseline is not credited to the rotation only.

The baselines' cost per token is constant once the window is full, so they are
timed on a sample of steady-state tokens (``naive_tokens``).  At the end the
paged result of the last token is checked against the re-rotating baseline
computed from the cache's own held keys.

Usage: ``python benchmarks/bench_streaming.py [--tokens N] [--quick] [--threads N]`` or
``pagedkv bench --suites streaming`` (which calls ``run()``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import pagedkv

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 128, 16
THETA = 10000.0


class NaiveWindow:
    """A contiguous [Hkv, cap, D] pre-RoPE window kept like StartRecentKVCache."""

    def __init__(self, sink, window, hkv, d, q_heads, rotate, dtype=np.float32):
        self.S, self.R, self.rotate = sink, window, rotate
        cap = sink + window + 1
        self.k = np.zeros((hkv, cap, d), dtype)
        self.v = np.zeros((hkv, cap, d), dtype)
        self.m = 0
        self.g = q_heads // hkv
        self.scale = 1.0 / math.sqrt(d)
        half = d // 2
        inv = THETA ** (-np.arange(half, dtype=np.float64) / half)
        ang = np.arange(cap, dtype=np.float64)[:, None] * inv[None, :]
        self.cos = np.cos(ang).astype(dtype)
        self.sin = np.sin(ang).astype(dtype)

    def _rope(self, x, pos0, m):
        """x [..., m, D] rotated at positions pos0 .. pos0 + m - 1 (new arrays)."""
        half = x.shape[-1] // 2
        c, s = self.cos[pos0:pos0 + m], self.sin[pos0:pos0 + m]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)

    def step(self, k, v, q):
        """k, v [Hkv, D]; q [Hq, D] -> out [Hq, D]."""
        S, R = self.S, self.R
        if self.m > S + R:  # evict: keep [0, S) and the last R, contiguously
            self.k[:, S:S + R] = self.k[:, self.m - R:self.m]
            self.v[:, S:S + R] = self.v[:, self.m - R:self.m]
            self.m = S + R
        self.k[:, self.m] = k
        self.v[:, self.m] = v
        self.m += 1
        m = self.m
        keys = self.k[:, :m]
        qg = q.reshape(self.k.shape[0], self.g, -1)  # [Hkv, G, D]
        if self.rotate:
            keys = self._rope(keys, 0, m)
            qg = self._rope(qg[:, :, None, :], m - 1, 1)[:, :, 0, :]
        scores = np.matmul(qg, keys.transpose(0, 2, 1)) * self.scale  # [Hkv, G, m]
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return np.matmul(p, self.v[:, :m]).reshape(-1, k.shape[-1])


def _cpu_clock():
    """Per-token CPU time: of this thread when the kernels run on it alone (immune to other
    processes taking the cores), else of the whole process."""
    return time.thread_time_ns if pagedkv.get_num_threads() == 1 else time.process_time_ns


def _med(a):
    return float(np.median(a)) if len(a) else float("nan")


def run(tokens=100_000, sink=4, window=1020, quick=False, naive_tokens=None, seed=0,
        verbose=True) -> dict:
    """Stream `tokens` tokens (quick: 10,000) and return the measurements as a dict.

    Times are per token (append + attend), in microseconds: wall clock and CPU time
    (see _cpu_clock); summaries are medians, which a busy machine disturbs least."""
    if quick:
        tokens = min(tokens, 10_000)
    if naive_tokens is None:
        naive_tokens = 200 if quick else 2000
    hkv, hq, d, bs = KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK_SIZE
    policy = pagedkv.StreamingLLM(sink_tokens=sink, window_tokens=window)
    bound = policy.max_blocks(bs, 1)
    cache = pagedkv.PagedKVCache(num_blocks=bound, block_size=bs, num_kv_heads=hkv, head_dim=d,
                                 dtype="float32", max_seqs=1, max_blocks_per_seq=bound,
                                 streaming=policy, rope=pagedkv.RoPE(theta=THETA))
    sid = cache.add_sequence()
    rng = np.random.default_rng(seed)
    pool = 64  # distinct random tokens, reused cyclically (generating them is not timed)
    ks = rng.standard_normal((pool, 1, hkv, d)).astype(np.float32)
    vs = rng.standard_normal((pool, 1, hkv, d)).astype(np.float32)
    qs = rng.standard_normal((pool, 1, hq, d)).astype(np.float32)
    out = np.empty((1, hq, d), np.float32)
    wall_ns = np.empty(tokens, np.int64)
    cpu_ns = np.empty(tokens, np.int64)
    held = np.empty(tokens, np.int32)
    append, attend, nblk = cache.append, cache.attend, cache.num_seq_blocks
    clock, cpu = time.perf_counter_ns, _cpu_clock()
    load_before = _load()

    t_start = time.perf_counter()
    for t in range(tokens):
        i = t % pool
        k, v, q = ks[i], vs[i], qs[i]
        c0 = cpu()
        t0 = clock()
        append(sid, k, v)
        attend(sid, q, out=out)
        t1 = clock()
        cpu_ns[t] = cpu() - c0
        wall_ns[t] = t1 - t0
        held[t] = nblk(sid)
    wall_s = time.perf_counter() - t_start
    wall, cput = wall_ns / 1e3, cpu_ns / 1e3

    held_tokens, evicted_tokens = cache.seq_len(sid), cache.stats().evicted_tokens

    # the cache's own answer for the last token vs the re-rotating NumPy computation
    k_held, v_held = cache.gather(sid)
    check = NaiveWindow(sink, window, hkv, d, hq, rotate=True)
    m = k_held.shape[0]
    check.k[:, :m - 1] = k_held[:-1].transpose(1, 0, 2)
    check.v[:, :m - 1] = v_held[:-1].transpose(1, 0, 2)
    check.m = m - 1
    expected = check.step(k_held[-1], v_held[-1], qs[(tokens - 1) % pool][0])
    err = float(np.max(np.abs(expected - out[0])) / max(1e-30, np.max(np.abs(v_held))))

    # Late vs early under the same conditions: a fresh cache just past its window fill and
    # the long stream step in alternation, so a load that changes over the run (other
    # processes) weighs on both alike.
    fresh = pagedkv.PagedKVCache(num_blocks=bound, block_size=bs, num_kv_heads=hkv,
                                 head_dim=d, dtype="float32", max_seqs=1,
                                 max_blocks_per_seq=bound, streaming=policy,
                                 rope=pagedkv.RoPE(theta=THETA))
    fsid = fresh.add_sequence()
    for t in range(sink + window + 1):
        fresh.append(fsid, ks[t % pool], vs[t % pool])
    pairs = min(naive_tokens, 2000)
    late = np.empty(pairs, np.int64)
    early = np.empty(pairs, np.int64)
    for j in range(pairs):
        i = j % pool
        for c, seq, dst in ((cache, sid, late), (fresh, fsid, early)):
            c0 = cpu()
            c.append(seq, ks[i], vs[i])
            c.attend(seq, qs[i], out=out)
            dst[j] = cpu() - c0

    naive = {}
    kt, vt, qt = ks[:, 0], vs[:, 0], qs[:, 0]
    for name, rotate in [("rerotate", True), ("plain", False)]:
        w = NaiveWindow(sink, window, hkv, d, hq, rotate)
        w.k[:] = rng.standard_normal(w.k.shape).astype(np.float32)
        w.v[:] = rng.standard_normal(w.v.shape).astype(np.float32)
        w.m = sink + window + 1
        for j in range(20):  # warm-up
            w.step(kt[j % pool], vt[j % pool], qt[j % pool])
        nw = np.empty(naive_tokens, np.int64)
        nc = np.empty(naive_tokens, np.int64)
        for j in range(naive_tokens):
            c0 = time.process_time_ns()  # NumPy may use BLAS threads
            t0 = clock()
            w.step(kt[j % pool], vt[j % pool], qt[j % pool])
            t1 = clock()
            nc[j] = time.process_time_ns() - c0
            nw[j] = t1 - t0
        naive[name] = (_med(nw / 1e3), _med(nc / 1e3))

    tenth = max(1, tokens // 10)
    filled = sink + window + 1  # from here on every step attends to S + R + 1 keys
    if tokens < filled + tenth:  # too short a stream to fill the window: no steady state
        filled = 0
    first, after, last = slice(0, tenth), slice(filled, filled + tenth), slice(tokens - tenth, tokens)
    steady = slice(filled, tokens)
    res = {
        "tokens": tokens, "sink": sink, "window": window, "block_size": bs,
        "kv_heads": hkv, "q_heads": hq, "head_dim": d, "dtype": "float32",
        "threads": pagedkv.get_num_threads(), "simd": pagedkv.simd_backend(),
        "load_avg_before": load_before, "load_avg_after": _load(), "cpus": os.cpu_count(),
        "wall_s": wall_s,
        "window_filled_at": filled,
    }
    for tag, arr in [("wall", wall), ("cpu", cput)]:
        res[f"{tag}_us_first10"] = _med(arr[first])
        res[f"{tag}_us_first10_after_fill"] = _med(arr[after])
        res[f"{tag}_us_last10"] = _med(arr[last])
        res[f"{tag}_us_steady"] = _med(arr[steady])
        res[f"{tag}_ratio_last_first"] = res[f"{tag}_us_last10"] / res[f"{tag}_us_first10"]
        res[f"{tag}_ratio_last_first_after_fill"] = (
            res[f"{tag}_us_last10"] / res[f"{tag}_us_first10_after_fill"])
    res.update({
        "paired_steps": pairs,
        "paired_late_cpu_us": _med(late / 1e3),
        "paired_early_cpu_us": _med(early / 1e3),
        "paired_ratio_late_early": _med(late) / _med(early),
        "wall_us_mean": float(wall.mean()),
        "wall_us_p99": float(np.percentile(wall, 99)),
        "held_blocks_first10": float(held[first].mean()),
        "held_blocks_first10_after_fill": float(held[after].mean()),
        "held_blocks_last10": float(held[last].mean()),
        "held_blocks_ratio_last_first": float(held[last].mean() / held[first].mean()),
        "held_blocks_ratio_last_first_after_fill": float(held[last].mean() / held[after].mean()),
        "held_blocks_max": int(held.max()),
        "held_blocks_steady_min": int(held[steady].min()),
        "held_blocks_steady_max": int(held[steady].max()),
        "held_blocks_bound": bound,
        "held_bytes_max": int(held.max()) * cache.bytes_per_block,
        "held_tokens_final": held_tokens,
        "evicted_tokens": evicted_tokens,
        "naive_tokens": naive_tokens,
        "naive_rerotate_wall_us": naive["rerotate"][0],
        "naive_rerotate_cpu_us": naive["rerotate"][1],
        "numpy_plain_wall_us": naive["plain"][0],
        "numpy_plain_cpu_us": naive["plain"][1],
    })
    for tag in ("wall", "cpu"):
        res[f"speedup_vs_naive_rerotate_{tag}"] = res[f"naive_rerotate_{tag}_us"] / res[f"{tag}_us_steady"]
        res[f"speedup_vs_numpy_plain_{tag}"] = res[f"numpy_plain_{tag}_us"] / res[f"{tag}_us_steady"]
    res["rerotate_over_plain_wall"] = naive["rerotate"][0] / naive["plain"][0]
    res["max_err_vs_naive_rel_to_max_v"] = err
    if verbose:
        print(report(res))
    return res


def _load():
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        return None


def report(r: dict) -> str:
    """A short table of run()'s result."""
    def row(name, a, b, c, fmt=".1f"):
        cells = [format(x, fmt) if isinstance(x, (int, float)) else str(x) for x in (a, b, c)]
        return f"{name:34}{cells[0]:>11}{cells[1]:>11}{cells[2]:>13}"

    lines = [
        f"StreamingLLM stream: {r['tokens']:,} tokens, S={r['sink']}, R={r['window']}, "
        f"block {r['block_size']}, Hkv={r['kv_heads']} Hq={r['q_heads']} D={r['head_dim']} f32, "
        f"RoPE in-kernel, {r['threads']} thread(s), {r['simd']}",
        f"{'per token, append + attend':34}{'wall us':>11}{'cpu us':>11}{'held blocks':>13}",
        f"{'(medians)':34}",
        row("first 10% (incl. window fill)", r["wall_us_first10"], r["cpu_us_first10"],
            r["held_blocks_first10"]),
        row(f"first 10% after fill (t>={r['window_filled_at']})",
            r["wall_us_first10_after_fill"], r["cpu_us_first10_after_fill"],
            r["held_blocks_first10_after_fill"]),
        row("last 10%", r["wall_us_last10"], r["cpu_us_last10"], r["held_blocks_last10"]),
        row("  ratio last / first", r["wall_ratio_last_first"], r["cpu_ratio_last_first"],
            r["held_blocks_ratio_last_first"], ".2f"),
        row("  ratio last / first after fill", r["wall_ratio_last_first_after_fill"],
            r["cpu_ratio_last_first_after_fill"], r["held_blocks_ratio_last_first_after_fill"],
            ".2f"),
        f"interleaved, {r['paired_steps']} steps each: token {r['tokens']:,}+ of this stream "
        f"{r['paired_late_cpu_us']:.1f} us cpu vs a fresh stream just past its fill "
        f"{r['paired_early_cpu_us']:.1f} us: ratio {r['paired_ratio_late_early']:.3f}",
        row("pagedkv, full window", r["wall_us_steady"], r["cpu_us_steady"],
            f"{r['held_blocks_steady_min']}..{r['held_blocks_steady_max']}"),
        row("naive NumPy, re-rotate window", r["naive_rerotate_wall_us"],
            r["naive_rerotate_cpu_us"], ""),
        row("NumPy attention, no re-rotation", r["numpy_plain_wall_us"],
            r["numpy_plain_cpu_us"], ""),
        f"pagedkv per token vs naive re-rotating NumPy: {r['speedup_vs_naive_rerotate_wall']:.1f}x "
        f"(wall), {r['speedup_vs_naive_rerotate_cpu']:.1f}x (cpu); vs NumPy attention alone: "
        f"{r['speedup_vs_numpy_plain_wall']:.1f}x / {r['speedup_vs_numpy_plain_cpu']:.1f}x; "
        f"re-rotation makes NumPy {r['rerotate_over_plain_wall']:.2f}x slower.",
        f"held blocks max {r['held_blocks_max']} (bound {r['held_blocks_bound']}, "
        f"{r['held_bytes_max'] / 2**20:.1f} MiB); held tokens {r['held_tokens_final']}; "
        f"evicted {r['evicted_tokens']:,} tokens; last token vs NumPy: "
        f"{r['max_err_vs_naive_rel_to_max_v']:.1e} of max|v|; {r['wall_s']:.1f} s",
    ]
    la, cpus = r.get("load_avg_before"), r.get("cpus")
    if la is not None and cpus and max(la, r.get("load_avg_after") or 0) > 0.5 * cpus:
        lines.append(f"note: load average {la} -> {r['load_avg_after']} on {cpus} CPUs: other "
                     "processes shared the cores; wall times are inflated, cpu times less so.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--naive-tokens", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="10,000 tokens, short baselines")
    ap.add_argument("--threads", type=int, default=None, help="pagedkv kernel threads")
    a = ap.parse_args(argv)
    if a.threads is not None:
        pagedkv.set_num_threads(a.threads)
    run(tokens=a.tokens, sink=a.sink, window=a.window, quick=a.quick,
        naive_tokens=a.naive_tokens)


if __name__ == "__main__":
    sys.exit(main())
