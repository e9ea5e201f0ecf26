"""Hugging Face transformers drop-in: pagedkv as the KV cache and the attention of ``generate()``.

    from pagedkv.integrations.hf import paged_cache
    cache = paged_cache(model, num_blocks=2048)          # also switches the model's attention
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    print(cache.paged.stats())                           # the PagedKVCache underneath

Many requests at once: ``ContinuousBatcher`` (continuous batching on the same layer groups;
it lives in ``pagedkv/integrations/batching.py`` and is re-exported here).  The layer groups
are ``layers.py``'s, the "pagedkv" attention function ``attention.py``'s (both re-exported);
``RowLinears`` (``linear.py``, re-exported) puts a model's small-batch linear layers on
``pagedkv.linear``, as the batcher does.

Needs the ``hf`` extra (``pip install 'pagedkv[hf]'``: transformers 5.x and torch); ``import
pagedkv`` never imports either.  Inference only (no autograd through the attention).

How the pieces meet (transformers 5.x calls ``cache.update(k, v, layer_idx)`` and then the
model's attention function, which is never handed the cache):

- ``PagedCache`` is a ``transformers.Cache`` with one ``PagedLayer`` per decoder layer.  Layers
  form groups by attention type ("full_attention", "sliding_attention": ``layer_groups``);
  each group has one ``PagedKVCache`` (its own pool and block tables) and one sequence per
  batch row (``_Rows``).  A sliding group with window W trims every sequence to its last
  W - 1 tokens before each step (``StreamingLLM(0, W - 1)``), so its memory stays bounded,
  and passes ``window=W`` to the kernels (the query at rank i sees ranks (i - W, i], as
  transformers' sliding mask; a longer prompt's early queries need it).
- ``PagedLayer.update`` writes nothing: it keeps the new K/V pending and returns the new key
  tensor with the attribute ``_pagedkv_layer`` set to the layer.  That attribute is the link:
  the ``"pagedkv"`` attention function finds the layer on the key tensor it receives.
- The attention function reads which of the new tokens are real (not padding) from the mask,
  appends only those to each row's sequence (padding is never stored, so nothing ever
  attends to it), then, for a prompt with nothing cached before it (``prompt_attention=
  "torch"``), runs transformers' sdpa over the new tokens' own K/V, else pagedkv's kernels
  over the pages: ``attend_batch`` for a decode
  step of the whole batch, ``attend`` (causal) per row for prefills and chunks.  GQA reads
  KV head ``h // (Hq // Hkv)`` directly, no ``repeat_kv``; K/V/Q/output are NumPy views of
  the torch tensors (copied only where the model's layout is not contiguous).
- The mask is transformers' own boolean sdpa mask, registered under the name "pagedkv"
  (``AttentionMaskInterface``): without a registered mask function transformers passes
  ``attention_mask=None`` and left-padded batches would attend to their padding.  ``None``
  still comes for plain causal batches and means "every new token is real".
- The attention module's ``sliding_window``, ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's
  learned sinks) become the kernels' ``window`` / ``softcap`` / ``sinks`` options; a window
  other than the one the layer's group was built for raises.
- A key tensor without the link (the model was called without a ``PagedCache``, e.g. a
  ``DynamicCache`` or ``use_cache=False``) is handled by transformers' sdpa attention (the
  module's eager attention where it needs softcap or sinks, which sdpa lacks), so a
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
whose cache (``cache=``, or ``past_key_values=`` before transformers 5.24) is a streaming
``PagedCache``, replaces (cos, sin) by (1, 0) — the
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
    from transformers import Cache
    from transformers.cache_utils import CacheLayerMixin
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("pagedkv.integrations.hf needs transformers and torch: "
                      "pip install 'pagedkv[hf]'") from e

from pagedkv._core import simd_backend
from pagedkv.cache import PagedKVCache
from pagedkv.integrations.attention import (ATTENTION_NAME, LINK, pagedkv_attention,  # noqa: F401
                                            register, switch_attention)
from pagedkv.integrations.batching import ContinuousBatcher
from pagedkv.integrations.layers import (FULL, group_layers, layer_groups, layer_windows,
                                         sliding_policy)
from pagedkv.integrations.linear import RowLinears
from pagedkv.integrations.pools import (TORCH_DTYPES, blocks_per_group, model_geometry,
                                        resolve_num_blocks, single_group)
from pagedkv.integrations.step import numpy_view
from pagedkv.rope import RoPE
from pagedkv.streaming import StreamingLLM

__all__ = ["ATTENTION_NAME", "ContinuousBatcher", "PagedCache", "PagedLayer", "RowLinears",
           "layer_groups", "layer_windows", "paged_cache", "register"]



def paged_cache(model, num_blocks=None, block_size: int = 16, kv_dtype: Optional[str] = None,
                streaming: Optional[StreamingLLM] = None, max_seqs: int = 256,
                kv_cache_bytes: Optional[int] = None,
                prompt_attention: str = "auto") -> "PagedCache":
    """A ``transformers.Cache`` backed by pagedkv, for ``past_key_values=``.

    Also registers the "pagedkv" attention and switches ``model`` to it (the model then uses
    transformers' own attention for any other cache, see the module docstring).

    Layers form groups by attention type, each group one ``PagedKVCache`` (its own pool and
    block tables): "full_attention" keeps every token; "sliding_attention" (a window of W
    tokens) keeps the last W - 1 before each step (StreamingLLM with no sinks: blocks that
    left the window return to its pool), so it holds about ``ceil((W + n) / block_size) + 1``
    blocks per sequence however long the stream.  Most models have one group.

    Args:
        model: a transformers decoder model (float32, float64, bfloat16 or float16 weights),
            e.g. LlamaForCausalLM.  16-bit models hand their tensors to the kernels as they
            are (no copy): the kernels compute in float32 and round the output once.
        num_blocks: blocks in each group's pool (all of the group's layers and batch rows share
            it), or a dict {group name: blocks} (names: ``layer_groups(model)``).
        block_size: tokens per block.
        kv_dtype: storage dtype of K/V (None: the model's dtype); passed to ``PagedKVCache``.
        streaming: None or ``pagedkv.StreamingLLM(sink_tokens, window_tokens)`` (see above;
            not with sliding-window models).
        max_seqs: live sequences at most (one per batch row, beams included).
        kv_cache_bytes: a memory budget instead of ``num_blocks``: as many blocks as fit,
            split across the groups by their layers (every group gets the same number of
            blocks; ``cache.paged.num_blocks`` / ``cache.groups`` tell how many).
        prompt_attention: how a prompt with nothing cached before it attends. "torch":
            over its own K/V with transformers' sdpa attention, as DynamicCache runs it,
            while its K/V are written into the pages; "pagedkv": pagedkv's causal prefill
            kernel over the pages; "auto" (default): "pagedkv" for float32 and float64
            models stored in their own dtype on the AVX-512 paths, where the prefill kernel
            measured faster than torch's (``prompt_kernel_default``), else "torch".  Every later step (decode, a
            second turn, chunks) runs pagedkv's kernels.  Under StreamingLLM, and for layers
            with logit softcapping or learned sinks, prompts always run the kernels.

    Returns:
        a ``PagedCache``; ``cache.paged`` is the ``PagedKVCache`` (one group),
        ``cache.groups`` maps each group's name to its ``PagedKVCache``.

    Raises:
        NotImplementedError: the model has layers pagedkv cannot run (the message names them).
    """
    if prompt_attention not in ("auto", "torch", "pagedkv"):
        raise ValueError(f"prompt_attention must be 'auto', 'torch' or 'pagedkv', "
                         f"got {prompt_attention!r}")
    config = model.config.get_text_config(decoder=True)
    geometry = model_geometry(model)  # CPU, dtype and attention checks
    dtype, num_kv_heads, head_dim = (geometry["dtype"], geometry["num_kv_heads"],
                                     geometry["head_dim"])
    windows = layer_windows(config)
    groups = group_layers(windows)
    if kv_cache_bytes is not None or num_blocks is None:
        num_blocks = _blocks_by_budget(num_blocks, kv_cache_bytes, groups, block_size,
                                       num_kv_heads, head_dim, dtype, kv_dtype)
    blocks_of = blocks_per_group(num_blocks, groups)
    base = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                max_seqs=max_seqs)
    if dtype in ("bfloat16", "float16"):
        base["raw16"] = True  # torch's 16-bit tensors reach the kernels as uint16 views
    if kv_dtype is not None:
        if "kv_dtype" not in inspect.signature(PagedKVCache.__init__).parameters:
            raise TypeError(f"kv_dtype={kv_dtype!r} needs a PagedKVCache that accepts kv_dtype "
                            "(storage formats); the installed pagedkv's does not")
        base["kv_dtype"] = kv_dtype
    if streaming is not None:
        if not isinstance(streaming, StreamingLLM):
            raise TypeError(f"streaming must be None or a pagedkv.StreamingLLM, "
                            f"got {type(streaming).__name__}")
        if any(w is not None for w in windows):
            raise NotImplementedError(
                "streaming= (StreamingLLM) with a model that has sliding-window layers: its "
                "sliding layers already keep bounded memory; use paged_cache without streaming")
        base["streaming"] = streaming
        base["rope"] = _rope_of(config, head_dim)
    caches = {}
    for name, (w, layers) in groups.items():
        kw = dict(base, num_blocks=blocks_of[name], num_layers=len(layers))
        if w is not None:  # keep the last w - 1 tokens before each step
            kw["streaming"] = sliding_policy(w)
        caches[name] = PagedKVCache(**kw)
    if streaming is not None:
        _install_rotary_gate(model)
    switch_attention(model)
    cache = PagedCache(caches, {name: layers for name, (w, layers) in groups.items()}, windows)
    if prompt_attention == "auto":
        prompt_attention = "pagedkv" if prompt_kernel_default(dtype, kv_dtype) else "torch"
    for rows in cache.group_rows.values():
        rows.torch_prompts = prompt_attention == "torch"
    return cache


def prompt_kernel_default(dtype: str, kv_dtype: Optional[str] = None) -> bool:
    """Whether ``prompt_attention="auto"`` runs a fresh prompt through pagedkv's prefill kernel
    (else torch's sdpa over the prompt's own K/V): for float32 and float64 models stored in
    their own dtype, on the AVX-512 paths.  There the kernel measured faster than torch's sdpa
    (causal prefill f32, Hq=32 Hkv=8: 1.1-1.3x on an Intel Xeon at 2,048-4,096 tokens, about
    1.0x at 8,192-16,384 on one thread; 2.2x on an AMD Zen 5 at 2,048); on AVX2 (AMD Zen 3) it
    ran 0.89-0.92x at 4,096; narrower storage converts every K/V value it reads (bfloat16
    storage: prefill about 1.35x the float32 time; on the avx512amx path, whose bfloat16 scores
    run in AMX tiles, about 0.9x, and a float32 model's whole pass over a 2,048-4,096-token
    prompt 2-5% faster than torch's, but over the bfloat16-rounded K/V where torch uses the
    prompt's own: left to torch), and 16-bit models and NEON were not compared
    (docs/performance.md)."""
    return (dtype in ("float32", "float64") and kv_dtype in (None, dtype)
            and simd_backend() in ("avx512", "avx512vnni", "avx512bf16", "avx512amx"))


def _blocks_by_budget(num_blocks, kv_cache_bytes, groups, block_size, num_kv_heads, head_dim,
                      dtype, kv_dtype) -> dict:
    """{group: blocks} from ``kv_cache_bytes``, split across the groups by their layers (so
    every group gets the same number of blocks); TypeError without a budget or with both."""
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or
                                       not isinstance(kv_cache_bytes, (int, np.integer))):
        raise TypeError(f"kv_cache_bytes must be an int, got {type(kv_cache_bytes).__name__}")
    total_layers = sum(len(layers) for _, layers in groups.values())
    out = {}
    for name, (_, layers) in groups.items():
        geometry = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=len(layers),
                        dtype=dtype)
        share = None if kv_cache_bytes is None else \
            int(kv_cache_bytes) * len(layers) // total_layers
        out[name] = resolve_num_blocks(num_blocks, share, block_size, geometry, kv_dtype)
    return out


class _Rows:
    """What all layers share: the PagedKVCache and one sequence per batch row.

    ``skipped[b]`` lists the stream positions of row b that were padding (never stored), so
    that ``crop`` can map a stream length to a stored length.
    """

    def __init__(self, paged: PagedKVCache, window: Optional[int] = None, name: str = FULL):
        self.paged = paged
        self.window = window  # sliding window of the group's layers (None: full attention)
        self.name = name
        self.torch_prompts = True  # paged_cache's prompt_attention (False: "pagedkv")
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

    def plan_crop(self, new_len: int) -> list:
        """Check a crop to ``new_len`` stream positions; returns its plan (changes nothing)."""
        if self.sids is None:
            return []
        keep = []
        for b, s in enumerate(self.sids):
            skipped = [p for p in self.skipped[b] if p < new_len]
            stored = new_len - len(skipped)  # tokens the row keeps, counted from its first
            kept = self.paged.kept_positions(s)
            first = int(kept[0]) if len(kept) else 0  # tokens a sliding group dropped
            if first > 0 and first > stored - (self.window - 1):
                raise ValueError(
                    f"cannot crop to {new_len} positions: the {self.name!r} layers keep only "
                    f"their last {self.window - 1} tokens and those before position {first} "
                    "of a row are gone")
            keep.append((stored - first, skipped))
        for (length, _), s in zip(keep, self.sids):
            if length > self.paged.seq_len(s):
                raise ValueError(f"cannot crop to {new_len} positions: a row holds only "
                                 f"{self.paged.seq_len(s)} tokens")
        return keep

    def apply_crop(self, keep: list) -> None:
        for (length, skipped), s, b in zip(keep, self.sids or [], range(len(keep))):
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

    def __init__(self, rows: _Rows, layer_idx: int, local_idx: Optional[int] = None):
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx  # the model's layer
        self.local_idx = layer_idx if local_idx is None else local_idx  # in its group's cache
        self.window = rows.window
        self.is_sliding = rows.window is not None
        self.seen = 0  # stream positions so far, padding included (transformers' length)
        self.pending = None
        self.peers: List[PagedLayer] = [self]  # every layer of the PagedCache, by model index
        self.is_initialized = True

    @property
    def is_croppable(self) -> bool:
        return self.rows.paged.streaming is None or self.window is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx}: the K/V of the previous step were never attended: "
                f"a PagedCache needs the model's attention to be {ATTENTION_NAME!r} "
                "(paged_cache(model, ...) switches it; model.config._attn_implementation is "
                "what the model uses now), called with the key tensor that update returned "
                "(a model that reshapes or repeats the K/V between update and attention, as "
                "JetMoE does, cannot run on pagedkv)")
        if key_states.dtype != value_states.dtype or key_states.shape != value_states.shape:
            raise ValueError(f"keys {tuple(key_states.shape)} {key_states.dtype} and values "
                             f"{tuple(value_states.shape)} {value_states.dtype} must match")
        self.rows.ensure(key_states.shape[0])
        self.pending = (key_states, value_states)  # `seen` grows once they are stored
        setattr(key_states, LINK, self)
        return key_states, value_states

    def reused_by(self, layer_idx: int, key, value) -> "PagedLayer":
        """The layer ``layer_idx`` of this cache, given this layer's new K/V (returned by its
        ``update``) to store and attend over as its own: a model whose later layers reuse an
        earlier layer's K/V (Gemma 3n's ``num_kv_shared_layers``) calls their attention with
        the earlier layer's keys.  Each such layer keeps its own copy in its group's pages."""
        if not 0 <= layer_idx < len(self.peers) or self.peers[layer_idx] is None:
            raise RuntimeError(f"layer {layer_idx} attends over layer {self.layer_idx}'s K/V "
                               "but this cache has no such layer")
        other = self.peers[layer_idx]
        if other.pending is not None:
            raise RuntimeError(f"layer {layer_idx} attends over layer {self.layer_idx}'s K/V "
                               "while its own new K/V were never attended")
        if other.window != self.window:
            raise NotImplementedError(
                f"layer {layer_idx} (window {other.window}) attends over the K/V of layer "
                f"{self.layer_idx} (window {self.window}): pagedkv keeps a layer's K/V for "
                "its own window")
        other.pending = (key, value)
        return other

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def attend(self, query, attention_mask, scaling, window=None, softcap=None,
               sinks=None, own_kv=None) -> "torch.Tensor":
        """Store the pending K/V of the new tokens and attend; ``own_kv(key, value)``: torch's
        attention over the new tokens' own K/V, used for a fresh prompt (see paged_cache's
        ``prompt_attention``)."""
        if self.pending is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: attention without new K/V from update (the layer "
                "attends twice in one step, which pagedkv does not support)")
        key, value = self.pending
        self.pending = None
        paged, rows = self.rows.paged, self.rows
        B, hq, T, D = query.shape
        dtype = TORCH_DTYPES.get(query.dtype)
        if dtype is None or dtype != paged.dtype_name or key.dtype != query.dtype:
            raise TypeError(f"the cache holds {paged.dtype_name} arrays; the model gave queries "
                            f"{query.dtype} and keys {key.dtype}")
        if key.shape[0] != B or key.shape[2] != T:
            raise ValueError(f"queries {tuple(query.shape)} and the pending keys "
                             f"{tuple(key.shape)} disagree in batch or length")
        real = _real_tokens(attention_mask, B, T)
        layer = self.local_idx
        # nothing before these tokens: their attention is over their own K/V, which torch
        # runs as fast as DynamicCache does (no RoPE by rank, softcap or sinks to apply)
        fresh = (own_kv is not None and rows.torch_prompts and self.seen == 0 and T > 1
                 and paged.rope is None and softcap is None and sinks is None)
        opts = dict(window=window, softcap=softcap, sinks=sinks)
        q = numpy_view(query).transpose(0, 2, 1, 3)   # [B, T, Hq, D], a view
        k = numpy_view(key).transpose(0, 2, 1, 3)     # [B, T, Hkv, D]
        v = numpy_view(value).transpose(0, 2, 1, 3)
        if T == 1 and real is None:  # a decode step of the whole batch: one call each
            out = torch.empty((B, T, hq, D), dtype=query.dtype)
            paged.append_batch(rows.sid_array, k[:, 0], v[:, 0], layer=layer)
            self.seen += 1
            paged.attend_batch(rows.sid_array, q[:, 0], layer=layer, scale=scaling,
                               out=numpy_view(out)[:, 0], **opts)
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
        if fresh:
            return own_kv(key, value)
        out = torch.empty((B, T, hq, D), dtype=query.dtype)  # the kernels write it
        o = numpy_view(out)
        for b, sid in enumerate(rows.sids):
            if real is None:
                paged.attend(sid, q[b], layer=layer, scale=scaling, out=o[b], **opts)
                continue
            o[b] = 0.0
            if real[b].any():
                o[b][real[b]] = paged.attend(sid, q[b][real[b]], layer=layer, scale=scaling,
                                             **opts)
        return out


def _real_tokens(mask, B: int, T: int) -> Optional[np.ndarray]:
    """Which of the T new tokens of each row are real, [B, T] bool, or None when all are.

    ``mask`` is the "pagedkv" (= sdpa) boolean mask [B, 1, Tq, kv_len] or None (causal, no
    padding).  A real query sees itself and a padding query sees nothing, so the diagonal of
    the new tokens' block (the last T columns) names the real new tokens, whatever the window.
    Only causal masks with key padding are supported.
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
    new = mask[:, 0, -T:, mask.shape[-1] - T:]
    diag = torch.diagonal(new, dim1=-2, dim2=-1)  # [B or 1, T]
    if bool(diag.all()):
        return None
    return diag.expand(B, T).numpy().copy()


class PagedCache(Cache):
    """A ``transformers.Cache`` whose K/V live in pagedkv caches, one per layer group.

    Build it with ``paged_cache(model, ...)``.  One sequence per batch row in each group;
    a group's layers share its pool.  Row operations map onto fork / truncate / free in every
    group (see the module docstring).
    """

    def __init__(self, caches, group_layers=None, windows=None):
        if isinstance(caches, PagedKVCache):  # one group of num_layers full-attention layers
            n = int(group_layers)
            caches, group_layers, windows = {FULL: caches}, {FULL: list(range(n))}, [None] * n
        self.group_rows = {name: _Rows(c, windows[group_layers[name][0]], name)
                           for name, c in caches.items()}
        layers: List[Optional[PagedLayer]] = [None] * len(windows)
        for name, idx in group_layers.items():
            for local, i in enumerate(idx):
                layers[i] = PagedLayer(self.group_rows[name], i, local)
        for layer in layers:
            layer.peers = layers
        self.rows = next(iter(self.group_rows.values()))
        super().__init__(layers=layers)

    @property
    def groups(self) -> dict:
        """{group name: PagedKVCache}: "full_attention", "sliding_attention"."""
        return {name: r.paged for name, r in self.group_rows.items()}

    @property
    def paged(self) -> PagedKVCache:
        """The PagedKVCache of a model with one layer group (see ``groups`` otherwise)."""
        return single_group(self.groups, "cache")

    @property
    def streaming(self) -> Optional[StreamingLLM]:
        """The StreamingLLM policy given to ``paged_cache`` (None without)."""
        if len(self.group_rows) == 1 and self.rows.window is None:
            return self.rows.paged.streaming
        return None

    @property
    def sequence_ids(self) -> List[int]:
        """The PagedKVCache sequence id of each batch row (one group; empty before the first
        forward); ``group_sequence_ids`` for every group."""
        self.paged  # noqa: B018 - raises for several groups
        return list(self.rows.sids or [])

    @property
    def group_sequence_ids(self) -> dict:
        """{group name: the sequence id of each batch row in that group's cache}."""
        return {name: list(r.sids or []) for name, r in self.group_rows.items()}

    def stats(self) -> dict:
        """{group name: CacheStats} (blocks, tokens, ... of each group's pool)."""
        return {name: r.paged.stats() for name, r in self.group_rows.items()}

    def _each(self, fn) -> None:
        for r in self.group_rows.values():
            fn(r)

    def reorder_cache(self, beam_idx) -> None:
        rows = _index_list(beam_idx)
        self._each(lambda r: r.select(rows))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows.sids is not None:
            rows = [r for r in range(len(self.rows.sids)) for _ in range(int(repeats))]
            self._each(lambda r: r.select(rows))

    def batch_select_indices(self, indices) -> None:
        rows = _index_list(indices)
        self._each(lambda r: r.select(rows))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers 5 convention:
        a negative count, or 0).  A sliding-window group can roll back only as far as it
        still holds the window the next token needs (ValueError otherwise, nothing changed)."""
        n = int(tokens_to_remove)
        if n > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {n}")
        if n == 0:
            return
        if self.streaming is not None:
            raise ValueError("a StreamingLLM cache cannot be cropped: evicted tokens are gone")
        seen = self.layers[0].seen
        new_len = max(seen + n, 0)
        plans = [(r, r.plan_crop(new_len)) for r in self.group_rows.values()]  # all or nothing
        for r, keep in plans:
            r.apply_crop(keep)
        for layer in self.layers:
            layer.seen = new_len
            layer.pending = None

    def reset(self) -> None:
        """Free every row's sequence; the cache starts over (same pools)."""
        self._each(lambda r: r.release())
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
        # transformers 5.24 passes the cache to the base model as `cache`; earlier 5.x as
        # `past_key_values`
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
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
