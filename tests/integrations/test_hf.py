"""Hugging Face transformers drop-in (pagedkv.integrations.hf) against transformers' own cache.

Every test runs a tiny random Llama (2 layers, 4 query heads, 2 KV heads, head_dim 16) twice:
once with pagedkv (cache + attention) and once, on an identical copy of the weights, with the
default DynamicCache and sdpa.  Tokens must be identical; logits within rel 1e-5 (f32).
The StreamingLLM test compares with a NumPy re-run of the same model with the paper's cache.
"""

import numpy as np
import pytest

from tiny_llama import left_padded, llama_config, prompt_ids, twin_llamas  # first: it skips the module without the hf extra

import torch  # noqa: E402
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.integrations import hf  # noqa: E402
from pagedkv.integrations.hf import PagedCache, paged_cache  # noqa: E402

LOGIT_RTOL = 1e-5


@pytest.fixture(scope="module")
def models():
    """(pagedkv model, reference model): the same random weights, two modules."""
    return twin_llamas(1234)


def _gen(model, ids, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)


def _same(ref, out, mask=None):
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits)
    for a, b in zip(ref.logits, out.logits):
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= LOGIT_RTOL * scale


@pytest.mark.parametrize("prompt_attention", ["torch", "pagedkv"])
def test_greedy_32_tokens_match_dynamic_cache(models, prompt_attention):
    ours, ref = models
    ids = prompt_ids(1, 1, 20)
    cache = paged_cache(ours, num_blocks=32, block_size=16, prompt_attention=prompt_attention)
    assert isinstance(cache, PagedCache) and isinstance(cache.paged, pagedkv.PagedKVCache)
    assert ours.config._attn_implementation == "pagedkv"
    out = _gen(ours, ids, max_new_tokens=32, past_key_values=cache)
    _same(_gen(ref, ids, max_new_tokens=32), out)
    # 20 + 32 tokens, the newest one never appended (generate stops after sampling it)
    assert cache.get_seq_length() == 51
    assert cache.paged.seq_len(cache.sequence_ids[0]) == 51
    assert cache.paged.stats().blocks_used == 4


def test_fresh_prompt_attention_is_torchs_over_its_own_kv(models):
    """prompt_attention="torch": a fresh prompt's logits are DynamicCache + sdpa's, bit for bit
    (the same computation), and its K/V are in the pages (the decode steps read them);
    "pagedkv": the prefill kernel, within the float32 tolerance."""
    ours, ref = models
    ids = prompt_ids(16, 2, 40)
    with torch.no_grad():
        want = ref(ids, past_key_values=DynamicCache(config=ref.config)).logits
        cache = paged_cache(ours, num_blocks=32, block_size=8, prompt_attention="torch")
        got = ours(ids, past_key_values=cache).logits
        assert torch.equal(got, want)
        assert [cache.paged.seq_len(s) for s in cache.sequence_ids] == [40, 40]
        kernel = ours(ids, past_key_values=paged_cache(ours, num_blocks=32, block_size=8,
                                                       prompt_attention="pagedkv")).logits
    assert not torch.equal(kernel, want)  # another order of float32 sums
    assert (kernel - want).abs().max().item() <= LOGIT_RTOL * want.abs().max().item()
    with pytest.raises(ValueError, match="prompt_attention"):
        paged_cache(ours, num_blocks=8, prompt_attention="sdpa")


@pytest.mark.parametrize("backend, kernel", [("avx512amx", True), ("avx512bf16", True),
                                             ("avx512vnni", True), ("avx512", True),
                                             ("avx2", False), ("avxvnni", False),
                                             ("neon", False), ("scalar", False)])
def test_auto_prompt_attention_picks_the_kernel_on_avx512(models, monkeypatch, backend, kernel):
    """prompt_attention="auto" (the default): the prefill kernel for a float32 model stored in
    float32 on the AVX-512 paths, torch's sdpa elsewhere, for narrower storage and for float16 /
    bfloat16 models."""
    ours, _ = models
    monkeypatch.setattr(hf, "simd_backend", lambda: backend)
    cache = paged_cache(ours, num_blocks=8)
    assert [rows.torch_prompts for rows in cache.group_rows.values()] == [not kernel]
    assert hf.prompt_kernel_default("float32") is kernel
    assert hf.prompt_kernel_default("float64") is kernel
    assert hf.prompt_kernel_default("bfloat16") is False
    assert hf.prompt_kernel_default("float16") is False
    assert hf.prompt_kernel_default("float32", "float32") is kernel
    for kv in ("bfloat16", "float16", "int8"):  # narrower storage: torch's over the prompt's own K/V
        assert hf.prompt_kernel_default("float32", kv) is False
    bf16 = paged_cache(ours, num_blocks=8, kv_dtype="bfloat16")
    assert [rows.torch_prompts for rows in bf16.group_rows.values()] == [True]
    forced = paged_cache(ours, num_blocks=8, prompt_attention="torch")
    assert [rows.torch_prompts for rows in forced.group_rows.values()] == [True]


@pytest.mark.parametrize("prompt_attention", ["torch", "pagedkv"])
def test_left_padded_batch_of_three(models, prompt_attention):
    ours, ref = models
    ids, mask = left_padded(2, 14, [0, 5, 11])
    cache = paged_cache(ours, num_blocks=32, block_size=8, prompt_attention=prompt_attention)
    out = _gen(ours, ids, attention_mask=mask, max_new_tokens=24, past_key_values=cache)
    _same(_gen(ref, ids, attention_mask=mask, max_new_tokens=24), out)
    # padding is never stored: each row holds its real tokens only
    lens = [cache.paged.seq_len(s) for s in cache.sequence_ids]
    assert lens == [14 + 23, 9 + 23, 3 + 23]


def test_prompt_prefilled_in_two_chunks_then_second_turn(models):
    ours, ref = models
    ids = prompt_ids(3, 1, 37)
    dyn = DynamicCache(config=ref.config)
    cache = paged_cache(ours, num_blocks=32, block_size=16)
    with torch.no_grad():
        a = ref(ids[:, :23], past_key_values=dyn).logits
        b = ours(ids[:, :23], past_key_values=cache).logits
    assert (a - b).abs().max() <= LOGIT_RTOL * a.abs().max()
    first_ref = _gen(ref, ids, max_new_tokens=16, past_key_values=dyn)
    first = _gen(ours, ids, max_new_tokens=16, past_key_values=cache)
    _same(first_ref, first)
    # the same caches, a second turn: the history plus a new user message
    turn2 = torch.cat([first_ref.sequences, prompt_ids(4, 1, 9)], dim=1)
    _same(_gen(ref, turn2, max_new_tokens=16, past_key_values=dyn),
          _gen(ours, turn2, max_new_tokens=16, past_key_values=cache))
    assert cache.get_seq_length() == dyn.get_seq_length()


def test_beam_search_three_beams(models):
    ours, ref = models
    ids = prompt_ids(5, 1, 18)
    cache = paged_cache(ours, num_blocks=32, block_size=4)
    kw = dict(num_beams=3, max_new_tokens=20, early_stopping=False)
    _same(_gen(ref, ids, **kw), _gen(ours, ids, past_key_values=cache, **kw))
    st = cache.paged.stats()
    assert st.sequences_active == 3 and st.forks > 0
    # beams share their common prefix through copy-on-write forks
    assert st.blocks_used < 3 * -(-(18 + 19) // 4)


def test_num_return_sequences_with_sampling(models):
    ours, ref = models
    ids = prompt_ids(6, 2, 10)
    kw = dict(do_sample=True, num_return_sequences=2, max_new_tokens=20, top_k=0)
    torch.manual_seed(77)
    want = _gen(ref, ids, **kw)
    cache = paged_cache(ours, num_blocks=64, block_size=8)
    torch.manual_seed(77)
    got = _gen(ours, ids, past_key_values=cache, **kw)
    _same(want, got)
    assert cache.paged.stats().sequences_active == 4


def test_assisted_decoding_crops(models, monkeypatch):
    ours, ref = models
    torch.manual_seed(4321)
    assistant = LlamaForCausalLM(llama_config(num_hidden_layers=1)).eval()
    crops = []
    real_crop = PagedCache.crop
    monkeypatch.setattr(PagedCache, "crop", lambda self, n: (crops.append(n), real_crop(self, n)))
    ids = prompt_ids(15, 1, 15)
    cache = paged_cache(ours, num_blocks=16)
    got = ours.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant,
                        past_key_values=cache)
    assert torch.equal(ref.generate(ids, max_new_tokens=24, do_sample=False), got)
    assert any(n < 0 for n in crops)                # rejected drafts were rolled back
    assert cache.paged.seq_len(cache.sequence_ids[0]) == cache.get_seq_length() == 38


def test_row_operations_fork_truncate_free(models):
    ours, _ = models
    ids = prompt_ids(7, 2, 12)
    cache = paged_cache(ours, num_blocks=32, block_size=4)
    with torch.no_grad():
        ours(ids, past_key_values=cache)
    p = cache.paged
    a, b = cache.sequence_ids
    ka = p.gather(a, layer=1)[0].copy()
    kb = p.gather(b, layer=1)[0].copy()
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    s = cache.sequence_ids
    assert len(s) == 3 and s[0] == b and s[2] == a and s[1] not in (a, b)
    for sid, want in zip(s, (kb, kb, ka)):
        np.testing.assert_array_equal(p.gather(sid, layer=1)[0], want)
    assert p.stats().blocks_used == 2 * 3            # forks share, nothing copied
    cache.batch_select_indices(torch.tensor([2]))
    assert cache.sequence_ids == [a] and p.stats().sequences_active == 1
    cache.crop(-5)
    assert cache.get_seq_length() == 7 and p.seq_len(a) == 7
    np.testing.assert_array_equal(p.gather(a, layer=1)[0], ka[:7])
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    with pytest.raises(IndexError, match="out of range"):
        cache.reorder_cache(torch.tensor([0, 4]))
    assert cache.sequence_ids == [a]
    cache.reset()
    assert cache.get_seq_length() == 0 and p.stats().sequences_active == 0


def test_crop_into_padding(models):
    ours, _ = models
    ids = prompt_ids(14, 2, 12)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = paged_cache(ours, num_blocks=16, block_size=4)
    with torch.no_grad():
        ours(ids, attention_mask=mask, past_key_values=cache)
    p = cache.paged
    assert [p.seq_len(s) for s in cache.sequence_ids] == [12, 7]
    cache.crop(-6)                                   # stream positions 0..5 stay
    assert [p.seq_len(s) for s in cache.sequence_ids] == [6, 1]
    cache.crop(-3)                                   # 0..2: row 1 holds only padding there
    assert [p.seq_len(s) for s in cache.sequence_ids] == [3, 0]
    assert cache.get_seq_length() == 3


def test_model_keeps_working_with_other_caches(models):
    """A model switched to the "pagedkv" attention runs sdpa for any cache but a PagedCache."""
    ours, ref = models
    paged_cache(ours, num_blocks=8)
    ids = prompt_ids(8, 1, 12)
    _same(_gen(ref, ids, max_new_tokens=8), _gen(ours, ids, max_new_tokens=8))


def test_errors(models):
    ours, _ = models
    with pytest.raises(TypeError, match="StreamingLLM"):
        paged_cache(ours, num_blocks=8, streaming=(4, 60))
    cache = paged_cache(ours, num_blocks=8)
    with torch.no_grad():
        ours(prompt_ids(9, 2, 5), past_key_values=cache)
        with pytest.raises(ValueError, match="batch size 3"):
            ours(prompt_ids(9, 3, 1), past_key_values=cache)
    small = paged_cache(ours, num_blocks=2, block_size=4)
    with pytest.raises(pagedkv.OutOfBlocksError):
        with torch.no_grad():
            ours(prompt_ids(10, 1, 200), past_key_values=small)
    assert small.get_seq_length() == 0 and small.paged.num_free_blocks == 2
    with torch.no_grad():  # still usable
        ours(prompt_ids(10, 1, 8), past_key_values=small)
    assert small.get_seq_length() == 8 and small.paged.num_free_blocks == 0
    rows = paged_cache(ours, num_blocks=3, block_size=4)   # the second row does not fit
    with pytest.raises(pagedkv.OutOfBlocksError):
        with torch.no_grad():
            ours(prompt_ids(10, 2, 8), past_key_values=rows)
    assert [rows.paged.seq_len(s) for s in rows.sequence_ids] == [0, 0]
    assert rows.get_seq_length() == 0 and rows.paged.num_free_blocks == 3
    with pytest.raises(TypeError, match="kv_dtype"):
        paged_cache(ours, num_blocks=8, kv_dtype="bfloat8")
    class Int8Model:  # paged_cache reads config, device and dtype first
        config, device, dtype = ours.config, torch.device("cpu"), torch.int8
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16 models; the "
                                        "model is torch.int8"):
        paged_cache(Int8Model(), num_blocks=8)


def test_wrong_attention_is_caught(models):
    ours, _ = models
    cache = paged_cache(ours, num_blocks=8)
    ours.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ours(prompt_ids(11, 1, 4), past_key_values=cache)
            with pytest.raises(RuntimeError, match="'pagedkv'"):
                ours(prompt_ids(11, 1, 1), past_key_values=cache)
    finally:
        ours.set_attn_implementation("pagedkv")


def test_bfloat16_storage(models):
    ours, ref = models
    ids = prompt_ids(12, 1, 20)
    cache = paged_cache(ours, num_blocks=32, kv_dtype="bfloat16")
    assert cache.paged.kv_dtype == "bfloat16"
    out = _gen(ours, ids, max_new_tokens=32, past_key_values=cache)
    want = _gen(ref, ids, max_new_tokens=32)
    assert out.sequences.shape == want.sequences.shape
    agree = (out.sequences[0, 20:] == want.sequences[0, 20:]).float().mean().item()
    assert agree >= 0.9, agree


def test_readme_hf_example(capsys):
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    if not readme.exists():
        pytest.skip("README.md is not next to the tests (installed copy)")
    (code,) = re.findall(r"```python hf\n(.*?)```", readme.read_text(), re.S)
    ns = {}
    exec(compile(code, str(readme), "exec"), ns)
    assert ns["out"].shape == (1, 320)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "8" and lines[-1] == "[0, 1, 2, 3, 66, 67]"


# ---------------------------------------------------------------------------
# StreamingLLM against a NumPy re-run of the model with the paper's cache


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate(x, pos, theta):
    """rotate-half RoPE of x [..., n, D] at positions pos [n] (float64)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(d // 2, dtype=np.float64) * 2.0 / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class _ReferenceStreamingLlama:
    """The model loop of the StreamingLLM paper, one token per step, in float64 NumPy:
    keys cached before RoPE; before each append a cache longer than S + R is cut to its first
    S and last R tokens; keys rotated by their rank in the cache, the query by its own."""

    def __init__(self, model, sink, window):
        cfg = model.config
        w = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
        self.w, self.cfg = w, cfg
        self.S, self.R = sink, window
        self.theta = cfg.rope_parameters["rope_theta"]
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = cfg.hidden_size // self.hq
        self.k = [np.zeros((self.hkv, 0, self.d)) for _ in range(cfg.num_hidden_layers)]
        self.v = [np.zeros((self.hkv, 0, self.d)) for _ in range(cfg.num_hidden_layers)]

    def step(self, token):
        w, eps, d = self.w, self.cfg.rms_norm_eps, self.d
        x = w["model.embed_tokens.weight"][token]
        for i in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = (w[p + "self_attn.q_proj.weight"] @ h).reshape(self.hq, 1, d)
            k = (w[p + "self_attn.k_proj.weight"] @ h).reshape(self.hkv, 1, d)
            v = (w[p + "self_attn.v_proj.weight"] @ h).reshape(self.hkv, 1, d)
            K, V = self.k[i], self.v[i]
            if K.shape[1] > self.S + self.R:
                K = np.concatenate([K[:, : self.S], K[:, -self.R:]], axis=1)
                V = np.concatenate([V[:, : self.S], V[:, -self.R:]], axis=1)
            K = np.concatenate([K, k], axis=1)
            V = np.concatenate([V, v], axis=1)
            self.k[i], self.v[i] = K, V
            n = K.shape[1]
            kr = _rotate(K, np.arange(n, dtype=np.float64), self.theta)
            qr = _rotate(q, np.array([n - 1.0]), self.theta)
            g = self.hq // self.hkv
            kr, vr = np.repeat(kr, g, axis=0), np.repeat(V, g, axis=0)
            s = qr @ kr.transpose(0, 2, 1) / np.sqrt(d)          # [Hq, 1, n]
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            o = (s / s.sum(axis=-1, keepdims=True)) @ vr           # [Hq, 1, d]
            x = x + w[p + "self_attn.o_proj.weight"] @ o.reshape(-1)
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate = w[p + "mlp.gate_proj.weight"] @ h
            up = w[p + "mlp.up_proj.weight"] @ h
            x = x + w[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
        x = _rms(x, w["model.norm.weight"], eps)
        return w["lm_head.weight"] @ x


def test_streaming_llm_2000_tokens_matches_paper_semantics():
    torch.manual_seed(99)
    model = LlamaForCausalLM(llama_config()).eval()
    S, R, bs, prompt, new = 4, 60, 16, 8, 2000
    cache = paged_cache(model, num_blocks=16, block_size=bs,
                        streaming=pagedkv.StreamingLLM(sink_tokens=S, window_tokens=R))
    ids = prompt_ids(13, 1, prompt)
    # sampling keeps the stream from settling into a short loop of tokens
    torch.manual_seed(3)
    out = _gen(model, ids, max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
               past_key_values=cache)
    seq = out.sequences[0].numpy()
    assert len(seq) == prompt + new
    st = cache.paged.stats()
    bound = -(-S // bs) + -(-(R + 1) // bs) + 1
    assert st.peak_blocks_used <= bound and st.blocks_used <= bound
    assert cache.paged.seq_len(cache.sequence_ids[0]) == S + R + 1
    kept = cache.paged.kept_positions(cache.sequence_ids[0])
    np.testing.assert_array_equal(kept, np.r_[0:S, prompt + new - 1 - R - 1:prompt + new - 1])
    # the prompt is one chunk of 8 < S + R tokens: per token it is the same computation
    ref = _ReferenceStreamingLlama(model, S, R)
    checked = 0
    sampled = set(range(0, new, 97)) | {new - 1, 60, 61, 62}
    for i in range(prompt + new - 1):
        logits = ref.step(seq[i])
        t = i - (prompt - 1)
        if t >= 0 and t in sampled:
            got = out.logits[t][0].double().numpy()
            scale = np.abs(logits).max()
            assert np.abs(got - logits).max() <= 1e-4 * scale, t
            checked += 1
    assert checked == len(sampled)
    # the rotary hook is off for other caches: the same model still matches sdpa + DynamicCache
    twin = LlamaForCausalLM(llama_config()).eval()
    twin.load_state_dict(model.state_dict())
    _same(_gen(twin, ids, max_new_tokens=8), _gen(model, ids, max_new_tokens=8))
