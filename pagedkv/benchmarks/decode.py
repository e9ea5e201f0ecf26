"""Batched decode: one query per sequence at its newest token (memory-bound).

pagedkv: ``cache.attend_batch(sids, q, out=out)`` over B sequences of L tokens
whose blocks were filled round-robin, one block per sequence at a time (so
the pages of a sequence are interleaved with the others', as in serving).

Baselines, each checked once per configuration against pagedkv's output:

* ``numpy``: K, V contiguous [B, Hkv, L, D]; q folded to [B, Hkv, G, D]
  (G = Hq / Hkv query heads of a group share their KV head); matmul,
  softmax, matmul.
* ``numpy-gather``: ``cache.gather(sid)`` per sequence (contiguous copies
  [L, Hkv, D]), then the same math on views of the copies.
* ``torch-sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with q
  viewed as [B, Hkv, G, D] (the group's query heads in the query-length axis:
  exact for decode, and faster than ``enable_gqa=True``), K, V [B, Hkv, L, D]
  sharing memory with the NumPy arrays.

Storage dtypes: ``pagedkv-bf16`` / ``-f16`` / ``-i8`` are the same call on a
cache holding the same K/V with ``kv_dtype=`` bfloat16 / float16 / int8; their
output is checked against pagedkv's within the storage's accuracy, and their
ratio is pagedkv (f32/f64 storage) time / their time.  Their GB/s counts the
bytes they read (the stored K+V, int8 scales included), and their %pat is
against the pattern read of their own pool (``kv-pattern read-bf16`` etc., in
the JSON).  With bf16 storage under a float32 run and torch installed,
``torch-sdpa-bf16`` is torch's SDPA on the same K/V, queries and output in
bfloat16 (folded GQA as above); its ratio is its time / pagedkv-bf16's.

The read ceiling, measured in the same interleaved rounds:

* ``kv-pattern read``: ``cache.read_kv_pattern(sids)`` reads the bytes
  attend_batch reads in the same block pattern (same pool, same block tables,
  each block's K plane then its V plane, as many threads) and computes
  nothing (include/pagedkv/kvread.h).  Its XOR checksum is checked against
  the K and V arrays.

Figures: GB/s = K+V bytes of the B sequences (read once per step) / time;
%BW = that / measured sequential read bandwidth at the same thread count;
%pat = pagedkv's GB/s / the pattern read's GB/s, paired per round (the median
over rounds of the ratio measured in the same round); GFLOP/s =
4 * B * Hq * L * D / time (two multiply-adds per key and query head element).

The arithmetic ceiling, measured once per run (1 thread, whatever --threads):

* ``instruction peak``: ``pagedkv._core.instruction_peak(kind)``, the FMA
  lanes per second of one core on the active SIMD path (include/pagedkv/
  peak.h: 12 independent FMA chains, best of short runs); kind ``fma_f32``
  for f32 compute, ``fma_f64`` for f64 (bf16 / f16 / int8 storage is widened
  on load and folded with the compute type's FMAs), and the dot instruction of
  the scores where the path has one (``dpbusd`` / ``sdot`` for int8 keys,
  ``dpbf16`` for bf16 keys on avx512bf16) and of P.V (``dpwssd`` for int8
  values where the weights are rounded to int16): peak_kinds.
* ``decode in L2``: B=1, the suite's heads, L sized so that the stored K+V
  is about half of this core's L2 (read from sysfs, else 1 MiB assumed), one
  configuration per storage dtype, timed like the rest.  FMA lanes/s =
  2 * Hq * L * D / time (one multiply-add per query head and stored K or V
  element); %peak = that / the instruction peak.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from pagedkv.benchmarks.common import (BLOCK_SIZE, NUMPY, PAGEDKV, Settings, ThreadScope,
                                       check_close, closing, load_torch, rel_error)
from pagedkv.benchmarks.report import (fmt_bytes, fmt_num, fmt_pct, fmt_ratio, grouped,
                                       impl_rows, results_of, short_dtype, suite_section,
                                       timed_cells)
from pagedkv.benchmarks.timing import Impl, measure, paired_ratio, timed_once

GATHER = "numpy-gather"
TORCH = "torch-sdpa"
TORCH16 = "torch-sdpa-bf16"
PATTERN = "kv-pattern read"
IMPLS = (PAGEDKV, PATTERN, NUMPY, GATHER, TORCH)
# max |error| / max |pagedkv output| a storage dtype may add (random normal K/V; see the README's
# accuracy table)
KV_CHECK_TOL = {"bfloat16": 1e-2, "float16": 1e-2, "int8": 3e-2}


def check_kv(name: str, got, want, kv_dtype: str) -> float:
    """Raise unless `got` is within the storage dtype's bound of `want` (pagedkv's
    float32 output); return the error (max |got - want| / max |want|)."""
    err = rel_error(got, want)
    if not err <= KV_CHECK_TOL[kv_dtype]:
        raise AssertionError(f"{name}: max error {err:.3g} / max |out| exceeds the "
                             f"storage's bound {KV_CHECK_TOL[kv_dtype]:g}")
    return err


def kv_impl(kv_dtype: str) -> str:
    return f"{PAGEDKV}-{short_dtype(kv_dtype)}"


def kv_pattern(kv_dtype: str) -> str:
    """The pattern read of the pool of a storage dtype."""
    return f"{PATTERN}-{short_dtype(kv_dtype)}"

# numpy-gather copies every byte it then reads (2-3x the traffic of the
# others); above this many K+V bytes per step it is skipped in full runs.
GATHER_LIMIT_BYTES = 600 << 20


@dataclass(frozen=True)
class Shape:
    hq: int
    hkv: int
    d: int


def shape(settings: Settings) -> Shape:
    return Shape(4, 2, 32) if settings.tiny else Shape(32, 8, 128)


def configs(settings: Settings) -> List[Tuple[int, int]]:
    """(B, L) pairs of the run."""
    if settings.tiny:
        return [(1, 16), (2, 64)]
    if settings.quick:
        return [(1, 16), (1, 512), (8, 2048), (1, 8192)]
    return [(b, l) for b in (1, 8) for l in (16, 512, 2048, 8192)]


def steps(settings: Settings) -> int:
    return len(settings.dtypes) * (len(configs(settings)) * len(settings.threads) + 1)


def _fill(cache, sids, K, V, bs):
    """Append K, V [B, Hkv, L, D] to the sequences one block per sequence at a
    time (round robin), so the sequences' blocks interleave in the pool."""
    L = K.shape[2]
    for s in range(0, L, bs):
        e = min(L, s + bs)
        for b, sid in enumerate(sids):
            cache.append(sid, K[b, :, s:e].transpose(1, 0, 2), V[b, :, s:e].transpose(1, 0, 2))


def _softmax_rows_inplace(s):
    """exp(s - max) in place over the last axis; returns the row sums."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    return s.sum(axis=-1, keepdims=True)


class _Case:
    """Data and implementations of one (dtype, B, L) configuration."""

    def __init__(self, dtype: str, B: int, L: int, sh: Shape, torch, seed: int,
                 kv_dtypes=()):
        import pagedkv

        dt = np.dtype(dtype)
        self.dtype, self.B, self.L, self.sh = dtype, B, L, sh
        G = sh.hq // sh.hkv
        rng = np.random.default_rng(seed)
        self.K = rng.standard_normal((B, sh.hkv, L, sh.d), dtype=dt)
        self.V = rng.standard_normal((B, sh.hkv, L, sh.d), dtype=dt)
        self.q = rng.standard_normal((B, sh.hq, sh.d), dtype=dt)
        self.scale = 1.0 / math.sqrt(sh.d)
        nblk = -(-L // BLOCK_SIZE)
        # the pool holds exactly the B sequences
        self.cache = pagedkv.PagedKVCache(num_blocks=B * nblk, block_size=BLOCK_SIZE,
                                          num_kv_heads=sh.hkv, head_dim=sh.d, dtype=dtype,
                                          max_seqs=B, max_blocks_per_seq=nblk)
        self.sids = [self.cache.add_sequence() for _ in range(B)]
        _fill(self.cache, self.sids, self.K, self.V, BLOCK_SIZE)
        self.out = np.empty((B, sh.hq, sh.d), dtype=dt)
        # the same K/V in each storage dtype: {kv_dtype: (cache, sids, out)}
        self.kv: Dict[str, tuple] = {}
        for kv_dtype in kv_dtypes:
            c = pagedkv.PagedKVCache(num_blocks=B * nblk, block_size=BLOCK_SIZE,
                                     num_kv_heads=sh.hkv, head_dim=sh.d, dtype=dtype,
                                     kv_dtype=kv_dtype, max_seqs=B, max_blocks_per_seq=nblk)
            sids = [c.add_sequence() for _ in range(B)]
            _fill(c, sids, self.K, self.V, BLOCK_SIZE)
            self.kv[kv_dtype] = (c, sids, np.empty_like(self.out), B * nblk * c.bytes_per_block)
        # numpy (contiguous) buffers
        self.qf = self.q.reshape(B, sh.hkv, G, sh.d)
        self.qs = np.empty_like(self.qf)
        self.s = np.empty((B, sh.hkv, G, L), dtype=dt)
        self.o = np.empty((B, sh.hkv, G, sh.d), dtype=dt)
        self.og = np.empty((B, sh.hkv, G, sh.d), dtype=dt)
        self.torch = torch
        if torch is not None:
            self.tq = torch.from_numpy(self.q).view(B, sh.hkv, G, sh.d)
            self.tK = torch.from_numpy(self.K)
            self.tV = torch.from_numpy(self.V)
            self.sdpa = torch.nn.functional.scaled_dot_product_attention
            self.bf16 = dtype == "float32" and "bfloat16" in self.kv
            if self.bf16:  # torch in bfloat16, beside pagedkv's bfloat16 storage
                self.tq16, self.tK16, self.tV16 = (x.to(torch.bfloat16)
                                                   for x in (self.tq, self.tK, self.tV))

    @property
    def kv_bytes(self) -> int:
        return 2 * self.K.nbytes

    @property
    def pattern_bytes(self) -> int:
        """Bytes the pattern read reads: whole blocks of K and V."""
        nblk = -(-self.L // BLOCK_SIZE)
        return 2 * self.B * nblk * BLOCK_SIZE * self.sh.hkv * self.sh.d * self.K.itemsize

    @property
    def flops(self) -> int:
        return 4 * self.B * self.sh.hq * self.L * self.sh.d

    # -- implementations (each computes [B, Hq, D]) --------------------------

    def run_pagedkv(self, n: int) -> None:
        attend, sids, q, out = self.cache.attend_batch, self.sids, self.q, self.out
        for _ in range(n):
            attend(sids, q, out=out)

    def runner_kv(self, kv_dtype: str):
        cache, sids, out, _ = self.kv[kv_dtype]
        attend, q = cache.attend_batch, self.q

        def run(n: int) -> None:
            for _ in range(n):
                attend(sids, q, out=out)
        return run

    def run_pattern(self, n: int) -> None:
        read, sids = self.cache.read_kv_pattern, self.sids
        for _ in range(n):
            self.pattern = read(sids)

    def runner_kv_pattern(self, kv_dtype: str):
        cache, sids, _, _ = self.kv[kv_dtype]
        read = cache.read_kv_pattern

        def run(n: int) -> None:
            for _ in range(n):
                self.kv_read = read(sids)
        return run

    def run_numpy(self, n: int) -> None:
        Kt = self.K.transpose(0, 1, 3, 2)
        for _ in range(n):
            np.multiply(self.qf, self.scale, out=self.qs)
            np.matmul(self.qs, Kt, out=self.s)
            den = _softmax_rows_inplace(self.s)
            np.matmul(self.s, self.V, out=self.o)
            self.o /= den

    def run_gather(self, n: int) -> None:
        for _ in range(n):
            np.multiply(self.qf, self.scale, out=self.qs)
            for b, sid in enumerate(self.sids):
                k, v = self.cache.gather(sid)           # [L, Hkv, D] copies
                s = np.matmul(self.qs[b], k.transpose(1, 2, 0))   # [Hkv, G, L]
                den = _softmax_rows_inplace(s)
                np.matmul(s, v.transpose(1, 0, 2), out=self.og[b])
                self.og[b] /= den

    def run_torch(self, n: int) -> None:
        torch, sdpa = self.torch, self.sdpa
        with torch.inference_mode():
            for _ in range(n):
                self.to = sdpa(self.tq, self.tK, self.tV, scale=self.scale)

    def run_torch16(self, n: int) -> None:
        torch, sdpa = self.torch, self.sdpa
        with torch.inference_mode():
            for _ in range(n):
                self.to16 = sdpa(self.tq16, self.tK16, self.tV16, scale=self.scale)

    def outputs(self, name: str) -> np.ndarray:
        sh = (self.B, self.sh.hq, self.sh.d)
        if name == PAGEDKV:
            return self.out
        if name == NUMPY:
            return self.o.reshape(sh)
        if name == GATHER:
            return self.og.reshape(sh)
        for kv_dtype, (_, _, out, _) in self.kv.items():
            if name == kv_impl(kv_dtype):
                return out
        if name == TORCH16:
            return self.to16.float().numpy().reshape(sh)
        return self.to.numpy().reshape(sh)

    def close(self) -> None:
        for sid in self.sids:
            self.cache.free(sid)
        for cache, sids, _, _ in self.kv.values():
            for sid in sids:
                cache.free(sid)
        self.__dict__.clear()


def run(settings: Settings) -> List[dict]:
    torch = load_torch(settings)
    sh = shape(settings)
    recs: List[dict] = []
    for di, dtype in enumerate(settings.dtypes):
        for ci, (B, L) in enumerate(configs(settings)):
            with closing(_Case(dtype, B, L, sh, torch, seed=1000 * di + ci,
                               kv_dtypes=settings.kv_dtypes)) as case:
                skip_gather = (not settings.tiny and not settings.quick
                               and case.kv_bytes > GATHER_LIMIT_BYTES)
                if skip_gather:
                    settings.note(f"numpy-gather skipped where K+V > {GATHER_LIMIT_BYTES >> 20} "
                                  "MiB per step (it copies every byte before reading it; "
                                  "it would dominate the run time)")
                for t in settings.threads:
                    cool = settings.cooldown_after_blas(t)
                    impls: Dict[str, Impl] = {PAGEDKV: Impl(case.run_pagedkv),
                                              PATTERN: Impl(case.run_pattern),
                                              NUMPY: Impl(case.run_numpy, cooldown=cool)}
                    if not skip_gather:
                        impls[GATHER] = Impl(case.run_gather, cooldown=cool)
                    if torch is not None:
                        impls[TORCH] = Impl(case.run_torch)
                    for kv_dtype in case.kv:
                        impls[kv_impl(kv_dtype)] = Impl(case.runner_kv(kv_dtype))
                        impls[kv_pattern(kv_dtype)] = Impl(case.runner_kv_pattern(kv_dtype))
                    if torch is not None and case.bf16:
                        impls[TORCH16] = Impl(case.run_torch16)
                    with settings.stage(f"decode {short_dtype(dtype)} t={t} B={B} L={L}"), \
                            ThreadScope(t, torch):
                        first = timed_once(impls)   # warm-up, and the outputs to check
                        errors = _verify(case, impls)
                        timings = measure(impls, settings, prior=first, rewarm=True)
                    recs.append(_record(settings, case, t, timings, errors,
                                        skipped=[GATHER] if skip_gather else []))
    recs.extend(run_l2(settings))
    return recs


def _xor_bytes(a: np.ndarray) -> int:
    """XOR of every byte of `a`."""
    w = np.bitwise_xor.reduce(a.reshape(-1).view(np.uint64))
    return int(np.bitwise_xor.reduce(np.frombuffer(w.tobytes(), dtype=np.uint8)))


def _verify(case: _Case, impls: Dict[str, Impl]) -> Dict[str, float]:
    nbytes, xor = case.pattern
    want_xor = _xor_bytes(case.K) ^ _xor_bytes(case.V)
    if nbytes != case.pattern_bytes or xor != want_xor:
        raise AssertionError(f"kv-pattern read: read {nbytes} bytes with XOR {xor}, expected "
                             f"{case.pattern_bytes} bytes with XOR {want_xor}")
    want = case.outputs(PAGEDKV)
    errors = {}
    for name in impls:
        if name in (PAGEDKV, PATTERN):
            continue
        kvp = [k for k in case.kv if kv_pattern(k) == name]
        if kvp:  # read alone: its byte count (the pool's whole blocks)
            case.runner_kv_pattern(kvp[0])(1)
            if case.kv_read[0] != case.kv[kvp[0]][3]:
                raise AssertionError(f"{name}: read {case.kv_read[0]} bytes, expected "
                                     f"{case.kv[kvp[0]][3]}")
            continue
        kv = [k for k in case.kv if kv_impl(k) == name]
        if name == TORCH16:
            kv = ["bfloat16"]
        if kv:
            errors[name] = check_kv(name, case.outputs(name), want, kv[0])
        else:
            errors[name] = check_close(name, case.outputs(name), want, case.dtype)
    return errors


def _record(settings: Settings, case: _Case, t: int, timings, errors, skipped) -> dict:
    bw = settings.bw(t)
    kv_names = {kv_impl(k): k for k in case.kv}
    kv_reads = {kv_pattern(k): k for k in case.kv}

    def figures(name, tm) -> dict:
        kv = kv_names.get(name) or kv_reads.get(name)
        nbytes = (case.kv[kv][3] if kv else case.pattern_bytes if name == PATTERN
                  else case.kv_bytes)
        r = {"gbps": nbytes / tm.median / 1e9,
             "pct_bw": 100.0 * nbytes / tm.median / bw if bw else None,
             "gflops": case.flops / tm.median / 1e9}
        if name in errors:
            r["max_rel_err_vs_pagedkv"] = errors[name]
        return r

    results = results_of(timings, figures)
    # decode GB/s as a fraction of the pattern read's, paired per round (storage
    # dtypes: their own pool's; both count the same whole blocks)
    results[PAGEDKV]["pct_pattern"] = (100.0 * case.kv_bytes / case.pattern_bytes
                                       * paired_ratio(timings[PATTERN], timings[PAGEDKV]))
    for name, kv in kv_names.items():
        results[name]["pct_pattern"] = 100.0 * paired_ratio(timings[kv_pattern(kv)], timings[name])
    # baselines: their time / pagedkv's; storage dtypes: pagedkv's time / theirs;
    # torch in bfloat16: its time / pagedkv-bf16's
    ratios = {name: (paired_ratio(timings[PAGEDKV], tm) if name in kv_names
                     else paired_ratio(tm, timings[kv_impl("bfloat16")]) if name == TORCH16
                     else paired_ratio(tm, timings[PAGEDKV]))
              for name, tm in timings.items()
              if name not in (PAGEDKV, PATTERN) and name not in kv_reads}
    return {"suite": "decode", "dtype": case.dtype, "threads": t, "B": case.B, "L": case.L,
            "Hq": case.sh.hq, "Hkv": case.sh.hkv, "D": case.sh.d, "block_size": BLOCK_SIZE,
            "kv_bytes": case.kv_bytes, "flops": case.flops, "results": results,
            "ratios": ratios, "skipped": skipped, "kv_dtypes": list(case.kv)}


# ---------------------------------------------------------------------------
# the arithmetic ceiling: instruction peak, and decode with K/V in L2

L2_SUITE = "decode-l2"
PEAK_SUITE = "instruction-peak"
L2_DEFAULT_BYTES = 1 << 20


def _parse_cache_size(text: str) -> int:
    """sysfs cache size ('1024K', '2M', '512') in bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def l2_cache_bytes() -> Tuple[int, str]:
    """(size of the L2 of the first CPU this process may run on, 'sysfs'), or
    (1 MiB, 'assumed') where sysfs does not say."""
    try:
        cpus = [min(os.sched_getaffinity(0)), 0]
    except (AttributeError, OSError, ValueError):  # pragma: no cover - non-Linux
        cpus = [0]
    for cpu in dict.fromkeys(cpus):
        base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
        try:
            names = sorted(n for n in os.listdir(base) if n.startswith("index"))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(base, name, "level")) as f:
                    level = f.read().strip()
                with open(os.path.join(base, name, "type")) as f:
                    kind = f.read().strip()
                with open(os.path.join(base, name, "size")) as f:
                    size = _parse_cache_size(f.read())
            except (OSError, ValueError):
                continue
            if level == "2" and kind in ("Data", "Unified") and size > 0:
                return size, "sysfs"
    return L2_DEFAULT_BYTES, "assumed"


def peak_kind(dtype: str) -> str:
    """The instruction the kernels of compute dtype `dtype` are built on:
    every storage dtype is widened on load to the compute type and folded
    with its FMAs (but see peak_kinds)."""
    return "fma_f64" if np.dtype(dtype) == np.float64 else "fma_f32"


def peak_kinds(cache, dtype: str) -> Tuple[str, str]:
    """The instructions of (scores, P.V) of `cache`'s decode: the compute type's
    FMA for both, except where the cache scores int8 keys with an integer dot
    product (cache.quantizes_queries): vpdpbusd on the avx512vnni, avx512bf16, avx512amx and
    avxvnni paths, sdot on neondot; or bfloat16 keys with vdpbf16ps
    (cache.rounds_queries_bf16, the avx512bf16 path); and P.V of int8 values
    on vpdpwssd where the weights are rounded to int16 (cache.quantizes_weights)."""
    fma = peak_kind(dtype)
    if cache.rounds_queries_bf16:
        return "dpbf16", fma
    if not cache.quantizes_queries:
        return fma, fma
    from pagedkv import simd_backend
    pv = "dpwssd" if cache.quantizes_weights else fma
    return ("sdot" if simd_backend() == "neondot" else "dpbusd"), pv


def _reference(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float) -> np.ndarray:
    """Decode in float64: q [1, Hq, D], K, V [1, Hkv, L, D] -> [1, Hq, D]."""
    hq, hkv = q.shape[1], K.shape[1]
    qf = q.astype(np.float64).reshape(hkv, hq // hkv, -1)
    s = np.matmul(qf * scale, K[0].astype(np.float64).transpose(0, 2, 1))  # [Hkv, G, L]
    den = _softmax_rows_inplace(s)
    return (np.matmul(s, V[0].astype(np.float64)) / den).reshape(q.shape)


class _L2Case:
    """B=1 decode, one cache per storage dtype, each with L tokens so that
    its stored K+V is about half of the L2."""

    def __init__(self, dtype: str, sh: Shape, l2_bytes: int, kv_dtypes, seed: int):
        import pagedkv

        dt = np.dtype(dtype)
        rng = np.random.default_rng(seed)
        self.dtype, self.sh = dtype, sh
        self.scale = 1.0 / math.sqrt(sh.d)
        self.q = rng.standard_normal((1, sh.hq, sh.d), dtype=dt)
        # name -> {"kv_dtype", "L", "kv_bytes", "cache", "sid", "out", "want"}
        self.entries: Dict[str, dict] = {}
        for kv_dtype in [dtype] + [k for k in kv_dtypes if k != dtype]:
            geom = dict(block_size=BLOCK_SIZE, num_kv_heads=sh.hkv, head_dim=sh.d, dtype=dtype,
                        kv_dtype=kv_dtype, max_seqs=1)
            per_block = pagedkv.PagedKVCache(num_blocks=1, **geom).bytes_per_block
            L = max(1, (l2_bytes // 2) * BLOCK_SIZE // per_block)  # tokens, not whole blocks
            nblk = -(-L // BLOCK_SIZE)
            cache = pagedkv.PagedKVCache(num_blocks=nblk, max_blocks_per_seq=nblk, **geom)
            sid = cache.add_sequence()
            K = rng.standard_normal((1, sh.hkv, L, sh.d), dtype=dt)
            V = rng.standard_normal((1, sh.hkv, L, sh.d), dtype=dt)
            _fill(cache, [sid], K, V, BLOCK_SIZE)
            name = PAGEDKV if kv_dtype == dtype else kv_impl(kv_dtype)
            self.entries[name] = {"kv_dtype": kv_dtype, "L": L,
                                  "kv_bytes": L * per_block // BLOCK_SIZE, "cache": cache,
                                  "sid": sid, "out": np.empty_like(self.q),
                                  "want": _reference(self.q, K, V, self.scale)}

    def runner(self, name: str):
        e = self.entries[name]
        attend, sids, q, out = e["cache"].attend_batch, [e["sid"]], self.q, e["out"]

        def run(n: int) -> None:
            for _ in range(n):
                attend(sids, q, out=out)
        return run

    def verify(self) -> Dict[str, float]:
        """Each output against the float64 reference of its own K/V."""
        errors = {}
        for name, e in self.entries.items():
            err = rel_error(e["out"], e["want"])
            tol = KV_CHECK_TOL.get(e["kv_dtype"], 1e-4 if self.dtype == "float32" else 1e-10)
            if not err <= tol:
                raise AssertionError(f"decode in L2, {name}: max error {err:.3g} / max |out| "
                                     f"against float64 exceeds {tol:g}")
            errors[name] = err
        return errors

    def close(self) -> None:
        for e in self.entries.values():
            e["cache"].free(e["sid"])
        self.__dict__.clear()


def run_l2(settings: Settings) -> List[dict]:
    """The instruction peak of each compute dtype's kind (1 thread), then
    decode with K/V in L2 for every storage dtype of the run (1 thread)."""
    import pagedkv
    from pagedkv._core import instruction_peak

    sh = shape(settings)
    l2, l2_source = l2_cache_bytes()
    simd = pagedkv.simd_backend()
    recs: List[dict] = []
    peaks: Dict[str, float] = {}
    seconds = 0.005 if settings.tiny else 0.05

    def peak(kind: str) -> float:
        if kind not in peaks:
            peaks[kind] = float(instruction_peak(kind, threads=1, seconds=seconds))
            recs.append({"suite": PEAK_SUITE, "kind": kind, "simd": simd, "threads": 1,
                         "lanes_per_s": peaks[kind]})
        return peaks[kind]

    for di, dtype in enumerate(settings.dtypes):
        with settings.stage(f"decode {short_dtype(dtype)} in L2, instruction peak"):
            kind = peak_kind(dtype)
            with closing(_L2Case(dtype, sh, l2, settings.kv_dtypes, seed=7000 + di)) as case:
                kinds = {name: peak_kinds(e["cache"], dtype) for name, e in case.entries.items()}
                for pair in kinds.values():
                    for k in pair:
                        peak(k)
                impls = {name: Impl(case.runner(name)) for name in case.entries}
                with ThreadScope(1):
                    first = timed_once(impls)
                    errors = case.verify()
                    timings = measure(impls, settings, prior=first, rewarm=True)

                def figures(name, tm) -> dict:
                    e = case.entries[name]
                    half = sh.hq * e["L"] * sh.d  # multiply-adds of the scores, and of P.V
                    rate = 2 * half / tm.median
                    sk, vk = kinds[name]
                    best = half / peaks[sk] + half / peaks[vk]  # both at their instruction's peak
                    return {"kv_dtype": e["kv_dtype"], "L": e["L"], "kv_bytes": e["kv_bytes"],
                            "fma_lanes": 2 * half, "lanes_per_s": rate,
                            "peak_kinds": [sk, vk], "pct_peak": 100.0 * best / tm.median,
                            "max_rel_err_vs_float64": errors[name]}

                recs.append({"suite": L2_SUITE, "dtype": dtype, "threads": 1, "B": 1,
                             "Hq": sh.hq, "Hkv": sh.hkv, "D": sh.d, "block_size": BLOCK_SIZE,
                             "l2_bytes": l2, "l2_source": l2_source, "simd": simd,
                             "peak_kind": kind, "peak_lanes_per_s": peaks[kind],
                             "results": results_of(timings, figures)})
    return recs


def _peak_line(recs: List[dict]) -> str:
    peaks = [r for r in recs if r["suite"] == PEAK_SUITE]
    if not peaks:
        return ""
    return (f"Instruction peaks of one core ({peaks[0]['simd']} path, 1 thread, best of short "
            "runs of 12 independent chains): "
            + ", ".join(f"{r['kind']} {fmt_num(r['lanes_per_s'] / 1e9)} G lanes/s"
                        for r in peaks)
            + " (dpbusd, sdot: byte products; dpbf16: bfloat16 products; dpwssd: int16 products).")


def _l2_head(r0: dict) -> str:
    src = "" if r0["l2_source"] == "sysfs" else ", assumed: sysfs does not say"
    return (f"Decode with K/V in L2 (1 thread, B=1, Hq={r0['Hq']} Hkv={r0['Hkv']} D={r0['D']}; "
            f"L sized so the stored K+V is about half of the {fmt_bytes(r0['l2_bytes'])} L2"
            f"{src}).\nG lanes/s = 2 * Hq * L * D / time (one multiply-add per query head and "
            "stored K or V element); %peak = the time the scores and P.V\nwould take at the peak "
            "of the instruction each is built on / the time taken: the FMA of the compute type "
            "(bf16/f16/i8 storage\nis widened on load), except int8 keys on the integer dot paths, "
            "scored with vpdpbusd or sdot against the query rounded to int8,\nbf16 keys on the "
            "avx512bf16 path, scored with vdpbf16ps (dpbf16) against the query rounded to bf16,\n"
            "and int8 values where P.V takes vpdpwssd (dpwssd) on the weights rounded to int16 "
            "(cache.quantizes_weights).")


def _l2_rows(r: dict) -> List[List[str]]:
    return grouped([short_dtype(r["dtype"])], [
        [name, str(res["L"]), fmt_bytes(res["kv_bytes"]), *timed_cells(res),
         fmt_num(res["lanes_per_s"] / 1e9), fmt_pct(res["pct_peak"])]
        for name, res in r["results"].items()])


def report_l2(recs: List[dict]) -> str:
    return suite_section(recs, L2_SUITE, _l2_head,
                         ["dtype", "impl", "L", "K+V", "time/call", "spread", "G lanes/s",
                          "%peak"], _l2_rows, [False, False, True, True, True, True, True, True])


def _head(r0: dict, peak: str) -> str:
    return (f"Decode: one query per sequence, Hq={r0['Hq']} Hkv={r0['Hkv']} D={r0['D']}, "
            f"block size {r0['block_size']}.  GB/s counts K+V bytes read once per step; "
            "%BW is against the\nmeasured sequential read bandwidth at the same thread count, "
            "%pat against the kv-pattern read\n(the same bytes in the same block order, nothing "
            "computed; paired per round); "
            "'pagedkv speedup' = baseline time / pagedkv time (paired per round; >1: pagedkv "
            "faster);\nspread = (max - min) / median of the rounds.  pagedkv-bf16/f16/i8: "
            "the same K/V stored as bfloat16 / float16 / int8;\ntheir last column is pagedkv "
            "time / theirs (>1: the smaller storage is faster), their GB/s the bytes they read, "
            "their %pat\nagainst the pattern read of their own pool.  torch-sdpa-bf16: torch "
            "in bfloat16; its last column is its time / pagedkv-bf16's."
            + ("\n" + peak if peak else ""))


def _rows(r: dict) -> List[List[str]]:
    def cells(name, res):
        speed = "" if name in (PAGEDKV, PATTERN) else fmt_ratio(r["ratios"][name])
        pat = fmt_pct(res["pct_pattern"]) if "pct_pattern" in res else ""
        flops = "" if name == PATTERN else fmt_num(res["gflops"])
        return [name, *timed_cells(res), fmt_num(res["gbps"]), fmt_pct(res["pct_bw"]), pat,
                flops, speed]

    # a missing implementation gets a row only if torch or skipped
    names = [n for n in IMPLS + tuple(kv_impl(k) for k in r.get("kv_dtypes", [])) + (TORCH16,)
             if n in r["results"] or n == TORCH or n in r["skipped"]]
    return grouped([short_dtype(r["dtype"]), str(r["threads"]), str(r["B"]), str(r["L"])],
                   impl_rows(r, names, cells, 8,
                             lambda n: "skipped" if n in r["skipped"] else "n/a"))


def report(settings: Settings, recs: List[dict]) -> str:
    peak = _peak_line(recs)
    l2 = report_l2(recs)
    main = suite_section(recs, "decode", lambda r0: _head(r0, peak),
                         ["dtype", "thr", "B", "L", "impl", "time/step", "spread", "GB/s", "%BW",
                          "%pat", "GFLOP/s", "pagedkv speedup"], _rows,
                         [False, True, True, True, False, True, True, True, True, True, True,
                          True])
    if not main:
        return ""
    return main + ("\n\n" + l2 if l2 else "")
