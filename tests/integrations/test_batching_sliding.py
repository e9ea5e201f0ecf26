"""ContinuousBatcher on sliding-window and hybrid models: one sequence per layer group in every
request.

The tiny models of test_hf_families (window 8) plus Qwen2 / Qwen3 with use_sliding_window
(layer 0 full, layer 1 sliding).  Prompts and generations run well past the window; the
references are each prompt's own generate() with DynamicCache and transformers' attention
(sdpa, or eager where softcap / sinks need it), whose masks set the window convention.
"""

import numpy as np
import pytest

from tiny_llama import llama_config, prompt_lists  # first: it skips the module without the hf extra
from tiny_llama import one_thread  # noqa: F401,E402  (an autouse fixture: one thread here)

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from pagedkv.integrations.hf import ContinuousBatcher, paged_cache  # noqa: E402

SL, FU = "sliding_attention", "full_attention"
SLIDING_FAMILIES = ["mistral", "mixtral", "gemma2", "gemma3", "gpt_oss", "qwen2_sliding",
                    "qwen3_sliding", "cohere2", "exaone4", "ministral", "olmo3", "gemma3n"]
_FAMILY = {}
_FAMILY_REF = {}


def _family(name):
    """(model for the batcher, reference model) with the same random weights."""
    import copy

    import test_hf_families as fam
    import transformers

    if name not in _FAMILY:
        if name.endswith("_sliding"):
            cls = {"qwen2_sliding": "Qwen2Config", "qwen3_sliding": "Qwen3Config"}[name]
            cfg = getattr(transformers, cls)(**dict(fam.COMMON, use_sliding_window=True,
                                                    sliding_window=fam.WINDOW,
                                                    max_window_layers=1))
            torch.manual_seed(0)
            ref = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation="sdpa").float().eval()
            _FAMILY[name] = (copy.deepcopy(ref), ref)
        else:
            _FAMILY[name] = fam._models(name)
    return _FAMILY[name]


def _family_reference(name, prompt, n):
    key = (name, tuple(prompt), n)
    if key not in _FAMILY_REF:
        with torch.no_grad():
            out = _family(name)[1].generate(torch.tensor([prompt]), max_new_tokens=n,
                                            do_sample=False, pad_token_id=0)
        _FAMILY_REF[key] = out[0, len(prompt):].tolist()
    return _FAMILY_REF[key]


def _every_group_back(b):
    for name, c in b.groups.items():
        assert c.num_free_blocks == c.num_blocks, name
        assert c.sequence_ids() == [], name
    st = b.stats()
    assert st.free_blocks == st.num_blocks


@pytest.mark.parametrize("name", SLIDING_FAMILIES)
def test_sliding_window_convention_is_the_references_mask(name):
    """The reference model's own sliding mask (sdpa's boolean one, or eager's additive one)
    over a 20-token prompt: a PagedKVCache with ``window=config.sliding_window`` attends
    exactly under it (NumPy softmax over the allowed keys)."""
    import test_hf_families as fam
    from transformers.masking_utils import create_sliding_window_causal_mask

    from pagedkv import PagedKVCache
    from pagedkv.integrations.hf import layer_windows

    _, ref = _family(name)
    cfg = ref.config.get_text_config(decoder=True)
    assert fam.WINDOW in layer_windows(cfg)
    T = 20
    mask = create_sliding_window_causal_mask(
        cfg, torch.zeros(1, T, cfg.hidden_size), torch.ones(1, T, dtype=torch.long), None,
        position_ids=torch.arange(T)[None], allow_is_causal_skip=False)[0, 0]
    allowed = (mask if mask.dtype == torch.bool else mask == 0).numpy()
    assert allowed.sum(1).max() == cfg.sliding_window
    rng = np.random.default_rng(5)
    q = rng.standard_normal((T, 4, 16), dtype=np.float32)
    k = rng.standard_normal((T, 2, 16), dtype=np.float32)
    v = rng.standard_normal((T, 2, 16), dtype=np.float32)
    c = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16)
    sid = c.add_sequence()
    c.append(sid, k, v)
    got = c.attend(sid, q, scale=0.25, window=cfg.sliding_window)
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)        # [T, Hq, D]
    s = np.einsum("ihd,jhd->hij", q, kr).astype(np.float64) * 0.25
    s = np.where(allowed[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hij,jhd->ihd", p / p.sum(-1, keepdims=True), vr)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SLIDING_FAMILIES)
def test_sliding_families_exact_greedy(name):
    """Mixed prompt lengths (up to 5x the window), generations past the window, chunked
    prefill next to decodes, requests added mid-run: each prompt's own generate()."""
    ours, _ = _family(name)
    prompts = prompt_lists(21, [1, 6, 9, 23, 40])
    news = [20, 14, 25, 9, 18]
    b = ContinuousBatcher(ours, num_blocks=64, block_size=4, max_batch_tokens=7)
    from pagedkv.integrations.hf import layer_groups
    assert {n: c.num_layers for n, c in b.groups.items()} == \
        {n: len(ls) for n, ls in layer_groups(ours).items()}
    rids = [b.add_request(p, n) for p, n in zip(prompts[:3], news[:3])]
    for _ in range(4):
        b.step()
    rids += [b.add_request(p, n) for p, n in zip(prompts[3:], news[3:])]   # mid-run
    out = b.run()
    for rid, p, n in zip(rids, prompts, news):
        assert out[rid] == _family_reference(name, p, n), (name, len(p))
    st = b.stats()
    assert st.computed_tokens == sum(map(len, prompts)) + sum(news) - len(news)
    assert st.preemptions == 0
    assert all(c.stats().evicted_tokens > 0 for n, c in b.groups.items() if n != FU), \
        "a sliding group never dropped a token"
    _every_group_back(b)


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_sliding_group_blocks_stay_bounded(name):
    """300 tokens per request: each sequence of a sliding group holds its last W - 1 tokens
    plus the step's, in at most ceil((W - 1 + n) / block_size) + 1 blocks; a full group holds
    every token."""
    import test_hf_families as fam

    ours, _ = _family(name)
    bs, chunk, new = 4, 16, 300
    prompts = prompt_lists(22, [30, 3, 17])
    b = ContinuousBatcher(ours, num_blocks=256, block_size=bs, max_batch_tokens=chunk)
    rids = [b.add_request(p, new) for p in prompts]
    keep = fam.WINDOW - 1
    steps = 0
    while b.has_unfinished():
        b.step()
        steps += 1
        decoding = steps > 4                 # 50 prompt tokens, 16 a step
        for gname, c in b.groups.items():
            for sid in c.sequence_ids():
                held = c.num_seq_blocks(sid)
                if gname == FU:
                    assert held == -(-c.seq_len(sid) // bs)
                    continue
                n = 1 if decoding else chunk
                assert c.seq_len(sid) <= keep + n
                # one run of stream positions, each where it was written in its block:
                # the blocks the scheduler counts
                kept = c.kept_positions(sid)
                assert list(kept) == list(range(kept[0], kept[-1] + 1))
                assert held == -(-(int(kept[-1]) + 1) // bs) - int(kept[0]) // bs
                assert held <= -(-(keep + n) // bs) + 1, (steps, held)
        if decoding and b.stats().running == 3:
            assert b.groups[SL].num_blocks - b.groups[SL].num_free_blocks <= 3 * 3
    out = b.run()
    for rid, p in zip(rids, prompts):
        assert out[rid] == _family_reference(name, p, new)
    assert b.groups[SL].stats().peak_blocks_used <= 3 * (-(-(keep + chunk) // bs) + 1)
    if FU in b.groups:
        assert b.groups[FU].stats().peak_blocks_used >= -(-(30 + new - 1) // bs)
    _every_group_back(b)


@pytest.mark.parametrize("name,num_blocks", [("mistral", 9), ("gemma3", {SL: 64, FU: 14}),
                                             ("gpt_oss", {SL: 9, FU: 40})],
                         ids=["mistral-sliding-pool", "gemma3-full-pool", "gpt_oss-both"])
def test_sliding_memory_pressure_preempts_and_recomputes(name, num_blocks):
    """Pools too small for every request at once (the sliding one, the full one, or both
    tight): the newest request is preempted, its blocks return to every group, and it is
    recomputed later with exact tokens; no pool ever holds more than it has."""
    ours, _ = _family(name)
    prompts = prompt_lists(23, [20, 18, 25, 11, 16, 22])
    b = ContinuousBatcher(ours, num_blocks=num_blocks, block_size=4, max_batch_tokens=8)
    rids = [b.add_request(p, 24) for p in prompts]
    peak = {n: 0 for n in b.groups}
    while b.has_unfinished():
        b.step()
        for n, c in b.groups.items():
            peak[n] = max(peak[n], c.num_blocks - c.num_free_blocks)
            assert len(c.sequence_ids()) == b.stats().running
    out = b.run()
    assert b.stats().preemptions > 0
    for rid, p in zip(rids, prompts):
        assert out[rid] == _family_reference(name, p, 24)
    assert all(peak[n] <= c.num_blocks for n, c in b.groups.items())
    _every_group_back(b)


def test_sliding_abort_returns_every_block_in_every_group():
    ours, _ = _family("gpt_oss")
    prompts = prompt_lists(24, [30, 12, 7, 19])
    b = ContinuousBatcher(ours, num_blocks=64, block_size=4, max_batch_tokens=12, max_seqs=2)
    rids = [b.add_request(p, 16) for p in prompts]
    for _ in range(5):
        b.step()
    assert b.stats().running == 2 and b.stats().waiting == 2
    assert all(c.num_free_blocks < c.num_blocks for c in b.groups.values())
    assert b.abort(rids[0]) is True            # running
    assert b.abort(rids[3]) is True            # waiting
    assert all(len(c.sequence_ids()) == 1 for c in b.groups.values())
    out = b.run()
    assert set(out) == {rids[1], rids[2]}
    for rid in (rids[1], rids[2]):
        assert out[rid] == _family_reference("gpt_oss", prompts[rid], 16)
    _every_group_back(b)
    b2 = ContinuousBatcher(ours, num_blocks=64, block_size=4, max_batch_tokens=12)
    ids = [b2.add_request(p, 16) for p in prompts]
    for _ in range(6):                         # past the window: sliding blocks were dropped
        b2.step()
    assert b2.groups[SL].stats().evicted_blocks > 0
    for rid in ids:
        assert b2.abort(rid) is True
    assert not b2.has_unfinished()
    _every_group_back(b2)


def test_sliding_requests_are_bounded_by_the_window_not_their_length():
    """A sliding-only model (Mistral) runs a request far longer than its pool; the bound is
    what one step can need (the window plus a chunk); a hybrid model's full group still
    refuses a request longer than its pool, and a refused request changes nothing."""
    import test_hf_families as fam

    ours, _ = _family("mistral")
    bs, chunk = 4, 8
    need = -(-(fam.WINDOW - 1 + chunk) // bs) + 1          # 5 blocks
    b = ContinuousBatcher(ours, num_blocks=need, block_size=bs, max_batch_tokens=chunk)
    prompt = prompt_lists(25, [40])[0]
    rid = b.add_request(prompt, 120)                       # 159 tokens, 40 blocks' worth
    assert b.run()[rid] == _family_reference("mistral", prompt, 120)
    _every_group_back(b)
    small = ContinuousBatcher(ours, num_blocks=need - 1, block_size=bs, max_batch_tokens=chunk)
    with pytest.raises(ValueError, match="sliding_attention"):
        small.add_request(prompt, 120)
    short = small.add_request(prompt[:5], 4)               # 8 tokens: 2 blocks at most
    assert small.run()[short] == _family_reference("mistral", prompt[:5], 4)
    hybrid, _ = _family("gemma3")
    h = ContinuousBatcher(hybrid, num_blocks={SL: need, FU: 12}, block_size=bs,
                          max_batch_tokens=chunk)
    first = h.add_request(prompt[:20], 10)
    h.step()
    before = (h.stats().running, h.stats().waiting, h.stats().group_blocks)
    with pytest.raises(ValueError, match="full_attention"):
        h.add_request(prompt, 10)                          # 49 tokens > 12 blocks of 4
    assert (h.stats().running, h.stats().waiting, h.stats().group_blocks) == before
    assert h.run()[first] == _family_reference("gemma3", prompt[:20], 10)
    _every_group_back(h)


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_sliding_kv_dtype_bf16_matches_paged_generate(name):
    """bf16 storage on a sliding model: the tokens of generate() with a bf16 paged_cache
    (the same window, trim and kernels), prompt by prompt."""
    ours, _ = _family(name)
    prompts = prompt_lists(26, [13, 27, 4])
    want = []
    with torch.no_grad():
        for p in prompts:
            pc = paged_cache(ours, num_blocks=32, block_size=4, kv_dtype="bfloat16")
            o = ours.generate(torch.tensor([p]), past_key_values=pc, max_new_tokens=20,
                              do_sample=False)
            want.append(o[0, len(p):].tolist())
    b = ContinuousBatcher(ours, num_blocks=48, block_size=4, kv_dtype="bfloat16",
                          max_batch_tokens=9)
    assert all(c.kv_dtype == "bfloat16" for c in b.groups.values())
    rids = [b.add_request(p, 20) for p in prompts]
    out = b.run()
    assert [out[r] for r in rids] == want
    _every_group_back(b)


def test_sliding_combinations_refused_at_construction():
    ours, _ = _family("gemma2")
    with pytest.raises(NotImplementedError, match=r"prefix_caching.*sliding_attention.*window 8"):
        ContinuousBatcher(ours, num_blocks=16, prefix_caching=True)
    mistral, _ = _family("mistral")
    with pytest.raises(NotImplementedError, match="prefix_caching"):
        ContinuousBatcher(mistral, num_blocks=16, prefix_caching=True)
    with pytest.raises(ValueError, match="groups"):           # a dict must name every group
        ContinuousBatcher(ours, num_blocks={SL: 16})
    b = ContinuousBatcher(ours, num_blocks={SL: 8, FU: 16}, block_size=4)
    assert {n: c.num_blocks for n, c in b.groups.items()} == {SL: 8, FU: 16}
    assert b.stats().group_blocks == {SL: (8, 8), FU: (16, 16)}
    with pytest.raises(AttributeError, match="groups"):       # two caches: no single .cache
        b.cache
    torch.manual_seed(0)
    chunked = LlamaForCausalLM(llama_config()).eval()
    chunked.config.layer_types = [FU, "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        ContinuousBatcher(chunked, num_blocks=16)


def test_sliding_sizing_by_bytes_caps_the_sliding_pool():
    """kv_cache_bytes on a hybrid model: the sliding pool gets no more blocks than its
    running requests can hold at once, the full pool the rest of the budget."""
    import test_hf_families as fam

    ours, _ = _family("gemma3")                # layers: sliding, sliding, full
    bs, seqs, chunk = 4, 4, 16
    budget = 1 << 20
    b = ContinuousBatcher(ours, kv_cache_bytes=budget, block_size=bs, max_seqs=seqs,
                          max_batch_tokens=chunk)
    sl, fu = b.groups[SL], b.groups[FU]
    cap = seqs * (-(-(fam.WINDOW - 1) // bs) + 2) + -(-chunk // bs)
    assert sl.num_blocks == cap
    assert fu.num_blocks == (budget - cap * sl.bytes_per_block) // fu.bytes_per_block
    assert b.stats().kv_cache_bytes <= budget
    assert b.stats().num_blocks == sl.num_blocks + fu.num_blocks
    tight = ContinuousBatcher(ours, kv_cache_bytes=10 * (sl.bytes_per_block + fu.bytes_per_block)
                              + 100, block_size=bs, max_seqs=seqs, max_batch_tokens=chunk)
    # below the cap: the same count in every group
    assert {n: c.num_blocks for n, c in tight.groups.items()} == {SL: 10, FU: 10}
    with pytest.raises(ValueError, match="holds no block"):
        ContinuousBatcher(ours, kv_cache_bytes=1000, block_size=bs)
    default = ContinuousBatcher(ours, block_size=16, max_seqs=seqs)   # 2048 tokens a request
    assert default.groups[FU].num_blocks == seqs * 2048 // 16
    assert default.groups[SL].num_blocks == seqs * 3 + 512 // 16


def test_sliding_failing_forward_leaves_nothing_behind():
    ours, _ = _family("gemma3")
    prompts = prompt_lists(27, [12, 30])
    b = ContinuousBatcher(ours, num_blocks=32, block_size=4, max_batch_tokens=16)
    rids = [b.add_request(p, 14) for p in prompts]
    for _ in range(3):
        b.step()

    def boom(module, args):
        raise KeyboardInterrupt("interrupted mid-step")

    hook = ours.model.layers[2].register_forward_pre_hook(boom)   # after the sliding layers
    try:
        with pytest.raises(KeyboardInterrupt):
            b.step()
    finally:
        hook.remove()
    assert b.stats().running == 0 and b.stats().waiting == 2
    _every_group_back(b)
    out = b.run()
    for rid, p in zip(rids, prompts):
        assert out[rid] == _family_reference("gemma3", p, 14)
