"""Hugging Face transformers drop-in: pagedkv as the KV cache and the attention of ``generate()``.

    from pagedkv.integrations.hf import paged_cache
    cache = paged_cache(model, num_blocks=2048)          # also switches the model's attention
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    print(cache.paged.stats())                           # the PagedKVCache underneath

Needs the ``hf`` extra (``pip install 'pagedkv[hf]'``: transformers 5.x and torch); ``import
pagedkv`` never imports either.  Inference only (no autograd through the attention).

How the pieces meet (transformers 5.x calls ``cache.update(k, v, layer_idx)`` and then the
model's attention function, which is never handed the cache):

- ``PagedCache`` is a ``transformers.Cache`` with one ``PagedLayer`` per decoder layer; all
  layers share one ``PagedKVCache`` (one pool) and one sequence per batch row (``_Rows``).
- ``PagedLayer.update`` writes nothing: it keeps the new K/V pending and returns the new key
  tensor with the attribute ``_pagedkv_layer`` set to the layer.  That attribute is the link:
  the ``"pagedkv"`` attention function finds the layer on the key tensor it receives.
- The attention function reads which of the new tokens are real (not padding) from the mask,
  appends only those to each row's sequence (padding is never stored, so nothing ever
  attends to it), then runs pagedkv's kernels over the pages: ``attend_batch`` for a decode
  step of the whole batch, ``attend`` (causal) per row for prefills and chunks.  GQA reads
  KV head ``h // (Hq // Hkv)`` directly, no ``repeat_kv``; K/V/Q/output are NumPy views of
  the torch tensors (copied only where the model's layout is not contiguous).
- The mask is transformers' own boolean sdpa mask, registered under the name "pagedkv"
  (``AttentionMaskInterface``): without a registered mask function transformers passes
  ``attention_mask=None`` and left-padded batches would attend to their padding.  ``None``
  still comes for plain causal batches and means "every new token is real".
- A key tensor without the link (the model was called without a ``PagedCache``, e.g. a
  ``DynamicCache`` or ``use_cache=False``) is handled by transformers' sdpa attention, so a
  model switched to "pagedkv" keeps working with any cache.
- Beam search, ``num_return_sequences``, contrastive search and assisted decoding reorder,
  repeat, select or crop batch rows: ``reorder_cache`` / ``batch_repeat_interleave`` /
  ``batch_select_indices`` keep one surviving row's sequence and ``fork`` the others
  (copy-on-write: no token is copied), free the rows nobody selected; ``crop`` truncates.

StreamingLLM (``streaming=pagedkv.StreamingLLM(S, R)``) follows the paper's semantics exactly:
every sequence is cut to its first S and last R tokens before each append, and RoPE positions
are ranks inside the cache.  transformers rotates keys and queries by their position in the
stream *before* the cache sees them, so the choice made here is to **store keys un-rotated**:
``paged_cache`` puts a forward hook on the model's rotary embedding that, only during a forward
whose ``past_key_values`` is a streaming ``PagedCache``, replaces (cos, sin) by (1, 0) — the
rotation becomes the identity, exactly — and the ``PagedKVCache`` is built with
``rope=RoPE(theta, rotary_dim)`` from the model's config, so the kernels rotate keys and queries
by cache rank at every step.  The alternative (re-rotating stored keys by rank minus position)
re-rounds every key at every eviction.  Only the "default" RoPE type is supported there.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Sequence

import numpy as np

try:
    import torch
    from transformers import AttentionInterface, Cache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("pagedkv.integrations.hf needs transformers and torch: "
                      "pip install 'pagedkv[hf]'") from e

from pagedkv.cache import PagedKVCache
from pagedkv.rope import RoPE
from pagedkv.streaming import StreamingLLM

__all__ = ["ATTENTION_NAME", "PagedCache", "PagedLayer", "paged_cache", "register"]

ATTENTION_NAME = "pagedkv"
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}
_LINK = "_pagedkv_layer"


def register() -> None:
    """Register the "pagedkv" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def paged_cache(model, num_blocks: int, block_size: int = 16, kv_dtype: Optional[str] = None,
                streaming: Optional[StreamingLLM] = None, max_seqs: int = 256) -> "PagedCache":
    """A ``transformers.Cache`` backed by a ``PagedKVCache``, for ``past_key_values=``.

    Also registers the "pagedkv" attention and switches ``model`` to it (the model then uses
    transformers' sdpa attention for any other cache, see the module docstring).

    Args:
        model: a transformers decoder model (float32, float64, bfloat16 or float16 weights),
            e.g. LlamaForCausalLM.  16-bit models hand their tensors to the kernels as they
            are (no copy): the kernels compute in float32 and round the output once.
        num_blocks: blocks in the pool; all layers and all batch rows share it.
        block_size: tokens per block.
        kv_dtype: storage dtype of K/V (None: the model's dtype); passed to ``PagedKVCache``.
        streaming: None or ``pagedkv.StreamingLLM(sink_tokens, window_tokens)`` (see above).
        max_seqs: live sequences at most (one per batch row, beams included).

    Returns:
        a ``PagedCache``; ``cache.paged`` is the ``PagedKVCache``.
    """
    config = model.config.get_text_config(decoder=True)
    if model.device.type != "cpu":
        raise ValueError(f"pagedkv runs on the CPU; the model is on {model.device}")
    dtype = _DTYPES.get(model.dtype)
    if dtype is None:
        raise TypeError(f"pagedkv takes float32, float64, bfloat16 or float16 models; the model "
                        f"is {model.dtype}")
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    kwargs = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, num_layers=num_layers, dtype=dtype, max_seqs=max_seqs)
    if dtype in ("bfloat16", "float16"):
        kwargs["raw16"] = True  # torch's 16-bit tensors reach the kernels as uint16 views
    if kv_dtype is not None:
        if "kv_dtype" not in inspect.signature(PagedKVCache.__init__).parameters:
            raise TypeError(f"kv_dtype={kv_dtype!r} needs a PagedKVCache that accepts kv_dtype "
                            "(storage formats); the installed pagedkv's does not")
        kwargs["kv_dtype"] = kv_dtype
    if streaming is not None:
        if not isinstance(streaming, StreamingLLM):
            raise TypeError(f"streaming must be None or a pagedkv.StreamingLLM, "
                            f"got {type(streaming).__name__}")
        kwargs["streaming"] = streaming
        kwargs["rope"] = _rope_of(config, head_dim)
        _install_rotary_gate(model)
    paged = PagedKVCache(**kwargs)
    register()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return PagedCache(paged, num_layers)


class _Rows:
    """What all layers share: the PagedKVCache and one sequence per batch row.

    ``skipped[b]`` lists the stream positions of row b that were padding (never stored), so
    that ``crop`` can map a stream length to a stored length.
    """

    def __init__(self, paged: PagedKVCache):
        self.paged = paged
        self.sids: Optional[List[int]] = None
        self.sid_array: Optional[np.ndarray] = None
        self.skipped: List[List[int]] = []

    def ensure(self, batch: int) -> None:
        if self.sids is not None:
            if len(self.sids) != batch:
                raise ValueError(f"this cache holds {len(self.sids)} batch rows but the model "
                                 f"was called with batch size {batch}; use a new cache (or "
                                 "cache.reset()) for another batch")
            return
        sids: List[int] = []
        try:
            for _ in range(batch):
                sids.append(self.paged.add_sequence())
        except BaseException:
            for s in sids:
                self.paged.free(s)
            raise
        self._set(sids, [[] for _ in range(batch)])

    def _set(self, sids: List[int], skipped: List[List[int]]) -> None:
        self.sids = sids
        self.sid_array = np.asarray(sids, dtype=np.int64)
        self.skipped = skipped

    def select(self, rows: Sequence[int]) -> None:
        """New row i continues old row ``rows[i]``: the first use of an old row keeps its
        sequence, every further use forks it, old rows nobody uses are freed."""
        if self.sids is None:
            return
        n = len(self.sids)
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not -n <= r < n]
        if bad:
            raise IndexError(f"batch row {bad[0]} out of range for {n} rows")
        rows = [r % n for r in rows]
        used = set()
        new_sids: List[int] = []
        forks: List[int] = []
        try:
            for r in rows:
                if r in used:
                    forks.append(self.paged.fork(self.sids[r]))
                    new_sids.append(forks[-1])
                else:
                    used.add(r)
                    new_sids.append(self.sids[r])
        except BaseException:
            for s in forks:
                self.paged.free(s)
            raise
        for r, s in enumerate(self.sids):
            if r not in used:
                self.paged.free(s)
        self._set(new_sids, [list(self.skipped[r]) for r in rows])

    def crop(self, new_len: int) -> None:
        """Keep the first ``new_len`` stream positions of every row."""
        if self.sids is None:
            return
        keep = []
        for b, s in enumerate(self.sids):
            skipped = [p for p in self.skipped[b] if p < new_len]
            keep.append((new_len - len(skipped), skipped))
        for (length, _), s in zip(keep, self.sids):
            if length > self.paged.seq_len(s):
                raise ValueError(f"cannot crop to {new_len} positions: a row holds only "
                                 f"{self.paged.seq_len(s)} tokens")
        for (length, skipped), s, b in zip(keep, self.sids, range(len(self.sids))):
            self.paged.truncate(s, length)
            self.skipped[b] = skipped

    def release(self) -> None:
        if self.sids is not None:
            for s in self.sids:
                self.paged.free(s)
        self.sids = self.sid_array = None
        self.skipped = []


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared pages (see the module docstring).

    ``update`` keeps the new K/V pending and returns the key tagged with this layer; the
    "pagedkv" attention function appends and attends.  ``keys``/``values`` stay None: the
    K/V live in ``cache.paged``.
    """

    is_sliding = False
    supports_early_init = False

    def __init__(self, rows: _Rows, layer_idx: int):
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx
        self.seen = 0  # stream positions so far, padding included (transformers' length)
        self.pending = None
        self.is_initialized = True

    @property
    def is_croppable(self) -> bool:
        return self.rows.paged.streaming is None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx}: the K/V of the previous step were never attended: "
                f"a PagedCache needs the model's attention to be {ATTENTION_NAME!r} "
                "(paged_cache(model, ...) switches it; model.config._attn_implementation is "
                "what the model uses now)")
        if key_states.dtype != value_states.dtype or key_states.shape != value_states.shape:
            raise ValueError(f"keys {tuple(key_states.shape)} {key_states.dtype} and values "
                             f"{tuple(value_states.shape)} {value_states.dtype} must match")
        self.rows.ensure(key_states.shape[0])
        self.pending = (key_states, value_states)  # `seen` grows once they are stored
        setattr(key_states, _LINK, self)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def attend(self, query, attention_mask, scaling) -> "torch.Tensor":
        key, value = self.pending
        self.pending = None
        paged, rows = self.rows.paged, self.rows
        B, hq, T, D = query.shape
        dtype = _DTYPES.get(query.dtype)
        if dtype is None or dtype != paged.dtype_name or key.dtype != query.dtype:
            raise TypeError(f"the cache holds {paged.dtype_name} arrays; the model gave queries "
                            f"{query.dtype} and keys {key.dtype}")
        if key.shape[0] != B or key.shape[2] != T:
            raise ValueError(f"queries {tuple(query.shape)} and the pending keys "
                             f"{tuple(key.shape)} disagree in batch or length")
        real = _real_tokens(attention_mask, B, T)
        layer = self.layer_idx
        q = _numpy(query).transpose(0, 2, 1, 3)   # [B, T, Hq, D], a view
        k = _numpy(key).transpose(0, 2, 1, 3)     # [B, T, Hkv, D]
        v = _numpy(value).transpose(0, 2, 1, 3)
        out = torch.empty((B, T, hq, D), dtype=query.dtype)
        o = _numpy(out)
        if T == 1 and real is None:  # a decode step of the whole batch: one call each
            paged.append_batch(rows.sid_array, k[:, 0], v[:, 0], layer=layer)
            self.seen += 1
            paged.attend_batch(rows.sid_array, q[:, 0], layer=layer, scale=scaling, out=o[:, 0])
            return out
        # every row's tokens first; if one row's append fails on layer 0, the rows before it
        # are truncated back, so the cache is unchanged (not under StreamingLLM: an append
        # there may have evicted tokens first)
        done = []
        try:
            for b, sid in enumerate(rows.sids):
                if real is None:
                    n_before = paged.seq_len(sid)
                    paged.append(sid, k[b], v[b], layer=layer)
                    done.append((sid, n_before))
                elif real[b].any():
                    n_before = paged.seq_len(sid)
                    paged.append(sid, k[b][real[b]], v[b][real[b]], layer=layer)
                    done.append((sid, n_before))
        except BaseException:
            if layer == 0 and paged.streaming is None:
                for sid, n_before in done:
                    paged.truncate(sid, n_before)
            raise
        if real is not None and layer == 0:
            for b in range(B):
                rows.skipped[b].extend((self.seen + np.flatnonzero(~real[b])).tolist())
        self.seen += T
        for b, sid in enumerate(rows.sids):
            if real is None:
                paged.attend(sid, q[b], layer=layer, scale=scaling, out=o[b])
                continue
            o[b] = 0.0
            if real[b].any():
                o[b][real[b]] = paged.attend(sid, q[b][real[b]], layer=layer, scale=scaling)
        return out


def _numpy(t) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy; strides kept); 16-bit floats as uint16 bits."""
    t = t.detach() if t.requires_grad else t
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _real_tokens(mask, B: int, T: int) -> Optional[np.ndarray]:
    """Which of the T new tokens of each row are real, [B, T] bool, or None when all are.

    ``mask`` is the "pagedkv" (= sdpa) boolean mask [B, 1, Tq, kv_len] or None (causal, no
    padding).  Its last query row allows every real key up to the newest token, so its last T
    columns name the real new tokens.  Only causal masks with key padding are supported.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 4:
        raise TypeError(f"the pagedkv attention expects the boolean [B, 1, Tq, kv_len] mask of "
                        f"the registered {ATTENTION_NAME!r} mask function, got "
                        f"{type(mask).__name__} {getattr(mask, 'dtype', '')} "
                        f"{tuple(getattr(mask, 'shape', ()))}")
    if mask.shape[-1] < T:
        raise ValueError(f"the mask covers {mask.shape[-1]} keys, fewer than the {T} new tokens")
    last = mask[:, 0, -1, mask.shape[-1] - T:]
    if bool(last.all()):
        return None
    return last.expand(B, T).numpy().copy()


def pagedkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """The "pagedkv" attention function (``transformers.AttentionInterface``).

    query [B, Hq, Tq, D], key/value as returned by the cache's ``update``; returns
    ``([B, Tq, Hq, D], None)``.  Without a ``PagedCache`` link on ``key``, transformers' sdpa
    attention runs instead.
    """
    layer = getattr(key, _LINK, None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the pagedkv attention does not support {name}")
    if dropout:
        raise NotImplementedError("the pagedkv attention is for inference: dropout must be 0 "
                                  "(call model.eval())")
    return layer.attend(query, attention_mask, scaling), None


class PagedCache(Cache):
    """A ``transformers.Cache`` whose K/V live in a ``PagedKVCache`` (``self.paged``).

    Build it with ``paged_cache(model, ...)``.  One sequence per batch row; all layers in
    one pool.  Row operations map onto fork / truncate / free (see the module docstring).
    """

    def __init__(self, paged: PagedKVCache, num_layers: int):
        self.rows = _Rows(paged)
        super().__init__(layers=[PagedLayer(self.rows, i) for i in range(num_layers)])

    @property
    def paged(self) -> PagedKVCache:
        return self.rows.paged

    @property
    def streaming(self) -> Optional[StreamingLLM]:
        return self.rows.paged.streaming

    @property
    def sequence_ids(self) -> List[int]:
        """The PagedKVCache sequence id of each batch row (empty before the first forward)."""
        return list(self.rows.sids or [])

    def reorder_cache(self, beam_idx) -> None:
        self.rows.select(_index_list(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows.sids is not None:
            self.rows.select([r for r in range(len(self.rows.sids)) for _ in range(int(repeats))])

    def batch_select_indices(self, indices) -> None:
        self.rows.select(_index_list(indices))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers 5 convention:
        a negative count, or 0)."""
        n = int(tokens_to_remove)
        if n > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {n}")
        if n == 0:
            return
        if self.streaming is not None:
            raise ValueError("a StreamingLLM cache cannot be cropped: evicted tokens are gone")
        seen = self.layers[0].seen
        new_len = max(seen + n, 0)
        self.rows.crop(new_len)
        for layer in self.layers:
            layer.seen = new_len
            layer.pending = None

    def reset(self) -> None:
        """Free every row's sequence; the cache starts over (same pool)."""
        self.rows.release()
        for layer in self.layers:
            layer.seen = 0
            layer.pending = None


def _index_list(idx) -> List[int]:
    if isinstance(idx, torch.Tensor):
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        return idx.tolist()
    idx = np.asarray(idx)
    if idx.dtype == bool:
        idx = np.flatnonzero(idx)
    return idx.tolist()


# ---------------------------------------------------------------------------
# StreamingLLM: keys and queries reach the cache un-rotated


def _rope_of(config, head_dim: int) -> RoPE:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_type != "default" or theta is None:
        raise ValueError(f"StreamingLLM needs the model's plain RoPE (rope_type 'default'); "
                         f"this model has rope_type {rope_type!r}")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * float(factor if factor is not None else 1.0))
    return RoPE(theta=float(theta), rotary_dim=None if rotary_dim == head_dim else rotary_dim)


class _RotaryGate:
    """On while the model runs a forward whose past_key_values is a streaming PagedCache."""

    def __init__(self):
        self.active = False

    def pre(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        self.active = isinstance(cache, PagedCache) and cache.streaming is not None

    def post(self, module, args, kwargs, output):
        self.active = False

    def rotary(self, module, args, output):
        if not self.active:
            return None
        cos, sin = output
        return torch.ones_like(cos), torch.zeros_like(sin)


def _install_rotary_gate(model) -> None:
    if getattr(model, "_pagedkv_rotary_gate", None) is not None:
        return
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"StreamingLLM needs a model with a shared rotary embedding module "
                         f"(`model.model.rotary_emb`, as in Llama); {type(model).__name__} "
                         "has none")
    gate = _RotaryGate()
    base.register_forward_pre_hook(gate.pre, with_kwargs=True)
    base.register_forward_hook(gate.post, with_kwargs=True)
    rotary.register_forward_hook(gate.rotary)
    model._pagedkv_rotary_gate = gate
