"""bfloat16 and float16 models on pagedkv (no ``model.float()``), against DynamicCache + sdpa
running the same 16-bit model.

Tolerance: logits within 3e-2 of their max magnitude, prompt and 100 teacher-forced decode
steps.  Both sides round K/V, attention outputs and every matmul to the model's dtype; pagedkv
computes attention in float32 and rounds its output once, sdpa likewise (flash attention with
float32 accumulation), so what differs is the order of float32 sums: far below a bfloat16 unit
on these tiny random models (measured max 8e-3 relative with bfloat16, 1e-3 with float16).
Greedy tokens are equal except where the reference itself holds an exact or near tie (its two
best logits within TIE_ULPS units of the dtype's rounding): one float16 prompt below meets an
exact tie on AVX2 machines, where the sums run in another order than sdpa's, and a tie one unit
apart on an Intel Xeon with AVX512_FP16 (torch's float16 matmuls there round differently).
"""

import numpy as np
import pytest

from tiny_llama import left_padded, llama_config, prompt_ids, twin_llamas  # first: it skips the module without the hf extra

import torch  # noqa: E402
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.integrations.hf import paged_cache  # noqa: E402

LOGIT_RTOL = 3e-2
#: a greedy token may differ from the reference's only where the reference's two best logits are
#: this many units of the dtype's rounding apart (or closer): a tie that float32 sums in another
#: order can break either way
TIE_ULPS = 2
DTYPES = [torch.bfloat16, torch.float16]
IDS = ["bfloat16", "float16"]


@pytest.fixture(scope="module", params=DTYPES, ids=IDS)
def models(request):
    return twin_llamas(4321, request.param)


def _close(a, b, what):
    a, b = a.float(), b.float()
    scale = a.abs().max().item()
    err = (a - b).abs().max().item()
    assert err <= LOGIT_RTOL * scale, f"{what}: {err / scale:.3g} of max |logit|"


def test_cache_is_16_bit_and_views_the_tensors(models):
    ours, _ = models
    name = str(ours.dtype).split(".")[1]
    cache = paged_cache(ours, num_blocks=16)
    assert cache.paged.dtype_name == name and cache.paged.kv_dtype == name
    assert cache.paged.raw16 and cache.paged.dtype == np.uint16
    f32 = paged_cache(ours, num_blocks=16, kv_dtype="float32")
    assert f32.paged.dtype_name == name and f32.paged.kv_dtype == "float32"


def test_prompt_and_100_teacher_forced_steps(models):
    ours, ref = models
    ids = prompt_ids(1, 1, 60)
    follow = prompt_ids(2, 1, 100)
    cache = paged_cache(ours, num_blocks=16, block_size=16)
    dyn = DynamicCache(config=ref.config)
    with torch.no_grad():
        a = ours(ids, past_key_values=cache).logits
        b = ref(ids, past_key_values=dyn).logits
        _close(b, a, "prompt")
        for t in range(follow.shape[1]):
            tok = follow[:, t:t + 1]
            _close(ref(tok, past_key_values=dyn).logits, ours(tok, past_key_values=cache).logits,
                   f"decode step {t}")
    assert cache.paged.seq_len(cache.sequence_ids[0]) == 160


@pytest.mark.parametrize("kv_dtype", [None, "float32", "int8"])
def test_greedy_tokens_left_padded_batch(models, kv_dtype):
    ours, ref = models
    ids, mask = left_padded(3, 24, [0, 7])
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    want = ref.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
    got = ours.generate(ids, past_key_values=paged_cache(ours, num_blocks=16, kv_dtype=kv_dtype),
                        **kw)
    if kv_dtype == "int8":  # a different storage: most tokens agree
        assert (got[:, 24:] == want.sequences[:, 24:]).float().mean().item() >= 0.75
    else:
        _assert_same_greedy(got, want, prompt_len=24, dtype=ours.dtype)


def _assert_same_greedy(got, want, prompt_len, dtype):
    """Greedy tokens equal the reference's, except that a row may part from it at a step where
    the reference's two best logits are tied within TIE_ULPS units of the model dtype's rounding
    (the order of float32 sums then decides, and the two generations go separate ways).  The
    unit is the model's dtype's: generate() hands the scores out as float32, but the logits
    were rounded to the model's dtype."""
    ref = want.sequences
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.equal(got[:, :prompt_len], ref[:, :prompt_len])
    eps = torch.finfo(dtype).eps
    for row in range(ref.shape[0]):
        differ = (got[row, prompt_len:] != ref[row, prompt_len:]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])
        top2 = want.scores[step][row].float().topk(2).values
        margin, ulp = (top2[0] - top2[1]).item(), eps * top2[0].abs().item()
        assert margin <= TIE_ULPS * ulp, (
            f"row {row} parts from the reference at generated token {step}, where its best two "
            f"logits are {margin:.3g} apart (> {TIE_ULPS} units of rounding, {ulp:.3g} each)")


def test_beam_search(models):
    ours, ref = models
    ids = prompt_ids(4, 1, 16)
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False)
    got = ours.generate(ids, past_key_values=paged_cache(ours, num_blocks=32), **kw)
    assert torch.equal(got, ref.generate(ids, **kw))


def test_streaming_llm_with_a_16_bit_model(models):
    """StreamingLLM on the 16-bit model vs the same weights in float32 on pagedkv: the same
    stream of tokens (teacher-forced) keeps logits within a 16-bit tolerance, and the cache
    stays within its sink + window (+ the newest token)."""
    ours, _ = models
    wide = LlamaForCausalLM(llama_config()).eval()
    wide.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    s = pagedkv.StreamingLLM(4, 28)
    c16 = paged_cache(ours, num_blocks=8, block_size=8, streaming=s)
    c32 = paged_cache(wide, num_blocks=8, block_size=8, streaming=s)
    ids = prompt_ids(5, 1, 20)
    with torch.no_grad():
        _close(wide(ids, past_key_values=c32).logits, ours(ids, past_key_values=c16).logits,
               "prompt")
        for t, tok in enumerate(prompt_ids(6, 1, 60)[0]):
            x = tok.view(1, 1)
            _close(wide(x, past_key_values=c32).logits, ours(x, past_key_values=c16).logits,
                   f"step {t}")
    held = c16.paged.seq_len(c16.sequence_ids[0])
    assert held == c32.paged.seq_len(c32.sequence_ids[0]) and 4 + 28 <= held <= 4 + 28 + 1
