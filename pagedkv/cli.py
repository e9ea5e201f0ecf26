"""Command line: ``pagedkv bench`` (the benchmark suite) and ``pagedkv demo``."""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="pagedkv",
                                description="pagedkv: a paged KV cache for CPU LLM inference")
    sub = p.add_subparsers(dest="command", metavar="{bench,demo}")
    sub.add_parser("bench", add_help=False,
                   help="benchmark against NumPy and torch on this machine "
                        "(pagedkv bench --help)")
    d = sub.add_parser("demo", help="transformers generate() on a small random Llama with "
                                     "pagedkv vs DynamicCache, then a long StreamingLLM run "
                                     "(needs pip install 'pagedkv[hf]')")
    d.add_argument("--new-tokens", type=int, default=48,
                   help="tokens generated per prompt (default 48)")
    d.add_argument("--stream-tokens", type=int, default=4000,
                   help="tokens of the StreamingLLM run (default 4000)")
    d.add_argument("--serve", action="store_true",
                   help="instead: serve many requests at once with ContinuousBatcher "
                        "(shared system prompt, prefix caching, a small pool)")
    d.add_argument("--requests", type=int, default=16,
                   help="requests of the --serve demo (default 16)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    if argv and argv[0] == "bench":
        from pagedkv.benchmarks import run_bench  # noqa: PLC0415 - keep `demo` light

        return run_bench(argv[1:])
    args = p.parse_args(argv)
    if args.command == "demo" and args.serve:
        return demo_serve(args.requests, args.new_tokens, progress=not args.no_progress)
    if args.command == "demo":
        return demo(args.new_tokens, args.stream_tokens, progress=not args.no_progress)
    p.print_help()
    return 2


DEMO_MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32)
DEMO_PROMPTS = (37, 5, 21, 12)   # prompt lengths (random token ids: the model is random too)


def _demo_models(*counts):
    """Two copies of the demo's random Llama (seed 0): the one pagedkv runs and the
    reference; or the exit status after a message on stderr, 2 when one of the ``counts``
    ((option, value) pairs) is below 1, 1 without the hf extra."""
    if any(n < 1 for _, n in counts):
        print(f"pagedkv demo: {' and '.join(name for name, _ in counts)} must be >= 1",
              file=sys.stderr)
        return 2
    try:
        import torch  # noqa: PLC0415 - optional extra
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

        import pagedkv.integrations.hf  # noqa: F401, PLC0415
    except ImportError:
        print("pagedkv demo needs transformers and torch: pip install 'pagedkv[hf]'",
              file=sys.stderr)
        return 1

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(pad_token_id=0, eos_token_id=None, bos_token_id=None,
                          max_position_embeddings=4096, **DEMO_MODEL)
        return LlamaForCausalLM(cfg).eval()

    return model(), model()


def demo(new_tokens: int = 48, stream_tokens: int = 4000, progress: bool = True) -> int:
    """``pagedkv demo``: pagedkv inside transformers' ``generate()`` on a small random Llama
    built from a config (fixed seed, nothing downloaded).  Generates for a left-padded batch
    of prompts with pagedkv and with the default DynamicCache, checks the tokens agree,
    prints tokens/s and the cache statistics, then runs StreamingLLM over a long stream
    whose memory stays flat."""
    models = _demo_models(("--new-tokens", new_tokens), ("--stream-tokens", stream_tokens))
    if isinstance(models, int):
        return models
    ours, ref = models
    import torch  # noqa: PLC0415 - present: _demo_models imported it
    from transformers import DynamicCache  # noqa: PLC0415
    from transformers.generation.streamers import BaseStreamer  # noqa: PLC0415

    import pagedkv
    from pagedkv.benchmarks.common import Progress
    from pagedkv.integrations.hf import paged_cache  # noqa: PLC0415

    print(f"pagedkv {pagedkv.__version__} demo: random Llama {DEMO_MODEL['num_hidden_layers']} "
          f"layers, hidden {DEMO_MODEL['hidden_size']}, Hq={DEMO_MODEL['num_attention_heads']} "
          f"Hkv={DEMO_MODEL['num_key_value_heads']} D={DEMO_MODEL['head_dim']} (seed 0, "
          f"nothing downloaded); SIMD {pagedkv.simd_backend()}, torch {torch.__version__}")
    g = torch.Generator().manual_seed(1)
    width = max(DEMO_PROMPTS)
    ids = torch.zeros((len(DEMO_PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(DEMO_PROMPTS):  # left padding
        ids[row, width - n:] = torch.randint(1, DEMO_MODEL["vocab_size"], (n,), generator=g)
        mask[row, width - n:] = 1
    blocks = len(DEMO_PROMPTS) * (-(-(width + new_tokens) // 16))
    cache = paged_cache(ours, num_blocks=blocks, block_size=16)
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False)
    with torch.no_grad():
        for m, c in ((ref, None), (ours, cache)):  # warm-up: first calls pay one-off costs
            m.generate(ids, past_key_values=c, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        cache.reset()
        t0 = time.perf_counter()
        want = ref.generate(ids, past_key_values=DynamicCache(config=ref.config), **kw)
        t1 = time.perf_counter()
        got = ours.generate(ids, past_key_values=cache, **kw)
        t2 = time.perf_counter()
    same = bool(torch.equal(want, got))
    n = len(DEMO_PROMPTS) * new_tokens
    print(f"  {len(DEMO_PROMPTS)} prompts of {', '.join(map(str, DEMO_PROMPTS))} tokens "
          f"(left-padded batch), {new_tokens} new tokens each, greedy:")
    print(f"    pagedkv        {n / (t2 - t1):8.1f} tokens/s")
    print(f"    DynamicCache   {n / (t1 - t0):8.1f} tokens/s   (sdpa attention)")
    print(f"    identical tokens: {'yes' if same else 'NO'}")
    for row in range(2):
        print(f"    prompt {row}: ... {got[row, width - 4:width].tolist()} -> "
              f"{got[row, width:width + 8].tolist()} ...")
    print("  cache after generate (padding is never stored):")
    print("    " + str(pagedkv.format_stats(cache.paged.stats())).replace("\n", "\n    "))

    S, R = 4, 252
    stream = paged_cache(ours, num_blocks=64, block_size=16,
                         streaming=pagedkv.StreamingLLM(sink_tokens=S, window_tokens=R))
    bar = Progress(20, enabled=progress)
    bar.start("StreamingLLM")
    used: List[int] = []

    class Watch(BaseStreamer):
        """Called by generate() after every step: records the blocks in use."""

        def put(self, value):
            used.append(stream.paged.num_blocks - stream.paged.num_free_blocks)
            if len(used) % max(stream_tokens // 20, 1) == 0:
                bar.step(f"StreamingLLM {len(used)}/{stream_tokens + 1} steps, "
                         f"{used[-1]} blocks held")

        def end(self):
            pass

    with torch.no_grad():
        t0 = time.perf_counter()
        out = ours.generate(ids[:1, width - DEMO_PROMPTS[0]:], past_key_values=stream,
                            max_new_tokens=stream_tokens, min_new_tokens=stream_tokens,
                            do_sample=True, top_k=0, streamer=Watch())
        dt = time.perf_counter() - t0
    bar.close()
    st = stream.paged.stats()
    sid = stream.sequence_ids[0]
    kept = stream.paged.kept_positions(sid)
    bound = -(-S // 16) + -(-(R + 1) // 16) + 1
    full = used[max(S + R + 1 - DEMO_PROMPTS[0], 0):] or used
    print(f"  StreamingLLM (sinks {S}, window {R}, RoPE by rank in the cache): "
          f"{out.shape[1]} tokens, {stream_tokens / dt:.1f} tokens/s sampled")
    print(f"    blocks held once the window is full: {min(full)}..{max(full)} over "
          f"{len(full)} steps (bound {bound}); peak {st.peak_blocks_used} of "
          f"{st.blocks_total} ({st.bytes_per_block * st.peak_blocks_used / 2**20:.2f} MiB)")
    print(f"    tokens held {stream.paged.seq_len(sid)}: positions {kept[:S].tolist()} + "
          f"{kept[S]}..{kept[-1]}; evicted {st.evicted_tokens} tokens, "
          f"{st.evicted_blocks} blocks returned to the pool")
    return 0 if same else 1


def demo_serve(requests: int = 16, new_tokens: int = 48, progress: bool = True) -> int:
    """``pagedkv demo --serve``: ``ContinuousBatcher`` on the demo model.  Requests share a
    64-token system prompt and carry their own 5-300 tokens; they arrive in two waves (the
    second while the first is decoding), in a pool too small for all of them at once, with
    prefix caching.  Shows progress, tokens/s against ``generate()`` one prompt at a time,
    and checks every request's greedy tokens against it."""
    models = _demo_models(("--requests", requests), ("--new-tokens", new_tokens))
    if isinstance(models, int):
        return models
    ours, ref = models
    import torch  # noqa: PLC0415 - present: _demo_models imported it

    import pagedkv
    from pagedkv.benchmarks.common import Progress
    from pagedkv.integrations.hf import ContinuousBatcher  # noqa: PLC0415

    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, DEMO_MODEL["vocab_size"], (64,), generator=g).tolist()
    prompts = [system + torch.randint(1, DEMO_MODEL["vocab_size"],
                                      (int(torch.randint(5, 301, (1,), generator=g)),),
                                      generator=g).tolist() for _ in range(requests)]
    bs = 16
    per_request = [-(-(len(p) + new_tokens) // bs) for p in prompts]
    blocks = max(max(per_request), sum(per_request) // 3)   # about a third of them at once
    b = ContinuousBatcher(ours, num_blocks=blocks, block_size=bs, prefix_caching=True,
                          max_batch_tokens=256)
    print(f"pagedkv {pagedkv.__version__} demo --serve: random Llama "
          f"{DEMO_MODEL['num_hidden_layers']} layers, hidden {DEMO_MODEL['hidden_size']} "
          f"(seed 0, nothing downloaded); SIMD {pagedkv.simd_backend()}")
    print(f"  {requests} requests: a shared 64-token system prompt + 5-300 tokens each, "
          f"{new_tokens} new tokens, greedy; pool {blocks} blocks of {bs} "
          f"({b.stats().kv_cache_bytes / 2**20:.2f} MiB), max_batch_tokens 256, prefix caching")
    bar = Progress(requests, enabled=progress)
    bar.start("serving")
    first_wave = (requests + 1) // 2
    rids = [b.add_request(p, new_tokens) for p in prompts[:first_wave]]
    t0 = time.perf_counter()
    with torch.no_grad():
        while b.has_unfinished() or len(rids) < requests:
            if len(rids) < requests and b.stats().generated_tokens >= new_tokens:
                rids += [b.add_request(p, new_tokens) for p in prompts[first_wave:]]
            for ev in b.step():
                if ev.finished:
                    st = b.stats()
                    bar.step(f"running {st.running}, waiting {st.waiting}, "
                             f"{st.generated_tokens} tokens, {st.preemptions} preemptions")
        dt = time.perf_counter() - t0
        bar.close()
        got = b.run()
        t1 = time.perf_counter()
        want = [ref.generate(torch.tensor([p]), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
        t2 = time.perf_counter()
    same = all(got[r] == w for r, w in zip(rids, want))
    st = b.stats()
    cs = b.cache.stats()
    n = requests * new_tokens
    print(f"    ContinuousBatcher     {n / dt:8.1f} tokens/s   ({st.steps} steps)")
    print(f"    generate() one by one {n / (t2 - t1):8.1f} tokens/s")
    print(f"    identical tokens: {'yes' if same else 'NO'}")
    print(f"  {st.preemptions} preemptions (recomputed, from the prefix cache where it had the "
          f"blocks); {st.prefix_hit_tokens} tokens reused from the prefix cache, "
          f"{st.computed_tokens} computed (prompts {sum(map(len, prompts))} + generated {n})")
    print(f"  peak {cs.peak_blocks_used} of {cs.blocks_total} blocks in use; all returned at the "
          f"end: {'yes' if b.cache.num_free_blocks == b.cache.num_blocks else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
