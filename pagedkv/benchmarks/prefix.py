"""Prefix caching, beam-search memory and save/load throughput.

* **Time to first token** with a shared 2,000-token prompt: a stand-in model
  (embedding, per layer a K/V/Q projection and causal attention over the
  cache) prefills the prompt into a ``prefix_caching=True`` cache.  "cold":
  the prompt's blocks are not cached (each round uses another
  ``cache_salt``); "hit": the same prompt again, so ``add_sequence`` starts
  with 1,984 tokens present and only the last 16 are projected and attended.
  TTFT is add_sequence to the last layer's attention output of the last
  prompt token.
* **Beam search memory**: width 4 over a 512-token prompt for 256 steps with
  random survivors each step; blocks in use with ``fork`` (shared prompt,
  copy-on-write) against what four private copies of every beam would hold.
* **save / load** of one sequence (all layers) to a temporary directory:
  bytes of the file per second.  Saving includes the fsync that makes the
  rename atomic (so it depends on the disk); loading reads a file the page
  cache holds, and is bounded by the CRC-32 check (zlib, ~0.8 GB/s measured
  on the development machine) and one copy into the pool.
"""
from __future__ import annotations

import os
import tempfile
from typing import List

import numpy as np

from pagedkv.benchmarks.common import BLOCK_SIZE as BS
from pagedkv.benchmarks.common import Settings
from pagedkv.benchmarks.report import fmt_bytes, fmt_ratio, fmt_time, table
from pagedkv.benchmarks.timing import median, timed_call

HKV, HQ, D = 8, 32, 128


def steps(settings: Settings) -> int:
    return 3


class _StandIn:
    """Random projections of a small transformer-shaped model (no MLP)."""

    def __init__(self, layers: int, hidden: int, vocab: int, rng):
        self.layers = layers
        s = 1.0 / np.sqrt(hidden)
        self.emb = rng.standard_normal((vocab, hidden), dtype=np.float32)
        self.wq = [rng.standard_normal((hidden, HQ * D), dtype=np.float32) * s
                   for _ in range(layers)]
        self.wkv = [rng.standard_normal((hidden, 2 * HKV * D), dtype=np.float32) * s
                    for _ in range(layers)]

    def prefill(self, cache, sid, tokens):
        """Project and attend the tokens the cache does not hold yet; returns the
        last token's attention output of the last layer."""
        start = cache.seq_len(sid)
        x = self.emb[np.asarray(tokens[start:])]
        out = None
        for layer in range(self.layers):
            kv = x @ self.wkv[layer]
            k = kv[:, :HKV * D].reshape(-1, HKV, D)
            v = kv[:, HKV * D:].reshape(-1, HKV, D)
            cache.append(sid, k, v, layer=layer, token_ids=tokens[start:] if layer == 0 else None)
            q = (x @ self.wq[layer]).reshape(-1, HQ, D)
            out = cache.attend(sid, q, layer=layer)
        return out[-1]


def _ttft(settings: Settings) -> dict:
    import pagedkv

    prompt_len = 2000
    layers = 2 if (settings.quick or settings.tiny) else 4
    if settings.tiny:
        prompt_len = 200
    rng = np.random.default_rng(0)
    model = _StandIn(layers, 512, 4096, rng)
    prompt = rng.integers(0, 4096, prompt_len).tolist()
    cache = pagedkv.PagedKVCache(num_blocks=8 * (prompt_len // BS + 2), block_size=BS,
                                 num_kv_heads=HKV, head_dim=D, num_layers=layers,
                                 prefix_caching=True)
    warm = cache.add_sequence(token_ids=prompt)
    model.prefill(cache, warm, prompt)  # registers the prompt (salt None)
    cold, hit = [], []

    def first_token(salt):
        """A new sequence of the prompt, prefilled: (it, its cached tokens, the last output)."""
        s = cache.add_sequence(token_ids=prompt, cache_salt=salt)
        return s, cache.seq_len(s), model.prefill(cache, s, prompt)

    for r in range(settings.repeats):
        dt, (s, _, last_cold) = timed_call(lambda: first_token(("cold", r)))
        cold.append(dt)
        cache.free(s)
        dt, (s, reused, last_hit) = timed_call(lambda: first_token(None))
        hit.append(dt)
        cache.free(s)
    err = float(np.max(np.abs(last_hit - last_cold)) / max(np.max(np.abs(last_cold)), 1e-30))
    st = cache.stats()
    return {"suite": "prefix", "case": "ttft", "prompt_tokens": prompt_len, "layers": layers,
            "reused_tokens": reused, "cold_s": median(cold),
            "hit_s": median(hit), "speedup": median(cold) / median(hit),
            "cold_samples_s": cold, "hit_samples_s": hit, "max_rel_diff": err,
            "hit_rate": st.prefix_hit_rate}


def _beam_memory(settings: Settings) -> dict:
    import pagedkv

    width, prompt_len, steps_ = 4, 512, (64 if settings.tiny else 256)
    total = prompt_len + steps_
    nb = width * (total // BS + 2)
    cache = pagedkv.PagedKVCache(num_blocks=nb, block_size=BS, num_kv_heads=HKV, head_dim=D)
    rng = np.random.default_rng(1)
    root = cache.add_sequence()
    k = rng.standard_normal((prompt_len, HKV, D), dtype=np.float32)
    cache.append(root, k, k)
    beams = [root] + [cache.fork(root) for _ in range(width - 1)]
    peak_shared = cache.stats().blocks_used
    tok = rng.standard_normal((width, HKV, D), dtype=np.float32)
    for _ in range(steps_):
        survivors = rng.integers(0, width, width)
        new = [cache.fork(beams[i]) for i in survivors]
        for s in beams:
            cache.free(s)
        beams = new
        cache.append_batch(beams, tok, tok)
        peak_shared = max(peak_shared, cache.stats().blocks_used)
    private = width * -(-total // BS)  # four private copies of the final beams
    st = cache.stats()
    return {"suite": "prefix", "case": "beam", "width": width, "prompt_tokens": prompt_len,
            "steps": steps_, "blocks_shared_end": st.blocks_used, "blocks_shared_peak": peak_shared,
            "blocks_private": private, "bytes_per_block": st.bytes_per_block,
            "saved": 1.0 - st.blocks_used / private, "cow_copies": st.cow_copies}


def _save_load(settings: Settings) -> dict:
    import pagedkv

    tokens = 512 if settings.tiny else (2048 if settings.quick else 8192)
    layers = 2
    cache = pagedkv.PagedKVCache(num_blocks=2 * (tokens // BS + 1), block_size=BS,
                                 num_kv_heads=HKV, head_dim=D, num_layers=layers)
    rng = np.random.default_rng(2)
    sid = cache.add_sequence()
    for layer in range(layers):
        k = rng.standard_normal((tokens, HKV, D), dtype=np.float32)
        cache.append(sid, k, k, layer=layer)
    save_s, load_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seq.pkv")
        nbytes = 0
        for _ in range(settings.repeats):
            dt, nbytes = timed_call(lambda: cache.save(sid, path))
            save_s.append(dt)
            dt, new = timed_call(lambda: cache.load(path))
            load_s.append(dt)
            same = np.array_equal(cache.gather(new, 1)[0], cache.gather(sid, 1)[0])
            cache.free(new)
            if not same:
                raise RuntimeError("save/load did not round-trip")
    return {"suite": "prefix", "case": "save_load", "tokens": tokens, "layers": layers,
            "file_bytes": nbytes, "save_s": median(save_s), "load_s": median(load_s),
            "save_gbps": nbytes / median(save_s) / 1e9,
            "load_gbps": nbytes / median(load_s) / 1e9}


def run(settings: Settings) -> List[dict]:
    recs = []
    for label, fn in (("prefix: time to first token", _ttft), ("prefix: beam memory", _beam_memory),
                      ("prefix: save/load", _save_load)):
        with settings.stage(label):
            recs.append(fn(settings))
    return recs


def report(settings: Settings, recs: List[dict]) -> str:
    by = {r["case"]: r for r in recs}
    t, b, s = by["ttft"], by["beam"], by["save_load"]
    lines = [
        f"Prefix caching: time to first token, {t['prompt_tokens']}-token shared prompt, "
        f"stand-in model of {t['layers']} layers (Hq={HQ} Hkv={HKV} D={D}, block {BS}), f32",
        table(["prompt", "reused tokens", "TTFT", "speedup"], [
            ["cold (not cached)", "0", fmt_time(t["cold_s"]), ""],
            ["hit (cached prefix)", str(t["reused_tokens"]), fmt_time(t["hit_s"]),
             fmt_ratio(t["speedup"])],
        ], right=[False, True, True, True]),
        f"  last-token output, hit vs cold: max relative difference {t['max_rel_diff']:.1e}",
        "",
        f"Beam search width {b['width']}, {b['prompt_tokens']}-token prompt, {b['steps']} steps, "
        "random survivors (fork + copy-on-write vs private copies)",
        table(["", "blocks", "memory"], [
            ["shared, at the end", str(b["blocks_shared_end"]),
             fmt_bytes(b["blocks_shared_end"] * b["bytes_per_block"])],
            ["shared, peak", str(b["blocks_shared_peak"]),
             fmt_bytes(b["blocks_shared_peak"] * b["bytes_per_block"])],
            ["private copies", str(b["blocks_private"]),
             fmt_bytes(b["blocks_private"] * b["bytes_per_block"])],
        ], right=[False, True, True]),
        f"  memory saved by sharing: {b['saved']:.1%} ({b['cow_copies']} copy-on-write copies)",
        "",
        f"save / load of one sequence: {s['tokens']} tokens x {s['layers']} layers, "
        f"file {fmt_bytes(s['file_bytes'])}",
        f"  save {fmt_time(s['save_s'])} = {s['save_gbps']:.2f} GB/s, "
        f"load {fmt_time(s['load_s'])} = {s['load_gbps']:.2f} GB/s",
    ]
    return "\n".join(lines)
