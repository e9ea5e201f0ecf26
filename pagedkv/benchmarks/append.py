"""Appending one token's K and V (the per-step write of decode).

pagedkv: ``cache.append(sid, k, v)`` with k, v [1, Hkv, D] and
``cache.append_batch(sids, k, v)`` with k, v [B, Hkv, D] (one token for each
of B sequences).  Baselines write the same bytes (K and V) into preallocated
arrays: NumPy ``K[i] = k; V[i] = v`` and torch slice assignment.

With narrower storage (``--kv-dtypes``, default bf16, f16, int8) ``append`` is
also timed into a cache of that ``kv_dtype`` from the same arrays (one row per
storage): the conversion's cost, against the same baselines.

A sample is a fixed number of consecutive appends into a sequence that the
untimed set-up rewinds to empty first (``truncate(sid, 0)``), so block
allocation at block boundaries is part of what is measured; the baselines
write to positions 0, 1, 2, ... of arrays of the same size.

Allocation: bytes seen by ``tracemalloc`` (Python's allocators and NumPy's
data allocations; not torch's C++ allocator) over 10,000 appends: the peak
above the starting point and the net growth.
"""
from __future__ import annotations

import gc
import tracemalloc
from typing import List

import numpy as np

from pagedkv.benchmarks.common import (BLOCK_SIZE, NUMPY, PAGEDKV, Settings, ThreadScope,
                                       closing, load_torch)
from pagedkv.benchmarks.decode import shape
from pagedkv.benchmarks.report import (fmt_bytes, fmt_ratio, fmt_time, grouped, impl_rows,
                                       results_of, short_dtype, suite_section, timed_cells)
from pagedkv.benchmarks.timing import Impl, measure, paired_ratios

TORCH = "torch"
ALLOC_APPENDS = 10_000


def steps(settings: Settings) -> int:
    return sum(2 + len(_kv_dtypes(settings, dt)) for dt in settings.dtypes)


def _kv_dtypes(settings: Settings, dtype: str) -> List[str]:
    """The narrower storages timed for arrays of `dtype` (its own storage is the plain row)."""
    return [k for k in settings.kv_dtypes if k != dtype]


def _appends_per_sample(settings: Settings) -> int:
    return 256 if settings.tiny else 4096


class _Case:
    """One (dtype, B, storage) configuration; B == 0 means single-sequence ``append``;
    kv_dtype None stores the arrays' own dtype."""

    def __init__(self, dtype: str, B: int, tokens: int, sh, torch, seed: int, kv_dtype=None):
        import pagedkv

        dt = np.dtype(dtype)
        self.dtype, self.B, self.tokens = dtype, B, tokens
        self.kv_dtype = kv_dtype or dtype
        nseq = max(B, 1)
        rng = np.random.default_rng(seed)
        self.k = rng.standard_normal((nseq, sh.hkv, sh.d), dtype=dt)
        self.v = rng.standard_normal((nseq, sh.hkv, sh.d), dtype=dt)
        nblk = -(-tokens // BLOCK_SIZE)
        self.cache = pagedkv.PagedKVCache(num_blocks=nseq * nblk, block_size=BLOCK_SIZE,
                                          num_kv_heads=sh.hkv, head_dim=sh.d, dtype=dtype,
                                          kv_dtype=kv_dtype, max_seqs=nseq,
                                          max_blocks_per_seq=nblk)
        self.sids = [self.cache.add_sequence() for _ in range(nseq)]
        self.K = np.zeros((tokens,) + self.k.shape, dtype=dt) if B else \
            np.zeros((tokens, sh.hkv, sh.d), dtype=dt)
        self.V = np.zeros_like(self.K)
        self.torch = torch
        if torch is not None:
            self.tK = torch.zeros(self.K.shape, dtype=getattr(torch, dtype))
            self.tV = torch.zeros(self.V.shape, dtype=getattr(torch, dtype))
            self.tk = torch.from_numpy(self.k if B else self.k[0].copy())
            self.tv = torch.from_numpy(self.v if B else self.v[0].copy())

    @property
    def token_bytes(self) -> int:
        """K+V bytes written per call."""
        return 2 * self.k.nbytes

    def rewind(self) -> None:
        for sid in self.sids:
            self.cache.truncate(sid, 0)

    def run_pagedkv(self, n: int) -> None:
        if self.B:
            app, sids, k, v = self.cache.append_batch, self.sids, self.k, self.v
        else:
            app, sids, k, v = self.cache.append, self.sids[0], self.k, self.v
        for _ in range(n):
            app(sids, k, v)

    def run_numpy(self, n: int) -> None:
        K, V = self.K, self.V
        k, v = (self.k, self.v) if self.B else (self.k[0], self.v[0])
        for i in range(n):
            K[i] = k
            V[i] = v

    def run_torch(self, n: int) -> None:
        K, V, k, v = self.tK, self.tV, self.tk, self.tv
        with self.torch.inference_mode():
            for i in range(n):
                K[i] = k
                V[i] = v

    def close(self) -> None:
        for sid in self.sids:
            self.cache.free(sid)
        self.__dict__.clear()


def _allocated(run, setup, appends: int) -> dict:
    """tracemalloc bytes over `appends` calls (after one warm-up call)."""
    setup()
    run(1)
    setup()
    gc.collect()
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        run(appends)
        cur, peak = tracemalloc.get_traced_memory()
    finally:
        if not was:
            tracemalloc.stop()
    return {"calls": appends, "peak_bytes": max(0, peak - base), "net_bytes": cur - base}


def run(settings: Settings) -> List[dict]:
    torch = load_torch(settings)
    sh = shape(settings)
    per_sample = _appends_per_sample(settings)
    alloc_appends = 1000 if settings.tiny else ALLOC_APPENDS
    t = 1  # appends are single-threaded everywhere
    recs = []
    for di, dtype in enumerate(settings.dtypes):
        configs = [(0, None), (2 if settings.tiny else 8, None)]
        configs += [(0, kv) for kv in _kv_dtypes(settings, dtype)]
        for B, kv in configs:
            calls = per_sample if B == 0 else max(1, per_sample // B)
            alloc_calls = alloc_appends if B == 0 else max(1, alloc_appends // B)
            tokens = max(calls, alloc_calls)
            label = (f"append {_storage(dtype, kv or dtype)} "
                     + ("append" if B == 0 else f"append_batch B={B}"))
            with settings.stage(label), \
                    closing(_Case(dtype, B, tokens, sh, torch, seed=100 + di, kv_dtype=kv)) as case:
                impls = {PAGEDKV: Impl(case.run_pagedkv, setup=case.rewind, inner=calls),
                         NUMPY: Impl(case.run_numpy, inner=calls)}
                if torch is not None:
                    impls[TORCH] = Impl(case.run_torch, inner=calls)
                with ThreadScope(t, torch):
                    _verify(case, sh)
                    repeats = max(settings.repeats, 7 if not settings.tiny else 3)
                    timings = measure(impls, settings, repeats=repeats)
                    allocs = {PAGEDKV: _allocated(case.run_pagedkv, case.rewind, alloc_calls),
                              NUMPY: _allocated(case.run_numpy, lambda: None, alloc_calls)}
                    if torch is not None:
                        allocs[TORCH] = _allocated(case.run_torch, lambda: None, alloc_calls)
                recs.append(_record(case, sh, timings, allocs))
                recs[-1]["alloc_tokens"] = alloc_calls * max(B, 1)
    return recs


def _storage(dtype: str, kv_dtype: str) -> str:
    """The dtype cell: the arrays' dtype, and the storage where it is another."""
    if kv_dtype == dtype:
        return short_dtype(dtype)
    return f"{short_dtype(dtype)} as {short_dtype(kv_dtype)}"


def _close(got: np.ndarray, want: np.ndarray, kv_dtype: str) -> bool:
    """got (read back from `kv_dtype` storage) is want within that storage's rounding: half
    a unit in the last place of bfloat16 (8 bits) or float16 (11 bits, 2^-24 apart below
    2^-14), half a step of int8's scale per group of 32 values (its largest |x| / 127)."""
    want = want.astype(np.float64)
    err = np.abs(got.astype(np.float64) - want)
    if kv_dtype == "int8":
        groups = -(-want.shape[-1] // 32) * 32
        padded = np.zeros(want.shape[:-1] + (groups,))
        padded[..., :want.shape[-1]] = np.abs(want)
        amax = padded.reshape(want.shape[:-1] + (-1, 32)).max(axis=-1)
        bound = np.repeat(amax / 254.0, 32, axis=-1)[..., :want.shape[-1]] * (1 + 1e-6)
    else:
        bits = {"bfloat16": 8, "float16": 11}.get(kv_dtype, 53)
        bound = np.maximum(np.abs(want) * 2.0 ** -bits, 2.0 ** -25 if kv_dtype == "float16" else 0)
    return bool(np.all(err <= bound))


def _verify(case: _Case, sh) -> None:
    """The appended token reads back as written (pagedkv; within the storage's rounding
    where it is narrower) - a sanity check that the timed call does what the baselines do."""
    case.rewind()
    case.run_pagedkv(1)
    for b, sid in enumerate(case.sids):
        k, v = case.cache.gather(sid)
        if case.kv_dtype == case.dtype:
            ok = np.array_equal(k[0], case.k[b]) and np.array_equal(v[0], case.v[b])
        else:
            ok = _close(k[0], case.k[b], case.kv_dtype) and _close(v[0], case.v[b], case.kv_dtype)
        if not ok:
            raise AssertionError("append benchmark: the token read back differs")


def _record(case: _Case, sh, timings, allocs) -> dict:
    tokens_per_call = max(case.B, 1)
    results = results_of(timings, lambda name, tm: {
        "us_per_call": tm.median * 1e6, "us_per_token": tm.median * 1e6 / tokens_per_call,
        "gbps": case.token_bytes / tm.median / 1e9, "tracemalloc": allocs[name]})
    ratios = paired_ratios(timings)
    return {"suite": "append", "dtype": case.dtype, "kv_dtype": case.kv_dtype, "threads": 1,
            "call": "append" if case.B == 0 else "append_batch", "B": tokens_per_call,
            "Hkv": sh.hkv, "D": sh.d, "token_shape": [tokens_per_call, sh.hkv, sh.d],
            "bytes_per_call": case.token_bytes, "results": results, "ratios": ratios}


def _head(r0: dict) -> str:
    return (f"Append: K and V of one token per sequence [B, {r0['Hkv']}, {r0['D']}], 1 thread.  "
            f"Allocation = tracemalloc peak / net bytes over\n{r0['alloc_tokens']:,} "
            "appended tokens (number of calls shown; torch's C++ allocator is invisible to "
            "tracemalloc).  \"f32 as bf16\": float32 arrays into bfloat16 storage (the "
            "baselines write the\narrays' own bytes).")


def _rows(r: dict) -> List[List[str]]:
    def cells(name, res):
        a = res["tracemalloc"]
        speed = "" if name == PAGEDKV else fmt_ratio(r["ratios"][name])
        return [name, *timed_cells(res), fmt_time(res["median_s"] / r["B"]),
                f"{fmt_bytes(a['peak_bytes'])} / {fmt_bytes(a['net_bytes'])}"
                f" ({a['calls']:,} calls)", speed]

    call = "append" if r["call"] == "append" else f"append_batch B={r['B']}"
    dtype = _storage(r["dtype"], r.get("kv_dtype", r["dtype"]))
    return grouped([dtype, call], impl_rows(r, (PAGEDKV, NUMPY, TORCH), cells, 6))


def report(settings: Settings, recs: List[dict]) -> str:
    return suite_section(recs, "append", _head,
                         ["dtype", "call", "impl", "per call", "spread", "per token",
                          "alloc peak / net", "pagedkv speedup"], _rows,
                         [False, False, False, True, True, True, True, True])
