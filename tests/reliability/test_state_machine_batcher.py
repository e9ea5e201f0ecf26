"""The ContinuousBatcher as a state machine (hypothesis.stateful): requests added (and refused),
steps, aborts and runs in any order, on pools small enough that steps preempt.

Machines: the tiny random Llama of tests/integrations/tiny_llama.py (one full-attention layer
group), without and with prefix caching (prompts share whole blocks), and the tiny gpt-oss of
test_hf_families.py (a sliding group with window 8 and learned sinks beside a full group: one
sequence per group in every request).  Each prompt's reference is its own greedy ``generate()``
on a second module with the same weights and transformers' attention (memoized per prompt).

After every rule:
- every group's cache passes the block accounting (``reference.check_pool_invariants``: reference
  counts, free queue, prefix index) and holds one sequence per running request; a sliding
  group's sequences stay within the bound the scheduler plans with;
- each tracked request's tokens so far are a prefix of its reference (eos cuts it after the
  first eos); ``stats()`` counts exactly the requests the model says are waiting or running,
  finished and aborted;
- a refused ``add_request`` or a failed ``abort`` changed nothing (stats and every pool).
After ``run()``: its outputs are the references whole, and every pool is back (no sequence,
every block free).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "integrations"))
from tiny_llama import VOCAB, prompt_lists, twin_llamas  # noqa: E402  (skips without the hf extra)
from tiny_llama import one_thread  # noqa: F401,E402  (an autouse fixture: one thread here)

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from pagedkv.integrations.hf import ContinuousBatcher  # noqa: E402
from profiles import depth  # noqa: E402
from reference import check_pool_invariants  # noqa: E402

SETTINGS = settings(deadline=None, **depth(
    dict(max_examples=12, stateful_step_count=30),
    dict(max_examples=300, stateful_step_count=60, derandomize=False, print_blob=True)))

MAX_NEW = 8
_BASE = prompt_lists(31, [20, 12])
#: prompts sharing whole blocks of 4 tokens (prefix hits), and unrelated ones
PROMPTS = [_BASE[0][:3], _BASE[0][:9], _BASE[0][:17], _BASE[0][:9] + [5, 6], _BASE[1][:5],
           _BASE[1], _BASE[0][:8]]
_MODELS = {}
_REFS = {}


def _models(name):
    """(model for the batcher, reference model) with the same random weights, built once."""
    if name not in _MODELS:
        if name == "llama":
            _MODELS[name] = twin_llamas(97)
        else:
            import test_hf_families as fam
            _MODELS[name] = fam._models(name)
    return _MODELS[name]


def _reference(name, prompt):
    """The prompt's own greedy generate() of MAX_NEW tokens (a shorter one is its prefix)."""
    key = (name, tuple(prompt))
    if key not in _REFS:
        with torch.no_grad():
            out = _models(name)[1].generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                            min_new_tokens=MAX_NEW, do_sample=False,
                                            pad_token_id=0)
        _REFS[key] = out[0, len(prompt):].tolist()
    return _REFS[key]


class _Tracked:
    """A request as the machine models it."""

    def __init__(self, prompt, expected):
        self.prompt, self.expected = prompt, expected
        self.aborted = False

    def done(self, out):
        return self.aborted or len(out) == len(self.expected)


class BatcherMachine(RuleBasedStateMachine):
    MODEL = "llama"
    NUM_BLOCKS = 9                       # blocks of 4 tokens: a long request takes 7
    PREFIX = False
    MAX_BATCH_TOKENS, MAX_SEQS = 6, 4    # chunked prefill next to decodes

    def __init__(self):
        super().__init__()
        self.b = ContinuousBatcher(_models(self.MODEL)[0], num_blocks=self.NUM_BLOCKS,
                                   block_size=4, prefix_caching=self.PREFIX,
                                   max_batch_tokens=self.MAX_BATCH_TOKENS, max_seqs=self.MAX_SEQS)
        self.reqs = {}          # rid -> _Tracked (until run() returns it)
        self.collected = set()  # rids run() returned: the batcher forgot them
        self.collected_finished = self.aborted = 0

    def max_blocks(self):
        return max(c.num_blocks for c in self.b.groups.values())

    # ---- what the batcher must not change when a call fails ----------------------------------

    def state(self):
        st_ = self.b.stats()
        return ((st_.running, st_.waiting, st_.finished, st_.aborted, st_.steps,
                 st_.generated_tokens, st_.free_blocks),
                {n: (c.num_free_blocks, tuple(c.sequence_ids())) for n, c in self.b.groups.items()})

    # ---- rules ----------------------------------------------------------------------------------

    @rule(reqs=st.lists(st.tuples(st.sampled_from(range(len(PROMPTS))),
                                  st.integers(1, MAX_NEW),
                                  st.one_of(st.none(), st.integers(0, MAX_NEW - 1))),
                        min_size=1, max_size=4))
    def add(self, reqs):
        """1-4 requests at once (pressure on the pools: preemption)."""
        for p, n, eos_at in reqs:
            prompt = PROMPTS[p]
            ref = _reference(self.MODEL, prompt)[:n]
            eos = None
            if eos_at is not None and eos_at < n:  # an eos the request meets: output ends at it
                eos = ref[eos_at]
                ref = ref[:ref.index(eos) + 1]
            rid = self.b.add_request(prompt, n, eos_token_id=eos)
            assert rid not in self.reqs and rid not in self.collected
            self.reqs[rid] = _Tracked(prompt, ref)

    @rule(kind=st.sampled_from(["empty", "vocab", "negative", "zero_new", "float_ids",
                                "never_fits", "2d"]))
    def add_refused(self, kind):
        before = self.state()
        prompt, n = {"empty": ([], 3), "vocab": ([1, VOCAB], 3), "negative": ([1, -2], 3),
                     "zero_new": ([1, 2], 0), "float_ids": ([1.5, 2], 3),
                     "never_fits": ([3] * (4 * self.max_blocks() + 1), 2),
                     "2d": ([[1, 2], [3, 4]], 2)}[kind]
        with pytest.raises(ValueError):
            self.b.add_request(torch.tensor(prompt) if kind == "2d" else prompt, n)
        assert self.state() == before, kind

    @rule(times=st.integers(1, 6))
    def step(self, times):
        for _ in range(times):
            self.one_step()

    def one_step(self):
        pending = self.b.stats().running + self.b.stats().waiting
        events = self.b.step()
        assert events or not pending or self.b.stats().running, "a step with work did nothing"
        for ev in events:
            t = self.reqs[ev.request_id]
            out = self.b.output(ev.request_id)
            assert out[-len(ev.new_tokens):] == ev.new_tokens
            assert ev.finished == t.done(out), (ev, out, t.expected)

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.reqs) + sorted(self.collected) + [max(self.reqs, default=0) + 50]
        rid = data.draw(st.sampled_from(ids))
        if rid not in self.reqs:  # returned by run(), or never given out
            before = self.state()
            with pytest.raises(KeyError):
                self.b.abort(rid)
            assert self.state() == before
            return
        t = self.reqs[rid]
        was_done = t.done(self.b.output(rid))
        before = self.state()
        assert self.b.abort(rid) == (not was_done)
        if was_done:
            assert self.state() == before
        else:
            t.aborted = True
            self.aborted += 1

    @precondition(lambda self: len(self.reqs) <= 12)
    @rule()
    def run(self):
        out = self.b.run()
        want = {rid for rid, t in self.reqs.items() if not t.aborted}
        assert set(out) == want
        for rid, toks in out.items():
            assert toks == self.reqs[rid].expected, (rid, toks, self.reqs[rid].expected)
        self.collected_finished += len(out)
        for rid in list(self.reqs):
            self.collected.add(rid)
            del self.reqs[rid]
        for name, c in self.b.groups.items():
            assert c.sequence_ids() == [], name
            assert c.num_free_blocks == c.num_blocks, name

    # ---- invariants -----------------------------------------------------------------------------

    @invariant()
    def pools_hold_what_the_requests_hold(self):
        st_ = self.b.stats()
        for name, c in self.b.groups.items():
            check_pool_invariants(c)
            assert len(c.sequence_ids()) == st_.running, name
            if c.streaming is not None:  # a sliding group: what it keeps plus a step's chunk
                keep = c.streaming.window_tokens
                bound = -(-(keep + self.MAX_BATCH_TOKENS) // c.block_size) + 1
                for sid in c.sequence_ids():
                    assert c.num_seq_blocks(sid) <= bound, (name, sid, c.num_seq_blocks(sid))

    @invariant()
    def tokens_follow_the_references(self):
        st_ = self.b.stats()
        pending = finished = 0
        for rid, t in self.reqs.items():
            out = self.b.output(rid)
            assert out == t.expected[:len(out)], (rid, out, t.expected)
            if t.aborted:
                continue
            if len(out) == len(t.expected):
                finished += 1
            else:
                pending += 1
        assert st_.running + st_.waiting == pending, (st_, pending)
        assert st_.aborted == self.aborted
        assert st_.finished == finished + self.collected_finished, (st_, finished)


class PrefixBatcherMachine(BatcherMachine):
    """prefix_caching=True: prompts that share whole blocks hit, preempted requests recompute
    from their hits."""
    PREFIX = True


class HybridBatcherMachine(BatcherMachine):
    """gpt-oss: a sliding group (window 8, learned sinks) and a full group, each pool tight."""
    MODEL = "gpt_oss"
    NUM_BLOCKS = {"sliding_attention": 8, "full_attention": 10}


TestBatcherMachine = BatcherMachine.TestCase
TestBatcherMachine.settings = SETTINGS
TestPrefixBatcherMachine = PrefixBatcherMachine.TestCase
TestPrefixBatcherMachine.settings = SETTINGS
TestHybridBatcherMachine = HybridBatcherMachine.TestCase
TestHybridBatcherMachine.settings = SETTINGS
