"""Bad-input matrix: every public method x every kind of wrong argument.

Each row calls one method with one bad argument on a cache holding two sequences (two layers,
one of them forked so blocks are shared) and one freed id.  It must raise the documented
exception, with a message naming what was expected and what was received (the `match` regex),
and leave the cache exactly as it was: lengths, kept positions, stored K/V of every layer, free
blocks, statistics and reference counts (reference.check_pool_invariants).

New operations get their rows in ROWS (one line each); `ids_rows` adds the id rows for every
method that takes a sequence id.
"""
import re

import numpy as np
import pytest

import pagedkv
from reference import assert_unchanged, check_pool_invariants, snapshot

HKV, HQ, D, BS, LAYERS = 2, 4, 4, 4, 2
F = np.float32


def make():
    """The cache every row starts from, and its ids: a (6 tokens), b = fork(a) + 1 token,
    c (3 tokens), freed (a freed id)."""
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=BS, num_kv_heads=HKV, head_dim=D,
                                 num_layers=LAYERS, dtype="float32", max_seqs=6)
    rng = np.random.default_rng(0)
    ids = {}
    for name, n in (("a", 6), ("c", 3), ("freed", 2)):
        sid = ids[name] = cache.add_sequence()
        for layer in range(LAYERS):
            kv = rng.standard_normal((n, HKV, D)).astype(F)
            cache.append(sid, kv, kv, layer=layer)
    ids["b"] = cache.fork(ids["a"])
    for layer in range(LAYERS):
        kv = rng.standard_normal((1, HKV, D)).astype(F)
        cache.append(ids["b"], kv, kv, layer=layer)
    cache.free(ids["freed"])
    return cache, ids


def tok(n, heads=HKV, d=D, dtype=F):
    return np.ones((n, heads, d), dtype)


def strided(a):
    return np.repeat(a, 2, axis=-1)[..., ::2]


def readonly(a):
    a = np.array(a)
    a.setflags(write=False)
    return a


# (method, what is wrong, call(cache, ids), exception, regex naming expected and received)
ROWS = [
    # --- append: arrays
    ("append", "k int32", lambda c, i: c.append(i["c"], tok(1, dtype=np.int32), tok(1)),
     TypeError, r"k must be a float array.*got dtype int32"),
    ("append", "k bool", lambda c, i: c.append(i["c"], tok(1, dtype=np.bool_), tok(1)),
     TypeError, r"k must be a float array.*got dtype bool"),
    ("append", "k complex", lambda c, i: c.append(i["c"], tok(1, dtype=np.complex64), tok(1)),
     TypeError, r"float array.*complex64"),
    ("append", "k object", lambda c, i: c.append(i["c"], tok(1, dtype=object), tok(1)),
     TypeError, r"float array.*object"),
    ("append", "k None", lambda c, i: c.append(i["c"], None, tok(1)),
     TypeError, r"float array.*object"),
    ("append", "k 2-d", lambda c, i: c.append(i["c"], np.ones((2, D), F), tok(1)),
     ValueError, r"\[n, 2, 4\].*2-d shape \(2, 4\)"),
    ("append", "k 4-d", lambda c, i: c.append(i["c"], np.ones((1, 1, HKV, D), F), tok(1)),
     ValueError, r"\[n, 2, 4\].*\(1, 1, 2, 4\)"),
    ("append", "k heads", lambda c, i: c.append(i["c"], tok(1, heads=3), tok(1)),
     ValueError, r"\[n, 2, 4\].*\(1, 3, 4\)"),
    ("append", "k head_dim", lambda c, i: c.append(i["c"], tok(1, d=5), tok(1)),
     ValueError, r"\[n, 2, 4\].*\(1, 2, 5\)"),
    ("append", "k zero-length", lambda c, i: c.append(i["c"], tok(0), tok(0)),
     ValueError, r"\[n, 2, 4\].*\(0, 2, 4\)"),
    ("append", "v length differs", lambda c, i: c.append(i["c"], tok(2), tok(3)),
     ValueError, r"v must have shape \[n=2, 2, 4\].*\(3, 2, 4\)"),
    ("append", "v int64", lambda c, i: c.append(i["c"], tok(1), tok(1, dtype=np.int64)),
     TypeError, r"v must be a float array.*int64"),
    # refused for its size before any copy (a 32 TiB copy could be granted lazily by an
    # overcommitting kernel and then fill memory)
    ("append", "k huge broadcast", lambda c, i: c.append(
        i["c"], np.broadcast_to(tok(1), (2**40, HKV, D)), np.broadcast_to(tok(1), (2**40, HKV, D))),
     pagedkv.OutOfBlocksError, r"needs \d+ free block\(s\)"),
    ("append", "too many tokens for the pool", lambda c, i: c.append(i["c"], tok(40), tok(40)),
     pagedkv.OutOfBlocksError, r"needs \d+ free block\(s\), \d+ available"),
    ("append", "layer 1 n differs", lambda c, i: c.append(i["c"], tok(2), tok(2), layer=1),
     ValueError, r"n=3 tokens .* got n=2"),
    # --- append_batch
    ("append_batch", "empty sids", lambda c, i: c.append_batch([], tok(0), tok(0)),
     ValueError, r"at least one sequence"),
    ("append_batch", "sids not a sequence", lambda c, i: c.append_batch(5, tok(1), tok(1)),
     TypeError, r"sids must be a sequence of ints, got int"),
    ("append_batch", "duplicate sids", lambda c, i: c.append_batch([i["a"], i["a"]], tok(2), tok(2)),
     ValueError, r"appears twice"),
    ("append_batch", "more sids than max_seqs", lambda c, i: c.append_batch([i["a"]] * 7, tok(7), tok(7)),
     ValueError, r"7 sequence ids given.*at most 6"),
    ("append_batch", "k rows != B", lambda c, i: c.append_batch([i["a"], i["c"]], tok(3), tok(3)),
     ValueError, r"\[B=2, 2, 4\].*\(3, 2, 4\)"),
    ("append_batch", "k float16 wrong shape", lambda c, i: c.append_batch([i["a"]], tok(1, d=3, dtype=np.float16), tok(1)),
     ValueError, r"\[B=1, 2, 4\].*\(1, 2, 3\)"),
    ("append_batch", "one id freed", lambda c, i: c.append_batch([i["a"], i["freed"]], tok(2), tok(2)),
     KeyError, r"unknown or freed sequence id"),
    ("append_batch", "pool exhausted by the last sequence", None, pagedkv.OutOfBlocksError,
     r"needs \d+ free block\(s\), 0 available"),
    # --- attend / attend_batch
    ("attend", "q heads not a multiple", lambda c, i: c.attend(i["a"], tok(1, heads=3)),
     ValueError, r"q has 3 heads.*multiple of num_kv_heads=2"),
    ("attend", "q zero heads", lambda c, i: c.attend(i["a"], np.ones((1, 0, D), F)),
     ValueError, r"q has 0 heads"),
    ("attend", "q head_dim", lambda c, i: c.attend(i["a"], tok(1, heads=HQ, d=5)),
     ValueError, r"\[n, 4, 4\].*\(1, 4, 5\)"),
    ("attend", "q 2-d", lambda c, i: c.attend(i["a"], np.ones((HQ, D), F)),
     ValueError, r"q must have shape \[n, Hq, 4\], got shape \(4, 4\)"),
    ("attend", "q int", lambda c, i: c.attend(i["a"], tok(1, heads=HQ, dtype=np.int32)),
     TypeError, r"q must be a float array.*int32"),
    ("attend", "q zero-length", lambda c, i: c.attend(i["a"], tok(0, heads=HQ)),
     ValueError, r"\[n, 4, 4\].*\(0, 4, 4\)"),
    ("attend", "more queries than tokens", lambda c, i: c.attend(i["c"], tok(4, heads=HQ)),
     ValueError, r"4 queries but the sequence holds only 3 tokens"),
    ("attend", "out float64", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), out=np.empty((1, HQ, D))),
     TypeError, r"out must have dtype float32, got float64"),
    ("attend", "out shape", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), out=np.empty((2, HQ, D), F)),
     ValueError, r"out must have shape \[1, 4, 4\], got \(2, 4, 4\)"),
    ("attend", "out non-contiguous", lambda c, i: c.attend(i["a"], tok(1, heads=HQ),
                                                          out=strided(np.empty((1, HQ, D), F))),
     ValueError, r"out must be C-contiguous, aligned and writable"),
    ("attend", "out read-only", lambda c, i: c.attend(i["a"], tok(1, heads=HQ),
                                                     out=readonly(np.empty((1, HQ, D), F))),
     ValueError, r"out must be C-contiguous, aligned and writable"),
    ("attend", "out a list", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), out=[[0.0]]),
     TypeError, r"out must be a numpy array, got list"),
    ("attend", "scale nan", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), scale=float("nan")),
     ValueError, r"scale must be finite, got nan"),
    ("attend", "scale inf", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), scale=np.inf),
     ValueError, r"scale must be finite, got inf"),
    ("attend", "scale huge int", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), scale=10**400),
     ValueError, r"scale must be finite"),
    ("attend", "scale str", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), scale="1"),
     TypeError, r"scale must be None or a number, got str"),
    ("attend", "scale bool", lambda c, i: c.attend(i["a"], tok(1, heads=HQ), scale=True),
     TypeError, r"scale must be None or a number, got bool"),
    ("attend", "empty sequence", None, ValueError, r"is empty: append before attend"),
    ("attend", "layer not written", None, RuntimeError, r"layer 1 .* lacks its newest tokens"),
    ("attend_batch", "empty sids", lambda c, i: c.attend_batch([], tok(0, heads=HQ)),
     ValueError, r"at least one sequence"),
    ("attend_batch", "q rows != B", lambda c, i: c.attend_batch([i["a"], i["c"]], tok(1, heads=HQ)),
     ValueError, r"\[B=2, 4, 4\].*\(1, 4, 4\)"),
    ("attend_batch", "out shape", lambda c, i: c.attend_batch([i["a"]], tok(1, heads=HQ),
                                                             out=np.empty((1, 2, D), F)),
     ValueError, r"out must have shape \[1, 4, 4\], got \(1, 2, 4\)"),
    ("attend_batch", "one id freed", lambda c, i: c.attend_batch([i["a"], i["freed"]], tok(2, heads=HQ)),
     KeyError, r"unknown or freed sequence id"),
    # --- truncate
    ("truncate", "negative length", lambda c, i: c.truncate(i["a"], -1),
     ValueError, r"truncate length must be in \[0, 6\], got -1"),
    ("truncate", "beyond seq_len", lambda c, i: c.truncate(i["a"], 7),
     ValueError, r"in \[0, 6\], got 7"),
    ("truncate", "huge length", lambda c, i: c.truncate(i["a"], 2**70),
     ValueError, r"in \[0, 6\], got 1180591620717411303424"),
    ("truncate", "float length", lambda c, i: c.truncate(i["a"], 1.0),
     TypeError, r"length must be an int, got float"),
    ("truncate", "bool length", lambda c, i: c.truncate(i["a"], True),
     TypeError, r"length must be an int, got bool"),
    ("truncate", "None length", lambda c, i: c.truncate(i["a"], None),
     TypeError, r"length must be an int, got NoneType"),
    # --- add_sequence / fork / priorities
    ("add_sequence", "priority nan", lambda c, i: c.add_sequence(priority=float("nan")),
     ValueError, r"priority must be a finite number, got nan"),
    ("add_sequence", "priority huge int", lambda c, i: c.add_sequence(priority=10**400),
     ValueError, r"priority must be a finite number"),
    ("add_sequence", "priority str", lambda c, i: c.add_sequence(priority="1"),
     TypeError, r"priority must be a number, got str"),
    ("add_sequence", "max_seqs reached", None, RuntimeError, r"max_seqs|sequence slot|sequences"),
    ("fork", "max_seqs reached", None, RuntimeError, r"max_seqs|sequence slot|sequences"),
    ("set_priority", "priority inf", lambda c, i: c.set_priority(i["a"], float("inf")),
     ValueError, r"priority must be a finite number, got inf"),
    ("set_priority", "priority None", lambda c, i: c.set_priority(i["a"], None),
     TypeError, r"priority must be a number, got NoneType"),
    # --- StreamingLLM and eviction
    ("apply_streaming_llm", "negative sinks", lambda c, i: c.apply_streaming_llm(i["a"], -1, 2),
     ValueError, r"sink_tokens must be an int in \[0, 2\*\*61\), got -1"),
    ("apply_streaming_llm", "huge window", lambda c, i: c.apply_streaming_llm(i["a"], 0, 2**64),
     ValueError, r"window_tokens must be an int in \[0, 2\*\*61\), got 18446744073709551616"),
    ("apply_streaming_llm", "float window", lambda c, i: c.apply_streaming_llm(i["a"], 0, 2.0),
     ValueError, r"window_tokens must be an int .*got 2.0"),
    ("apply_streaming_llm", "zero tokens kept", lambda c, i: c.apply_streaming_llm(i["a"], 0, 0),
     ValueError, r"at least 1"),
    ("evict_to_threshold", "utilization 1.5", lambda c, i: c.evict_to_threshold(1.5),
     ValueError, r"utilization must be in \[0, 1\], got 1.5"),
    ("evict_to_threshold", "utilization nan", lambda c, i: c.evict_to_threshold(float("nan")),
     ValueError, r"utilization must be in \[0, 1\], got nan"),
    ("evict_to_threshold", "utilization str", lambda c, i: c.evict_to_threshold("0.5"),
     TypeError, r"utilization must be a number in \[0, 1\], got str"),
]

# layers, for every method that takes one
LAYER_CALLS = {
    "append": lambda c, i, l: c.append(i["c"], tok(1), tok(1), layer=l),
    "append_batch": lambda c, i, l: c.append_batch([i["c"]], tok(1), tok(1), layer=l),
    "attend": lambda c, i, l: c.attend(i["a"], tok(1, heads=HQ), layer=l),
    "attend_batch": lambda c, i, l: c.attend_batch([i["a"]], tok(1, heads=HQ), layer=l),
    "gather": lambda c, i, l: c.gather(i["a"], layer=l),
}
for method, call in LAYER_CALLS.items():
    for bad, exc, match in ((-1, ValueError, r"layer -1 out of range: the cache has 2 layer"),
                            (2, ValueError, r"layer 2 out of range: the cache has 2 layer"),
                            (2**70, ValueError, r"layer \d+ out of range"),
                            (np.uint64(2**64 - 1), ValueError, r"layer \d+ out of range"),
                            (1.0, TypeError, r"layer must be an int, got float"),
                            (True, TypeError, r"layer must be an int, got bool"),
                            (None, TypeError, r"layer must be an int, got NoneType")):
        ROWS.append((method, f"layer {bad!r}", lambda c, i, call=call, bad=bad: call(c, i, bad),
                     exc, match))

# attention options (sliding window, logit softcapping, learned sinks), for both attention calls
OPTION_CALLS = {
    "attend": lambda c, i, kw: c.attend(i["a"], tok(2, heads=HQ), **kw),
    "attend_batch": lambda c, i, kw: c.attend_batch([i["a"], i["c"]], tok(2, heads=HQ), **kw),
}
SINKS_TYPE = r"sinks must be None or a float32/float64 NumPy array of shape \[4\]"
BAD_OPTIONS = [
    ("window 0", dict(window=0), ValueError, r"window must be None or an int >= 1, got 0"),
    ("window negative", dict(window=-1), ValueError, r"window must be None or an int >= 1, got -1"),
    ("window 2**62", dict(window=2**62), ValueError, r"int >= 1, got 4611686018427387904"),
    ("window huge", dict(window=2**200), ValueError, r"int >= 1, got 1606938044"),
    ("window uint64 max", dict(window=np.uint64(2**64 - 1)), ValueError,
     r"int >= 1, got 18446744073709551615"),
    ("window nan", dict(window=float("nan")), TypeError, r"window must be None or an int >= 1, got float"),
    ("window float", dict(window=2.0), TypeError, r"window must be None or an int >= 1, got float"),
    ("window bool", dict(window=True), TypeError, r"window must be None or an int >= 1, got bool"),
    ("window str", dict(window="4"), TypeError, r"window must be None or an int >= 1, got str"),
    ("softcap 0", dict(softcap=0.0), ValueError, r"softcap must be None or a finite number > 0, got 0.0"),
    ("softcap negative", dict(softcap=-1), ValueError, r"finite number > 0, got -1"),
    ("softcap nan", dict(softcap=float("nan")), ValueError, r"finite number > 0, got nan"),
    ("softcap float32 nan", dict(softcap=np.float32("nan")), ValueError, r"finite number > 0, got nan"),
    ("softcap inf", dict(softcap=float("inf")), ValueError, r"finite number > 0, got inf"),
    ("softcap huge int", dict(softcap=10**400), ValueError, r"finite number > 0, got 1000"),
    ("softcap str", dict(softcap="50"), TypeError, r"softcap must be None or a number > 0, got str"),
    ("softcap bool", dict(softcap=True), TypeError, r"softcap must be None or a number > 0, got bool"),
    ("softcap complex", dict(softcap=1j), TypeError, r"number > 0, got complex"),
    ("sinks list", dict(sinks=[0.0] * HQ), TypeError, SINKS_TYPE + r".*got list"),
    ("sinks numpy scalar", dict(sinks=np.float64(0.0)), TypeError, SINKS_TYPE + r".*got float64"),
    ("sinks int64", dict(sinks=np.zeros(HQ, np.int64)), TypeError,
     r"sinks must be float32 or float64, got int64"),
    ("sinks float16", dict(sinks=np.zeros(HQ, np.float16)), TypeError,
     r"sinks must be float32 or float64, got float16"),
    ("sinks big-endian", dict(sinks=np.zeros(HQ, ">f8")), TypeError,
     r"sinks must be float32 or float64, got >f8"),
    ("sinks too short", dict(sinks=np.zeros(HQ - 1)), ValueError,
     r"sinks must have shape \(4,\) \(one logit per query head\), got \(3,\)"),
    ("sinks too long", dict(sinks=np.zeros(HQ + 1, np.float32)), ValueError, r"got \(5,\)"),
    ("sinks empty", dict(sinks=np.zeros(0)), ValueError, r"got \(0,\)"),
    ("sinks 0-d", dict(sinks=np.array(1.0)), ValueError, r"got \(\)"),
    ("sinks 2-d", dict(sinks=np.zeros((1, HQ))), ValueError, r"got \(1, 4\)"),
    ("sinks per KV head", dict(sinks=np.zeros(HKV)), ValueError, r"got \(2,\)"),
    ("sinks nan", dict(sinks=np.array([0.0, np.nan, 0.0, 0.0])), ValueError, r"sinks must be finite"),
    ("sinks inf", dict(sinks=np.array([0.0, 0.0, -np.inf, 0.0], np.float32)), ValueError,
     r"sinks must be finite"),
    ("good window, bad softcap", dict(window=2, softcap=-0.5), ValueError, r"softcap"),
    ("good options, bad sinks", dict(window=3, softcap=30.0, sinks=np.zeros(HQ, np.int32)),
     TypeError, r"sinks must be float32 or float64, got int32"),
]
for method, call in OPTION_CALLS.items():
    for what, kw, exc, match in BAD_OPTIONS:
        ROWS.append((method, what, lambda c, i, call=call, kw=kw: call(c, i, kw), exc, match))

# ids, for every method that takes one
ID_CALLS = {
    "append": lambda c, s: c.append(s, tok(1), tok(1)),
    "append_batch": lambda c, s: c.append_batch([s], tok(1), tok(1)),
    "attend": lambda c, s: c.attend(s, tok(1, heads=HQ)),
    "attend_batch": lambda c, s: c.attend_batch([s], tok(1, heads=HQ)),
    "gather": lambda c, s: c.gather(s),
    "fork": lambda c, s: c.fork(s),
    "truncate": lambda c, s: c.truncate(s, 0),
    "free": lambda c, s: c.free(s),
    "seq_len": lambda c, s: c.seq_len(s),
    "kept_positions": lambda c, s: c.kept_positions(s),
    "num_seq_blocks": lambda c, s: c.num_seq_blocks(s),
    "block_table": lambda c, s: c.block_table(s),
    "apply_streaming_llm": lambda c, s: c.apply_streaming_llm(s, 1, 1),
    "evict": lambda c, s: c.evict(s),
    "set_priority": lambda c, s: c.set_priority(s, 1.0),
    "priority": lambda c, s: c.priority(s),
    "sequence_info": lambda c, s: c.sequence_info(s),
}
BAD_IDS = [
    ("unknown", lambda i: 12345, KeyError, r"unknown or freed sequence id 12345"),
    ("freed", lambda i: i["freed"], KeyError, r"unknown or freed sequence id \d+"),
    ("negative", lambda i: -1, KeyError, r"unknown or freed sequence id -1"),
    ("huge", lambda i: 2**70, KeyError, r"unknown or freed sequence id 1180591620717411303424"),
    ("float", lambda i: float(i["a"]), TypeError, r"sequence id must be an int, got float"),
    ("numpy float", lambda i: np.float64(i["a"]), TypeError, r"must be an int, got float64"),
    ("bool", lambda i: True, TypeError, r"sequence id must be an int, got bool"),
    ("None", lambda i: None, TypeError, r"sequence id must be an int, got NoneType"),
    ("str", lambda i: "0", TypeError, r"sequence id must be an int, got str"),
]
for method, call in ID_CALLS.items():
    for what, sid, exc, match in BAD_IDS:
        if method == "evict" and what == "None":
            continue  # evict(None) is valid: the strategy's choice
        ROWS.append((method, f"id {what}", lambda c, i, call=call, sid=sid: call(c, sid(i)),
                     exc, match))


def _special(cache, ids, method, what):
    """Rows that need a particular state first (call = None in ROWS)."""
    if what == "pool exhausted by the last sequence":
        # grow c until the pool is empty and c's last block is full: then a fits its new
        # token in its own last block but c needs a new block
        while cache.num_free_blocks or cache.seq_len(ids["c"]) % BS:
            cache.append(ids["c"], tok(1), tok(1))
            cache.append(ids["c"], tok(1), tok(1), layer=1)
        return lambda: cache.append_batch([ids["a"], ids["c"]], tok(2), tok(2))
    if what == "empty sequence":
        sid = cache.add_sequence()
        return lambda: cache.attend(sid, tok(1, heads=HQ))
    if what == "layer not written":
        cache.append(ids["c"], tok(1), tok(1))
        return lambda: cache.attend(ids["c"], tok(1, heads=HQ), layer=1)
    if what == "max_seqs reached":
        while len(cache.sequence_ids()) < cache.max_seqs:
            cache.add_sequence()
        return (lambda: cache.add_sequence()) if method == "add_sequence" else (
            lambda: cache.fork(ids["a"]))
    raise AssertionError(what)


@pytest.mark.parametrize("method, what, call, exc, match", ROWS,
                         ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_bad_input_raises_and_changes_nothing(method, what, call, exc, match):
    cache, ids = make()
    run = _special(cache, ids, method, what) if call is None else (lambda: call(cache, ids))
    live = cache.sequence_ids()
    before = snapshot(cache, live, layers=range(LAYERS))
    refs = [cache._core.ref_count(b) for b in range(cache.num_blocks)]
    with pytest.raises(exc) as info:
        run()
    message = info.value.args[0] if isinstance(info.value, KeyError) else str(info.value)
    assert re.search(match, str(message)), f"{type(info.value).__name__}: {message!r}"
    assert cache.sequence_ids() == live
    assert_unchanged(cache, before, layers=range(LAYERS))
    assert [cache._core.ref_count(b) for b in range(cache.num_blocks)] == refs
    check_pool_invariants(cache)


CONSTRUCTOR_ROWS = [
    (dict(num_blocks=0), ValueError, r"num_blocks must be >= 1, got 0"),
    (dict(num_blocks=-5), ValueError, r"num_blocks must be >= 1, got -5"),
    (dict(num_blocks=2**40), ValueError, r"num_blocks must be < 2\*\*31, got 1099511627776"),
    (dict(num_blocks=8.0), TypeError, r"num_blocks must be an integer, got float"),
    (dict(num_blocks=True), TypeError, r"num_blocks must be an integer, got bool"),
    (dict(block_size=0), ValueError, r"block_size must be >= 1, got 0"),
    (dict(head_dim=None), TypeError, r"head_dim must be an integer, got NoneType"),
    (dict(num_kv_heads=-1), ValueError, r"num_kv_heads must be >= 1, got -1"),
    (dict(num_layers=0), ValueError, r"num_layers must be >= 1, got 0"),
    (dict(max_seqs=0), ValueError, r"max_seqs must be >= 1, got 0"),
    (dict(max_blocks_per_seq=0), ValueError, r"max_blocks_per_seq must be >= 1, got 0"),
    (dict(dtype="int8"), TypeError, r"dtype must be 'float32', 'float64', 'bfloat16' or 'float16', got 'int8'"),
    (dict(dtype="nonsense"), TypeError, r"dtype must be 'float32', 'float64', 'bfloat16' or 'float16', got 'nonsense'"),
    (dict(num_blocks=2**31 - 1, head_dim=2**31 - 1), MemoryError, r"would need \d+ bytes"),
    (dict(streaming="yes"), TypeError, r"streaming must be None or a StreamingLLM, got str"),
    (dict(rope=1), TypeError, r"rope must be None or a RoPE, got int"),
    (dict(eviction_strategy="random"), ValueError, r"unknown eviction strategy 'random'"),
    (dict(eviction_threshold=2), ValueError, r"eviction_threshold must be in \[0, 1\], got 2"),
]


@pytest.mark.parametrize("kwargs, exc, match", CONSTRUCTOR_ROWS,
                         ids=[next(iter(r[0])) + "=" + repr(next(iter(r[0].values())))
                              for r in CONSTRUCTOR_ROWS])
def test_bad_constructor_argument(kwargs, exc, match):
    args = dict(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        pagedkv.PagedKVCache(**args)


ACCEPTED = {
    "non-contiguous": strided,
    "read-only": readonly,
    "Fortran order": np.asfortranarray,
    "reversed": lambda a: np.ascontiguousarray(a[::-1])[::-1],
    "float64": lambda a: a.astype(np.float64),
    "float16": lambda a: a.astype(np.float16),
    "list": lambda a: a.tolist(),
}


@pytest.mark.parametrize("how", list(ACCEPTED))
def test_inputs_in_other_layouts_are_copied_not_misread(how):
    """Non-contiguous, read-only, Fortran-ordered, reversed, other float dtypes and lists are
    accepted, converted, and give exactly what the same C-contiguous float32 values give."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((5, HKV, D)).astype(np.float16).astype(F)  # exact in float16 too
    q = rng.standard_normal((2, HQ, D)).astype(np.float16).astype(F)
    results = []
    for convert in (lambda a: a, ACCEPTED[how]):
        cache, ids = make()
        sid = ids["c"]
        cache.append(sid, convert(k), convert(k[::-1].copy()))
        cache.append(sid, convert(k), convert(k), layer=1)
        cache.append_batch([ids["a"], sid], convert(k[:2]), convert(k[:2]))
        results.append((cache.gather(sid), cache.attend(sid, convert(q[:1])),
                        cache.attend_batch([ids["a"], sid], convert(q), layer=0)))
    (g0, a0, b0), (g1, a1, b1) = results
    for x, y in zip(g0, g1):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a0, a1)
    np.testing.assert_array_equal(b0, b1)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_data_and_stay_in_their_sequence(bad):
    """NaN / inf in K or V are stored and attended like any value, never an error, and never
    change what another sequence sees, also when the two share blocks (fork)."""
    cache, ids = make()
    a, b, c = ids["a"], ids["b"], ids["c"]
    q = np.ones((1, HQ, D), F)
    seen = {s: (cache.gather(s, 0), cache.gather(s, 1)) for s in (a, c)}
    out = {s: cache.attend(s, q, layer=1) for s in (a, c)}
    poison = np.full((2, HKV, D), bad, F)
    for layer in range(LAYERS):
        cache.append(b, poison, poison, layer=layer)   # b shares a's blocks: the write copies
    cache.append_batch([b], poison[:1], poison[:1])
    cache.append_batch([b], poison[:1], poison[:1], layer=1)
    res = cache.attend(b, np.ones((1, HQ, D), F), layer=1)
    assert not np.isfinite(res).all()                     # the poison is data of b
    k_b, _ = cache.gather(b, 0)
    assert k_b.shape[0] == 10 and not np.isfinite(k_b[-3:]).any()
    for s in (a, c):
        for layer in range(LAYERS):
            np.testing.assert_array_equal(cache.gather(s, layer)[0], seen[s][layer][0])
            np.testing.assert_array_equal(cache.gather(s, layer)[1], seen[s][layer][1])
        np.testing.assert_array_equal(cache.attend(s, q, layer=1), out[s])
        assert np.isfinite(out[s]).all()
    check_pool_invariants(cache)


def test_matrix_size():
    """The matrix covers every public method of the facade that takes arguments."""
    covered = {r[0] for r in ROWS}
    public = {"append", "append_batch", "attend", "attend_batch", "gather", "fork", "truncate",
              "free", "seq_len", "kept_positions", "num_seq_blocks", "block_table",
              "add_sequence", "apply_streaming_llm", "evict", "evict_to_threshold",
              "set_priority", "priority", "sequence_info"}
    assert public <= covered, public - covered
    assert len(ROWS) + len(CONSTRUCTOR_ROWS) >= 250


@pytest.mark.parametrize("batch", [False, True])
def test_auto_evict_never_evicts_for_a_sequence_larger_than_the_pool(batch):
    """Found by the fuzzer: with the pool as the per-sequence bound, an append that would make
    one sequence hold more blocks than the pool has used to evict other sequences first and
    then raise anyway.  Now it raises at once (whole_pool) and evicts nothing."""
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=HKV, head_dim=D,
                                 auto_evict=True)
    big, other = cache.add_sequence(), cache.add_sequence()
    if batch:
        cache.append(big, tok(8), tok(8))                 # the whole pool; other is empty
    else:
        cache.append(big, tok(6), tok(6))                 # 3 blocks
        cache.append(other, tok(1), tok(1))               # the 4th
    before = snapshot(cache, [big, other])
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        if batch:
            cache.append_batch([big], tok(1), tok(1))     # a 5th block
        else:
            cache.append(big, tok(3), tok(3))             # 9 tokens: 5 blocks
    assert info.value.whole_pool and "whole pool" in str(info.value)
    assert cache.sequence_ids() == [big, other]
    assert len(cache.eviction_log) == 0
    assert_unchanged(cache, before)


def test_huge_broadcast_inputs_raise_before_being_copied():
    """Found by the fuzzer: append converted k (and attend q) to contiguous arrays before
    checking n against the sequence, so a broadcast view of 2**31 tokens was first copied
    (gigabytes), then refused.  Now the checks come first and nothing is copied."""
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=BS, num_kv_heads=HKV, head_dim=D,
                                 num_layers=LAYERS)
    sid = cache.add_sequence()
    for layer in range(LAYERS):
        cache.append(sid, tok(3), tok(3), layer=layer)
    cache.append(sid, tok(2), tok(2))                     # a step: layer 1 must carry n=2
    before = snapshot(cache, [sid], layers=range(LAYERS))

    def huge(heads):
        one = tok(1, heads)
        return np.lib.stride_tricks.as_strided(one, [2**31, heads, D], [0] + list(one.strides[1:]))

    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append(sid, huge(HKV), huge(HKV))
    with pytest.raises(ValueError, match="v must have shape"):
        cache.append(sid, huge(HKV), tok(2))
    with pytest.raises(ValueError, match="n=2"):
        cache.append(sid, huge(HKV), huge(HKV), layer=1)
    with pytest.raises(ValueError, match="queries but the sequence holds only 5"):
        cache.attend(sid, huge(HQ))
    assert_unchanged(cache, before, layers=range(LAYERS))
    # other float dtypes and non-contiguous inputs are still converted when the call proceeds
    k = np.asfortranarray(np.arange(2 * HKV * D, dtype=np.float64).reshape(2, HKV, D))
    cache.append(sid, k, k, layer=1)
    np.testing.assert_array_equal(cache.gather(sid, 1)[0][3:], k.astype(np.float32))
    q = np.asfortranarray(np.ones((2, HQ, D), np.float64))
    np.testing.assert_array_equal(cache.attend(sid, q), cache.attend(sid, q.astype(F)))


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_unaligned_inputs_are_read_exactly(kv_dtype):
    """A C-contiguous but unaligned K/V (a byte buffer at an odd offset) is copied to an aligned
    array before the C code reads it (found by the sanitizer build: a misaligned double load)."""
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=32,
                                 dtype="float64", kv_dtype=kv_dtype)
    sid = cache.add_sequence()
    want = np.random.default_rng(3).standard_normal((3, 2, 32))
    raw = bytearray(want.nbytes + 1)
    k = np.frombuffer(raw, dtype=np.float64, count=want.size, offset=1).reshape(want.shape)
    k[...] = want
    assert not k.flags.aligned and k.flags.c_contiguous
    cache.append(sid, k, k)
    got, _ = cache.gather(sid)
    if kv_dtype is None:
        np.testing.assert_array_equal(got, want)
    else:  # within int8's half step (scale = max |x| of a 32-value group / 127)
        assert np.max(np.abs(got - want)) <= np.abs(want).max() / 254 * (1 + 1e-6)
