"""The error contract: KeyError for unknown or freed ids; TypeError for non-float arrays or
junk; ValueError for wrong shapes or ndim (the message names the expected shape), a bad layer,
a layer > 0 append whose n differs from layer 0's; RuntimeError for attend on a layer whose
newest tokens were not written.  Any call that raises leaves the cache unchanged."""

import numpy as np
import pytest

import pagedkv
from reference import SeqModel, assert_unchanged, check_against_model, random_tokens, snapshot
from small import HKV, D, fill, small_cache, toks


# ----------------------------------------------------------------------------------------------
# Unknown and freed ids


def _calls(cache, sid, rng):
    """Every per-sequence entry point, called with a given id and otherwise valid arguments."""
    k, v = toks(rng, 1), toks(rng, 1)
    q = toks(rng, 1)
    return {
        "seq_len": lambda: cache.seq_len(sid),
        "kept_positions": lambda: cache.kept_positions(sid),
        "gather": lambda: cache.gather(sid),
        "append": lambda: cache.append(sid, k, v),
        "attend": lambda: cache.attend(sid, q),
        "fork": lambda: cache.fork(sid),
        "truncate": lambda: cache.truncate(sid, 0),
        "free": lambda: cache.free(sid),
        "append_batch": lambda: cache.append_batch([sid], k, v),
        "attend_batch": lambda: cache.attend_batch([sid], q),
    }


METHODS = ["seq_len", "kept_positions", "gather", "append", "attend", "fork", "truncate", "free",
           "append_batch", "attend_batch"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad_id", [-1, 5, 10**6, 2**20])
def test_unknown_sequence_id_raises_key_error(rng, method, bad_id):
    cache = small_cache(num_blocks=4, max_seqs=4)
    live = cache.add_sequence()
    fill(cache, live, rng, 2)
    assert bad_id != live
    before = snapshot(cache, [live])
    with pytest.raises(KeyError):
        _calls(cache, bad_id, rng)[method]()
    assert_unchanged(cache, before)


@pytest.mark.parametrize("method", METHODS)
def test_huge_or_non_int_id_never_crashes(rng, method):
    cache = small_cache(num_blocks=4)
    live = cache.add_sequence()
    fill(cache, live, rng, 2)
    before = snapshot(cache, [live])
    for bad in (2**31, 2**63 - 1, 2**64, -(2**64), 2**100):
        with pytest.raises((KeyError, OverflowError, TypeError, ValueError)):
            _calls(cache, bad, rng)[method]()
    for bad in ("0", None, 1.5, 0.0):
        with pytest.raises((KeyError, TypeError, ValueError)):
            _calls(cache, bad, rng)[method]()
    assert_unchanged(cache, before)


@pytest.mark.parametrize("method", METHODS)
def test_freed_sequence_id_raises_key_error(rng, method):
    cache = small_cache(num_blocks=6)
    live = cache.add_sequence()
    fill(cache, live, rng, 3)
    dead = cache.add_sequence()
    fill(cache, dead, rng, 5)
    cache.free(dead)
    before = snapshot(cache, [live])
    with pytest.raises(KeyError):
        _calls(cache, dead, rng)[method]()
    assert_unchanged(cache, before)


def test_freed_fork_parent_id_raises_but_child_lives(rng):
    cache = small_cache(num_blocks=6)
    a = cache.add_sequence()
    m = fill(cache, a, rng, 5)
    b = cache.fork(a)
    cache.free(a)
    with pytest.raises(KeyError):
        cache.seq_len(a)
    with pytest.raises(KeyError):
        cache.free(a)
    check_against_model(cache, b, m, 1)


def test_batch_with_one_unknown_id_is_atomic(rng):
    cache = small_cache(num_blocks=8, block_size=2)
    sids = [cache.add_sequence() for _ in range(3)]
    for s in sids:
        fill(cache, s, rng, 3)
    cache.free(sids[1])
    live = [sids[0], sids[2]]
    before = snapshot(cache, live)
    with pytest.raises(KeyError):
        cache.append_batch([sids[0], sids[1], sids[2]], toks(rng, 3), toks(rng, 3))
    assert_unchanged(cache, before)
    with pytest.raises(KeyError):
        cache.append_batch([sids[0], 999], toks(rng, 2), toks(rng, 2))
    assert_unchanged(cache, before)
    with pytest.raises(KeyError):
        cache.attend_batch([sids[0], sids[1]], toks(rng, 2))
    assert_unchanged(cache, before)


# ----------------------------------------------------------------------------------------------
# Bad arrays


def _bad_kv_cases():
    ok = np.zeros((2, HKV, D), np.float32)
    return [
        # (id, k, v, expected exception)
        ("k-int", ok.astype(np.int32), ok, TypeError),
        ("v-int", ok, ok.astype(np.int64), TypeError),
        ("k-bool", ok.astype(bool), ok, TypeError),
        ("k-complex", ok.astype(np.complex64), ok, TypeError),
        ("k-object", ok.astype(object), ok, TypeError),
        ("k-none", None, ok, TypeError),
        ("v-none", ok, None, TypeError),
        ("k-str", "abc", ok, TypeError),
        ("k-dict", {"a": 1}, ok, TypeError),
        ("k-2d", ok[0], ok, ValueError),
        ("both-2d", ok[0], ok[0], ValueError),
        ("k-4d", ok[None], ok, ValueError),
        ("k-0d", np.float32(1.0), ok, (ValueError, TypeError)),
        ("k-wrong-heads", np.zeros((2, HKV + 1, D), np.float32), ok, ValueError),
        ("k-wrong-dim", np.zeros((2, HKV, D + 3), np.float32), ok, ValueError),
        ("v-wrong-dim", ok, np.zeros((2, HKV, D - 1), np.float32), ValueError),
        ("kv-n-mismatch", ok, np.zeros((3, HKV, D), np.float32), ValueError),
        ("n-zero", ok[:0], ok[:0], ValueError),
        ("both-wrong-heads", np.zeros((2, 1, D), np.float32), np.zeros((2, 1, D), np.float32), ValueError),
    ]


@pytest.mark.parametrize("case", _bad_kv_cases(), ids=lambda c: c[0])
def test_append_rejects_bad_arrays(rng, case):
    _, k, v, exc = case
    cache = small_cache(num_blocks=4)
    sid = cache.add_sequence()
    fill(cache, sid, rng, 3)
    before = snapshot(cache, [sid])
    with pytest.raises(exc):
        cache.append(sid, k, v)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("case", _bad_kv_cases(), ids=lambda c: c[0])
def test_append_batch_rejects_bad_arrays(rng, case):
    _, k, v, exc = case
    cache = small_cache(num_blocks=4)
    sids = [cache.add_sequence(), cache.add_sequence()]
    for s in sids:
        fill(cache, s, rng, 3)
    before = snapshot(cache, sids)
    with pytest.raises(exc):
        cache.append_batch(sids, k, v)
    assert_unchanged(cache, before)


def test_shape_error_messages_name_expected_shape(rng):
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=3, head_dim=5)
    sid = cache.add_sequence()
    with pytest.raises(ValueError) as info:
        cache.append(sid, np.zeros((2, 3, 7), np.float32), np.zeros((2, 3, 7), np.float32))
    message = str(info.value)
    assert "5" in message and "7" in message, message
    with pytest.raises(ValueError) as info:
        cache.append(sid, np.zeros((2, 6, 5), np.float32), np.zeros((2, 6, 5), np.float32))
    message = str(info.value)
    assert "3" in message and "6" in message, message
    with pytest.raises(TypeError) as info:
        cache.append(sid, np.zeros((2, 3, 5), np.int16), np.zeros((2, 3, 5), np.int16))
    assert "int16" in str(info.value), str(info.value)


def _bad_q_cases():
    ok = np.zeros((1, 2 * HKV, D), np.float32)
    return [
        ("int", ok.astype(np.int32), TypeError),
        ("complex", ok.astype(np.complex128), TypeError),
        ("object", ok.astype(object), TypeError),
        ("none", None, TypeError),
        ("str", "q", TypeError),
        ("2d", ok[0], ValueError),
        ("4d", ok[None], ValueError),
        ("wrong-dim", np.zeros((1, 2 * HKV, D + 1), np.float32), ValueError),
        ("heads-not-multiple", np.zeros((1, HKV + 1, D), np.float32), ValueError),
        ("heads-fewer", np.zeros((1, 1, D), np.float32), ValueError),
    ]


@pytest.mark.parametrize("case", _bad_q_cases(), ids=lambda c: c[0])
def test_attend_rejects_bad_queries(rng, case):
    _, q, exc = case
    cache = small_cache(num_blocks=4)
    sid = cache.add_sequence()
    fill(cache, sid, rng, 3)
    before = snapshot(cache, [sid])
    with pytest.raises(exc):
        cache.attend(sid, q)
    with pytest.raises(exc):
        cache.attend_batch([sid], q)
    assert_unchanged(cache, before)


def test_attend_more_queries_than_tokens(rng):
    cache = small_cache(num_blocks=4)
    sid = cache.add_sequence()
    fill(cache, sid, rng, 3)
    with pytest.raises(ValueError):
        cache.attend(sid, toks(rng, 4))
    empty = cache.add_sequence()
    with pytest.raises(ValueError):
        cache.attend(empty, toks(rng, 1))
    assert cache.attend(sid, toks(rng, 3)).shape == (3, HKV, D)


def test_attend_batch_on_empty_sequence_raises(rng):
    cache = small_cache(num_blocks=4)
    a = cache.add_sequence()
    fill(cache, a, rng, 2)
    empty = cache.add_sequence()
    before = snapshot(cache, [a, empty])
    with pytest.raises((ValueError, RuntimeError)):
        cache.attend_batch([a, empty], toks(rng, 2))
    assert_unchanged(cache, before)


def test_batch_size_mismatch(rng):
    cache = small_cache(num_blocks=8)
    sids = [cache.add_sequence() for _ in range(3)]
    for s in sids:
        fill(cache, s, rng, 2)
    before = snapshot(cache, sids)
    with pytest.raises(ValueError):
        cache.append_batch(sids, toks(rng, 2), toks(rng, 2))
    with pytest.raises(ValueError):
        cache.append_batch(sids[:2], toks(rng, 3), toks(rng, 3))
    with pytest.raises(ValueError):
        cache.attend_batch(sids, toks(rng, 2))
    with pytest.raises(ValueError):
        cache.attend_batch(sids[:1], toks(rng, 3))
    assert_unchanged(cache, before)


def test_append_batch_duplicate_ids_raise(rng):
    cache = small_cache(num_blocks=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, a, rng, 1)
    before = snapshot(cache, [a, b])
    for sids in ([a, a], (b, a, b), np.array([a, b, a])):
        with pytest.raises(ValueError):
            cache.append_batch(sids, toks(rng, len(sids)), toks(rng, len(sids)))
        assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "sids_factory",
    [lambda a, b: np.array([a, b], dtype=np.float64), lambda a, b: np.array([[a, b]]),
     lambda a, b: "ab", lambda a, b: None, lambda a, b: [a, "b"]],
    ids=["float-array", "2d-array", "str", "none", "mixed-list"],
)
def test_bad_sid_containers(rng, sids_factory):
    cache = small_cache(num_blocks=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, a, rng, 1)
    fill(cache, b, rng, 1)
    before = snapshot(cache, [a, b])
    sids = sids_factory(a, b)
    with pytest.raises((TypeError, ValueError, KeyError)):
        cache.append_batch(sids, toks(rng, 2), toks(rng, 2))
    with pytest.raises((TypeError, ValueError, KeyError)):
        cache.attend_batch(sids, toks(rng, 2))
    assert_unchanged(cache, before)


# ----------------------------------------------------------------------------------------------
# out=


def _bad_outs(shape, dtype):
    n, h, d = shape
    readonly = np.zeros(shape, dtype)
    readonly.flags.writeable = False
    wide = np.zeros((n, h, 2 * d), dtype)
    return [
        ("wrong-shape", np.zeros((n, h, d + 1), dtype), ValueError),
        ("wrong-n", np.zeros((n + 1, h, d), dtype), ValueError),
        ("2d", np.zeros((n * h, d), dtype), ValueError),
        ("other-float-dtype", np.zeros(shape, np.float64 if dtype == np.float32 else np.float32), TypeError),
        ("int-dtype", np.zeros(shape, np.int32), TypeError),
        ("non-contiguous", wide[:, :, ::2], ValueError),
        ("fortran", np.asfortranarray(np.zeros(shape, dtype)), ValueError),
        ("read-only", readonly, ValueError),
        ("list", np.zeros(shape, dtype).tolist(), TypeError),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["attend", "attend_batch"])
@pytest.mark.parametrize("index", range(9))
def test_bad_out_is_rejected(rng, dtype, which, index):
    cache = small_cache(num_blocks=8, dtype=np.dtype(dtype).name)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, a, rng, 3)
    fill(cache, b, rng, 3)
    q = random_tokens(rng, 2, HKV, D, dtype)
    name, out, _ = _bad_outs(q.shape, dtype)[index]
    before = snapshot(cache, [a, b])
    with pytest.raises((ValueError, TypeError)):
        if which == "attend":
            cache.attend(a, q, out=out)
        else:
            cache.attend_batch([a, b], q, out=out)
    assert_unchanged(cache, before)
    if name == "read-only":
        assert not out.any()


# ----------------------------------------------------------------------------------------------
# Layers


def test_layer_out_of_range(rng):
    cache = small_cache(num_blocks=8, num_layers=2)
    sid = cache.add_sequence()
    model = fill(cache, sid, rng, 3, num_layers=2)
    before = snapshot(cache, [sid], layers=(0, 1))
    for layer in (2, 3, -1, 10**9):
        with pytest.raises(ValueError):
            cache.append(sid, toks(rng, 3), toks(rng, 3), layer=layer)
        with pytest.raises(ValueError):
            cache.attend(sid, toks(rng, 1), layer=layer)
        with pytest.raises(ValueError):
            cache.append_batch([sid], toks(rng, 1), toks(rng, 1), layer=layer)
        with pytest.raises(ValueError):
            cache.attend_batch([sid], toks(rng, 1), layer=layer)
        with pytest.raises(ValueError):
            cache.gather(sid, layer=layer)
    assert_unchanged(cache, before, layers=(0, 1))
    check_against_model(cache, sid, model, 2)


def test_layer_append_must_match_layer0_n(rng):
    cache = small_cache(num_blocks=8, num_layers=3)
    sid = cache.add_sequence()
    model = SeqModel(3, HKV, D, cache.dtype)
    k0, v0 = toks(rng, 3), toks(rng, 3)
    cache.append(sid, k0, v0, layer=0)
    model.extend(0, k0, v0)
    before = snapshot(cache, [sid], layers=(0,))
    for n in (1, 2, 4):
        with pytest.raises(ValueError):
            cache.append(sid, toks(rng, n), toks(rng, n), layer=1)
        assert_unchanged(cache, before, layers=(0,))
    # Layer 1 still counts as unwritten: attending on it raises.
    with pytest.raises(RuntimeError):
        cache.attend(sid, toks(rng, 1), layer=1)
    for layer in (1, 2):
        k, v = toks(rng, 3), toks(rng, 3)
        cache.append(sid, k, v, layer=layer)
        model.extend(layer, k, v)
    check_against_model(cache, sid, model, 3)
    assert cache.seq_len(sid) == 3  # layer > 0 appends do not grow the sequence
    # Next step: layer 0 with n=1, then layer 2 with n=2 is rejected.
    k0, v0 = toks(rng, 1), toks(rng, 1)
    cache.append(sid, k0, v0, layer=0)
    model.extend(0, k0, v0)
    with pytest.raises(ValueError):
        cache.append(sid, toks(rng, 2), toks(rng, 2), layer=2)
    for layer in (1, 2):
        k, v = toks(rng, 1), toks(rng, 1)
        cache.append(sid, k, v, layer=layer)
        model.extend(layer, k, v)
    check_against_model(cache, sid, model, 3)
    assert cache.seq_len(sid) == 4


def test_layer_append_before_any_layer0_append(rng):
    cache = small_cache(num_blocks=8, num_layers=2)
    sid = cache.add_sequence()
    before = snapshot(cache, [sid])
    with pytest.raises(ValueError):
        cache.append(sid, toks(rng, 1), toks(rng, 1), layer=1)
    assert_unchanged(cache, before)


def test_attend_on_unwritten_layer_raises_runtime_error(rng):
    cache = small_cache(num_blocks=8, num_layers=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    ma = fill(cache, a, rng, 3, num_layers=2)
    mb = fill(cache, b, rng, 2, num_layers=2)
    # a: new token on layer 0 only.
    k, v = toks(rng, 1), toks(rng, 1)
    cache.append(a, k, v, layer=0)
    ma.extend(0, k, v)
    before = snapshot(cache, [b], layers=(0, 1))
    with pytest.raises(RuntimeError):
        cache.attend(a, toks(rng, 1), layer=1)
    with pytest.raises(RuntimeError):
        cache.attend_batch([b, a], toks(rng, 2), layer=1)
    assert cache.seq_len(a) == 4
    assert_unchanged(cache, before, layers=(0, 1))
    # Layer 0 is fine, and so is b on layer 1.
    cache.attend(a, toks(rng, 4), layer=0)
    cache.attend_batch([b], toks(rng, 1), layer=1)
    k, v = toks(rng, 1), toks(rng, 1)
    cache.append(a, k, v, layer=1)
    ma.extend(1, k, v)
    cache.attend_batch([a, b], toks(rng, 2), layer=1)
    check_against_model(cache, a, ma, 2)
    check_against_model(cache, b, mb, 2)


def test_batch_layer_rules(rng):
    cache = small_cache(num_blocks=8, num_layers=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, a, rng, 2, num_layers=2)
    fill(cache, b, rng, 2, num_layers=2)
    cache.append_batch([a, b], toks(rng, 2), toks(rng, 2), layer=0)
    with pytest.raises(RuntimeError):
        cache.attend_batch([a, b], toks(rng, 2), layer=1)
    # Layer 1 for only a: fine; b stays unwritten on layer 1.
    cache.append_batch([a], toks(rng, 1), toks(rng, 1), layer=1)
    cache.attend_batch([a], toks(rng, 1), layer=1)
    with pytest.raises(RuntimeError):
        cache.attend(b, toks(rng, 1), layer=1)
    cache.append(b, toks(rng, 1), toks(rng, 1), layer=1)
    out = cache.attend_batch([a, b], toks(rng, 2), layer=1)
    assert out.shape == (2, HKV, D)
