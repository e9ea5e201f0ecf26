"""The state machine over every public operation against a pure-Python model (a helper module:
its machines run from test_state_machine_full.py and test_state_machine_prefix.py).

The model keeps, per sequence, the held tokens (original stream position and K/V of every layer),
applying StreamingLLM's rule before each layer-0 append, and the pending layers of a step that has
only been written on layer 0.  Rules: add_sequence, append (1..n tokens, every layer, or layer 0
only and the other layers later), append_batch, attend, attend_batch, gather, fork, truncate, free,
apply_streaming_llm, evict (by id and by strategy), evict_to_threshold, automatic eviction on or
off, set_priority, save + load (the loaded sequence equals the saved one: gather, kept positions,
attention bit for bit; a save in the middle of a step raises), load of a damaged file (truncated,
a flipped byte, foreign magic, another version, an inconsistent header with a valid checksum:
CacheFileError; another configuration: ValueError), compact (the blocks moved are exactly the used
blocks above the used count; afterwards the used blocks are 0..used-1) and resize (grow, shrink to
what fits, shrink below a used block: ValueError).  Block-exact accounting without StreamingLLM is
test_state_machine.py's job; this machine covers every operation and mode.

Storage dtypes: the machines with KV_DTYPE set store ``reference.ref_stored`` of what they append,
so gather compares exactly and attention is held to the *compute* dtype's tolerance on the stored
values (the kernels convert on load and lose nothing more).

After every step: every block's reference count equals the block-table entries naming it, the free
queue holds exactly the unreferenced blocks, free + used == total, the prefix index's cached
blocks and per-sequence state agree with the pool and the live sequences
(reference.check_pool_invariants); gather and kept_positions equal the model exactly; attention
results equal the NumPy reference (per-dtype tolerance); a call that raised left everything as it
was (snapshot before and after), except that an append which automatic eviction could not make
room for keeps the evictions it made first (documented: the room check counts blocks shared with
the call's sequences, which can be optimistic).

Profiles (tests/profiles.py): the default `ci` runs a bounded number of programs;
PAGEDKV_TEST_PROFILE=long runs deep ones with fresh random programs each run (set PAGEDKV_STATE_MACHINE_REPORT=path to append
"<machine> programs steps" counts there, one line per program, cumulative per machine class).
"""
import json
import os
import shutil
import struct
import tempfile
import zlib

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from profiles import PROFILE
from reference import (assert_attention_close, check_pool_invariants, math_scale, ref_attention,
                       ref_stored, snapshot)

PROFILES = {"ci": dict(max_examples=40, stateful_step_count=40),
            "long": dict(max_examples=3000, stateful_step_count=100, derandomize=False,
                         print_blob=True)}
SETTINGS = settings(deadline=None, **PROFILES[PROFILE])
SEEDS = st.integers(0, 2**32 - 1)


class Held:
    """One sequence of the model: positions and per-layer K/V of the held tokens (as stored);
    with prefix caching also its known token ids, salt and registrable full blocks."""

    def __init__(self, layers, hkv, d, dtype):
        self.pos = []
        self.k = [np.zeros((0, hkv, d), dtype) for _ in range(layers)]
        self.v = [np.zeros((0, hkv, d), dtype) for _ in range(layers)]
        self.next_pos = 0
        self.pending = None          # (n, layers still to write) after a layer-0-only append
        self.ids = []                # token ids the cache knows for positions 0..len-1
        self.salt = None
        self.elig = 0                # leading full blocks registered or chained (prefix caching)

    def copy(self):
        c = Held.__new__(Held)
        c.pos, c.next_pos, c.pending = list(self.pos), self.next_pos, self.pending
        c.k, c.v = [a.copy() for a in self.k], [a.copy() for a in self.v]
        c.ids, c.salt, c.elig = list(self.ids), self.salt, self.elig
        return c

    def keep(self, idx):
        idx = np.asarray(idx, dtype=np.int64)
        self.pos = [self.pos[i] for i in idx]
        self.k = [a[idx] for a in self.k]
        self.v = [a[idx] for a in self.v]

    def trim(self, sink, window):
        if len(self.pos) > sink + window:
            self.keep(list(range(sink)) + list(range(len(self.pos) - window, len(self.pos))))


def _count(cls, name):
    """Per-class counters (a subclass does not share its parent's)."""
    setattr(cls, name, cls.__dict__.get(name, 0) + 1)


class FullMachine(RuleBasedStateMachine):
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 12, 3, 2, 2, 4, 2, 5
    DTYPE = "float64"
    KV_DTYPE = None                  # storage dtype (None: DTYPE)
    STREAMING = None                 # (sink, window) or None
    PREFIX = False
    MAX_BLOCKS_PER_SEQ = None
    programs = steps = 0

    def __init__(self):
        super().__init__()
        kw = {}
        if self.STREAMING:
            kw["streaming"] = pagedkv.StreamingLLM(*self.STREAMING)
        self.cache = pagedkv.PagedKVCache(
            num_blocks=self.NUM_BLOCKS, block_size=self.BS, num_kv_heads=self.HKV,
            head_dim=self.D, num_layers=self.LAYERS, dtype=self.DTYPE, kv_dtype=self.KV_DTYPE,
            max_seqs=self.MAX_SEQS, max_blocks_per_seq=self.MAX_BLOCKS_PER_SEQ,
            eviction_strategy="lru", prefix_caching=self.PREFIX, **kw)
        self.model = {}
        self.dir = tempfile.mkdtemp(prefix="pagedkv-sm-")
        self.files = 0
        _count(type(self), "programs")

    # ---- helpers --------------------------------------------------------------------------------
    def tokens(self, seed, n, heads):
        return np.random.default_rng(seed).standard_normal((n, heads, self.D)).astype(self.DTYPE)

    def stored(self, x):
        """What x reads back as from this cache's storage."""
        return ref_stored(x, self.KV_DTYPE, self.DTYPE)

    def state(self):
        live = self.cache.sequence_ids()
        refs = [self.cache._core.ref_count(b) for b in range(self.cache.num_blocks)]
        snap = snapshot(self.cache, live, layers=range(self.LAYERS))
        s = self.cache.stats()
        prefix = (s.prefix_hit_blocks, s.prefix_miss_blocks, s.prefix_hit_tokens,
                  s.prefix_miss_tokens, s.cached_free_blocks)
        prios = [self.cache.priority(sid) for sid in live]
        return live, refs, snap, prefix, prios, self.cache.num_blocks

    def assert_same(self, before, gone=()):
        """Everything as in `before`; or, with `gone` (sequences an automatic eviction took
        before the call raised), every other sequence, its priority and the counters as before
        (the block accounting is the invariant's to check)."""
        live, refs, snap, prefix, prios, nb = self.state()
        if gone:
            assert self.cache.auto_evict
            assert live == [s for s in before[0] if s not in gone]
            assert prefix[:4] == before[3][:4] and nb == before[5]
            assert prios == [p for s, p in zip(before[0], before[4]) if s not in gone]
        else:
            assert live == before[0] and refs == before[1]
            assert (prefix, prios, nb) == before[3:]
            assert snap["num_free_blocks"] == before[2]["num_free_blocks"]
            assert snap["stats"] == before[2]["stats"]
        for sid, (n, kept, data) in before[2]["seqs"].items():
            if sid in gone:
                continue
            n2, kept2, data2 = snap["seqs"][sid]
            assert n2 == n
            np.testing.assert_array_equal(kept2, kept)
            for (k, v), (k2, v2) in zip(data, data2):
                np.testing.assert_array_equal(k2, k)
                np.testing.assert_array_equal(v2, v)

    def attempt(self, call, allowed, evicting=False):
        """Run call(); when it raises one of `allowed`, check that nothing changed and return
        the exception; otherwise return (result, None).  `evicting` (append, append_batch):
        an OutOfBlocksError may follow evictions automatic eviction made first (documented:
        with shared blocks its room check can be optimistic); those sequences stay evicted
        and are dropped from the model."""
        before = self.state()
        try:
            return call(), None
        except allowed as e:
            gone = ()
            if evicting and isinstance(e, pagedkv.OutOfBlocksError):
                gone = set(before[0]) - set(self.cache.sequence_ids())
            self.assert_same(before, gone)
            self.drop(gone)
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
        m.k[layer][len(m.pos) - n:] = self.stored(k)
        m.v[layer][len(m.pos) - n:] = self.stored(v)

    def path(self):
        self.files += 1
        return os.path.join(self.dir, f"seq{self.files}.pkv")

    def used_blocks(self):
        return sorted({b for s in self.cache.sequence_ids()
                       for b in self.cache.block_table(s).tolist()})

    # hooks for token ids (prefix caching); without it there are none
    def layer0_ids(self, data, m, n):
        """(keyword arguments of the layer-0 append, the sequence's known ids after it)."""
        return {}, None

    def step_kv(self, m, n, seed, ids):
        """K/V of every layer for the n tokens appended to m next (as passed to append)."""
        ks = [self.tokens(seed + 2 * l, n, self.HKV) for l in range(self.LAYERS)]
        vs = [self.tokens(seed + 2 * l + 1, n, self.HKV) for l in range(self.LAYERS)]
        return ks, vs

    def written(self, m):
        """m's newest tokens were written on some layers (prefix caching registers blocks)."""

    def loaded_copy(self, m):
        return m.copy()

    def saveable(self, m):
        return True

    # ---- rules ----------------------------------------------------------------------------------
    @initialize()
    def start(self):
        self.add_sequence(priority=0.0)

    @rule(priority=st.sampled_from([0.0, -1.0, 2.5]))
    def add_sequence(self, priority):
        sid, err = self.attempt(lambda: self.cache.add_sequence(priority=priority), RuntimeError)
        if err is None:
            assert sid not in self.model and self.cache.seq_len(sid) == 0
            self.model[sid] = Held(self.LAYERS, self.HKV, self.D, self.DTYPE)
        else:
            assert len(self.model) == self.MAX_SEQS

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 7), seed=SEEDS, whole_step=st.booleans())
    def append(self, data, n, seed, whole_step):
        sid = self.pick(data, lambda m: m.pending is None)
        if sid is None:
            return
        kw, ids = self.layer0_ids(data, self.model[sid], n)
        self.append_step(sid, n, seed, kw, ids, whole_step)

    def append_step(self, sid, n, seed, kw, ids, whole_step):
        """Append n tokens to sid (layer 0 with `kw`; the other layers now or, unless
        whole_step, later); ids: its known token ids afterwards.  True when it fitted."""
        m = self.model[sid]
        ks, vs = self.step_kv(m, n, seed, ids)
        res, err = self.attempt(lambda: self.cache.append(sid, ks[0], vs[0], **kw),
                                (pagedkv.OutOfBlocksError, ValueError), evicting=True)
        if err is not None:
            return False
        self.drop(res or ())                      # automatic eviction's victims
        self.grow(m, n, self.stored(ks[0]), self.stored(vs[0]))
        if ids is not None:
            m.ids = ids
        if whole_step or self.LAYERS == 1:
            for l in range(1, self.LAYERS):
                self.cache.append(sid, ks[l], vs[l], layer=l)
                self.write_layer(m, l, ks[l], vs[l])
        else:
            m.pending = (n, ks, vs)
        self.written(m)
        return True

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
        self.written(m)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=SEEDS)
    def append_batch(self, data, seed):
        ok = sorted(s for s, m in self.model.items() if m.pending is None)
        if not ok:
            return
        batch = data.draw(st.lists(st.sampled_from(ok), min_size=1, max_size=len(ok), unique=True))
        B = len(batch)
        kw, ids = self.batch_ids(data, batch)
        rows = [self.step_kv(self.model[sid], 1, seed + 1000 * b, ids[b])
                for b, sid in enumerate(batch)]
        ks = [np.concatenate([r[0][l] for r in rows]) for l in range(self.LAYERS)]
        vs = [np.concatenate([r[1][l] for r in rows]) for l in range(self.LAYERS)]
        res, err = self.attempt(lambda: self.cache.append_batch(batch, ks[0], vs[0], **kw),
                                (pagedkv.OutOfBlocksError, ValueError), evicting=True)
        if err is not None:
            return
        self.drop(res or ())
        for b, sid in enumerate(batch):
            m = self.model[sid]
            self.grow(m, 1, self.stored(ks[0][b:b + 1]), self.stored(vs[0][b:b + 1]))
            if ids[b] is not None:
                m.ids = ids[b]
        for l in range(1, self.LAYERS):
            self.cache.append_batch(batch, ks[l], vs[l], layer=l)
            for b, sid in enumerate(batch):
                self.write_layer(self.model[sid], l, ks[l][b:b + 1], vs[l][b:b + 1])
        for sid in batch:
            self.written(self.model[sid])

    def batch_ids(self, data, batch):
        return {}, [None] * len(batch)

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
        self.truncate_to(sid, data.draw(st.integers(-1, len(self.model[sid].pos) + 1)))

    def truncate_to(self, sid, length):
        m = self.model[sid]
        _, err = self.attempt(lambda: self.cache.truncate(sid, length), ValueError)
        if err is None:
            m.keep(range(length))
            m.next_pos = m.pos[-1] + 1 if m.pos else 0  # a roll back: the stream resumes there
            del m.ids[length:]                          # what the prefix cache forgets
            m.elig = min(m.elig, length // self.BS)
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

    # ---- save / load, compact, resize -----------------------------------------------------------
    @precondition(lambda self: self.model)
    @rule(data=st.data(), priority=st.sampled_from([None, 1.5]), seed=SEEDS)
    def save_load(self, data, priority, seed):
        sid = self.pick(data, self.saveable)
        if sid is None:
            return
        m, c = self.model[sid], self.cache
        path = self.path()
        if m.pending:
            _, err = self.attempt(lambda: c.save(sid, path), ValueError)
            assert err is not None and "middle of a step" in str(err)
            assert not os.path.exists(path) and os.listdir(self.dir) == []
            return
        nbytes = c.save(sid, path)
        assert os.path.getsize(path) == nbytes and os.listdir(self.dir) == [os.path.basename(path)]
        full = len(self.model) == self.MAX_SEQS
        short = c.num_free_blocks < c.num_seq_blocks(sid)
        want_priority = c.priority(sid) if priority is None else priority
        new, err = self.attempt(lambda: c.load(path, priority=priority),
                                (pagedkv.OutOfBlocksError, RuntimeError))
        os.unlink(path)
        if err is not None:
            assert isinstance(err, pagedkv.OutOfBlocksError) != full and (full or short), err
            return
        assert not full and not short and new not in self.model
        assert c.priority(new) == want_priority
        self.model[new] = self.loaded_copy(m)
        self.written(self.model[new])
        if m.pos:  # attention over the copy is the original's, bit for bit
            for layer in range(self.LAYERS):
                n = data.draw(st.integers(1, len(m.pos)))
                q = self.tokens(seed + layer, n, self.HKV * self.G)
                np.testing.assert_array_equal(c.attend(new, q, layer=layer),
                                              c.attend(sid, q, layer=layer))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), damage=st.sampled_from(
        ["truncate", "flip", "magic", "version", "length", "config"]))
    def load_damaged(self, data, damage):
        sid = self.pick(data, lambda m: m.pending is None and self.saveable(m))
        if sid is None:
            return
        path = self.path()
        self.cache.save(sid, path)
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        if damage == "truncate":
            raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
        elif damage == "flip":
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        elif damage == "magic":
            raw[:4] = b"GGUF"
        elif damage == "version":
            raw[8:12] = struct.pack("<I", 3)  # a version this pagedkv does not read
        else:  # edit the header and write a valid checksum: the contents are inconsistent
            (hlen,) = struct.unpack_from("<I", raw, 12)
            header = json.loads(raw[16:16 + hlen])
            if damage == "length":
                header["sequence"]["length"] += 1
            else:
                header["config"]["block_size"] += 1
            head = json.dumps(header, separators=(",", ":")).encode()
            body = raw[:12] + struct.pack("<I", len(head)) + head + raw[16 + hlen:-4]
            raw = body + struct.pack("<I", zlib.crc32(body))
        with open(path, "wb") as f:
            f.write(bytes(raw))
        _, err = self.attempt(lambda: self.cache.load(path), ValueError)
        os.unlink(path)
        assert err is not None
        if damage == "config":
            assert not isinstance(err, pagedkv.CacheFileError) and "block_size" in str(err), err
        else:
            assert isinstance(err, pagedkv.CacheFileError), err

    @rule()
    def compact(self):
        used = self.used_blocks()
        moved = self.cache.compact()
        assert moved == sum(1 for b in used if b >= len(used))
        assert self.used_blocks() == list(range(len(used)))
        assert self.cache.num_free_blocks == self.cache.num_blocks - len(used)

    @rule(data=st.data())
    def resize(self, data):
        used = self.used_blocks()
        top = used[-1] + 1 if used else 0      # the smallest pool that keeps every used block
        n = data.draw(st.one_of(
            st.sampled_from(sorted({top, max(top, 1), len(used), self.NUM_BLOCKS})),
            st.integers(top - 2, top + 2), st.integers(1, 2 * self.NUM_BLOCKS)))
        _, err = self.attempt(lambda: self.cache.resize(n), ValueError)
        if n >= max(top, 1):
            assert err is None, err
            assert self.cache.num_blocks == n and self.cache.stats().blocks_total == n
            assert self.cache.num_free_blocks == n - len(used)
        else:
            assert err is not None
            assert ("compact" in str(err)) == (n >= 1), err

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        _count(type(self), "steps")
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

    def report_extra(self):
        return ""

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        report = os.environ.get("PAGEDKV_STATE_MACHINE_REPORT")
        if report:
            cls = type(self)
            with open(report, "a") as f:
                f.write(f"{cls.__name__} {cls.__dict__.get('programs', 0)} "
                        f"{cls.__dict__.get('steps', 0)}{self.report_extra()}\n")
