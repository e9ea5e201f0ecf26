"""Stateful test over every public operation against a pure-Python model.

The model keeps, per sequence, the held tokens (original stream position and K/V of every layer),
applying StreamingLLM's rule before each layer-0 append, and the pending layers of a step that has
only been written on layer 0.  Rules: add_sequence, append (1..n tokens, every layer, or layer 0
only and the other layers later), append_batch, attend, attend_batch, gather, fork, truncate, free,
apply_streaming_llm, evict (by id and by strategy), evict_to_threshold, automatic eviction on or
off, set_priority.  Block-exact accounting without StreamingLLM is test_state_machine.py's job;
this machine covers every operation and mode.

After every step: every block's reference count equals the block-table entries naming it, the free
queue holds exactly the unreferenced blocks, free + used == total (reference.check_pool_invariants);
gather and kept_positions equal the model exactly; attention results equal the NumPy reference
(per-dtype tolerance); a call that raised left everything as it was (snapshot before and after).

Profiles: the default `ci` runs a bounded number of programs; PAGEDKV_STATE_MACHINE=long runs deep
ones (set PAGEDKV_STATE_MACHINE_REPORT=path to append "programs steps" counts there).
"""
import os

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from reference import assert_attention_close, check_pool_invariants, math_scale, ref_attention, snapshot

PROFILE = os.environ.get("PAGEDKV_STATE_MACHINE", "ci")
PROFILES = {"ci": dict(max_examples=40, stateful_step_count=40),
            "long": dict(max_examples=3000, stateful_step_count=100)}
SEEDS = st.integers(0, 2**32 - 1)


class Held:
    """One sequence of the model: positions and per-layer K/V of the held tokens."""

    def __init__(self, layers, hkv, d, dtype):
        self.pos = []
        self.k = [np.zeros((0, hkv, d), dtype) for _ in range(layers)]
        self.v = [np.zeros((0, hkv, d), dtype) for _ in range(layers)]
        self.next_pos = 0
        self.pending = None          # (n, layers still to write) after a layer-0-only append

    def copy(self):
        c = Held.__new__(Held)
        c.pos, c.next_pos, c.pending = list(self.pos), self.next_pos, self.pending
        c.k, c.v = [a.copy() for a in self.k], [a.copy() for a in self.v]
        return c

    def keep(self, idx):
        idx = np.asarray(idx, dtype=np.int64)
        self.pos = [self.pos[i] for i in idx]
        self.k = [a[idx] for a in self.k]
        self.v = [a[idx] for a in self.v]

    def trim(self, sink, window):
        if len(self.pos) > sink + window:
            self.keep(list(range(sink)) + list(range(len(self.pos) - window, len(self.pos))))


class FullMachine(RuleBasedStateMachine):
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 12, 3, 2, 2, 4, 2, 5
    DTYPE = "float64"
    STREAMING = None                 # (sink, window) or None
    MAX_BLOCKS_PER_SEQ = None
    programs = steps = 0

    def __init__(self):
        super().__init__()
        kw = {}
        if self.STREAMING:
            kw["streaming"] = pagedkv.StreamingLLM(*self.STREAMING)
        self.cache = pagedkv.PagedKVCache(
            num_blocks=self.NUM_BLOCKS, block_size=self.BS, num_kv_heads=self.HKV,
            head_dim=self.D, num_layers=self.LAYERS, dtype=self.DTYPE, max_seqs=self.MAX_SEQS,
            max_blocks_per_seq=self.MAX_BLOCKS_PER_SEQ, eviction_strategy="lru", **kw)
        self.model = {}
        FullMachine.programs += 1

    # ---- helpers --------------------------------------------------------------------------------
    def tokens(self, seed, n, heads):
        return np.random.default_rng(seed).standard_normal((n, heads, self.D)).astype(self.DTYPE)

    def state(self):
        live = self.cache.sequence_ids()
        refs = [self.cache._core.ref_count(b) for b in range(self.cache.num_blocks)]
        return live, refs, snapshot(self.cache, live, layers=range(self.LAYERS))

    def assert_same(self, before):
        live, refs, snap = self.state()
        assert live == before[0] and refs == before[1]
        assert snap["num_free_blocks"] == before[2]["num_free_blocks"]
        assert snap["stats"] == before[2]["stats"]
        for sid, (n, kept, data) in before[2]["seqs"].items():
            n2, kept2, data2 = snap["seqs"][sid]
            assert n2 == n
            np.testing.assert_array_equal(kept2, kept)
            for (k, v), (k2, v2) in zip(data, data2):
                np.testing.assert_array_equal(k2, k)
                np.testing.assert_array_equal(v2, v)

    def attempt(self, call, allowed):
        """Run call(); when it raises one of `allowed`, check that nothing changed and return
        the exception; otherwise return (result, None)."""
        before = self.state()
        try:
            return call(), None
        except allowed as e:
            self.assert_same(before)
            return None, e

    def drop(self, sids):
        for s in sids:
            del self.model[s]

    def pick(self, data, ok=lambda m: True):
        choices = sorted(s for s, m in self.model.items() if ok(m))
        return data.draw(st.sampled_from(choices)) if choices else None

    def grow(self, m, n, k0, v0):
        if self.STREAMING:
            m.trim(*self.STREAMING)
        m.pos += list(range(m.next_pos, m.next_pos + n))
        m.next_pos += n
        m.k[0] = np.concatenate([m.k[0], k0])
        m.v[0] = np.concatenate([m.v[0], v0])
        for layer in range(1, self.LAYERS):  # filled by the layer appends of this step
            pad = np.zeros((n, self.HKV, self.D), self.DTYPE)
            m.k[layer] = np.concatenate([m.k[layer], pad])
            m.v[layer] = np.concatenate([m.v[layer], pad])

    def write_layer(self, m, layer, k, v):
        n = k.shape[0]
        m.k[layer][len(m.pos) - n:] = k
        m.v[layer][len(m.pos) - n:] = v

    # ---- rules ----------------------------------------------------------------------------------
    @initialize()
    def start(self):
        self.add_sequence(priority=0.0)

    @rule(priority=st.sampled_from([0.0, -1.0, 2.5]))
    def add_sequence(self, priority):
        sid, err = self.attempt(lambda: self.cache.add_sequence(priority=priority), RuntimeError)
        if err is None:
            assert sid not in self.model
            self.model[sid] = Held(self.LAYERS, self.HKV, self.D, self.DTYPE)
        else:
            assert len(self.model) == self.MAX_SEQS

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 7), seed=SEEDS, whole_step=st.booleans())
    def append(self, data, n, seed, whole_step):
        sid = self.pick(data, lambda m: m.pending is None)
        if sid is None:
            return
        ks = [self.tokens(seed + 2 * l, n, self.HKV) for l in range(self.LAYERS)]
        vs = [self.tokens(seed + 2 * l + 1, n, self.HKV) for l in range(self.LAYERS)]
        res, err = self.attempt(lambda: self.cache.append(sid, ks[0], vs[0]),
                                (pagedkv.OutOfBlocksError, ValueError))
        if err is not None:
            return
        self.drop(res or ())                      # automatic eviction's victims
        m = self.model[sid]
        self.grow(m, n, ks[0], vs[0])
        if whole_step or self.LAYERS == 1:
            for l in range(1, self.LAYERS):
                self.cache.append(sid, ks[l], vs[l], layer=l)
                self.write_layer(m, l, ks[l], vs[l])
        else:
            m.pending = (n, ks, vs)

    @precondition(lambda self: any(m.pending for m in self.model.values()))
    @rule(data=st.data())
    def finish_step(self, data):
        sid = self.pick(data, lambda m: m.pending is not None)
        m = self.model[sid]
        n, ks, vs = m.pending
        wrong = self.tokens(0, n + 1, self.HKV)
        _, err = self.attempt(lambda: self.cache.append(sid, wrong, wrong, layer=1), ValueError)
        assert err is not None and f"n={n}" in str(err)
        for l in range(1, self.LAYERS):
            self.cache.append(sid, ks[l], vs[l], layer=l)
            self.write_layer(m, l, ks[l], vs[l])
        m.pending = None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=SEEDS)
    def append_batch(self, data, seed):
        ok = sorted(s for s, m in self.model.items() if m.pending is None)
        if not ok:
            return
        batch = data.draw(st.lists(st.sampled_from(ok), min_size=1, max_size=len(ok), unique=True))
        B = len(batch)
        ks = [self.tokens(seed + 2 * l, B, self.HKV) for l in range(self.LAYERS)]
        vs = [self.tokens(seed + 2 * l + 1, B, self.HKV) for l in range(self.LAYERS)]
        res, err = self.attempt(lambda: self.cache.append_batch(batch, ks[0], vs[0]),
                                (pagedkv.OutOfBlocksError, ValueError))
        if err is not None:
            return
        self.drop(res or ())
        for b, sid in enumerate(batch):
            self.grow(self.model[sid], 1, ks[0][b:b + 1], vs[0][b:b + 1])
        for l in range(1, self.LAYERS):
            self.cache.append_batch(batch, ks[l], vs[l], layer=l)
            for b, sid in enumerate(batch):
                self.write_layer(self.model[sid], l, ks[l][b:b + 1], vs[l][b:b + 1])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=SEEDS)
    def attend(self, data, seed):
        sid = self.pick(data)
        m = self.model[sid]
        layer = data.draw(st.integers(0, self.LAYERS - 1))
        n = data.draw(st.integers(1, max(1, len(m.pos))))
        q = self.tokens(seed, n, self.HKV * self.G)
        if not m.pos or (m.pending and layer > 0):
            _, err = self.attempt(lambda: self.cache.attend(sid, q, layer=layer),
                                  (ValueError, RuntimeError))
            assert isinstance(err, RuntimeError if m.pos else ValueError)
            return
        out = self.cache.attend(sid, q, layer=layer)
        exp = ref_attention(q, m.k[layer], m.v[layer], math_scale(self.D), len(m.pos) - n)
        assert_attention_close(out, exp, self.DTYPE, m.v[layer])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=SEEDS)
    def attend_batch(self, data, seed):
        ok = sorted(s for s, m in self.model.items() if m.pos and not m.pending)
        if not ok:
            return
        batch = data.draw(st.lists(st.sampled_from(ok), min_size=1, max_size=len(ok), unique=True))
        layer = data.draw(st.integers(0, self.LAYERS - 1))
        q = self.tokens(seed, len(batch), self.HKV * self.G)
        out = self.cache.attend_batch(batch, q, layer=layer)
        for b, sid in enumerate(batch):
            m = self.model[sid]
            exp = ref_attention(q[b:b + 1], m.k[layer], m.v[layer], math_scale(self.D),
                                len(m.pos) - 1)
            assert_attention_close(out[b:b + 1], exp, self.DTYPE, m.v[layer])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        sid = self.pick(data, lambda m: m.pending is None)
        if sid is None:
            return
        child, err = self.attempt(lambda: self.cache.fork(sid), RuntimeError)
        if err is None:
            self.model[child] = self.model[sid].copy()
        else:
            assert len(self.model) == self.MAX_SEQS

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        sid = self.pick(data, lambda m: m.pending is None)
        if sid is None:
            return
        m = self.model[sid]
        length = data.draw(st.integers(-1, len(m.pos) + 1))
        _, err = self.attempt(lambda: self.cache.truncate(sid, length), ValueError)
        if err is None:
            m.keep(range(length))
            m.next_pos = m.pos[-1] + 1 if m.pos else 0  # a roll back: the stream resumes there
        else:
            assert length < 0 or length > len(m.pos)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), manner=st.sampled_from(["free", "evict"]))
    def free(self, data, manner):
        sid = self.pick(data)
        (self.cache.free if manner == "free" else self.cache.evict)(sid)
        self.drop([sid])
        for call in (self.cache.free, self.cache.seq_len):
            _, err = self.attempt(lambda: call(sid), KeyError)
            assert err is not None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), sink=st.integers(0, 3), window=st.integers(1, 6))
    def apply_streaming_llm(self, data, sink, window):
        sid = self.pick(data)
        m = self.model[sid]
        res, err = self.attempt(lambda: self.cache.apply_streaming_llm(sid, sink, window),
                                ValueError)
        if err is not None:
            assert m.pending or "run" in str(err), err  # mid-step, or a third run of slots
            return
        held = len(m.pos)
        m.trim(sink, window)
        assert res == held - len(m.pos)

    @rule()
    def evict_by_strategy(self):
        target = self.cache.select_eviction_target()
        assert self.cache.evict() == target
        if target is not None:
            self.drop([target])

    @rule(u=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    def evict_to_threshold(self, u):
        self.drop(self.cache.evict_to_threshold(u))
        c = self.cache
        assert not self.model or c.num_blocks - c.num_free_blocks <= u * c.num_blocks

    @rule(on=st.booleans())
    def auto_evict(self, on):
        self.cache.auto_evict = on

    @precondition(lambda self: self.model)
    @rule(data=st.data(), p=st.sampled_from([-2.0, 0.0, 5.0]))
    def set_priority(self, data, p):
        sid = self.pick(data)
        self.cache.set_priority(sid, p)
        assert self.cache.priority(sid) == p

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        FullMachine.steps += 1
        c = self.cache
        assert sorted(c.sequence_ids()) == sorted(self.model)
        for sid, m in self.model.items():
            assert c.seq_len(sid) == len(m.pos)
            np.testing.assert_array_equal(c.kept_positions(sid), m.pos)
            for layer in range(self.LAYERS if not m.pending else 1):
                k, v = c.gather(sid, layer)
                np.testing.assert_array_equal(k, m.k[layer])
                np.testing.assert_array_equal(v, m.v[layer])
        check_pool_invariants(c)

    def teardown(self):
        report = os.environ.get("PAGEDKV_STATE_MACHINE_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(f"{type(self).__name__} {FullMachine.programs} {FullMachine.steps}\n")


class StreamingMachine(FullMachine):
    """StreamingLLM on (1 sink, 4 recent), float32, block size 2."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 10, 2, 1, 3, 3, 2, 4
    DTYPE = "float32"
    STREAMING = (1, 4)


class TightMachine(FullMachine):
    """A tiny pool with a per-sequence bound: appends often fail, eviction often runs."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 5, 4, 1, 1, 2, 1, 4
    MAX_BLOCKS_PER_SEQ = 3


SETTINGS = settings(deadline=None, **PROFILES[PROFILE])
TestFull = FullMachine.TestCase
TestFull.settings = SETTINGS
TestStreaming = StreamingMachine.TestCase
TestStreaming.settings = SETTINGS
TestTight = TightMachine.TestCase
TestTight.settings = SETTINGS
