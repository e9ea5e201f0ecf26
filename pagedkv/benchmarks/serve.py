"""Serving many requests: ``ContinuousBatcher`` vs transformers' ``generate_batch`` vs
``generate()`` one prompt at a time.

Opt-in (``pagedkv bench --suites serve``; needs the ``hf`` extra).  A random Llama (hidden 512,
4 layers, 8 query heads, 4 KV heads, head_dim 64, MLP 1536, vocabulary 32000, f32; seed 0) and
two workloads, greedy, every request's tokens checked equal across the systems (the batcher
runs twice: as it comes, and with ``linear_kernel=False``, every matrix product left to torch,
which shows what its small-step linear kernel adds to what the paging and packing give):

- ``batch``: 24 requests, prompts of 16-400 tokens (uniform), 48 new tokens each, all there at
  the start (an offline batch).
- ``trace``: requests arriving as a Poisson process, prompts of 16-2,000 tokens (log-uniform),
  32 new tokens each.  Each system sees the same arrival times (wall clock from the start of
  its run): the batcher adds a request once its time has come and steps while any is
  unfinished; transformers' manager gets ``add_request`` at the same times; one-by-one
  ``generate()`` serves them in arrival order.

tokens/s = generated tokens / wall time from the first arrival to the last token; TTFT = time
of a request's first token minus its arrival (median and p90 over requests); peak memory =
the process's peak resident set during the run minus at its start (sampled every 2 ms from
/proc/self/statm; None where that file does not exist), and for the batcher also the bytes of
the KV blocks it used at most.  Each system runs once untimed first (``generate_batch`` is
measured warm); then rounds interleave the systems, which goes first rotating.  transformers'
continuous batching runs through its manager (``init_continuous_batching``, what
``generate_batch`` uses) so that requests can arrive over time, with the batcher's KV budget,
page size and ``max_batch_tokens``.  The two
models are separate modules with the same weights: the batcher switches its model to the
"pagedkv" attention, which transformers' continuous batching does not accept.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from pagedkv.benchmarks.common import BLOCK_SIZE, Settings, ThreadScope, needs_hf
from pagedkv.benchmarks.report import fmt_bytes, fmt_ratio, section
from pagedkv.benchmarks.timing import median, paired_median, round_order

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MAX_BATCH_TOKENS = 512
CB_PAGE_SIZE = 16  # transformers' page size (its default is 256)
SYSTEMS = ("pagedkv batcher", "generate_batch", "generate one-by-one",
           "pagedkv batcher, torch linears")
#: the JSON key of each system's ratio (its time / the batcher's)
RATIO_KEYS = {SYSTEMS[1]: "ratio_vs_generate_batch", SYSTEMS[2]: "ratio_vs_one_by_one",
              SYSTEMS[3]: "ratio_vs_torch_linears"}


def _workloads(settings: Settings) -> List[dict]:
    if settings.tiny:
        return [dict(name="batch", requests=4, prompt=(4, 40), dist="uniform", new=4, rate=None),
                dict(name="trace", requests=4, prompt=(4, 60), dist="log", new=3, rate=50.0)]
    return [dict(name="batch", requests=24, prompt=(16, 400), dist="uniform", new=48, rate=None),
            dict(name="trace", requests=12, prompt=(16, 2000), dist="log", new=32, rate=4.0)]


def steps(settings: Settings) -> int:
    return len(_workloads(settings))


def _requests(w: dict, vocab: int) -> Tuple[List[List[int]], List[float]]:
    rng = np.random.default_rng(len(w["name"]) * 1000 + w["requests"])
    lo, hi = w["prompt"]
    if w["dist"] == "uniform":
        lens = rng.integers(lo, hi + 1, w["requests"])
    else:
        lens = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), w["requests"])).astype(int)
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in lens]
    if w["rate"] is None:
        arrivals = [0.0] * len(prompts)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / w["rate"], len(prompts))).tolist()
        arrivals = [a - arrivals[0] for a in arrivals]
    return prompts, arrivals


class _PeakRSS:
    """Peak resident set size above the level at start, sampled by a thread."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.ok = os.path.exists("/proc/self/statm")
        self.peak = self.start = 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        if self.ok:
            self.start = self.peak = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        if self.ok:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def delta(self) -> Optional[int]:
        return self.peak - self.start if self.ok else None


def _wait_until(t: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches t (a request's arrival)."""
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _run_batcher(model, prompts, arrivals, new, linear_kernel=True) -> dict:
    from pagedkv.integrations.hf import ContinuousBatcher  # noqa: PLC0415

    blocks = sum(-(-(len(p) + new) // BLOCK_SIZE) for p in prompts)
    b = ContinuousBatcher(model, num_blocks=blocks, block_size=BLOCK_SIZE,
                          max_batch_tokens=MAX_BATCH_TOKENS, max_seqs=len(prompts),
                          linear_kernel=linear_kernel)
    first: Dict[int, float] = {}
    rids: List[int] = []
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or b.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rids.append(b.add_request(prompts[nxt], new))
            nxt += 1
        if not b.has_unfinished():
            time.sleep(max(arrivals[nxt] - now, 0.0))
            continue
        for ev in b.step():
            first.setdefault(ev.request_id, time.perf_counter() - t0)
    end = time.perf_counter() - t0
    out = b.run()
    peak = sum(c.stats().peak_blocks_used * c.bytes_per_block for c in b.groups.values())
    return dict(tokens=[out[r] for r in rids], end=end,
                ttft=[first[r] - arrivals[i] for i, r in enumerate(rids)],
                kv_peak_bytes=peak,
                preemptions=b.stats().preemptions)


def _run_generate_batch(model, gen_config, prompts, arrivals, new) -> dict:
    from transformers import ContinuousBatchingConfig  # noqa: PLC0415

    # the same KV budget and batch size as the batcher (left alone, it sizes its cache from
    # the free memory: ~10 GiB allocated and touched per run on a 24 GiB machine)
    pages = sum(-(-(len(p) + new) // CB_PAGE_SIZE) for p in prompts)
    cb = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=pages,
                                  max_batch_tokens=MAX_BATCH_TOKENS)
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb)
    manager.start()
    try:
        t0 = time.perf_counter()
        t0_abs = t0
        ids = []
        for i, p in enumerate(prompts):
            _wait_until(t0 + arrivals[i])
            ids.append(manager.add_request(p, request_id=f"r{i}", max_new_tokens=new,
                                           record_timestamps=True))
        results = {}
        while len(results) < len(prompts):
            r = manager.get_result(timeout=1.0)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if r.is_finished():
                results[r.request_id] = r
        end = max(r.timestamps[-1] for r in results.values()) - t0_abs
    finally:
        manager.stop(block=True)
    rs = [results[f"r{i}"] for i in range(len(prompts))]
    return dict(tokens=[list(r.generated_tokens) for r in rs], end=end,
                ttft=[r.timestamps[0] - t0_abs - arrivals[i] for i, r in enumerate(rs)])


def _run_one_by_one(model, prompts, arrivals, new) -> dict:
    import torch  # noqa: PLC0415
    from transformers.generation.streamers import BaseStreamer  # noqa: PLC0415

    class First(BaseStreamer):
        def __init__(self):
            self.calls = 0
            self.t = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.t is None:  # the first put is the prompt
                self.t = time.perf_counter()

        def end(self):
            pass

    t0 = time.perf_counter()
    tokens, ttft = [], []
    for i, p in enumerate(prompts):
        _wait_until(t0 + arrivals[i])
        s = First()
        out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, streamer=s)
        tokens.append(out[0, len(p):].tolist())
        ttft.append(s.t - t0 - arrivals[i])
    return dict(tokens=tokens, end=time.perf_counter() - t0, ttft=ttft)


@needs_hf("serve")
def run(settings: Settings, torch, transformers) -> List[dict]:
    GenerationConfig, LlamaConfig = transformers.GenerationConfig, transformers.LlamaConfig
    LlamaForCausalLM = transformers.LlamaForCausalLM
    threads = max(settings.threads)
    if threads > 1 and not os.environ.get("OMP_WAIT_POLICY") and \
            not os.environ.get("GOMP_SPINCOUNT"):
        settings.note("serve: OpenMP threads spin between parallel regions by default; on a "
                      "machine busy with other processes a spinning team waits for its "
                      "descheduled thread at every region.  libgomp throttles the spinning when "
                      "a process has more OpenMP threads than CPUs, which is the case while "
                      "transformers' continuous batching runs its own generation thread and "
                      "not for the batcher or generate() on the main thread.  On a busy machine "
                      "compare with OMP_WAIT_POLICY=passive (measured on 2 busy vCPUs: the "
                      "batcher 2-8x faster with it, transformers' batching unchanged)")
    shape = TINY_SHAPE if settings.tiny else SHAPE
    cfg = LlamaConfig(max_position_embeddings=4096, pad_token_id=0, eos_token_id=None,
                      bos_token_id=None, **shape)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    base = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    base.load_state_dict(ours.state_dict())
    base.set_attn_implementation("sdpa")
    rounds = 1 if settings.tiny else max(1, min(settings.repeats, 2))
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(logging.CRITICAL)  # its CPU notes (no psutil, eos not set) every call
    recs = []
    try:
        with ThreadScope(threads, torch), torch.no_grad():
            for w in _workloads(settings):
                with settings.stage(f"serve: {w['name']}"):
                    recs.append(_run_workload(w, settings, ours, base, shape, rounds, threads,
                                              GenerationConfig))
    finally:
        cb_log.setLevel(level)
    return recs


def _run_workload(w, settings, ours, base, shape, rounds, threads, GenerationConfig) -> dict:
    prompts, arrivals = _requests(w, shape["vocab_size"])
    new = w["new"]
    gen_config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    runners: Dict[str, Callable[[], dict]] = {
        SYSTEMS[0]: lambda: _run_batcher(ours, prompts, arrivals, new),
        SYSTEMS[1]: lambda: _run_generate_batch(base, gen_config, prompts, arrivals, new),
        SYSTEMS[2]: lambda: _run_one_by_one(base, prompts, arrivals, new),
        SYSTEMS[3]: lambda: _run_batcher(ours, prompts, arrivals, new, linear_kernel=False),
    }
    for fn in runners.values():   # warm-up: first calls pay one-off costs
        fn()
    samples: Dict[str, List[dict]] = {name: [] for name in runners}
    for r in range(rounds):
        for name in round_order(list(runners), r, rotate=True):
            time.sleep(settings.gap)
            with _PeakRSS() as mem:
                res = runners[name]()
            res["peak_rss_delta"] = mem.delta
            samples[name].append(res)
    n_tokens = len(prompts) * new
    results = {}
    for name, ss in samples.items():
        ends = [s["end"] for s in ss]
        ttft = np.concatenate([s["ttft"] for s in ss])
        rss = [s["peak_rss_delta"] for s in ss if s["peak_rss_delta"] is not None]
        results[name] = {
            "tokens_per_s": n_tokens / median(ends),
            "wall_s": ends,
            "ttft_median_s": median(ttft),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "peak_rss_delta_bytes": max(rss) if rss else None,
        }
    for name in (SYSTEMS[0], SYSTEMS[3]):
        results[name]["kv_peak_bytes"] = samples[name][0]["kv_peak_bytes"]
        results[name]["preemptions"] = samples[name][0]["preemptions"]
    ref = samples[SYSTEMS[2]][0]["tokens"]
    match = {name: all(s["tokens"] == ref for s in ss) for name, ss in samples.items()}
    ours_t = results[SYSTEMS[0]]["wall_s"]
    return {
        "suite": "serve", "available": True, "workload": w["name"],
        "requests": len(prompts), "prompt_tokens": [len(p) for p in prompts],
        "arrivals_s": arrivals, "new_tokens": new, "threads": threads, "model": dict(shape),
        "block_size": BLOCK_SIZE, "max_batch_tokens": MAX_BATCH_TOKENS, "rounds": rounds,
        "results": results, "tokens_match": match,
        **{key: paired_median(results[name]["wall_s"], ours_t)
           for name, key in RATIO_KEYS.items()},
    }


def report(settings: Settings, recs: List[dict]) -> str:
    if not recs or not recs[0].get("available"):
        return "serving: skipped (pip install 'pagedkv[hf]')"
    r0 = recs[0]
    m = r0["model"]
    head = (f"serving, greedy: random Llama (hidden {m['hidden_size']}, "
            f"{m['num_hidden_layers']} layers, Hq={m['num_attention_heads']} "
            f"Hkv={m['num_key_value_heads']} D={m['head_dim']}, vocabulary {m['vocab_size']}), "
            f"f32, {r0['threads']} thread(s); tokens/s = generated tokens / wall time, median "
            f"of {r0['rounds']} interleaved round(s) after a warm-up; peak memory = peak RSS "
            "above the start of the run")
    out = [head]
    for r in recs:
        lens = r["prompt_tokens"]
        what = (f"{r['workload']}: {r['requests']} requests, prompts {min(lens)}-{max(lens)} "
                f"tokens, {r['new_tokens']} new tokens each, "
                + ("all at once" if not any(r["arrivals_s"]) else
                   f"Poisson arrivals over {r['arrivals_s'][-1]:.1f} s"))
        rows = []
        for name in SYSTEMS:
            x = r["results"][name]
            ratio = "1.00x" if name == SYSTEMS[0] else fmt_ratio(r[RATIO_KEYS[name]])
            rows.append([name, f"{x['tokens_per_s']:.1f}", ratio,
                         f"{x['ttft_median_s']:.2f} / {x['ttft_p90_s']:.2f}",
                         fmt_bytes(x["peak_rss_delta_bytes"]),
                         "yes" if r["tokens_match"][name] else "NO"])
        kv = r["results"][SYSTEMS[0]]
        out.append(section(
            what, ["system", "tokens/s", "batcher faster by", "TTFT median / p90 (s)",
                   "peak memory", "same tokens"], rows, [False, True, True, True, True, False])
            + f"\n  batcher KV blocks at peak: {fmt_bytes(kv['kv_peak_bytes'])}, "
              f"preemptions {kv['preemptions']}")
    return "\n".join(out)
