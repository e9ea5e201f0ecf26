"""transformers ``generate()`` tokens/s: pagedkv (cache + attention) vs DynamicCache + sdpa.

Opt-in (``pagedkv bench --suites hf``; needs the ``hf`` extra).  A random Llama-shaped model
where attention matters at long context: hidden 256, 2 layers, 8 query heads, 4 KV heads,
head_dim 64, vocabulary 512, f32 (2 KiB of K+V per token and layer).  For each context L the
first L-1 prompt tokens are prefilled once per cache (timed once, reported), then every
round runs ``generate(prompt, max_new_tokens=N)`` greedily on both caches, interleaved in the
same round (which goes first alternates), and crops the N new positions off again.
tokens/s = N / time of that generate call (one forward per token: the last prompt token,
then N-1 generated ones); the ratio is the median of per-round DynamicCache / pagedkv
times.  The first round's tokens of the two are compared and reported.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np

from pagedkv.benchmarks.common import Settings, ThreadScope, fmt_ratio, fmt_time, table

CONTEXTS = (512, 4096, 16384)
NEW_TOKENS = 32
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
BLOCK_SIZE = 16


def _contexts(settings: Settings):
    return (48, 96) if settings.tiny else CONTEXTS


def steps(settings: Settings) -> int:
    return len(_contexts(settings))


def run(settings: Settings) -> List[dict]:
    try:
        import torch  # noqa: PLC0415 - optional extra
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

        from pagedkv.integrations.hf import paged_cache  # noqa: PLC0415
    except ImportError:
        settings.note("hf suite skipped: transformers and torch are not installed "
                      "(pip install 'pagedkv[hf]')")
        return [{"suite": "hf", "available": False}]
    threads = max(settings.threads)
    new = 4 if settings.tiny else NEW_TOKENS

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(max_position_embeddings=max(CONTEXTS) + NEW_TOKENS, pad_token_id=0,
                          eos_token_id=None, bos_token_id=None, **SHAPE)
        return LlamaForCausalLM(cfg).eval()

    ours, base = model(), model()
    base.set_attn_implementation("sdpa")
    recs = []
    with ThreadScope(threads, torch), torch.no_grad():
        for L in _contexts(settings):
            if settings.progress is not None:
                settings.progress.start(f"hf: context {L}")
            ids = torch.randint(1, SHAPE["vocab_size"], (1, L),
                                generator=torch.Generator().manual_seed(L))
            t0 = time.perf_counter()
            dyn = DynamicCache(config=base.config)
            base(ids[:, :L - 1], past_key_values=dyn)
            t1 = time.perf_counter()
            pc = paged_cache(ours, num_blocks=-(-(L + new) // BLOCK_SIZE) + 1,
                             block_size=BLOCK_SIZE)
            ours(ids[:, :L - 1], past_key_values=pc)
            t2 = time.perf_counter()
            runs = {"pagedkv": (ours, pc), "dynamic-sdpa": (base, dyn)}
            times = {name: [] for name in runs}
            seqs = {}
            for r in range(settings.repeats):
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for name in order:
                    m, cache = runs[name]
                    time.sleep(settings.gap)
                    s = time.perf_counter()
                    out = m.generate(ids, past_key_values=cache, max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False)
                    times[name].append(time.perf_counter() - s)
                    seqs.setdefault(name, out)
                    cache.crop(-new)
            p, d = np.array(times["pagedkv"]), np.array(times["dynamic-sdpa"])
            recs.append({
                "suite": "hf", "available": True, "context": L, "new_tokens": new,
                "threads": threads, "model": dict(SHAPE), "block_size": BLOCK_SIZE,
                "prefill_s": {"pagedkv": t2 - t1, "dynamic-sdpa": t1 - t0},
                "samples_s": {"pagedkv": p.tolist(), "dynamic-sdpa": d.tolist()},
                "tokens_per_s": {"pagedkv": new / float(np.median(p)),
                                 "dynamic-sdpa": new / float(np.median(d))},
                "ratio": float(np.median(d / p)),
                "tokens_match": bool(torch.equal(seqs["pagedkv"], seqs["dynamic-sdpa"])),
            })
            del dyn, pc
            if settings.progress is not None:
                settings.progress.step()
    return recs


def report(settings: Settings, recs: List[dict]) -> str:
    if not recs or not recs[0].get("available"):
        return "transformers generate: skipped (pip install 'pagedkv[hf]')"
    r0 = recs[0]
    head = (f"transformers generate, greedy, {r0['new_tokens']} new tokens after a prefilled "
            f"context; random Llama (hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} "
            f"layers, Hq={SHAPE['num_attention_heads']} Hkv={SHAPE['num_key_value_heads']} "
            f"D={SHAPE['head_dim']}), f32, {r0['threads']} thread(s); ratio = DynamicCache time "
            "/ pagedkv time, median of paired rounds")
    rows = []
    for r in recs:
        rows.append([str(r["context"]), f"{r['tokens_per_s']['pagedkv']:.1f}",
                     f"{r['tokens_per_s']['dynamic-sdpa']:.1f}", fmt_ratio(r["ratio"]),
                     f"{fmt_time(r['prefill_s']['pagedkv'])} / "
                     f"{fmt_time(r['prefill_s']['dynamic-sdpa'])}",
                     "yes" if r["tokens_match"] else "NO"])
    return head + "\n" + table(
        ["context", "pagedkv tok/s", "DynamicCache+sdpa tok/s", "ratio",
         "prefill pagedkv / sdpa", "same tokens"], rows,
        [True, True, True, True, True, False])
