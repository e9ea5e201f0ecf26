"""Causal prefill: L queries of one sequence against its L keys (compute-bound).

pagedkv: ``cache.attend(sid, q, out=out)`` with q [L, Hq, D] (the newest L
tokens are the whole sequence, so query i sees keys 0..i).

Baselines, each checked once per configuration against pagedkv's output:

* ``numpy``: per KV head, the G query heads of its group stacked [G, L, D];
  scores [G, L, L] by matmul, a -inf upper triangle added, softmax, matmul.
  It computes the whole square (twice the useful work).
* ``torch-sdpa``: ``scaled_dot_product_attention(..., is_causal=True)`` with
  q [1, Hq, L, D] and K, V [1, Hkv, L, D], GQA either through
  ``enable_gqa=True`` or ``repeat_interleave`` of K and V inside the timed
  call; both are timed and the faster is reported (both are in the JSON).

With float32, the same K/V in each storage dtype of ``--kv-dtypes``
(``pagedkv-bf16``, ...; checked within the storage's bound, their ratio the
float32 storage's time / theirs).

Useful FLOPs = 4 * Hq * D * sum_{i<L} (i + 1) = 2 * Hq * D * L * (L + 1): the
multiply-adds of Q K^T and P V over the causal triangle only.
"""
from __future__ import annotations

import gc
import math
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Tuple

import numpy as np

from pagedkv.benchmarks.common import (BLOCK_SIZE, NUMPY, PAGEDKV, Settings, ThreadScope,
                                       check_close, load_torch)
from pagedkv.benchmarks.decode import Shape, check_kv, kv_impl, shape
from pagedkv.benchmarks.report import (fmt_num, fmt_ratio, grouped, impl_rows, results_of,
                                       short_dtype, suite_section, timed_cells)
from pagedkv.benchmarks.timing import Impl, measure, paired_ratio, paired_ratios, timed_once

if TYPE_CHECKING:
    from pagedkv.cache import PagedKVCache

TORCH = "torch-sdpa"
TORCH_GQA = "torch-sdpa(enable_gqa)"
TORCH_REP = "torch-sdpa(repeat_interleave)"


def configs(settings: Settings) -> List[Tuple[str, int, int]]:
    """(dtype, L, threads) triples of the run."""
    if settings.tiny:
        return [(d, 32, t) for d in settings.dtypes for t in settings.threads]
    if settings.quick:
        # the target configuration only: f32 (if asked), L=2048, most threads
        dt = "float32" if "float32" in settings.dtypes else settings.dtypes[0]
        return [(dt, 2048, max(settings.threads))]
    return [(d, L, t) for d in settings.dtypes for L in (512, 2048) for t in settings.threads]


def steps(settings: Settings) -> int:
    return len(configs(settings))


def useful_flops(hq: int, d: int, L: int) -> int:
    return 2 * hq * d * L * (L + 1)


class _KvCase(NamedTuple):
    """The prompt's K/V in one storage dtype: its cache, sequence and output buffer."""
    kv_dtype: str
    cache: PagedKVCache
    sid: int
    out: np.ndarray


class _Case:
    def __init__(self, dtype: str, L: int, sh: Shape, torch, seed: int, kv_dtypes=()):
        import pagedkv

        dt = np.dtype(dtype)
        self.dtype, self.L, self.sh = dtype, L, sh
        G = sh.hq // sh.hkv
        rng = np.random.default_rng(seed)
        k = rng.standard_normal((L, sh.hkv, sh.d), dtype=dt)
        v = rng.standard_normal((L, sh.hkv, sh.d), dtype=dt)
        self.q = rng.standard_normal((L, sh.hq, sh.d), dtype=dt)
        self.scale = 1.0 / math.sqrt(sh.d)
        nblk = -(-L // BLOCK_SIZE)
        self.cache = pagedkv.PagedKVCache(num_blocks=nblk, block_size=BLOCK_SIZE,
                                          num_kv_heads=sh.hkv, head_dim=sh.d, dtype=dtype,
                                          max_seqs=1, max_blocks_per_seq=nblk)
        self.sid = self.cache.add_sequence()
        self.cache.append(self.sid, k, v)
        self.out = np.empty((L, sh.hq, sh.d), dtype=dt)
        # the same K/V in each storage dtype, by row name ("pagedkv-bf16", ...)
        self.kv: Dict[str, _KvCase] = {}
        for kv_dtype in kv_dtypes:
            c = pagedkv.PagedKVCache(num_blocks=nblk, block_size=BLOCK_SIZE, num_kv_heads=sh.hkv,
                                     head_dim=sh.d, dtype=dtype, kv_dtype=kv_dtype, max_seqs=1,
                                     max_blocks_per_seq=nblk)
            sid = c.add_sequence()
            c.append(sid, k, v)
            self.kv[kv_impl(kv_dtype)] = _KvCase(kv_dtype, c, sid, np.empty_like(self.out))
        # each baseline gets its inputs in the layout it prefers (untimed)
        self.Kh = np.ascontiguousarray(k.transpose(1, 0, 2))            # [Hkv, L, D]
        self.Vh = np.ascontiguousarray(v.transpose(1, 0, 2))
        self.Qg = np.ascontiguousarray(
            self.q.reshape(L, sh.hkv, G, sh.d).transpose(1, 2, 0, 3))   # [Hkv, G, L, D]
        self.mask = np.triu(np.full((L, L), -np.inf, dtype=dt), k=1)
        self.o = np.empty((sh.hkv, G, L, sh.d), dtype=dt)
        self.torch = torch
        if torch is not None:
            self.tq = torch.from_numpy(self.Qg.reshape(1, sh.hq, L, sh.d))  # head h = kv*G + g
            self.tk = torch.from_numpy(self.Kh).unsqueeze(0)
            self.tv = torch.from_numpy(self.Vh).unsqueeze(0)
            self.sdpa = torch.nn.functional.scaled_dot_product_attention
            self.torch_out: Dict[str, object] = {}

    @property
    def flops(self) -> int:
        return useful_flops(self.sh.hq, self.sh.d, self.L)

    def run_pagedkv(self, n: int) -> None:
        for _ in range(n):
            self.cache.attend(self.sid, self.q, out=self.out)

    def runner_kv(self, name: str):
        _, c, sid, out = self.kv[name]

        def run(n: int) -> None:
            for _ in range(n):
                c.attend(sid, self.q, out=out)
        return run

    def run_numpy(self, n: int) -> None:
        for _ in range(n):
            for h in range(self.sh.hkv):
                s = np.matmul(self.Qg[h], self.Kh[h].T)    # [G, L, L]
                s *= self.scale
                s += self.mask
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                den = s.sum(axis=-1, keepdims=True)
                np.matmul(s, self.Vh[h], out=self.o[h])
                self.o[h] /= den

    def run_torch_gqa(self, n: int) -> None:
        with self.torch.inference_mode():
            for _ in range(n):
                self.torch_out[TORCH_GQA] = self.sdpa(self.tq, self.tk, self.tv, is_causal=True,
                                                      scale=self.scale, enable_gqa=True)

    def run_torch_rep(self, n: int) -> None:
        G = self.sh.hq // self.sh.hkv
        with self.torch.inference_mode():
            for _ in range(n):
                k = self.tk.repeat_interleave(G, dim=1)
                v = self.tv.repeat_interleave(G, dim=1)
                self.torch_out[TORCH_REP] = self.sdpa(self.tq, k, v, is_causal=True,
                                                      scale=self.scale)

    def outputs(self, name: str) -> np.ndarray:
        L, sh = self.L, self.sh
        if name == PAGEDKV:
            return self.out
        if name in self.kv:
            return self.kv[name].out
        if name == NUMPY:
            o = self.o
        else:
            o = self.torch_out[name].numpy().reshape(sh.hkv, sh.hq // sh.hkv, L, sh.d)
        return o.transpose(2, 0, 1, 3).reshape(L, sh.hq, sh.d)

    def close(self) -> None:
        self.cache.free(self.sid)
        for e in self.kv.values():
            e.cache.free(e.sid)
        self.__dict__.clear()


def _has_enable_gqa(torch) -> bool:
    try:
        q = torch.zeros(1, 2, 1, 4)
        k = torch.zeros(1, 1, 1, 4)
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def run(settings: Settings) -> List[dict]:
    torch = load_torch(settings)
    gqa = torch is not None and _has_enable_gqa(torch)
    sh = shape(settings)
    recs = []
    cases = {}
    for i, (dtype, L, t) in enumerate(configs(settings)):
        key = (dtype, L)
        if key not in cases:  # consecutive configs share their data
            for old in cases.values():
                old.close()
            cases.clear()
            gc.collect()
            cases[key] = _Case(dtype, L, sh, torch, seed=7 + i,
                               kv_dtypes=settings.kv_dtypes if dtype == "float32" else ())
        case = cases[key]
        impls = {PAGEDKV: Impl(case.run_pagedkv)}
        for name in case.kv:
            impls[name] = Impl(case.runner_kv(name))
        if settings.quick:
            settings.note("--quick: the NumPy prefill baseline is skipped (not a target; "
                          "the full run has it)")
        else:
            impls[NUMPY] = Impl(case.run_numpy, cooldown=settings.cooldown_after_blas(t))
        if torch is not None:
            if gqa:
                impls[TORCH_GQA] = Impl(case.run_torch_gqa)
            impls[TORCH_REP] = Impl(case.run_torch_rep)
        with settings.stage(f"prefill {short_dtype(dtype)} t={t} L={L}"):
            with ThreadScope(t, torch):
                first = timed_once(impls)  # warm-up, and the outputs to check
                want = case.outputs(PAGEDKV)
                errors = {name: _check(case, name, want) for name in impls if name != PAGEDKV}
                timings = measure(impls, settings, prior=first)
            recs.append(_record(settings, case, t, timings, errors))
            recs[-1]["skipped"] = [] if NUMPY in impls else [NUMPY]
    for old in cases.values():
        old.close()
    cases.clear()
    gc.collect()
    return recs


def _check(case: _Case, name: str, want) -> float:
    """The error of `name`'s output against pagedkv's: a baseline's within the
    compute type's tolerance, a storage dtype's within its bound."""
    if name in case.kv:
        return check_kv(name, case.outputs(name), want, case.kv[name].kv_dtype)
    return check_close(name, case.outputs(name), want, case.dtype)


def _record(settings: Settings, case: _Case, t: int, timings, errors) -> dict:
    results = results_of(timings, lambda name, tm: {
        "gflops": case.flops / tm.median / 1e9,
        **({} if name == PAGEDKV else {"max_rel_err_vs_pagedkv": errors[name]})})
    ratios = paired_ratios(timings)
    for name in case.kv:  # storage dtypes: the float32 storage's time / theirs
        ratios[name] = paired_ratio(timings[PAGEDKV], timings[name])
    variants = [n for n in (TORCH_GQA, TORCH_REP) if n in timings]
    torch_variant = None
    if variants:
        torch_variant = min(variants, key=lambda n: timings[n].median)
        results[TORCH] = dict(results[torch_variant], variant=torch_variant)
        ratios[TORCH] = ratios[torch_variant]
    return {"suite": "prefill", "dtype": case.dtype, "threads": t, "L": case.L,
            "Hq": case.sh.hq, "Hkv": case.sh.hkv, "D": case.sh.d, "causal": True,
            "useful_flops": case.flops, "results": results, "ratios": ratios,
            "torch_variant": torch_variant, "kv_dtypes": [e.kv_dtype for e in case.kv.values()]}


def _head(r0: dict) -> str:
    return (f"Prefill, causal: L queries over L keys, Hq={r0['Hq']} Hkv={r0['Hkv']} D={r0['D']}.  "
            "GFLOP/s counts useful FLOPs 2*Hq*D*L*(L+1) (the causal triangle);\n"
            "torch-sdpa is the faster of enable_gqa=True and repeat_interleave (named); "
            "numpy computes the full square then masks it; pagedkv-bf16 / -f16 / -i8: the same "
            "K/V stored\nin that dtype (their speedup: the float32 storage's time / theirs).")


def _rows(r: dict) -> List[List[str]]:
    def cells(name, res):
        label = res["variant"].replace("torch-sdpa", "torch-sdpa ") if name == TORCH else name
        speed = "" if name == PAGEDKV else fmt_ratio(r["ratios"][name])
        return [label, *timed_cells(res), fmt_num(res["gflops"]), speed]

    return grouped([short_dtype(r["dtype"]), str(r["threads"]), str(r["L"])],
                   impl_rows(r, (PAGEDKV, *(kv_impl(k) for k in r.get("kv_dtypes", [])), NUMPY,
                                 TORCH), cells, 5,
                             lambda n: "skipped" if n in r.get("skipped", ()) else "n/a"))


def report(settings: Settings, recs: List[dict]) -> str:
    return suite_section(recs, "prefill", _head,
                         ["dtype", "thr", "L", "impl", "time", "spread", "GFLOP/s",
                          "pagedkv speedup"], _rows,
                         [False, True, True, False, True, True, True, True])
