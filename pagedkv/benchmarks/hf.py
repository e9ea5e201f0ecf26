"""transformers ``generate()``: pagedkv (cache + attention) vs DynamicCache + sdpa.

Opt-in (``pagedkv bench --suites hf``; needs the ``hf`` extra).  Two random Llama-shaped models,
f32 weights:

* "small": hidden 256, 2 layers, 8 query heads, 4 KV heads, head_dim 64, vocabulary 512
  (2 KiB of K+V per token and layer): attention dominates at long context.
* "1b-layers": a Llama-3.2-1B-shaped layer stack, two layers (per-layer ratios): hidden
  2048, 32 query heads, 8 KV heads, head_dim 64, MLP 8192, vocabulary 512.  Contexts 512 and
  4,096 by default, 16,384 with ``--long`` (its prefills take minutes on a small machine).
* "1b-layers-bf16": the same layer stack with bfloat16 weights (no ``model.float()``): pagedkv
  gets the model's 16-bit tensors as they are; DynamicCache + sdpa runs in bfloat16 too.
* "h1024" (only with ``--hf-models h1024``): hidden 1024, 4 layers, 16 query heads, 4 KV
  heads, head_dim 64, MLP 4096; 16,384 too with ``--long``.

pagedkv runs with f32 and with bfloat16 storage (``kv_dtype``), DynamicCache in the model's dtype.
Every (model, context) runs at each of ``--threads``' counts (pagedkv's and torch's threads
alike; the default ``1,all`` doubles the suite's time).  For each context L the first L-1 prompt
tokens are prefilled into a fresh cache of each kind, interleaved (``prefill_rounds`` times,
median: time to first token without the last token's forward); then every round runs
``generate(prompt, max_new_tokens=N)`` greedily on each cache, interleaved (the order
alternates), and crops the N new positions off again.
tokens/s = N / time of that generate call (one forward per token: the last prompt token,
then N-1 generated ones); ratios are medians of per-round DynamicCache / pagedkv times.  The
first round's tokens of each cache are compared with DynamicCache's and reported (f32 storage
must match; bf16 storage rounds K/V, so a near-tie between two tokens of a random model can
flip).
"""
from __future__ import annotations

from typing import List

from pagedkv.benchmarks.common import BLOCK_SIZE, PAGEDKV, Settings, ThreadScope, needs_hf
from pagedkv.benchmarks.report import fmt_ratio, fmt_time, section
from pagedkv.benchmarks.timing import median, paired_median, round_order, timed_call

NEW_TOKENS = 32
MODELS = {
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "1b-layers": dict(vocab_size=512, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64),
    "1b-layers-bf16": dict(vocab_size=512, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64),
    # opt-in (--hf-models): a mid-sized Llama, 4 layers
    "h1024": dict(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64),
}
BF16_WEIGHTS = ("1b-layers-bf16",)  # models run in bfloat16 (the others in float32)
DEFAULT_MODELS = ("small", "1b-layers", "1b-layers-bf16")
CONTEXTS = {"small": (512, 4096, 16384), "1b-layers": (512, 4096), "1b-layers-bf16": (512, 4096),
            "h1024": (512, 4096)}
LONG_CONTEXTS = {"1b-layers": (16384,), "1b-layers-bf16": (16384,), "h1024": (16384,)}
STORAGE = ("float32", "bfloat16")
DYN = "dynamic-sdpa"


def _plan(settings: Settings):
    """[(model name, context)] this run measures."""
    if settings.tiny:
        return [("small", 48), ("small", 96)]
    out = []
    for name in settings.hf_models or DEFAULT_MODELS:
        ctx = CONTEXTS[name] + (LONG_CONTEXTS.get(name, ()) if settings.long else ())
        if settings.quick:
            ctx = tuple(c for c in ctx if c <= 4096)
        out.extend((name, c) for c in ctx)
    return out


def parse_models(text) -> tuple:
    names = tuple(p.strip() for p in str(text).split(",") if p.strip())
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise ValueError(f"unknown hf model {bad[0] if bad else text!r}; choose from "
                         f"{', '.join(MODELS)}")
    return names


def steps(settings: Settings) -> int:
    return len(_plan(settings)) * len(settings.threads)


def _impl(storage: str) -> str:
    return PAGEDKV if storage == "float32" else f"{PAGEDKV}-{storage}"


@needs_hf("hf")
def run(settings: Settings, torch, transformers) -> List[dict]:
    from pagedkv.integrations.hf import paged_cache  # noqa: PLC0415

    DynamicCache, LlamaConfig = transformers.DynamicCache, transformers.LlamaConfig
    new = 4 if settings.tiny else NEW_TOKENS
    plan = _plan(settings)
    max_ctx = max(c for _, c in plan)

    def model(name):
        torch.manual_seed(0)
        cfg = LlamaConfig(max_position_embeddings=max_ctx + NEW_TOKENS, pad_token_id=0,
                          eos_token_id=None, bos_token_id=None, **MODELS[name])
        m = transformers.LlamaForCausalLM(cfg).eval()
        return m.to(torch.bfloat16) if name in BF16_WEIGHTS else m

    recs = []
    pair = {}
    with torch.no_grad():
        for (name, L), threads in ((p, t) for p in plan for t in settings.threads):
            if name not in pair:
                pair.clear()  # one model pair in memory at a time
                ours, base = model(name), model(name)
                base.set_attn_implementation("sdpa")
                pair[name] = (ours, base)
            ours, base = pair[name]
            with settings.stage(f"hf: {name} context {L}, {threads} thread(s)"), \
                    ThreadScope(threads, torch):
                vocab = MODELS[name]["vocab_size"]
                ids = torch.randint(1, vocab, (1, L), generator=torch.Generator().manual_seed(L))
                nblk = -(-(L + new) // BLOCK_SIZE) + 1

                def fresh(impl):
                    if impl == DYN:
                        return base, DynamicCache(config=base.config)
                    # f32 / bf16 storage (a bf16 model's default storage is bf16)
                    kv = "bfloat16" if impl.endswith("bfloat16") else "float32"
                    return ours, paged_cache(ours, num_blocks=nblk, block_size=BLOCK_SIZE,
                                             kv_dtype=kv)

                impls = [_impl(st) for st in STORAGE] + [DYN]
                big = L * MODELS[name]["hidden_size"] >= 4096 * 1024  # a prefill of 10 s or more
                prefill_rounds = 1 if (settings.tiny or L > 4096) else (2 if big else
                                                                        min(3, settings.repeats))
                pre = {i: [] for i in impls}
                caches = {}
                for r in range(prefill_rounds):
                    for impl in round_order(impls, r):
                        m, cache = fresh(impl)
                        caches.pop(impl, None)
                        dt, _ = timed_call(lambda: m(ids[:, :L - 1], past_key_values=cache),
                                           settings.gap)
                        pre[impl].append(dt)
                        caches[impl] = (m, cache)
                times = {i: [] for i in impls}
                seqs = {}
                for r in range(settings.repeats):
                    for impl in round_order(impls, r):
                        m, cache = caches[impl]
                        dt, out = timed_call(lambda: m.generate(
                            ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False), settings.gap)
                        times[impl].append(dt)
                        seqs.setdefault(impl, out)
                        cache.crop(-new)
                rec = {
                    "suite": "hf", "available": True, "model_name": name, "context": L,
                    "new_tokens": new, "threads": threads, "model": dict(MODELS[name]),
                    "block_size": BLOCK_SIZE,
                    "prefill_s": {i: median(pre[i]) for i in impls},
                    "prefill_samples_s": {i: list(pre[i]) for i in impls},
                    "samples_s": {i: list(times[i]) for i in impls},
                    "tokens_per_s": {i: new / median(times[i]) for i in impls},
                    "ratios": {i: paired_median(times[DYN], times[i]) for i in impls if i != DYN},
                    "prefill_ratios": {i: paired_median(pre[DYN], pre[i])
                                       if len(pre[i]) == len(pre[DYN])
                                       else float(pre[DYN][0] / pre[i][0])
                                       for i in impls if i != DYN},
                    "tokens_match": {i: bool(torch.equal(seqs[i], seqs[DYN]))
                                     for i in impls if i != DYN},
                }
                rec["ratio"] = rec["ratios"][PAGEDKV]
                recs.append(rec)
                caches.clear()
    return recs


def report(settings: Settings, recs: List[dict]) -> str:
    if not recs or not recs[0].get("available"):
        return "transformers generate: skipped (pip install 'pagedkv[hf]')"
    r0 = recs[0]
    head = (f"transformers generate, greedy, {r0['new_tokens']} new tokens after a prefilled "
            "context, at each thread count (thr); random Llama-shaped models; "
            "small = hidden 256, 2 layers, Hq=8 Hkv=4 D=64; 1b-layers = 2 layers of "
            "Llama-3.2-1B (hidden 2048, Hq=32 Hkv=8 D=64, MLP 8192; -bf16: bfloat16 weights, "
            "DynamicCache in bfloat16 too); h1024 = hidden 1024, "
            "4 layers, Hq=16 Hkv=4 D=64, MLP 4096.  pagedkv f32 / bf16 "
            "storage vs DynamicCache + sdpa.  Decode ratio = DynamicCache time / pagedkv "
            "time, median of paired rounds; prefill = the L-1 prompt tokens in one forward "
            "(median), ratio > 1: pagedkv faster")
    rows = []
    for r in recs:
        tp = r["tokens_per_s"]
        rows.append([r.get("model_name", "small"), str(r["context"]), str(r["threads"]),
                     f"{tp['pagedkv']:.1f} / {tp['pagedkv-bfloat16']:.1f}", f"{tp[DYN]:.1f}",
                     f"{fmt_ratio(r['ratios']['pagedkv'])} / "
                     f"{fmt_ratio(r['ratios']['pagedkv-bfloat16'])}",
                     f"{fmt_time(r['prefill_s']['pagedkv'])} / "
                     f"{fmt_time(r['prefill_s']['pagedkv-bfloat16'])}",
                     fmt_time(r["prefill_s"][DYN]),
                     f"{fmt_ratio(r['prefill_ratios']['pagedkv'])} / "
                     f"{fmt_ratio(r['prefill_ratios']['pagedkv-bfloat16'])}",
                     " / ".join("yes" if r["tokens_match"][i] else "no"
                                for i in ("pagedkv", "pagedkv-bfloat16"))])
    return section(
        head, ["model", "context", "thr", "pagedkv f32 / bf16 tok/s", "DynamicCache+sdpa tok/s",
               "decode ratio f32 / bf16", "prefill pagedkv f32 / bf16", "prefill sdpa",
               "prefill ratio f32 / bf16", "same tokens f32 / bf16"], rows,
        [False, True, True, True, True, True, True, True, True, False])
