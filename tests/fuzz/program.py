"""Decode bytes into a hostile program over one PagedKVCache and run it (the arguments are read
from the bytes by inputs.py; the save / load calls and their files are files.py's).

Shared by the atheris harness (tests/fuzz/fuzz_cache.py, coverage-guided over the in-place build;
tools/fuzz.sh --replay runs what it kept under the sanitizer build) and by
tests/reliability/test_fuzz_programs.py (saved regressions plus random byte strings, in every test run).  A
program builds a small cache from the bytes (arrays of float32, float64, float16 or bfloat16, raw
16-bit bit patterns, storage kv_dtype, prefix caching, StreamingLLM, RoPE, automatic eviction:
each chosen, sometimes wrongly), then runs up to MAX_OPS public calls with
arguments that are often wrong: ids live / freed / huge / negative / float / bool / None, arrays
of the wrong dtype, ndim, shape, strides, alignment, writability, zero length or huge broadcast
length, NaN / inf data, hostile layers, scales, sizes and out= arrays, attention options
(sliding windows shorter and longer than the sequences, logit softcaps, learned sinks; and
zero / negative / huge / NaN / non-int windows, softcaps <= 0, NaN, inf or huge, sinks of the
wrong type, dtype, shape or length or holding NaN / inf), token ids and cache salts
of the wrong length, type or size, save / load paths of every kind, files truncated, bit-flipped,
foreign or forged (a rewritten header with a valid checksum), hostile compact / resize sizes.

Documented exceptions (anything else raised by a call is a failure):
  * every call: KeyError (unknown or freed id), ValueError (a bad value; CacheFileError is one),
    TypeError (an argument of the wrong type), RuntimeError (max_seqs, a layer whose newest tokens
    are missing), MemoryError (OutOfBlocksError is one; an absurd size);
  * save: OSError as well, when the program gives it a directory or a path in a missing
    directory;
  * load of a file (a real path, priority None or a number): only ValueError (CacheFileError for
    a foreign, truncated or corrupt file, ValueError for another configuration), RuntimeError
    (max_seqs) and MemoryError (OutOfBlocksError); TypeError only for a path or priority of the
    wrong type, OSError only for a missing path or a directory.

What counts as a failure (raised out of run_program):
  * an exception other than the documented ones,
  * a call that raised but changed the cache (lengths, kept positions, priorities, stored K/V,
    free blocks, block generations and cached marks, the valid prefix-index entries and what the
    prefix cache knows of each sequence), or a save that raised and changed its target file,
  * a successful read-only call (attend, gather, queries, save) that changed the cache, a compact
    or resize that changed any sequence's contents or dropped a valid prefix entry of a used
    block, a compact that left a used block above the used count, a loaded file (unmodified)
    whose sequence differs from the saved one,
  * a broken block accounting after any call (reference.check_pool_invariants) or broken state
    (check_state: kept positions, finite priorities, cached-free count, the prefix index and
    chains, registered blocks whose bytes changed),
  * and, under the sanitizers, any memory or undefined-behaviour error (the process aborts).
"""
import collections
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pagedkv  # noqa: E402
from pagedkv.prefix import _same_prefix  # noqa: E402
from reference import check_accounting  # noqa: E402
from fuzz.files import FileOps, _clear_tmpdir  # noqa: E402
from fuzz.inputs import (  # noqa: E402
    _ML_DTYPES, ALLOWED, SALTS, Bytes, _array, _data, _hostile_ids, _hostile_int, _normals,
    _sid, _stream_token)

#: calls per program: coverage-guided search favours short inputs, and the state machines run the
#: long ones
MAX_OPS = 16
# weighted: sequences must live long enough to be appended to and attended over
OPS = (["add"] * 3 + ["append"] * 5 + ["append_batch"] * 2 + ["attend"] * 2
       + ["attend_batch"] * 2 + ["gather", "fork", "truncate", "free", "streaming", "evict",
                                 "threshold", "priority", "query", "auto"]
       + ["save"] * 2 + ["load"] * 3 + ["compact", "resize"] + ["step"] * 4)
#: calls that must leave the cache as it was when they succeed
READ_ONLY = {"attend", "attend_batch", "gather", "query", "save"}
#: (operation, "ok" or the exception's name) -> calls, over every program run in this process
OUTCOMES = collections.Counter()
#: the coverage-guided search sets this to a callable taking a feature number (fuzz_cache.py):
#: what each call did and the shape of the sequence it named, as extra coverage (the core,
#: compiled by GCC, has none of its own)
FEEDBACK = None
_OP_INDEX = {name: i for i, name in enumerate(sorted(set(OPS)))}
_OUTCOME_INDEX = {name: i for i, name in enumerate(
    ["ok", "KeyError", "ValueError", "TypeError", "RuntimeError", "MemoryError",
     "OutOfBlocksError", "CacheFileError", "OverflowError", "FileNotFoundError",
     "IsADirectoryError", "NotADirectoryError", "PermissionError", "OSError"])}

class Runner(FileOps):
    def __init__(self, b: Bytes):
        self.b = b
        self.hkv = b.int(1, 3)
        self.g = b.int(1, 3)
        self.d = b.int(1, 9)
        self.layers = b.int(1, 2)
        self.bs = b.int(1, 6)
        self.dtype = b.pick(["float32", "float64", "float32", "float64", "float16", "bfloat16"])
        kw = dict(num_blocks=b.int(1, 12), block_size=self.bs, num_kv_heads=self.hkv,
                  head_dim=self.d, num_layers=self.layers, dtype=self.dtype,
                  max_seqs=b.int(1, 5))
        if b.chance(160):
            kw["kv_dtype"] = (b.pick([None, "float32", "float64", "bfloat16", "float16", "int8",
                                      "int8", np.float16,
                                      np.dtype(self.dtype) if self.dtype[0] == "f" else "float32"])
                              if b.chance(230) else
                              b.pick(["int4", "float8", "bf16", "INT8", "", 3, object, np.int8,
                                      np.complex64, b"int8", ["int8"]]))
        self.prefix = b.chance(100)
        if self.prefix:
            kw["prefix_caching"] = True if b.chance(230) else b.pick([np.bool_(True), 1, "yes",
                                                                      None])
        if b.chance(10 if self.prefix else 60):
            kw["max_blocks_per_seq"] = b.int(1, 6)
        if b.chance(8 if self.prefix else 60):
            kw["streaming"] = pagedkv.StreamingLLM(sink_tokens=b.int(0, 4),
                                                   window_tokens=b.int(1, 8))
        if b.chance(50) and self.d % 2 == 0:
            kw["rope"] = pagedkv.RoPE(theta=b.pick([10000.0, 1.0, 1e6]))
        if b.chance(60):
            kw["auto_evict"] = True
            kw["eviction_strategy"] = b.pick(["lru", "lfu", "longest", "priority"])
        if self.dtype in ("float16", "bfloat16") and (b.chance(64) or _ML_DTYPES is None
                                                      and self.dtype == "bfloat16"):
            kw["raw16"] = True  # arrays of uint16 bit patterns (bfloat16 needs ml_dtypes else)
        self.cache = pagedkv.PagedKVCache(**kw)
        self.np_dtype = self.cache.dtype.type   # arrays in and out
        self.live, self.freed = [], []
        self.target, self.prev = None, 0
        self.stream = {}        # sid -> the token stream its token ids come from (prefix caching)
        self.saved = {}         # path -> (file bytes, the saved sequence's contents)
        self.block_bytes = {}   # (block, generation) -> bytes of a registered block, when seen
        self.allowed, self.on_fail, self.rewrites, self.opt_bits = ALLOWED, None, (), 0
        self.checked = {}       # sid -> what check_state last passed for it
        self.fresh = None       # _fresh_file(), made once
        _clear_tmpdir()

    # ------------------------------------------------------------------
    # state

    def snapshot(self):
        """What a failing call must leave as it was: {part: value}.  Sets self.inner to what
        the invariant checks read beyond it (which a failing call may change: the free queue's
        order, stale index entries dropped on sight): an unchanged snapshot and unchanged
        internals mean the checks would see what they last passed.

        The core's part is one read through the core (CacheCore.debug_snapshot: every live
        sequence's length, kept positions, priority and held K/V of every layer; every block's
        generation, cached mark and references; the free queue, block tables, written tokens
        and segments).  The core is not instrumented: these reads are not the search's
        coverage."""
        c = self.cache
        seqs, pool, inner = c._core.debug_snapshot()
        state = {"seqs": seqs, "pool": pool}
        p = c._prefix
        if p is None:
            self.inner = inner + (None,)
            return state
        entries, valid = p._entries(), p._valid
        state["index"] = sorted((e.key, e.block, e.gen, e.tokens, repr(e.salt))
                                for e in entries if valid(e))
        state["prefix_seqs"] = sorted((sid, list(st.tokens), [e.key for e in st.chain])
                                      for sid, st in p._seqs.items())
        state["counts"] = p.counts()
        self.inner = inner + ([(e.key, e.block, e.gen, valid(e)) for e in entries],)
        return state

    def used_entries(self):
        """The valid prefix-index entries whose block is in use (every copy: compaction moves
        the entries themselves)."""
        p, core = self.cache._prefix, self.cache._core
        if p is None:
            return set()
        return {e for e in p._entries() if p._valid(e) and core.ref_count(e.block) > 0}

    def check_accounting(self, state, inner):
        """reference.check_pool_invariants on the snapshot and internals just read (nothing
        has changed since): every reference count equals the block tables naming the block,
        the free queue holds exactly the free blocks, the prefix index agrees (stats():
        check_stats, once a program)."""
        seqs, tables = state["seqs"], inner[1]
        num_blocks, num_free, blocks, _ = state["pool"]
        check_accounting(self.cache,
                         [(s[0], memoryview(t[1]).cast("i").tolist(), s[1])
                          for s, t in zip(seqs, tables)],
                         [ref for _, _, ref in blocks], inner[0], num_free, with_stats=False)

    def check_stats(self, state):
        """stats() agrees with the snapshot `state` of the cache as it is now (it is computed
        from the same counters on every call, so checking it once a program, at the end, sees
        what any earlier call left wrong in them)."""
        st = self.cache.stats()
        num_blocks, num_free, _, cached_free = state["pool"]
        assert (st.blocks_total, st.blocks_free, st.blocks_used) == (
            num_blocks, num_free, num_blocks - num_free), st
        assert st.tokens_held == sum(s[1] for s in state["seqs"]), st
        assert st.sequences_active == len(state["seqs"]), st
        assert st.cached_free_blocks == cached_free, st

    def check_state(self, state, inner):
        """Invariants beyond the block accounting (reference.check_pool_invariants), on
        `state` and `inner`, the snapshot of the cache as it is now and its internals.  A
        sequence's own checks read its segments, offsets, length, kept positions and priority;
        they run again only when one of those changed since they last passed (self.checked)."""
        c = self.cache
        core, pool = c._core, c._core.pool
        checked = {}
        for (sid, length, kept, pr, _), (sid2, _, _, g) in zip(state["seqs"], inner[1]):
            assert sid == sid2, (sid, sid2)
            key = (g, length, kept, pr)
            checked[sid] = key
            if self.checked.get(sid) == key:
                continue
            # kept positions: segment a's slots + off0, then segment b's + off1 (increasing,
            # from 0 on)
            a0, a1, b0, b1, off0, off1 = g
            assert 0 <= a0 <= a1 <= b0 <= b1, g
            assert a0 == a1 or a1 + off0 <= b0 + off1, g
            assert length == a1 - a0 + b1 - b0 and len(kept) == 8 * length, (sid, length, g)
            first = a0 + off0 if a1 > a0 else b0 + off1
            assert not length or first >= 0, g
            assert math.isfinite(pr), f"sequence {sid} has priority {pr}"
        self.checked = checked
        _, _, blocks, num_cached_free = state["pool"]
        cached_free = sum(1 for _, cached, ref in blocks if cached and not ref)
        assert num_cached_free == cached_free, (num_cached_free, cached_free)
        p = c._prefix
        if p is None:
            return
        valid_on = {}
        for key, copies in p._index.items():
            for e in copies:
                assert e.key == key
                if p._valid(e):
                    assert 0 <= e.block < c.num_blocks and len(e.tokens) == self.bs
                    assert valid_on.setdefault(e.block, e) is e, f"block {e.block}: two entries"
        assert p.num_entries <= c.num_blocks, (p.num_entries, c.num_blocks)
        assert sorted(p._seqs) == sorted(c.sequence_ids()), (sorted(p._seqs), c.sequence_ids())
        bs = self.bs
        for sid, st in p._seqs.items():
            assert len(st.chain) * bs <= c.seq_len(sid), (sid, len(st.chain), c.seq_len(sid))
            table = c.block_table(sid).tolist()
            for i, e in enumerate(st.chain):
                assert e.tokens == tuple(st.tokens[i * bs:(i + 1) * bs]), (sid, i)
                assert _same_prefix(e.parent, st.chain[i - 1] if i else None), (sid, i)
                assert e.salt is st.salt or e.salt == st.salt, (sid, i)
                assert e.block == table[i] and valid_on.get(e.block) is e, (sid, i)
        # a registered block's bytes never change while its entry is valid
        for sid in c.sequence_ids():
            table = c.block_table(sid).tolist()
            if not any(b in valid_on for b in table):
                continue
            try:
                _, data = core.export_seq(sid)
            except ValueError:
                continue  # in the middle of a step
            for i, blk in enumerate(table):
                if blk in valid_on:
                    raw = data[i].tobytes()
                    seen = self.block_bytes.setdefault((blk, pool.generation(blk)), raw)
                    assert seen == raw, f"registered block {blk} changed in place"

    def ids(self):
        self.live = self.cache.sequence_ids()

    # ------------------------------------------------------------------
    # the next call

    def op(self):
        """(name, call) of the next operation; sets self.allowed (the exceptions it may raise)
        and self.on_fail (a check after it raised, or None)."""
        b = self.b
        name = b.pick(OPS)
        self.allowed, self.on_fail, self.rewrites, self.opt_bits = ALLOWED, None, (), 0
        return name, self._call(name)

    def _tokens(self, sid, n, start=None):
        """The token ids of the next n tokens of `sid` (its stream, from its length on)."""
        j = self.stream.get(sid, 0) if type(sid) is int else 0
        if start is None:
            try:
                start = self.cache.seq_len(sid)
            except Exception:
                start = 0
        return [_stream_token(j, p) for p in range(start, start + n)]

    def _call(self, name):
        b, c = self.b, self.cache
        sid = self.target = _sid(b, self.live, self.freed)
        layer = _hostile_int(b, b.int(0, self.layers - 1))
        n = b.int(1, 2 * self.bs + 1)
        hq = self.hkv * self.g
        dt = self.np_dtype
        if name == "add":
            return self._add()
        if name == "step":
            return self._step(sid, n)
        if name == "append":
            k = _array(b, n, self.hkv, self.d, dt)
            v = _array(b, n, self.hkv, self.d, dt) if b.chance(200) else k
            if layer != 0:
                self.rewrites = (sid,)
            if self.prefix and b.chance(200) or b.chance(6):
                ids = _hostile_ids(b, self._tokens(sid, n))
                return lambda: c.append(sid, k, v, layer=layer, token_ids=ids)
            return lambda: c.append(sid, k, v, layer=layer)
        if name in ("append_batch", "attend_batch"):
            sids = [_sid(b, self.live, self.freed) for _ in range(b.int(0, 4))]
            if b.chance(15):
                ints = [x for x in sids if type(x) is int and -2**63 <= x < 2**63]
                sids = b.pick([None, 3, "ab", np.array(ints, dtype=np.int64), tuple(sids)])
            B = len(sids) if hasattr(sids, "__len__") else 1
            if name == "append_batch":
                k = _array(b, B, self.hkv, self.d, dt)
                if layer != 0 and isinstance(sids, (list, tuple, np.ndarray)):
                    self.rewrites = tuple(sids)
                if self.prefix and b.chance(160) or b.chance(6):
                    good = ([self._tokens(s, 1)[0] for s in sids]
                            if isinstance(sids, (list, tuple, np.ndarray)) else [0] * B)
                    ids = _hostile_ids(b, good)
                    return lambda: c.append_batch(sids, k, k, layer=layer, token_ids=ids)
                return lambda: c.append_batch(sids, k, k, layer=layer)
            q = _array(b, B, hq, self.d, dt)
            out = self._out(B, hq)
            opts = self._attn_options(hq)
            return lambda: c.attend_batch(sids, q, layer=layer, scale=self._scale(), out=out,
                                          **opts)
        if name == "attend":
            m = b.int(1, 4)
            q = _array(b, m, hq, self.d, dt)
            out = self._out(m, hq)
            opts = self._attn_options(hq)
            return lambda: c.attend(sid, q, layer=layer, scale=self._scale(), out=out, **opts)
        if name == "gather":
            return lambda: c.gather(sid, layer=layer)
        if name == "fork":
            return lambda: self.stream.__setitem__(c.fork(sid), self.stream.get(sid, 0))
        if name == "truncate":
            length = _hostile_int(b, b.int(0, 3 * self.bs))
            return lambda: c.truncate(sid, length)
        if name == "free":
            return lambda: c.free(sid)
        if name == "streaming":
            s, r = _hostile_int(b, b.int(0, 3)), _hostile_int(b, b.int(1, 6))
            return lambda: c.apply_streaming_llm(sid, s, r)
        if name == "evict":
            target = sid if b.chance(128) else None
            return lambda: c.evict(target)
        if name == "threshold":
            u = b.pick([0.0, 0.5, 1.0, -0.1, 1.5, float("nan"), None, "x"])
            return lambda: c.evict_to_threshold(u)
        if name == "priority":
            p = b.pick([0, 2.5, -1e300, float("nan"), float("inf"), None, "1"])
            return lambda: c.set_priority(sid, p)
        if name == "query":
            f = b.pick([c.seq_len, c.kept_positions, c.sequence_info, c.num_seq_blocks,
                        c.block_table, c.priority, lambda s: s in c])
            return lambda: (f(sid), c.stats(), repr(c), c.eviction_order())
        if name == "save":
            return self._save(sid)
        if name == "load":
            return self._load()
        if name == "compact":
            return self._compact()
        if name == "resize":
            return self._resize()
        on = b.chance(128)

        def auto():
            c.auto_evict = on
        return auto

    def _step(self, sid, n):
        """A well-formed append on every layer (token ids from the sequence's stream): drives
        sequences to full, registered blocks.  Each layer's append is checked on its own."""
        b, c = self.b, self.cache
        k = _data(b, [n, self.hkv, self.d], self.np_dtype)
        v = k if b.chance(128) else _data(b, [n, self.hkv, self.d], self.np_dtype)
        ids = self._tokens(sid, n) if self.prefix else None

        def step():
            for layer in range(self.layers):
                if layer:
                    self.before = self.snapshot()  # a failure here must undo only this layer
                c.append(sid, k, v, layer=layer, token_ids=ids if layer == 0 else None)
        return step

    def _add(self):
        b, c = self.b, self.cache
        p = 0 if b.chance(200) else b.pick([1.5, -3, float("nan"), "x", float("inf"),
                                             10**400, None])
        # 0-1: no token ids; 2-3: a prompt and a salt; 4: a prompt only; 5: a salt only;
        # 6: hostile token ids; 7: an unhashable salt (without prefix caching: TypeError)
        how = b.int(0, 7) if self.prefix or b.chance(12) else 0
        if how <= 1:
            return lambda: c.add_sequence(priority=p)
        j = b.int(0, 3)
        good = [_stream_token(j, i) for i in range(b.int(0, 4 * self.bs + 2))]
        ids = _hostile_ids(b, good) if how == 6 else good
        salt = b.pick(SALTS)
        if how == 7:
            salt = b.pick([[1], {"a": 1}, np.zeros(2), {1}, bytearray(b"s")])
        kw = {}
        if how != 5:
            kw["token_ids"] = ids
        if how != 4:
            kw["cache_salt"] = salt

        def add():
            self.stream[c.add_sequence(priority=p, **kw)] = j
        return add

    def _compact(self):
        c = self.cache
        keep = self.used_entries()

        def compact():
            before = self.before
            used = c.num_blocks - c.num_free_blocks
            moved = c.compact()
            assert type(moved) is int and 0 <= moved <= used, moved
            assert c._core.pool.highest_used() == used - 1, "compact left a hole"
            self.check_kept(before, keep)
        return compact

    def _resize(self):
        b, c = self.b, self.cache
        used = c.num_blocks - c.num_free_blocks
        hi = c._core.pool.highest_used()
        n = b.pick([used, hi + 1, hi, c.num_blocks, c.num_blocks + 1, c.num_blocks - 1, 0, 1,
                    b.int(0, 24), b.int(0, 64), 96,
                    -1, 2**31, 2**63, 2**64, -2**63, 10**30, 1.0, float(hi + 1), True, None,
                    str(hi + 1), np.int64(hi + 1), np.uint64(2**64 - 1), np.int8(-1),
                    np.float64(hi + 1)])
        keep = self.used_entries()

        def resize():
            before = self.before
            c.resize(n)
            assert c.num_blocks == int(n) and c.num_free_blocks == int(n) - used
            self.check_kept(before, keep)
        return resize

    def rewritten(self):
        """After a layer > 0 append: the newest step of those sequences may have been written
        again (allowed: the same n positions), registered blocks included; their recorded
        bytes start over."""
        blocks = set()
        for sid in self.rewrites:
            try:
                blocks.update(self.cache.block_table(sid).tolist())
            except ALLOWED:
                pass
        self.block_bytes = {k: v for k, v in self.block_bytes.items() if k[0] not in blocks}

    def evicted_during(self, name, e, log_before):
        """Ids an automatic eviction removed before `e` was raised (documented: with forks the
        room check can be optimistic and evictions made before the error stay)."""
        c = self.cache
        if not (isinstance(e, pagedkv.OutOfBlocksError) and c.auto_evict
                and name in ("append", "append_batch", "step")):
            return set()
        return {r.sid for r in list(c.eviction_log)[log_before:] if r.cause == "out_of_blocks"}

    @staticmethod
    def only_evicted(before, after, evicted):
        """`after` is `before` less the evicted sequences."""
        for part in ("seqs", "prefix_seqs"):
            if part in before and after[part] != [s for s in before[part] if s[0] not in evicted]:
                return False
        return after.get("index") == before.get("index")

    def check_kept(self, before, keep):
        """After compact / resize: every sequence's contents as before, and every valid prefix
        entry of a used block still valid."""
        assert self.snapshot()["seqs"] == before["seqs"], "contents changed"
        gone = keep - self.used_entries()
        assert not gone, f"prefix entries of used blocks lost: {len(gone)}"

    def _scale(self):
        b = self.b
        return None if b.chance(200) else b.pick([0.0, -1.0, 1e308, float("nan"),
                                                  float("inf"), "x", 1e-300])

    def _attn_options(self, hq):
        """window / softcap / sinks keywords for attend and attend_batch: often none, mostly
        valid (windows shorter and longer than the sequences), sometimes hostile."""
        b = self.b
        opts = {}
        if b.chance(150):
            return opts
        if b.chance(150):
            opts["window"] = (b.pick([1, 2, self.bs, self.bs + 1, b.int(1, 4 * self.bs + 2),
                                      2**62 - 1, np.int32(3), np.uint8(1), None])
                              if b.chance(210) else
                              b.pick([0, -1, -2**63, 2**62, 2**64, 2**200, 1.0, 2.5,
                                      float("nan"), True, np.bool_(True), "4", [2],
                                      np.int64(0), np.uint64(2**64 - 1), np.int8(-1),
                                      np.float64(2)]))
        if b.chance(120):
            opts["softcap"] = (b.pick([0.5, 5.0, 30.0, 50.0, 1e-3, 2, np.float32(20.0),
                                       np.int64(7), 1e300, None])
                               if b.chance(210) else
                               b.pick([0.0, -0.0, -1.0, -1e300, float("nan"), float("inf"),
                                       float("-inf"), 10**400, -10**400, 5e-324, True,
                                       np.bool_(False), "50", [1.0], np.float32("nan"),
                                       np.float64("inf"), np.complex128(1)]))
        if b.chance(120):
            good = b.chance(200)
            dtype = b.pick([np.float32, np.float64]) if good else b.pick(
                [np.float16, np.int64, np.int32, np.bool_, np.complex64, object,
                 np.dtype(">f8"), np.float32, np.float64])
            n = hq if good or b.chance(128) else b.pick([0, 1, hq - 1, hq + 1, 2 * hq])
            sinks = _normals(b, n) * b.pick([1.0, 3.0, 1e3, 1e300])
            if not good and n and b.chance(100):
                sinks[b.int(0, n - 1)] = b.pick([np.nan, np.inf, -np.inf])
            sinks = sinks.astype(dtype)
            how = b.int(0, 7)
            if how == 1:
                sinks = sinks.reshape(1, -1)
            elif how == 2 and not good:
                sinks = sinks.reshape(-1, 1)
            elif how == 3:
                sinks = np.repeat(sinks, 2)[::2]  # non-contiguous
            elif how == 4:
                sinks.setflags(write=False)
            elif how == 5 and not good:
                sinks = b.pick([sinks.tolist(), None, 1.5, "s", sinks[:0]])
            elif how == 6 and not good and n:
                sinks = sinks[0]  # 0-d (NumPy scalar)
            opts["sinks"] = sinks
        # for the feedback: which options, and a window shorter than some live sequence (the
        # kernels then skip blocks)
        w = opts.get("window")
        core = self.cache._core
        cuts = (isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))
                and any(1 <= w < core.seq_len(s) for s in core.sequence_ids()))
        self.opt_bits = (("window" in opts) | ("softcap" in opts) << 1 | ("sinks" in opts) << 2
                         | cuts << 3)
        return opts

    def _out(self, m, hq):
        b = self.b
        if b.chance(200):
            return None
        dt, d = self.np_dtype, self.d
        how = b.int(0, 5)
        if how == 0:
            return np.empty((m, hq, d), dt)
        if how == 1:
            return np.empty((m, hq, d + 1), dt)
        if how == 2:
            return np.empty((m, hq, d), np.float16)
        if how == 3:
            return np.empty((m, hq, 2 * d), dt)[:, :, ::2]
        if how == 4:
            return np.empty((m + 1, hq, d), dt)
        return [[0.0]]

    def feature(self, name, outcome, state, inner):
        """A number for (previous call, this call, its outcome, the shape of the sequence it
        named, the attention options it passed): segments held, a partial last block, a step not
        yet written on every layer, a shared last block, or no such sequence; window, softcap,
        sinks, a window shorter than a live sequence.  `state` and `inner`: the snapshot after
        the call."""
        sid, shape = self.target, 0
        if type(sid) is int:
            for (s, length, _, _, _), (_, table, written, g) in zip(state["seqs"], inner[1]):
                if s == sid:
                    last = int.from_bytes(table[-4:], "little") if table else -1
                    shape = (1 | (g[1] > g[0]) << 1 | (g[3] > g[2]) << 2
                             | (length % self.bs != 0) << 3 | (written < length) << 4
                             | (last >= 0 and state["pool"][2][last][2] > 1) << 5)
                    break
        op = _OP_INDEX[name]
        f = ((((self.prev * 32 + op) * 16 + _OUTCOME_INDEX.get(outcome, 15)) * 64 + shape) * 16
             + self.opt_bits)
        self.prev = op
        return f

    def run(self):
        """Up to MAX_OPS calls.  The snapshot after a call is the next call's `before`; the
        invariants run after every call that changed the snapshot or the internals they read
        (so a run pays for checks in proportion to the calls that changed something)."""
        with np.errstate(all="ignore"):  # NaN / inf data are the programs' own
            self._run()

    def _run(self):
        state = self.snapshot()
        inner = self.inner
        for _ in range(MAX_OPS):
            if self.b.left() <= 0:
                break
            name, call = self.op()
            self.before = state
            live_before = self.live
            log_before = len(self.cache.eviction_log)
            try:
                call()
                OUTCOMES[name, "ok"] += 1
                outcome = "ok"
                after, now = self.snapshot(), self.inner
                if name in READ_ONLY and after != state:
                    raise AssertionError(f"a successful {name} changed the cache")
                if self.rewrites:
                    self.rewritten()
            except self.allowed as e:
                outcome = type(e).__name__
                OUTCOMES[name, outcome] += 1
                after, now, before = self.snapshot(), self.inner, self.before
                evicted = self.evicted_during(name, e, log_before)
                if evicted and self.only_evicted(before, after, evicted):
                    OUTCOMES[name, "evicted-then-raised"] += 1
                elif after != before:
                    diff = sorted(k for k in after if after[k] != before.get(k))
                    raise AssertionError(f"a {name} that raised {type(e).__name__} changed the "
                                         f"cache ({', '.join(diff)})") from e
                if self.on_fail is not None:
                    self.on_fail()
            if FEEDBACK is not None:
                FEEDBACK(self.feature(name, outcome, after, now))
            if after != state or now != inner:
                self.ids()
                self.freed = sorted(set(self.freed) | (set(live_before) - set(self.live)))[-8:]
                self.check_accounting(after, now)
                self.check_state(after, now)
            state, inner = after, now
        self.check_stats(state)


def run_program(data: bytes):
    """Build a cache from `data` and run the program it encodes (raises on a failure)."""
    b = Bytes(data)
    try:
        runner = Runner(b)
    except ALLOWED:
        return
    runner.run()
