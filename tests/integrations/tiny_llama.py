"""What the transformers tests share: the skip when the hf extra is missing (import this module
before torch), a tiny random Llama twice with the same weights, and random prompts."""
import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra (transformers, torch) is not installed: pip install '.[hf]'",
                allow_module_level=True)

import torch  # noqa: E402

import pagedkv  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 96
#: 2 layers, 4 query heads, 2 KV heads, head_dim 16; nothing downloaded
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            pad_token_id=0, eos_token_id=None, bos_token_id=None)


def llama_config(**kw):
    return LlamaConfig(**{**TINY, **kw})


def twin_llamas(seed, dtype=None):
    """(model for pagedkv, reference model): the same random weights in two modules; the
    reference has its own config, so it keeps sdpa attention."""
    torch.manual_seed(seed)
    ours = LlamaForCausalLM(llama_config()).eval()
    ref = LlamaForCausalLM(llama_config()).eval()
    if dtype is not None:
        ours, ref = ours.to(dtype), ref.to(dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def prompt_lists(seed, lengths):
    """One random prompt (a list of ids, never the pad id 0) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def left_padded(seed, length, pads):
    """(ids, attention mask) of len(pads) random prompts, row i left-padded by pads[i] (id 0)."""
    ids = prompt_ids(seed, len(pads), length)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
    ids[mask == 0] = 0
    return ids, mask


def prompt_ids(seed, batch, length):
    """[batch, length] random token ids (never the pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second thread only adds barrier waits (seconds each on a loaded
    machine).  Restored afterwards."""
    before = torch.get_num_threads(), pagedkv.get_num_threads()
    torch.set_num_threads(1)
    pagedkv.set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    pagedkv.set_num_threads(before[1])
