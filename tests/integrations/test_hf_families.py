"""Model families in transformers: pagedkv (cache + attention) against DynamicCache.

Each family is a tiny random model (2-4 layers, nothing downloaded), run twice on identical
weights: with ``paged_cache`` and with transformers' DynamicCache and its own attention (sdpa;
eager for the families whose attention needs it: Gemma 2's logit softcapping, gpt-oss's sinks).
A left-padded batch of 2 generates past the sliding window, then a second turn continues both
caches; beam search runs on a fresh pair.  Greedy tokens must be identical, logits close.
Sliding-window layers keep bounded memory: held blocks stay flat over 1,000 generated tokens.
Models pagedkv cannot run are refused with the cause named, before anything changes.
"""
import copy
import math
import types

import pytest

from tiny_llama import TINY, VOCAB  # first: it skips the module without the hf extra

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList  # noqa: E402

from pagedkv.integrations.hf import (ContinuousBatcher, layer_groups, layer_windows,  # noqa: E402
                                     paged_cache)

WINDOW = 8
COMMON = dict(TINY, head_dim=16)
SL, FU = "sliding_attention", "full_attention"

# name: (config class, config overrides, attention of the reference)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "sdpa"),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "sdpa"),
    "mixtral": ("MixtralConfig", dict(sliding_window=WINDOW, num_local_experts=4,
                                      num_experts_per_tok=2), "sdpa"),
    "qwen2": ("Qwen2Config", {}, "sdpa"),
    "qwen3": ("Qwen3Config", {}, "sdpa"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32), "sdpa"),
    "phi3": ("Phi3Config", {}, "sdpa"),
    "gemma": ("GemmaConfig", {}, "sdpa"),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, layer_types=[SL, FU],
                                    attn_logit_softcapping=0.05, final_logit_softcapping=30.0,
                                    query_pre_attn_scalar=16), "eager"),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, num_hidden_layers=3,
                                        layer_types=[SL, SL, FU], query_pre_attn_scalar=16),
               "sdpa"),
    "gpt2": ("GPT2Config", {}, "sdpa"),
    "gpt_neox": ("GPTNeoXConfig", {}, "sdpa"),
    "olmo2": ("Olmo2Config", {}, "sdpa"),
    "smollm3": ("SmolLM3Config", {}, "sdpa"),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=WINDOW, layer_types=[SL, FU],
                                     num_local_experts=4, num_experts_per_tok=2), "eager"),
    "granite": ("GraniteConfig", {}, "sdpa"),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    "cohere": ("CohereConfig", {}, "sdpa"),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=[SL, FU]), "sdpa"),
    "exaone4": ("Exaone4Config", dict(sliding_window=WINDOW, layer_types=[SL, FU]), "sdpa"),
    "ministral": ("MinistralConfig", dict(sliding_window=WINDOW, layer_types=[SL, FU]), "sdpa"),
    "olmo": ("OlmoConfig", {}, "sdpa"),
    "olmo3": ("Olmo3Config", dict(sliding_window=WINDOW, layer_types=[SL, FU]), "sdpa"),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), "sdpa"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32), "sdpa"),
    "phi": ("PhiConfig", {}, "sdpa"),
    "phimoe": ("PhimoeConfig", dict(num_local_experts=4, num_experts_per_tok=2), "sdpa"),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None), "sdpa"),
    "gpt_bigcode": ("GPTBigCodeConfig", {}, "sdpa"),  # multi-query: one KV head
    "stablelm": ("StableLmConfig", {}, "sdpa"),
    "glm": ("GlmConfig", {}, "sdpa"),
    "glm4": ("Glm4Config", {}, "sdpa"),
    "glm4_moe": ("Glm4MoeConfig", {}, "sdpa"),
    "ernie4_5": ("Ernie4_5Config", {}, "sdpa"),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}, "sdpa"),
    "helium": ("HeliumConfig", {}, "sdpa"),
    "seed_oss": ("SeedOssConfig", {}, "sdpa"),
    "arcee": ("ArceeConfig", {}, "sdpa"),
    "apertus": ("ApertusConfig", {}, "sdpa"),
    "nemotron": ("NemotronConfig", {}, "sdpa"),
    "bitnet": ("BitNetConfig", {}, "sdpa"),
    "vaultgemma": ("VaultGemmaConfig", {}, "eager"),
    "opt": ("OPTConfig", {}, "sdpa"),
    "persimmon": ("PersimmonConfig", {}, "sdpa"),
    # the last two layers attend over the K/V of the last earlier layer of their type
    "gemma3n": ("Gemma3nTextConfig", dict(
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_hidden_layers=4,
        sliding_window=WINDOW, layer_types=[SL, FU, SL, FU], num_kv_shared_layers=2,
        laurel_rank=8, activation_sparsity_pattern=[0.0] * 4, intermediate_size=[128] * 4),
        "sdpa"),
}
SLIDING = {"mistral", "mixtral", "gemma2", "gemma3", "gpt_oss", "cohere2", "exaone4", "ministral",
           "olmo3", "gemma3n"}
# multi-head attention only: they would ignore a KV head count (and a head size) in the config
MHA_ONLY = {"gpt_neox", "opt", "persimmon"}


def _config(name):
    cls, over, _ = FAMILIES[name]
    kw = dict(COMMON)
    if name in ("gpt2", "gpt_bigcode"):
        kw = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                  n_embd=64, n_layer=2, n_head=4, n_positions=4096)
    if name in MHA_ONLY:
        del kw["num_key_value_heads"], kw["head_dim"]
    kw.update(over)
    return getattr(transformers, cls)(**kw)


def _models(name, seed=0):
    """(ours, reference): the same random weights; the reference keeps its attention."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(_config(name), attn_implementation=FAMILIES[name][2])
    ref = ref.float().eval()
    with torch.no_grad():  # sinks are left uninitialized by some inits: give them values
        for mod in ref.modules():
            if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
                mod.sinks.normal_(0.0, 1.0)
    ours = copy.deepcopy(ref)
    return ours, ref


def _batch(seed, lengths):
    """A left-padded batch: (ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros((len(lengths), T), dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, T - n:] = 1
    return ids, mask


def _gen(model, ids, mask, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, output_logits=True,
                          return_dict_in_generate=True, **kw)


def _same(ref, out, what):
    assert torch.equal(ref.sequences, out.sequences), (what, ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item(), what


@pytest.mark.parametrize("prompt_attention", ["torch", "pagedkv"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_dynamic_cache(name, prompt_attention):
    ours, ref = _models(name)
    ids, mask = _batch(1, [14, 9])
    cache = paged_cache(ours, num_blocks=64, block_size=4, prompt_attention=prompt_attention)
    r1 = _gen(ref, ids, mask, max_new_tokens=20, min_new_tokens=20)
    o1 = _gen(ours, ids, mask, past_key_values=cache, max_new_tokens=20, min_new_tokens=20)
    _same(r1, o1, "first turn")
    if name in SLIDING:  # past the window
        assert ids.shape[1] + 20 > 2 * WINDOW
        assert any(c.stats().evicted_tokens > 0 for n, c in cache.groups.items()
                   if n.startswith("sliding")), "the sliding layers never dropped a token"
    # a second turn on the same caches
    more, _ = _batch(2, [5, 5])
    ids2 = torch.cat([r1.sequences, more], dim=1)
    mask2 = torch.cat([mask, torch.ones((2, r1.sequences.shape[1] - ids.shape[1] + 5),
                                        dtype=torch.long)], dim=1)
    r2 = _gen(ref, ids2, mask2, past_key_values=r1.past_key_values, max_new_tokens=12,
              min_new_tokens=12)
    o2 = _gen(ours, ids2, mask2, past_key_values=cache, max_new_tokens=12, min_new_tokens=12)
    _same(r2, o2, "second turn")
    # beams, fresh caches
    r3 = _gen(ref, ids, mask, num_beams=3, max_new_tokens=14, min_new_tokens=14)
    o3 = _gen(ours, ids, mask, num_beams=3, max_new_tokens=14, min_new_tokens=14,
              past_key_values=paged_cache(ours, num_blocks=128, block_size=4))
    assert torch.equal(r3.sequences, o3.sequences), ("beams", r3.sequences, o3.sequences)


def test_layer_groups():
    assert layer_groups(_models("llama")[0]) == {FU: [0, 1]}
    assert layer_groups(_models("mistral")[0]) == {SL: [0, 1]}
    assert layer_groups(_models("gemma3")[0]) == {SL: [0, 1], FU: [2]}
    assert layer_groups(_models("gpt_oss")[0]) == {SL: [0], FU: [1]}
    cache = paged_cache(_models("gpt_oss")[0], num_blocks={SL: 8, FU: 32}, block_size=4)
    assert {n: c.num_blocks for n, c in cache.groups.items()} == {SL: 8, FU: 32}
    assert set(cache.stats()) == {SL, FU}
    assert cache.groups[SL].num_layers == 1 and cache.groups[FU].num_layers == 1
    with pytest.raises(AttributeError, match="groups"):
        cache.paged
    with pytest.raises(ValueError, match="groups"):
        paged_cache(_models("gpt_oss")[0], num_blocks={SL: 8})


class _Held(LogitsProcessor):
    """Records every group's used blocks at each generation step."""

    def __init__(self, cache):
        self.cache, self.trace = cache, []

    def __call__(self, input_ids, scores):
        self.trace.append({n: c.num_blocks - c.num_free_blocks
                           for n, c in self.cache.groups.items()})
        return scores


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_sliding_memory_stays_flat_over_1000_tokens(name):
    ours, _ = _models(name)
    bs, steps = 4, 1000
    cache = paged_cache(ours, num_blocks=512, block_size=bs)
    held = _Held(cache)
    ids, mask = _batch(3, [30])
    ours.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                  min_new_tokens=steps, do_sample=False, logits_processor=LogitsProcessorList([held]))
    assert len(held.trace) == steps
    sliding = [t[SL] for t in held.trace]
    bound = math.ceil((WINDOW + 1) / bs) + 1  # one sequence, one token per step
    assert max(sliding[1:]) <= bound, max(sliding[1:])
    assert min(sliding[1:]) >= 1
    if FU in held.trace[0]:  # the full-attention group keeps every token
        full = [t[FU] for t in held.trace]
        assert full[-1] == math.ceil((30 + steps - 1) / bs)


def test_crop_of_a_sliding_group_within_and_past_its_window():
    ours, _ = _models("mistral")
    cache = paged_cache(ours, num_blocks=64, block_size=4)
    ids, mask = _batch(4, [6])
    ours.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1,
                  do_sample=False)  # 6 tokens stored, none dropped yet (window 8)
    cache.crop(-2)
    assert cache.get_seq_length() == 4 and cache.groups[SL].seq_len(cache.sequence_ids[0]) == 4
    out = ours.generate(torch.cat([ids, ids], 1), past_key_values=cache, max_new_tokens=10,
                        min_new_tokens=10, do_sample=False)
    assert cache.groups[SL].kept_positions(cache.sequence_ids[0])[0] > 0  # now trimmed
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match="gone"):
        cache.crop(-WINDOW)
    assert cache.get_seq_length() == seen  # unchanged
    cache.crop(-1)  # still inside the window the next token needs... or refused if not
    assert cache.get_seq_length() in (seen - 1,)
    del out


def test_unsupported_layer_types_are_refused_by_name():
    cfg = types.SimpleNamespace(num_hidden_layers=2, layer_types=[FU, "chunked_attention"],
                                sliding_window=None)
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        layer_windows(cfg)
    cfg = types.SimpleNamespace(num_hidden_layers=1, layer_types=[SL], sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window"):
        layer_windows(cfg)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)).eval()
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        paged_cache(t5, num_blocks=8)
    ours, _ = _models("mistral")
    import pagedkv
    with pytest.raises(NotImplementedError, match="sliding"):
        paged_cache(ours, num_blocks=8, streaming=pagedkv.StreamingLLM(4, 60))


# models pagedkv cannot run: (config class, config, what the refusal names)
REFUSED = {
    # attention code of its own, outside transformers' AttentionInterface
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
              "AttentionInterface"),
    # multi-head latent attention: a latent and a rotary key of other sizes than the values
    "deepseek_v3": ("DeepseekV3Config", dict(
        TINY, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
        "latent attention"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_pagedkv_cannot_run_are_refused_before_any_change(name):
    cls, kw, what = REFUSED[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).float().eval()
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=what):
        paged_cache(model, num_blocks=16)
    with pytest.raises(NotImplementedError, match=what):
        ContinuousBatcher(model, num_blocks=16)
    assert model.config._attn_implementation == before  # not switched


def test_attention_that_changes_the_cached_kv_is_refused_at_the_next_step():
    """JetMoE repeats the K/V that the cache's update returned before attending, so the
    "pagedkv" attention never sees them: the next update says why instead of going on."""
    kw = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.JetMoeConfig(
        **kw, kv_channels=16, num_local_experts=4, num_experts_per_tok=2)).float().eval()
    ids, mask = _batch(1, [6, 6])
    with pytest.raises(RuntimeError, match="repeats the K/V"):
        _gen(model, ids, mask, past_key_values=paged_cache(model, num_blocks=16),
             max_new_tokens=3)


def test_attention_without_new_kv_is_refused():
    """A layer that attends a second time in one step, over no new K/V, gets a RuntimeError
    naming that, not a failure deep inside."""
    ours, _ = _models("llama")
    layer = paged_cache(ours, num_blocks=8).layers[0]
    with pytest.raises(RuntimeError, match="without new K/V"):
        layer.attend(torch.zeros((1, 4, 1, 16)), None, 0.25)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_switched_model_keeps_softcap_and_sinks_with_other_caches(name):
    """A model switched to "pagedkv" and called with a DynamicCache runs its own eager
    attention where sdpa lacks softcap / sinks: the same tokens as the reference."""
    ours, ref = _models(name)
    paged_cache(ours, num_blocks=16, block_size=4)  # switches the attention
    ids, mask = _batch(5, [12, 7])
    _same(_gen(ref, ids, mask, max_new_tokens=10), _gen(ours, ids, mask, max_new_tokens=10),
          "DynamicCache on the switched model")
