"""Continuous batching on the pages: ``ContinuousBatcher``.

    from pagedkv.integrations.hf import ContinuousBatcher
    b = ContinuousBatcher(model, kv_cache_bytes=256 << 20)
    rid = b.add_request(prompt_ids, max_new_tokens=64)
    for ev in b.step():             # one model forward over the scheduled batch
        print(ev.request_id, ev.new_tokens, ev.finished)
    outputs = b.run()               # {request id: generated ids (eos included)}

Requests join and leave a running batch between steps.  Each step is **one forward of the
model over one packed row** (the layout transformers' own continuous batching uses): first one
token of every decoding request, then chunks of prompts still being prefilled, no padding::

    row:        [ d0  d1  d2 | p3 p3 p3 p3 p3 | p4 p4 p4 ]      (T tokens <= max_batch_tokens)
    positions:  [ 57  12  90 |  0  1  2  3  4 | 16 17 18 ]      each request's own positions
    logits:     [  x   x   x |              x |          ]      rows that end a request's input

The model runs with ``position_ids`` for RoPE, a 4-D placeholder mask (so transformers builds
no mask at all) and ``logits_to_keep`` = the rows that end a request's input.  The plan of the
step travels to the ``"pagedkv"`` attention function as the keyword argument
``pagedkv_step``; for every layer it writes the new K/V into each request's pages and runs
each request over its own pages: ``append_batch`` + ``attend_batch`` for all decode tokens
at once, ``append`` + causal ``attend`` for each prefill chunk, in the layer's group.  Nothing
is padded and no request sees another's keys.

Layer groups (as ``paged_cache``: ``hf.layer_groups``): the layers of one attention type
share a ``PagedKVCache``, and a request holds one sequence in each group's cache.  A full
group keeps every token; a sliding group with window W keeps each sequence's last W - 1 tokens
before a step (``StreamingLLM(0, W - 1)``: blocks that left the window return to its pool) and
its kernels mask with ``window=W``, so it holds at most about ``ceil((W + n) / block_size) + 1``
blocks of a request that gets n tokens in a step.  Learned sinks (gpt-oss) and logit
softcapping (Gemma 2) pass to the kernels.  Prefix caching is refused with sliding groups (the
tokens they keep form no prefix).

Scheduling (vLLM v1's policy, in blocks of every group's pool):

- Running requests first, in admission order: a decode token each, or the next chunk of a
  prompt (chunked prefill) while ``max_batch_tokens`` lasts.  When the blocks a request needs
  for this step are not free in some group, the newest running request is preempted: its
  sequences are freed and it goes back to the front of the queue; later it is recomputed from
  its prompt plus the tokens it had generated (with prefix caching most of that is a cache
  hit).
- Then waiting requests, oldest first, while the step's token budget, ``max_seqs`` and the free
  blocks allow (none are admitted in a step that had to preempt).
- A request that could never fit (more blocks than a pool or one sequence may hold) is
  refused by ``add_request``.

Greedy requests produce exactly the tokens of the prompt's own ``model.generate(...)``; sampled
ones use their own ``torch.Generator`` (``seed=``), so their tokens do not depend on what else
is in the batch.
"""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("pagedkv.integrations.batching needs torch and transformers: "
                      "pip install 'pagedkv[hf]'") from e

from pagedkv.cache import PagedKVCache
# the scheduler's parts: the layer groups, the attention, the linear layers of small steps,
# pools (sizing), the packed step, per-request sampling
from pagedkv.integrations.attention import switch_attention
from pagedkv.integrations.layers import group_layers, layer_windows, sliding_policy
from pagedkv.integrations.linear import RowLinears
from pagedkv.integrations.pools import (DEFAULT_TOKENS_PER_SEQ, HALF_DTYPES, Group, group_blocks,
                                        model_geometry, num_blocks_for_bytes, single_group)
from pagedkv.integrations.sampling import Sampling, sample
from pagedkv.integrations.step import STEP_KWARG, StepPlan

__all__ = ["BatcherStats", "ContinuousBatcher", "StepEvent", "num_blocks_for_bytes"]


# ---------------------------------------------------------------------------
# requests, events, statistics


@dataclass(frozen=True)
class StepEvent:
    """What one step did for one request: the tokens it generated (one, or none for a
    request that finished by abort) and whether the request is done."""

    request_id: int
    new_tokens: List[int]
    finished: bool


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of a ContinuousBatcher."""

    running: int                  # requests holding a sequence in the cache
    waiting: int                  # queued (new or preempted)
    finished: int                 # completed requests (aborted ones not counted)
    aborted: int
    preemptions: int              # times a running request was preempted (recomputed later)
    steps: int                    # model forwards
    generated_tokens: int         # tokens sampled, all requests
    computed_tokens: int          # tokens run through the model (prompts, recomputes, decodes)
    prefix_hit_tokens: int        # tokens whose K/V came from the prefix cache at admission
    step_seconds: float           # time spent in step()
    tokens_per_s: float           # generated_tokens / step_seconds
    num_blocks: int               # blocks in the pools (chosen from kv_cache_bytes, or given)
    block_size: int
    free_blocks: int
    kv_cache_bytes: int           # blocks * bytes per block, every pool
    max_batch_tokens: int
    max_seqs: int
    group_blocks: Dict[str, Tuple[int, int]]  # {layer group: (blocks, free blocks)}


class _Request:
    __slots__ = ("rid", "tokens", "num_prompt", "max_new", "eos", "sampling", "sids", "computed",
                 "state", "t_added", "t_first")

    def __init__(self, rid: int, tokens: List[int], max_new: int, eos, sampling: Sampling):
        self.rid = rid
        self.tokens: List[int] = tokens          # prompt + generated
        self.num_prompt = len(tokens)
        self.max_new = max_new
        self.eos = eos
        self.sampling = sampling
        self.sids: Optional[List[int]] = None    # its sequence in each group's cache
        self.computed = 0                        # tokens whose K/V are in the caches
        self.state = "waiting"                   # waiting | running | finished | aborted
        self.t_added = time.perf_counter()
        self.t_first: Optional[float] = None

    @property
    def generated(self) -> List[int]:
        return self.tokens[self.num_prompt:]


# ---------------------------------------------------------------------------


class ContinuousBatcher:
    """Serve many generation requests at once on pagedkv's pages (see the module docstring
    for the packing, the scheduling and the layer groups).

    Args:
        model: a transformers decoder (float32, float64, bfloat16 or float16, on the CPU), e.g.
            LlamaForCausalLM, MistralForCausalLM, Gemma2ForCausalLM.  It is switched to the
            ``"pagedkv"`` attention (which falls back to transformers' attention whenever it
            is called without pagedkv's cache or batcher).
        num_blocks: blocks in each layer group's pool, a dict {group name: blocks}, or None to
            size the pools by ``kv_cache_bytes``.
        block_size: tokens per block.
        kv_dtype: K/V storage dtype (None: the model's; "bfloat16", "float16", "int8", ...).
        prefix_caching: prompts sharing full blocks of tokens reuse their K/V (not with
            sliding-window layers: NotImplementedError).
        max_batch_tokens: tokens in one step's packed row at most (decodes + prefill chunks).
        max_seqs: requests running at once at most.
        kv_cache_bytes: a memory budget for the pools instead of ``num_blocks``.  With neither,
            room for ``max_seqs`` sequences of 2048 tokens, at most 1 GiB.  A sliding group
            gets no more blocks than its running requests can hold at once; the rest of the
            budget goes to the other groups.
        linear_kernel: compute the model's float32 / float64 ``nn.Linear`` layers on steps'
            small inputs (at most 64 rows: decode steps, and the vocabulary projection of the
            rows that are sampled) with ``pagedkv.linear`` (``integrations/linear.py``), which
            reads each weight once for all rows; larger inputs stay with torch.  False: every
            matrix product is torch's.  Either way greedy tokens are the model's; the logits
            agree with torch's to float32 rounding.

    Raises:
        NotImplementedError: the model has layers pagedkv cannot run, or ``prefix_caching``
            with sliding-window layers (the messages name them).
    """

    def __init__(self, model, num_blocks: Optional[int] = None, block_size: int = 16,
                 kv_dtype: Optional[str] = None, prefix_caching: bool = False,
                 max_batch_tokens: int = 512, max_seqs: int = 64,
                 kv_cache_bytes: Optional[int] = None, linear_kernel: bool = True):

        for name, val in (("max_batch_tokens", max_batch_tokens), ("max_seqs", max_seqs),
                          ("block_size", block_size)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        geometry = model_geometry(model)
        config = model.config.get_text_config(decoder=True)
        windows = layer_windows(config)
        layer_groups = group_layers(windows)
        sliding = {name: w for name, (w, _) in layer_groups.items() if w is not None}
        if prefix_caching and sliding:
            raise NotImplementedError(
                f"ContinuousBatcher(prefix_caching=True) with sliding-window layers "
                f"({', '.join(f'{n!r}: window {w}' for n, w in sliding.items())}) in "
                f"{type(model).__name__}: a sliding group keeps only each sequence's last "
                "tokens, so a cached prefix would lack the K/V its sliding layers need; "
                "use prefix_caching=False")
        keep = {name: sliding_policy(w).window_tokens for name, w in sliding.items()}
        # more blocks than a sliding group's running requests ever hold at once: what each
        # keeps plus two straddled blocks, and the step's tokens
        caps = {name: int(max_seqs) * (-(-r // block_size) + 2) + -(-int(max_batch_tokens) //
                                                                  block_size)
                for name, r in keep.items()}
        blocks_of = group_blocks(num_blocks, kv_cache_bytes, layer_groups, block_size,
                                  geometry, kv_dtype, max_seqs * DEFAULT_TOKENS_PER_SEQ, caps)
        self._groups: List[Group] = []
        self._layer_of: List[Tuple[int, int]] = [(0, 0)] * len(windows)
        for name, (w, layers) in layer_groups.items():
            cache = PagedKVCache(num_blocks=blocks_of[name], block_size=block_size,
                                 kv_dtype=kv_dtype, max_seqs=max_seqs,
                                 prefix_caching=prefix_caching,
                                 streaming=None if w is None else sliding_policy(w),
                                 raw16=geometry["dtype"] in HALF_DTYPES,
                                 **dict(geometry, num_layers=len(layers)))
            for local, i in enumerate(layers):
                self._layer_of[i] = (len(self._groups), local)
            self._groups.append(Group(name, w, layers, cache))
        self.model = model
        self._linears = RowLinears(model) if linear_kernel else contextlib.nullcontext()
        self._prefix_caching = bool(prefix_caching)
        self.vocab_size = int(config.vocab_size)
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_seqs = int(max_seqs)
        switch_attention(model)
        # a 4-D mask is taken as prepared: transformers builds none (the plan is the mask)
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool)
        self._requests: Dict[int, _Request] = {}
        self._waiting: Deque[_Request] = collections.deque()
        self._running: List[_Request] = []
        # (request id, free blocks of each group) of the last admission that did not fit:
        # not retried until the free blocks change (a retry would repeat the prefix lookup)
        self._blocked: Optional[Tuple[int, Tuple[int, ...]]] = None
        self._next_id = 0
        self._preemptions = 0
        self._steps = 0
        self._generated = 0
        self._computed = 0
        self._reused = 0
        self._seconds = 0.0
        self._finished = 0
        self._aborted = 0

    @property
    def groups(self) -> Dict[str, PagedKVCache]:
        """{layer group name: its PagedKVCache}: "full_attention", "sliding_attention" (as
        ``hf.layer_groups(model)``)."""
        return {g.name: g.cache for g in self._groups}

    @property
    def cache(self) -> PagedKVCache:
        """The PagedKVCache of a model with one layer group (see ``groups`` otherwise)."""
        return single_group(self.groups, "batcher")

    # ------------------------------------------------------------------
    # requests

    def add_request(self, input_ids, max_new_tokens: int, eos_token_id=None,
                    do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, seed: Optional[int] = None) -> int:
        """Queue a request; returns its id.

        Args:
            input_ids: the prompt's token ids (a list, a 1-D array or tensor, or [1, n]).
            max_new_tokens: tokens to generate at most (>= 1).
            eos_token_id: None, an id or a list of ids that end the request (eos included
                in its output).
            do_sample: False for greedy; True samples with temperature / top_k (0: off) /
                top_p (1.0: off) from the request's own generator, seeded by ``seed``.

        Raises ValueError for an empty prompt, ``max_new_tokens < 1``, ids outside the
        vocabulary, bad sampling parameters, or a request that can never fit in the pool;
        nothing already queued or running is touched.
        """
        tokens = self._token_list(input_ids, "input_ids")
        if not tokens:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new = int(max_new_tokens)
        if eos_token_id is None:
            eos = frozenset()
        else:
            ids = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) \
                else [eos_token_id]
            eos = frozenset(self._token_list(list(ids), "eos_token_id"))
        sampling = Sampling.of(bool(do_sample), temperature, top_k, top_p, seed)
        # the K/V of the prompt and of every generated token but the last
        total = len(tokens) + max_new - 1
        for g in self._groups:
            need = g.peak_blocks(total, self.max_batch_tokens)
            limit = min(g.cache.num_blocks, g.cache.max_blocks_per_seq)
            if need > limit:
                raise ValueError(f"the request needs up to {need} blocks of the {g.name!r} "
                                 f"layers ({len(tokens)} prompt + {max_new} new tokens, "
                                 f"block_size {g.cache.block_size}) but their pool holds "
                                 f"{limit}: it could never run")
        rid = self._next_id
        self._next_id += 1
        req = _Request(rid, tokens, max_new, eos, sampling)
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def _token_list(self, ids, what: str) -> List[int]:
        if isinstance(ids, (list, tuple)):
            out = list(ids)
            for t in out:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"{what} must hold integer token ids, got "
                                     f"{type(t).__name__} {t!r}")
            out = [int(t) for t in out]
        else:  # a tensor or an array: integer ids, 1-D or [1, n]
            if isinstance(ids, torch.Tensor):
                bad_dtype = (ids.dtype.is_floating_point or ids.dtype.is_complex
                             or ids.dtype == torch.bool)
            else:
                ids = np.asarray(ids)
                bad_dtype = ids.dtype.kind not in "iu"
            if bad_dtype:
                raise ValueError(f"{what} must hold integer token ids, got {ids.dtype}")
            if ids.ndim == 2 and ids.shape[0] == 1:
                ids = ids[0]
            if ids.ndim != 1:
                raise ValueError(f"{what} must be 1-D (or [1, n]), got shape {tuple(ids.shape)}")
            out = ids.tolist()
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} holds {bad[0]}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return out

    def has_unfinished(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self._running or self._waiting)

    def abort(self, request_id: int) -> bool:
        """Stop a request now and return its blocks to the pools.  True if it was waiting or
        running, False if it had already finished or been aborted; KeyError for an id this
        batcher never gave out or whose output ``run`` already returned."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        if req.state == "running":
            self._running.remove(req)
            self._release(req)
        elif req.state == "waiting":
            self._waiting.remove(req)
        else:
            return False
        req.state = "aborted"
        self._aborted += 1
        return True

    def output(self, request_id: int) -> List[int]:
        """The tokens a request has generated so far (eos included)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        return list(req.generated)

    def run(self) -> Dict[int, List[int]]:
        """Step until every request is done; returns {request id: generated ids} of every
        finished request not returned by an earlier ``run`` (aborted ones left out).  The
        batcher then forgets the requests it returns and the aborted ones (``output`` /
        ``abort`` of their ids raise KeyError), so a long-lived batcher keeps no ended request
        once collected."""
        while self.has_unfinished():
            self.step()
        done = {rid: r.generated for rid, r in self._requests.items() if r.state == "finished"}
        for rid in [rid for rid, r in self._requests.items() if r.state in ("finished", "aborted")]:
            del self._requests[rid]
        return done

    # ------------------------------------------------------------------
    # one step

    def step(self) -> List[StepEvent]:
        """Schedule, run one model forward over the packed batch, sample; returns one event
        per request that got a token in this step."""
        t0 = time.perf_counter()
        decodes, chunks = self._schedule()
        if not decodes and not chunks:
            return []
        ids: List[int] = []
        pos: List[int] = []
        logit_rows: List[int] = []
        sampled: List[_Request] = []
        for req in decodes:
            ids.append(req.tokens[req.computed])
            pos.append(req.computed)
            if req.computed + 1 == len(req.tokens):
                logit_rows.append(len(ids) - 1)
                sampled.append(req)
        plan_chunks = []
        for req, n in chunks:
            c = req.computed
            plan_chunks.append((len(ids), n))
            ids.extend(req.tokens[c:c + n])
            pos.extend(range(c, c + n))
            if c + n == len(req.tokens):
                logit_rows.append(len(ids) - 1)
                sampled.append(req)
        plan = StepPlan(
            self._groups, self._layer_of,
            [np.array([r.sids[g] for r in decodes], dtype=np.int64)
             for g in range(len(self._groups))],
            [r.tokens[r.computed] for r in decodes] if self._prefix_caching else None,
            plan_chunks, [[r.sids[g] for r, _ in chunks] for g in range(len(self._groups))],
            len(ids))
        try:
            with torch.no_grad(), self._linears:
                logits = self.model(
                    input_ids=torch.tensor([ids], dtype=torch.long),
                    position_ids=torch.tensor([pos], dtype=torch.long),
                    attention_mask=self._mask, use_cache=False,
                    logits_to_keep=torch.tensor(logit_rows, dtype=torch.long),
                    **{STEP_KWARG: plan}).logits[0]
            if len(plan.attended) != len(self._layer_of):
                raise RuntimeError(
                    f"{len(self._layer_of) - len(plan.attended)} of the model's "
                    f"{len(self._layer_of)} layers attended without the batcher's step: "
                    f"{type(self.model).__name__}'s decoder layers do not pass the attention "
                    "keyword arguments through to its attention, so ContinuousBatcher cannot "
                    "run it (paged_cache with model.generate can)")
        except BaseException:
            # the layers may have stored part of the step: recompute every scheduled request
            for req in list(decodes) + [r for r, _ in chunks]:
                if req.state == "running":
                    self._preempt(req, count=False)
            raise
        for req in decodes:
            req.computed += 1
        for req, n in chunks:
            req.computed += n
        self._computed += len(ids)
        new_tokens = sample(logits, [req.sampling for req in sampled])
        now = time.perf_counter()
        events = []
        for req, tok in zip(sampled, new_tokens):
            req.tokens.append(tok)
            if req.t_first is None:
                req.t_first = now
            done = tok in req.eos or len(req.tokens) - req.num_prompt >= req.max_new
            if done:
                self._running.remove(req)
                self._release(req)
                req.state = "finished"
                self._finished += 1
            events.append(StepEvent(req.rid, [tok], done))
        self._generated += len(sampled)
        self._steps += 1
        self._seconds += time.perf_counter() - t0
        return events

    def _blocks_needed(self, req: _Request, n: int) -> List[int]:
        """Blocks each group must hand the request for n more tokens (a sliding group's
        blocks that leave what it keeps are not counted as returned)."""
        return [max(g.blocks_after(req.computed, n) - g.cache.num_seq_blocks(sid), 0)
                for g, sid in zip(self._groups, req.sids)]

    def _free_blocks(self) -> List[int]:
        return [g.cache.num_free_blocks for g in self._groups]

    def _schedule(self) -> Tuple[List[_Request], List[Tuple[_Request, int]]]:
        budget = self.max_batch_tokens
        planned = [0] * len(self._groups)
        decodes: List[_Request] = []
        chunks: List[Tuple[_Request, int]] = []
        preempted = False

        def short(need: List[int]) -> bool:
            return any(x > f - p for x, f, p in zip(need, self._free_blocks(), planned))

        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            n = min(len(req.tokens) - req.computed, budget)
            need = self._blocks_needed(req, n)
            while short(need):
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.state != "running":
                break  # it preempted itself: it was the newest, nothing follows it
            planned = [p + x for p, x in zip(planned, need)]
            budget -= n
            (decodes.append(req) if n == 1 else chunks.append((req, n)))
            i += 1
        while (self._waiting and budget > 0 and not preempted
               and len(self._running) < self.max_seqs):
            req = self._waiting[0]
            free_now = tuple(f - p for f, p in zip(self._free_blocks(), planned))
            if self._blocked == (req.rid, free_now):
                break  # it did not fit with exactly these blocks free: no new lookup
            self._add_sequences(req)
            n = min(len(req.tokens) - req.computed, budget)
            need = self._blocks_needed(req, n)
            if short(need):
                self._release(req)
                self._blocked = (req.rid, free_now)
                break
            self._blocked = None
            self._reused += req.computed
            self._waiting.popleft()
            req.state = "running"
            self._running.append(req)
            planned = [p + x for p, x in zip(planned, need)]
            budget -= n
            (decodes.append(req) if n == 1 else chunks.append((req, n)))
        return decodes, chunks

    def _add_sequences(self, req: _Request) -> None:
        """A sequence for the request in every group (with prefix caching, starting with the
        cached prefix of its tokens); all or none."""
        sids: List[int] = []
        try:
            for g in self._groups:
                if self._prefix_caching:
                    sids.append(g.cache.add_sequence(token_ids=req.tokens))
                else:
                    sids.append(g.cache.add_sequence())
        except BaseException:
            for g, sid in zip(self._groups, sids):
                g.cache.free(sid)
            raise
        req.sids = sids
        req.computed = self._groups[0].cache.seq_len(sids[0])

    def _release(self, req: _Request) -> None:
        if req.sids is not None:
            for g, sid in zip(self._groups, req.sids):
                g.cache.free(sid)
        req.sids = None
        req.computed = 0

    def _preempt(self, req: _Request, count: bool = True) -> None:
        """Free the request's sequence and queue it first again (recomputed later)."""
        self._running.remove(req)
        self._release(req)
        req.state = "waiting"
        self._waiting.appendleft(req)
        if count:
            self._preemptions += 1

    # ------------------------------------------------------------------

    def stats(self) -> BatcherStats:
        """A snapshot: queue sizes, preemptions, throughput, the pools' sizes (summed over
        the layer groups; ``group_blocks`` for each)."""
        groups = {g.name: (g.cache.num_blocks, g.cache.num_free_blocks) for g in self._groups}
        return BatcherStats(
            running=len(self._running), waiting=len(self._waiting), finished=self._finished,
            aborted=self._aborted, preemptions=self._preemptions, steps=self._steps,
            generated_tokens=self._generated, computed_tokens=self._computed,
            prefix_hit_tokens=self._reused, step_seconds=self._seconds,
            tokens_per_s=self._generated / self._seconds if self._seconds > 0 else 0.0,
            num_blocks=sum(n for n, _ in groups.values()),
            block_size=self._groups[0].cache.block_size,
            free_blocks=sum(f for _, f in groups.values()),
            kv_cache_bytes=sum(g.cache.num_blocks * g.cache.bytes_per_block
                               for g in self._groups),
            max_batch_tokens=self.max_batch_tokens, max_seqs=self.max_seqs,
            group_blocks=groups)

    def request_times(self, request_id: int) -> Tuple[float, Optional[float]]:
        """(time added, time of the first generated token or None), ``time.perf_counter``
        clock."""
        req = self._requests[request_id]
        return req.t_added, req.t_first

    def __repr__(self) -> str:
        used = ", ".join(f"{g.name}={g.cache.num_blocks - g.cache.num_free_blocks}/"
                         f"{g.cache.num_blocks}" for g in self._groups)
        return (f"ContinuousBatcher(running={len(self._running)}, waiting={len(self._waiting)}, "
                f"blocks: {used}, max_batch_tokens={self.max_batch_tokens}, "
                f"max_seqs={self.max_seqs})")
