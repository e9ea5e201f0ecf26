"""ContinuousBatcher (pagedkv.integrations.hf) against each prompt's own ``generate()``.

A tiny random Llama (2 layers, 4 query heads, 2 KV heads, head_dim 16, vocabulary 96); the
reference is a second module with the same weights that keeps transformers' sdpa attention
and DynamicCache, generating one prompt at a time.  Greedy tokens must be identical.  Small
``max_batch_tokens`` values force prompts to be prefilled in chunks next to decoding requests;
small pools force preemption.  (Sliding-window and hybrid models: test_batching_sliding.py.)
"""

import numpy as np
import pytest

from tiny_llama import VOCAB, llama_config, prompt_lists, twin_llamas  # first: it skips the module without the hf extra
from tiny_llama import one_thread  # noqa: F401,E402  (an autouse fixture: one thread here)

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from pagedkv.integrations.hf import ContinuousBatcher, paged_cache  # noqa: E402

BS = 8  # block size of most tests: prompts cross several blocks


@pytest.fixture(scope="module")
def models():
    """(model for the batcher, reference model): the same random weights, two modules."""
    return twin_llamas(4321)


_REF = {}


def _reference(ref, prompt, n, eos=None):
    """The prompt's own greedy generate(): the generated ids (eos included, when it came)."""
    key = (tuple(prompt), n, eos)
    if key not in _REF:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
        _REF[key] = out[0, len(prompt):].tolist()
    return _REF[key]


def _all_blocks_back(b):
    assert b.cache.num_free_blocks == b.cache.num_blocks
    assert b.cache.sequence_ids() == []


@pytest.mark.parametrize("max_batch_tokens", [7, 64])
def test_mixed_lengths_exact_greedy(models, max_batch_tokens):
    ours, ref = models
    prompts = prompt_lists(1, [1, 5, 8, 9, 23, 40, 3, 17])
    b = ContinuousBatcher(ours, num_blocks=128, block_size=BS, max_batch_tokens=max_batch_tokens)
    news = [6, 9, 1, 12, 7, 10, 4, 8]
    rids = [b.add_request(p, n) for p, n in zip(prompts, news)]
    out = b.run()
    for rid, p, n in zip(rids, prompts, news):
        assert out[rid] == _reference(ref, p, n)
    st = b.stats()
    assert st.finished == len(prompts) and st.running == st.waiting == 0
    assert st.generated_tokens == sum(news)
    # every prompt token once, every generated token but the last once, no more per step
    # than max_batch_tokens
    assert st.computed_tokens == sum(map(len, prompts)) + sum(news) - len(news)
    assert st.steps >= -(-st.computed_tokens // max_batch_tokens)
    _all_blocks_back(b)


def test_events_and_requests_added_mid_run(models):
    ours, ref = models
    first = prompt_lists(2, [12, 30, 4])
    later = prompt_lists(3, [19, 2, 25])
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=16)
    want = {}
    for p in first:
        want[b.add_request(p, 10)] = _reference(ref, p, 10)
    got = {rid: [] for rid in want}
    finished = set()
    steps = 0
    while b.has_unfinished():
        if steps == 3 or steps == 7:
            for p in later[:2] if steps == 3 else later[2:]:
                rid = b.add_request(p, 8)
                want[rid] = _reference(ref, p, 8)
                got[rid] = []
        for ev in b.step():
            assert ev.request_id not in finished
            assert len(ev.new_tokens) == 1
            got[ev.request_id] += ev.new_tokens
            if ev.finished:
                finished.add(ev.request_id)
        steps += 1
    assert got == want
    assert finished == set(want)
    assert b.step() == []
    rid0 = next(iter(want))
    assert b.abort(rid0) is False              # finished, not yet collected
    assert b.output(rid0) == want[rid0]
    assert b.run() == want                     # run() collects what the steps finished
    assert b.run() == {}
    _all_blocks_back(b)


def test_eos_ends_a_request(models):
    ours, ref = models
    prompts = prompt_lists(4, [6, 14, 9])
    full = [_reference(ref, p, 12) for p in prompts]
    eos = full[1][4]          # the 5th token of prompt 1 (maybe earlier, and in others too)
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=20)
    rids = [b.add_request(p, 12, eos_token_id=eos) for p in prompts]
    out = b.run()
    for rid, p, f in zip(rids, prompts, full):
        want = _reference(ref, p, 12, eos=eos)
        assert out[rid] == want
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert want == f[:cut]
    assert len(out[rids[1]]) <= 5 and out[rids[1]][-1] == eos
    _all_blocks_back(b)


def test_memory_pressure_preempts_and_recomputes(models):
    ours, ref = models
    prompts = prompt_lists(5, [20, 18, 25, 11, 16, 22])
    # each request alone needs up to ceil((25 + 24 - 1) / 8) = 6 blocks; 12 blocks hold two
    b = ContinuousBatcher(ours, num_blocks=12, block_size=BS, max_batch_tokens=64)
    rids = [b.add_request(p, 24) for p in prompts]
    peak = 0
    while b.has_unfinished():
        b.step()
        peak = max(peak, b.cache.num_blocks - b.cache.num_free_blocks)
    out = b.run()                  # collects what the steps above finished
    st = b.stats()
    assert st.preemptions > 0
    assert peak <= 12
    for rid, p in zip(rids, prompts):
        assert out[rid] == _reference(ref, p, 24)
    _all_blocks_back(b)


def test_preemption_with_prefix_caching_recomputes_from_hits(models):
    ours, ref = models
    prompts = prompt_lists(6, [20, 18, 25, 11])
    b = ContinuousBatcher(ours, num_blocks=10, block_size=BS, max_batch_tokens=64,
                          prefix_caching=True)
    rids = [b.add_request(p, 30) for p in prompts]
    out = b.run()
    assert b.stats().preemptions > 0
    for rid, p in zip(rids, prompts):
        assert out[rid] == _reference(ref, p, 30)
    _all_blocks_back(b)


def test_prefix_hits(models):
    ours, ref = models
    shared = prompt_lists(7, [33])[0]
    tails = prompt_lists(8, [5, 1, 12])
    prompts = [shared + t for t in tails]
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, prefix_caching=True)
    first = b.add_request(prompts[0], 6)
    b.step()                       # the first prompt is computed (and its blocks registered)
    rids = [first] + [b.add_request(p, 6) for p in prompts[1:]]
    out = b.run()
    for rid, p in zip(rids, prompts):
        assert out[rid] == _reference(ref, p, 6)
    st = b.stats()
    # 33 shared tokens = 4 full blocks of 8, reused by each of the two later prompts
    assert st.prefix_hit_tokens == 2 * 4 * BS
    assert st.computed_tokens == sum(map(len, prompts)) - 2 * 4 * BS + 3 * 5
    _all_blocks_back(b)


def test_abort_returns_every_block(models):
    ours, ref = models
    prompts = prompt_lists(9, [30, 12, 7, 19])
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=24, max_seqs=2)
    rids = [b.add_request(p, 10) for p in prompts]
    for _ in range(3):
        b.step()
    assert b.stats().running == 2 and b.stats().waiting == 2
    assert b.abort(rids[0]) is True            # running, mid-prefill or decoding
    assert b.abort(rids[3]) is True            # waiting
    assert b.abort(rids[3]) is False
    with pytest.raises(KeyError):
        b.abort(12345)
    out = b.run()
    assert set(out) == {rids[1], rids[2]}
    for rid in (rids[1], rids[2]):
        assert out[rid] == _reference(ref, prompts[rid], 10)
    with pytest.raises(KeyError):              # finished and collected by run(): forgotten
        b.abort(rids[1])
    with pytest.raises(KeyError):              # aborted, then forgotten by run() too (a
        b.output(rids[0])                      # long-lived batcher keeps no ended request)
    assert b.run() == {}                       # nothing new finished
    st = b.stats()
    assert st.aborted == 2 and st.finished == 2
    _all_blocks_back(b)
    # aborting everything mid-flight also returns every block
    b2 = ContinuousBatcher(ours, num_blocks=64, block_size=BS, prefix_caching=True)
    ids = [b2.add_request(p, 10) for p in prompts]
    b2.step()
    b2.step()
    assert b2.cache.num_free_blocks < b2.cache.num_blocks
    for rid in ids:
        b2.abort(rid)
    assert not b2.has_unfinished()
    _all_blocks_back(b2)


def test_bad_requests_raise_and_disturb_nothing(models):
    ours, ref = models
    prompts = prompt_lists(10, [15, 9])
    b = ContinuousBatcher(ours, num_blocks=16, block_size=BS, max_batch_tokens=16)
    rids = [b.add_request(p, 8) for p in prompts]
    b.step()
    b.step()
    before = (b.stats().running, b.stats().waiting, b.cache.num_free_blocks)
    bad = [
        dict(input_ids=[], max_new_tokens=4),                       # empty prompt
        dict(input_ids=torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4),
        dict(input_ids=[1, 2], max_new_tokens=0),                   # nothing to generate
        dict(input_ids=[1, 2], max_new_tokens=-3),
        dict(input_ids=[1, VOCAB], max_new_tokens=4),               # outside the vocabulary
        dict(input_ids=[-1, 2], max_new_tokens=4),
        dict(input_ids=[1.5, 2], max_new_tokens=4),                 # not token ids
        dict(input_ids=np.array([1.0, 2.0]), max_new_tokens=4),
        dict(input_ids=torch.ones((2, 3), dtype=torch.long), max_new_tokens=4),  # a batch
        dict(input_ids=[1] * 100, max_new_tokens=40),               # never fits 16 blocks of 8
        dict(input_ids=[1, 2], max_new_tokens=4, eos_token_id=VOCAB + 5),
        dict(input_ids=[1, 2], max_new_tokens=4, do_sample=True, temperature=0.0),
        dict(input_ids=[1, 2], max_new_tokens=4, do_sample=True, top_p=0.0),
        dict(input_ids=[1, 2], max_new_tokens=4, do_sample=True, top_k=-1),
        dict(input_ids=[1, 2], max_new_tokens=4, do_sample=True, seed=1.5),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            b.add_request(**kw)
    assert (b.stats().running, b.stats().waiting, b.cache.num_free_blocks) == before
    # the largest request that fits is accepted: ceil((100 + 29 - 1) / 8) = 16 blocks
    big = b.add_request([1] * 100, 29)
    out = b.run()
    for rid, p in zip(rids, prompts):
        assert out[rid] == _reference(ref, p, 8)
    assert len(out[big]) == 29
    _all_blocks_back(b)


def test_kv_dtype_bf16_matches_paged_generate(models):
    """bf16 storage: the tokens of generate() with a bf16 paged_cache, prompt by prompt."""
    ours, _ = models
    prompts = prompt_lists(11, [13, 27, 4])
    want = []
    with torch.no_grad():
        for p in prompts:
            pc = paged_cache(ours, num_blocks=16, block_size=BS, kv_dtype="bfloat16")
            o = ours.generate(torch.tensor([p]), past_key_values=pc, max_new_tokens=10,
                              do_sample=False)
            want.append(o[0, len(p):].tolist())
    b = ContinuousBatcher(ours, num_blocks=32, block_size=BS, kv_dtype="bfloat16",
                          max_batch_tokens=16)
    assert b.cache.kv_dtype == "bfloat16"
    rids = [b.add_request(p, 10) for p in prompts]
    out = b.run()
    assert [out[r] for r in rids] == want


def test_sampling_per_request_seed(models):
    ours, ref = models
    prompts = prompt_lists(12, [10, 21, 6])
    kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)

    def run(items, max_batch_tokens=64):
        b = ContinuousBatcher(ours, num_blocks=64, block_size=BS,
                              max_batch_tokens=max_batch_tokens)
        rids = [b.add_request(p, 12, seed=s, **kw) for p, s in items]
        out = b.run()
        return [out[r] for r in rids]

    alone = run([(prompts[0], 7)])[0]
    together = run([(prompts[1], 1), (prompts[0], 7), (prompts[2], 2)], max_batch_tokens=9)
    assert together[1] == alone                      # the seed decides, not the batch
    assert run([(prompts[0], 8)])[0] != alone        # another seed, other tokens
    assert all(0 <= t < VOCAB for t in together[0] + together[2])
    # top_k=1 samples the argmax: greedy
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS)
    rid = b.add_request(prompts[1], 12, do_sample=True, top_k=1, seed=3)
    assert b.run()[rid] == _reference(ref, prompts[1], 12)


def test_sizing_by_bytes(models):
    ours, _ = models
    # 2 layers x (K + V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token
    b = ContinuousBatcher(ours, kv_cache_bytes=100_000, block_size=BS)
    per_block = b.cache.bytes_per_block
    assert per_block == 512 * BS
    assert b.cache.num_blocks == 100_000 // per_block == b.stats().num_blocks
    assert b.stats().kv_cache_bytes == b.cache.num_blocks * per_block
    b16 = ContinuousBatcher(ours, kv_cache_bytes=100_000, block_size=BS, kv_dtype="bfloat16")
    assert b16.cache.num_blocks == 100_000 // (per_block // 2)
    pc = paged_cache(ours, kv_cache_bytes=1 << 20, block_size=16)
    assert pc.paged.num_blocks == (1 << 20) // pc.paged.bytes_per_block
    with pytest.raises(TypeError):
        ContinuousBatcher(ours, num_blocks=8, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError):
        ContinuousBatcher(ours, kv_cache_bytes=100)     # not even one block
    with pytest.raises(TypeError):
        paged_cache(ours)
    default = ContinuousBatcher(ours, max_seqs=4, block_size=16)
    assert default.cache.num_blocks == 4 * 2048 // 16


def _paged_generate(model, prompts, n):
    """Each prompt's own greedy generate() on a paged_cache of `model`: its n new tokens."""
    want = []
    with torch.no_grad():
        for p in prompts:
            pc = paged_cache(model, num_blocks=16, block_size=BS)
            o = model.generate(torch.tensor([p]), past_key_values=pc, max_new_tokens=n,
                               do_sample=False)
            want.append(o[0, len(p):].tolist())
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16bit_model_matches_paged_generate(dtype):
    """A bfloat16 / float16 model (no model.float()): the tokens of generate() on a
    paged_cache of the same model, prompt by prompt (the same kernels and roundings)."""
    torch.manual_seed(99)
    model = LlamaForCausalLM(llama_config()).eval().to(dtype)
    prompts = prompt_lists(13, [11, 26, 3])
    want = _paged_generate(model, prompts, 8)
    b = ContinuousBatcher(model, num_blocks=32, block_size=BS, max_batch_tokens=12)
    rids = [b.add_request(p, 8) for p in prompts]
    out = b.run()
    assert [out[r] for r in rids] == want
    _all_blocks_back(b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16bit_model_with_prefix_caching(dtype):
    """Prefix caching with a bfloat16 / float16 model: prompts sharing a system prompt reuse its
    full blocks (16-bit K/V kept as they are) and generate the tokens of each prompt's own
    generate() on a paged_cache of the same model."""
    torch.manual_seed(98)
    model = LlamaForCausalLM(llama_config()).eval().to(dtype)
    shared = prompt_lists(15, [33])[0]
    prompts = [shared + t for t in prompt_lists(16, [5, 1, 12])]
    want = _paged_generate(model, prompts, 6)
    b = ContinuousBatcher(model, num_blocks=64, block_size=BS, prefix_caching=True)
    assert b.cache.dtype_name == str(dtype).split(".")[1]
    first = b.add_request(prompts[0], 6)
    b.step()                       # the first prompt is computed (and its blocks registered)
    rids = [first] + [b.add_request(p, 6) for p in prompts[1:]]
    out = b.run()
    assert [out[r] for r in rids] == want
    assert b.stats().prefix_hit_tokens == 2 * 4 * BS  # 33 shared tokens: 4 full blocks, twice
    _all_blocks_back(b)


def test_a_failing_forward_leaves_nothing_behind(models):
    """A forward that raises half-way (after layer 0 stored its K/V) requeues the step's
    requests and frees their blocks; the batcher then finishes with exact tokens."""
    ours, ref = models
    prompts = prompt_lists(14, [12, 30])
    b = ContinuousBatcher(ours, num_blocks=32, block_size=BS, max_batch_tokens=16)
    rids = [b.add_request(p, 6) for p in prompts]
    b.step()
    b.step()

    def boom(module, args):
        raise KeyboardInterrupt("interrupted mid-step")

    hook = ours.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(KeyboardInterrupt):
            b.step()
    finally:
        hook.remove()
    st = b.stats()
    assert st.running == 0 and st.waiting == 2
    _all_blocks_back(b)
    out = b.run()
    for rid, p in zip(rids, prompts):
        assert out[rid] == _reference(ref, p, 6)


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma", "gpt2", "gpt_neox", "qwen3_moe",
                                    "granite", "granitemoe", "cohere", "olmo", "olmoe",
                                    "qwen2_moe", "phi", "phimoe", "starcoder2", "gpt_bigcode",
                                    "glm", "glm4", "glm4_moe", "ernie4_5", "hunyuan_v1_dense",
                                    "helium", "seed_oss", "arcee", "apertus", "bitnet", "opt",
                                    "persimmon"])
def test_full_attention_families_exact_greedy(family):
    """Other full-attention families (the models of test_hf_families): the batcher's tokens
    equal each prompt's own generate() on the reference module."""
    import test_hf_families as fam

    ours, ref = fam._models(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, fam.VOCAB, (n,), generator=g).tolist() for n in (5, 23, 12)]
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=16)
    rids = [b.add_request(p, 8) for p in prompts]
    out = b.run()
    with torch.no_grad():
        for rid, p in zip(rids, prompts):
            want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
            assert out[rid] == want[0, len(p):].tolist()
    _all_blocks_back(b)


@pytest.mark.parametrize("family", ["stablelm", "nemotron"])
def test_layers_that_drop_the_step_are_refused_at_the_first_step(family):
    """StableLM's and Nemotron's decoder layers call their attention without the keyword
    arguments the batcher passes: transformers' sdpa would run over the packed row instead of
    the pages. The first step raises saying so and leaves nothing behind."""
    import test_hf_families as fam

    ours, _ = fam._models(family)
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=16)
    b.add_request([1, 2, 3, 4, 5], 4)
    with pytest.raises(RuntimeError, match="do not pass the attention keyword arguments"):
        b.step()
    st = b.stats()
    assert st.running == 0 and st.waiting == 1
    _all_blocks_back(b)


def test_paged_cache_budget_is_split_across_layer_groups():
    import test_hf_families as fam

    ours, _ = fam._models("gemma3")        # layers: sliding, sliding, full
    pc = paged_cache(ours, kv_cache_bytes=3 << 20, block_size=16)
    sizes = {name: (c.num_layers, c.num_blocks, c.bytes_per_block) for name, c in pc.groups.items()}
    assert sorted(n for n, _, _ in sizes.values()) == [1, 2]
    for layers, blocks, per_block in sizes.values():
        assert blocks == (3 << 20) * layers // 3 // per_block
    assert len({blocks for _, blocks, _ in sizes.values()}) == 1   # same count per group
    with pytest.raises(TypeError):
        paged_cache(ours, num_blocks=8, kv_cache_bytes=1 << 20)


def test_torch_linears_give_the_same_tokens(models):
    """linear_kernel=False (every matrix product torch's): the same greedy tokens."""
    ours, ref = models
    prompts = prompt_lists(21, [4, 19, 33, 2])
    b = ContinuousBatcher(ours, num_blocks=64, block_size=BS, max_batch_tokens=16,
                          linear_kernel=False)
    rids = [b.add_request(p, 7) for p in prompts]
    out = b.run()
    assert [out[r] for r in rids] == [_reference(ref, p, 7) for p in prompts]
    assert not any("forward" in vars(m) for m in ours.modules())
    _all_blocks_back(b)


def test_row_linears_route_small_inputs_and_restore(models, monkeypatch):
    """RowLinears: inputs of at most max_rows rows go to pagedkv.linear (within float32
    rounding of torch), larger ones and calls recording autograd to torch unchanged; every
    module is restored on exit, also when the body raises."""
    import pagedkv
    from pagedkv.integrations.linear import RowLinears

    ours, _ = models
    lins = [m for m in ours.modules() if type(m) is torch.nn.Linear]
    calls = []
    real = pagedkv.linear
    monkeypatch.setattr(pagedkv, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = RowLinears(ours, max_rows=6)
    assert r.modules == lins
    lin = lins[0]
    g = torch.Generator().manual_seed(5)
    small = torch.randn(2, 3, lin.in_features, generator=g)     # 6 rows: the kernel
    big = torch.randn(7, lin.in_features, generator=g)          # 7 rows: torch
    with torch.no_grad():
        want_small, want_big = lin(small), lin(big)
        with r:
            got_small, got_big = lin(small), lin(big)
    assert len(calls) == 1
    assert got_small.shape == want_small.shape
    torch.testing.assert_close(got_small, want_small, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_big, want_big)
    with r:  # autograd on: torch, so gradients flow
        got = lin(small)
    assert len(calls) == 1 and got.requires_grad
    assert not any("forward" in vars(m) for m in lins)
    with pytest.raises(RuntimeError, match="inside"):
        with r:
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in lins)


def test_row_linears_leave_other_modules_alone():
    """Only plain float32 / float64 nn.Linear modules are routed: a bfloat16 model's
    linears, subclasses and modules whose forward is already replaced keep theirs."""
    from pagedkv.integrations.linear import RowLinears

    class Sub(torch.nn.Linear):
        pass

    hooked = torch.nn.Linear(4, 4)
    hooked.forward = lambda x: x
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Sub(4, 4), hooked,
                              torch.nn.Linear(4, 4).to(torch.bfloat16))
    r = RowLinears(net)
    assert r.modules == [net[0]]
