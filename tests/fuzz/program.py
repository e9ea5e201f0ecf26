"""Decode bytes into a hostile program over one PagedKVCache and run it.

Shared by the atheris harness (tests/fuzz/fuzz_cache.py, coverage-guided, against the sanitizer
build) and by tests/test_fuzz_programs.py (saved regressions plus random byte strings, in every
test run).  A program builds a small cache from the bytes, then runs up to MAX_OPS public calls
with arguments that are often wrong: ids live / freed / huge / negative / float / bool / None,
arrays of the wrong dtype, ndim, shape, strides, alignment, writability, zero length or huge
broadcast length, NaN / inf data, hostile layers, scales, sizes and out= arrays.

What counts as a failure (raised out of run_program):
  * an exception other than the documented ones (ALLOWED),
  * a call that raised but changed the cache (lengths, free blocks, stored K/V),
  * a broken block accounting after any call (reference.check_pool_invariants),
  * and, under the sanitizers, any memory or undefined-behaviour error (the process aborts).
"""
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pagedkv  # noqa: E402
from reference import check_pool_invariants  # noqa: E402

ALLOWED = (KeyError, ValueError, TypeError, RuntimeError, MemoryError)
MAX_OPS = 32
# weighted: sequences must live long enough to be appended to and attended over
OPS = (["add"] * 3 + ["append"] * 5 + ["append_batch"] * 2 + ["attend"] * 2
       + ["attend_batch"] * 2 + ["gather", "fork", "truncate", "free", "streaming", "evict",
                                 "threshold", "priority", "query", "auto"])
#: (operation, "ok" or the exception's name) -> calls, over every program run in this process
OUTCOMES = collections.Counter()


class Bytes:
    """Reads small integers and choices from a byte string (zeros once it runs out)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def left(self):
        return len(self.data) - self.pos

    def byte(self):
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, lo, hi):
        """An int in [lo, hi] (hi - lo < 2**32)."""
        span = hi - lo + 1
        v = 0
        for _ in range((span.bit_length() + 7) // 8):
            v = (v << 8) | self.byte()
        return lo + v % span

    def pick(self, options):
        return options[self.int(0, len(options) - 1)]

    def chance(self, in256):
        return self.byte() < in256


def _hostile_int(b: Bytes, good):
    """Mostly `good`; otherwise an int, or not an int, chosen to break things."""
    if b.chance(225):
        return good
    return b.pick([-1, 0, 1, good + 1, good - 1, 2**31, 2**31 - 1, 2**63 - 1, -2**63, 2**64,
                   2**200, -2**200, 1.0, float("nan"), True, False, None, "3", np.int8(1),
                   np.uint64(2**64 - 1), np.int64(-1), np.float32(good), [good]])


def _sid(b: Bytes, live, freed):
    r = b.byte()
    if live and r < 215:
        return live[r % len(live)]
    if freed and r < 235:
        return freed[r % len(freed)]
    return b.pick([-1, 0, 1, 7, 2**31, 2**62, 2**64, -2**70, 1.5, True, None, "0",
                   np.int32(0), np.uint8(1), np.float64(0)])


def _data(b: Bytes, shape, dtype):
    n = int(np.prod(shape)) if len(shape) else 1
    kind = b.int(0, 7)
    if kind == 0:
        a = np.zeros(n)
    elif kind == 1:
        a = np.full(n, b.pick([np.nan, np.inf, -np.inf, 1e38, -1e308, 5e-324, -0.0]))
    elif kind == 2:  # some NaN / inf among normal values
        a = np.random.default_rng(b.byte()).standard_normal(n)
        a[:: max(1, b.int(1, 7))] = b.pick([np.nan, np.inf, -np.inf])
    else:
        a = np.random.default_rng(b.byte()).standard_normal(n) * b.pick([1.0, 1e-3, 1e3, 1e30])
    with np.errstate(all="ignore"):
        return a.reshape(shape).astype(dtype) if dtype is not object else a.reshape(shape)


def _array(b: Bytes, n, heads, d, dtype):
    """A [n, heads, d] argument, often wrong in one or more ways."""
    shape = [n, heads, d]
    if b.chance(20):  # wrong shape or ndim
        how = b.int(0, 5)
        if how == 0:
            shape = shape[:2]
        elif how == 1:
            shape = shape + [1]
        elif how == 2:
            shape[b.int(0, 2)] += b.pick([-1, 1, 3])
        elif how == 3:
            shape[0] = 0
        elif how == 4:
            shape = []
        shape = [max(0, s) for s in shape]
    if b.chance(20):
        dtype = b.pick([np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_,
                        np.complex64, np.uint8, object])
    layout = b.int(0, 9) if b.chance(40) else 0
    if layout == 1 and len(shape) == 3 and shape[0] > 0:  # huge broadcast view (tiny memory)
        base = _data(b, [1] + shape[1:], dtype)
        big = b.pick([2**12, 2**31, 2**40, 2**62])
        try:
            return np.lib.stride_tricks.as_strided(base, [big] + shape[1:],
                                                   [0] + list(base.strides[1:]))
        except (ValueError, MemoryError):
            return base
    a = _data(b, shape, dtype)
    if layout == 2 and a.ndim:  # non-contiguous
        big = _data(b, [s * 2 for s in shape], dtype)
        a = big[tuple(slice(None, None, 2) for _ in shape)]
    elif layout == 3:
        a = np.asfortranarray(a)
    elif layout == 4:
        a.setflags(write=False)
    elif layout == 5 and a.dtype != object:  # misaligned
        raw = np.zeros(a.nbytes + 1, np.uint8)
        a = np.frombuffer(raw[1:].data, dtype=a.dtype, count=a.size).reshape(a.shape)
    elif layout == 6 and a.ndim:
        a = a[::-1]
    elif layout == 7:
        return a.tolist()
    elif layout == 8:
        return b.pick([None, 1.0, "k", b"\x00" * 8, [[1.0]]])
    return a


class Runner:
    def __init__(self, b: Bytes):
        self.b = b
        self.hkv = b.int(1, 3)
        self.g = b.int(1, 3)
        self.d = b.int(1, 9)
        self.layers = b.int(1, 2)
        self.bs = b.int(1, 6)
        self.dtype = b.pick(["float32", "float64"])
        kw = dict(num_blocks=b.int(1, 12), block_size=self.bs, num_kv_heads=self.hkv,
                  head_dim=self.d, num_layers=self.layers, dtype=self.dtype,
                  max_seqs=b.int(1, 5))
        if b.chance(60):
            kw["max_blocks_per_seq"] = b.int(1, 6)
        if b.chance(60):
            kw["streaming"] = pagedkv.StreamingLLM(sink_tokens=b.int(0, 4),
                                                   window_tokens=b.int(1, 8))
        if b.chance(50) and self.d % 2 == 0:
            kw["rope"] = pagedkv.RoPE(theta=b.pick([10000.0, 1.0, 1e6]))
        if b.chance(60):
            kw["auto_evict"] = True
            kw["eviction_strategy"] = b.pick(["lru", "lfu", "longest", "priority"])
        self.cache = pagedkv.PagedKVCache(**kw)
        self.live, self.freed = [], []

    # ------------------------------------------------------------------
    def snapshot(self):
        c = self.cache
        state = [c.num_free_blocks]
        for sid in c.sequence_ids():
            data = [c.gather(sid, layer) for layer in range(self.layers)]
            state.append((sid, c.seq_len(sid), c.kept_positions(sid).tobytes(),
                          [(k.tobytes(), v.tobytes()) for k, v in data]))
        return state

    def ids(self):
        self.live = self.cache.sequence_ids()

    def op(self):
        """(name, call) of the next operation."""
        b = self.b
        name = b.pick(OPS)
        return name, self._call(name)

    def _call(self, name):
        b, c = self.b, self.cache
        sid = _sid(b, self.live, self.freed)
        layer = _hostile_int(b, b.int(0, self.layers - 1))
        n = b.int(1, 2 * self.bs + 1)
        hq = self.hkv * self.g
        dt = np.dtype(self.dtype).type
        if name == "add":
            p = 0 if b.chance(200) else b.pick([1.5, -3, float("nan"), "x", float("inf"),
                                                 10**400, None])
            return lambda: c.add_sequence(priority=p)
        if name == "append":
            k = _array(b, n, self.hkv, self.d, dt)
            v = _array(b, n, self.hkv, self.d, dt) if b.chance(200) else k
            return lambda: c.append(sid, k, v, layer=layer)
        if name in ("append_batch", "attend_batch"):
            sids = [_sid(b, self.live, self.freed) for _ in range(b.int(0, 4))]
            if b.chance(15):
                ints = [x for x in sids if type(x) is int and -2**63 <= x < 2**63]
                sids = b.pick([None, 3, "ab", np.array(ints, dtype=np.int64), tuple(sids)])
            B = len(sids) if hasattr(sids, "__len__") else 1
            if name == "append_batch":
                k = _array(b, B, self.hkv, self.d, dt)
                return lambda: c.append_batch(sids, k, k, layer=layer)
            q = _array(b, B, hq, self.d, dt)
            out = self._out(B, hq)
            return lambda: c.attend_batch(sids, q, layer=layer, scale=self._scale(), out=out)
        if name == "attend":
            m = b.int(1, 4)
            q = _array(b, m, hq, self.d, dt)
            out = self._out(m, hq)
            return lambda: c.attend(sid, q, layer=layer, scale=self._scale(), out=out)
        if name == "gather":
            return lambda: c.gather(sid, layer=layer)
        if name == "fork":
            return lambda: c.fork(sid)
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
        on = b.chance(128)

        def auto():
            c.auto_evict = on
        return auto

    def _scale(self):
        b = self.b
        return None if b.chance(200) else b.pick([0.0, -1.0, 1e308, float("nan"),
                                                  float("inf"), "x", 1e-300])

    def _out(self, m, hq):
        b = self.b
        if b.chance(200):
            return None
        dt = np.dtype(self.dtype).type
        return b.pick([
            np.empty((m, hq, self.d), dt),
            np.empty((m, hq, self.d + 1), dt),
            np.empty((m, hq, self.d), np.float16),
            np.empty((m, hq, 2 * self.d), dt)[:, :, ::2],
            np.empty((m + 1, hq, self.d), dt),
            [[0.0]],
        ])

    def run(self):
        for _ in range(MAX_OPS):
            if self.b.left() <= 0:
                break
            name, call = self.op()
            before = self.snapshot()
            live_before = set(self.live)
            try:
                with np.errstate(all="ignore"):
                    call()
                OUTCOMES[name, "ok"] += 1
            except ALLOWED as e:
                OUTCOMES[name, type(e).__name__] += 1
                after = self.snapshot()
                if after != before:
                    raise AssertionError("a call that raised changed the cache")
            self.ids()
            self.freed = sorted(set(self.freed) | (live_before - set(self.live)))[-8:]
            check_pool_invariants(self.cache)


def run_program(data: bytes):
    """Build a cache from `data` and run the program it encodes (raises on a failure)."""
    b = Bytes(data)
    try:
        runner = Runner(b)
    except ALLOWED:
        return
    runner.run()
