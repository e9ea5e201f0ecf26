"""Block pool accounting, copy-on-write, statistics, and the error contract.

Error contract (design.md §2): KeyError for unknown/freed ids; TypeError for non-float arrays or
junk; ValueError for wrong shapes/ndim (message names the expected shape), bad layer, bad truncate,
a layer>0 append whose n differs from layer 0's; RuntimeError for attend on a layer whose newest
tokens were not written; OutOfBlocksError (a MemoryError) with .needed/.available when the pool is
exhausted.  Any call that raises leaves the cache unchanged.
"""

import dataclasses

import numpy as np
import pytest

import pagedkv
from reference import (
    SeqModel,
    append_step,
    assert_attention_close,
    assert_unchanged,
    blocks_for,
    build_random_cache,
    check_against_model,
    random_tokens,
    ref_attention,
    snapshot,
)

HKV, D = 2, 4


def small_cache(num_blocks=8, block_size=4, num_layers=1, dtype="float32", **kw):
    return pagedkv.PagedKVCache(
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=HKV, head_dim=D,
        num_layers=num_layers, dtype=dtype, **kw,
    )


def toks(rng, n, heads=HKV, dtype="float32"):
    return random_tokens(rng, n, heads, D, dtype)


def fill(cache, sid, rng, n, num_layers=1, model=None):
    model = model if model is not None else SeqModel(num_layers, HKV, D, cache.dtype)
    append_step(cache, model, sid, rng, n, num_layers, HKV, D, cache.dtype)
    return model


# ----------------------------------------------------------------------------------------------
# Construction and properties


def test_new_cache_properties_and_all_blocks_free():
    cache = small_cache(num_blocks=10, block_size=4)
    assert cache.num_blocks == 10
    assert cache.num_free_blocks == 10
    assert cache.block_size == 4
    assert cache.dtype == np.dtype(np.float32)
    assert isinstance(cache.dtype, np.dtype)
    stats = cache.stats()
    assert dataclasses.is_dataclass(stats)
    assert stats.blocks_total == 10
    assert stats.blocks_free == 10
    assert stats.blocks_used == 0
    assert stats.peak_blocks_used == 0
    assert stats.cow_copies == 0
    assert stats.forks == 0


@pytest.mark.parametrize(
    "spec,expected",
    [("float32", np.float32), ("float64", np.float64), (np.float32, np.float32), (np.float64, np.float64)],
)
def test_dtype_argument_forms(spec, expected):
    cache = pagedkv.PagedKVCache(num_blocks=2, block_size=2, num_kv_heads=1, head_dim=2, dtype=spec)
    assert cache.dtype == np.dtype(expected)
    sid = cache.add_sequence()
    cache.append(sid, np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    assert cache.gather(sid)[0].dtype == np.dtype(expected)
    assert cache.attend(sid, np.ones((1, 1, 2))).dtype == np.dtype(expected)


def test_default_arguments():
    cache = pagedkv.PagedKVCache(num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2)
    assert cache.dtype == np.dtype(np.float32)
    sid = cache.add_sequence()
    cache.append(sid, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32))
    with pytest.raises(ValueError):
        cache.append(sid, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32), layer=1)


GOOD = dict(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4)
BAD_CONSTRUCTOR_ARGS = [
    dict(num_blocks=0),
    dict(num_blocks=-1),
    dict(block_size=0),
    dict(block_size=-4),
    dict(num_kv_heads=0),
    dict(num_kv_heads=-2),
    dict(head_dim=0),
    dict(head_dim=-1),
    dict(num_layers=0),
    dict(num_layers=-1),
    dict(dtype="int8"),
    dict(dtype="int32"),
    dict(dtype="complex64"),
    dict(dtype="bogus"),
    dict(dtype=np.int64),
    dict(max_seqs=0),
    dict(max_seqs=-1),
    dict(max_blocks_per_seq=0),
    dict(max_blocks_per_seq=-3),
    dict(num_blocks=2.5),
    dict(block_size="4"),
    dict(head_dim=None),
]


@pytest.mark.parametrize("bad", BAD_CONSTRUCTOR_ARGS, ids=lambda d: repr(d))
def test_constructor_rejects_invalid_arguments(bad):
    with pytest.raises((ValueError, TypeError)):
        pagedkv.PagedKVCache(**{**GOOD, **bad})


@pytest.mark.parametrize(
    "huge",
    [dict(num_blocks=2**62), dict(num_blocks=2**40, head_dim=2**20), dict(block_size=2**40),
     dict(num_layers=2**40), dict(num_kv_heads=2**33, head_dim=2**33)],
    ids=repr,
)
def test_absurd_sizes_fail_cleanly(huge):
    """Pool sizes whose byte count overflows or cannot be allocated raise instead of wrapping."""
    with pytest.raises((ValueError, MemoryError, OverflowError)):
        pagedkv.PagedKVCache(**{**GOOD, **huge})


@pytest.mark.parametrize("bounds", [dict(max_seqs=2**62), dict(max_blocks_per_seq=2**62)], ids=repr)
def test_absurd_metadata_bounds_fail_cleanly_or_work(rng, bounds):
    """Huge metadata bounds either raise cleanly or give a cache that works."""
    try:
        cache = pagedkv.PagedKVCache(**{**GOOD, **bounds})
    except (ValueError, MemoryError, OverflowError):
        return
    sid = cache.add_sequence()
    model = fill(cache, sid, rng, 5)
    check_against_model(cache, sid, model, 1)


def test_repr_and_str_are_one_line(rng):
    cache = small_cache()
    sid = cache.add_sequence()
    fill(cache, sid, rng, 5)
    for text in (repr(cache), str(cache)):
        assert isinstance(text, str)
        assert text.strip()
        assert "\n" not in text.strip()


# ----------------------------------------------------------------------------------------------
# Pool exhaustion


def test_out_of_blocks_error_attributes_and_atomicity(rng):
    assert issubclass(pagedkv.OutOfBlocksError, MemoryError)
    cache = small_cache(num_blocks=4, block_size=4)
    a = cache.add_sequence()
    b = cache.add_sequence()
    fill(cache, a, rng, 9)  # 3 blocks, last one partial
    fill(cache, b, rng, 1)  # 1 block: pool full
    assert cache.num_free_blocks == 0
    before = snapshot(cache, [a, b])
    # a has 3 free slots: 4 tokens need one more block.
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append(a, toks(rng, 4), toks(rng, 4))
    err = info.value
    assert isinstance(err, MemoryError)
    assert err.needed == 1 and err.available == 0
    assert_unchanged(cache, before)
    # Filling the partial block exactly needs no block and succeeds.
    fill(cache, a, rng, 3)
    assert cache.seq_len(a) == 12
    assert cache.num_free_blocks == 0


def test_out_of_blocks_needed_and_available_counts(rng):
    cache = small_cache(num_blocks=5, block_size=4)
    a = cache.add_sequence()
    fill(cache, a, rng, 12)  # 3 blocks, 2 free
    b = cache.add_sequence()
    before = snapshot(cache, [a, b])
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append(b, toks(rng, 13), toks(rng, 13))  # needs 4
    assert info.value.needed == 4
    assert info.value.available == 2
    message = str(info.value)
    assert "4" in message and "2" in message
    assert_unchanged(cache, before)
    fill(cache, b, rng, 8)  # exactly the 2 free blocks
    assert cache.num_free_blocks == 0


def test_out_of_blocks_in_append_batch_is_atomic(rng):
    cache = small_cache(num_blocks=6, block_size=2)
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (2, 4, 3)):
        fill(cache, sid, rng, n)  # 1 + 2 + 2 blocks = 5, 1 free; sids[2] has a free slot
    assert cache.num_free_blocks == 1
    before = snapshot(cache, sids)
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append_batch(sids, toks(rng, 3), toks(rng, 3))  # sids[0], sids[1] need a block each
    assert info.value.needed == 2 and info.value.available == 1
    assert_unchanged(cache, before)
    cache.append_batch([sids[0], sids[2]], toks(rng, 2), toks(rng, 2))  # needs 1: fits
    assert [cache.seq_len(s) for s in sids] == [3, 4, 4]
    assert cache.num_free_blocks == 0


def test_out_of_blocks_when_cow_copy_needs_a_block(rng):
    cache = small_cache(num_blocks=2, block_size=4)
    a = cache.add_sequence()
    fill(cache, a, rng, 6)  # 2 blocks, second one partial and about to be shared
    b = cache.fork(a)
    assert cache.num_free_blocks == 0
    before = snapshot(cache, [a, b])
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append(b, toks(rng, 1), toks(rng, 1))  # writing into the shared block needs a copy
    assert info.value.needed == 1 and info.value.available == 0
    assert_unchanged(cache, before)
    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append(a, toks(rng, 1), toks(rng, 1))
    assert_unchanged(cache, before)
    cache.free(b)  # now a owns both blocks alone and can write in place
    fill(cache, a, rng, 2)
    assert cache.seq_len(a) == 8 and cache.num_free_blocks == 0


def test_out_of_blocks_on_layered_cache_keeps_layers_consistent(rng):
    cache = small_cache(num_blocks=3, block_size=2, num_layers=2)
    other = cache.add_sequence()
    fill(cache, other, rng, 1, num_layers=2)
    sid = cache.add_sequence()
    model = fill(cache, sid, rng, 3, num_layers=2)
    assert cache.num_free_blocks == 0
    before = snapshot(cache, [other, sid], layers=(0, 1))
    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append(sid, toks(rng, 2), toks(rng, 2), layer=0)
    assert_unchanged(cache, before, layers=(0, 1))
    # The failed step left no half-written step behind: a full step of 1 token still works.
    append_step(cache, model, sid, rng, 1, 2, HKV, D, cache.dtype)
    check_against_model(cache, sid, model, 2)


# ----------------------------------------------------------------------------------------------
# Freeing


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_freeing_all_sequences_returns_all_blocks(rng, block_size):
    lengths = [int(rng.integers(1, 5 * block_size)) for _ in range(6)]
    cache, sids, models = build_random_cache(
        rng, lengths=lengths, block_size=block_size, num_kv_heads=HKV, head_dim=D, spare_blocks=12,
    )
    children = [cache.fork(sids[i]) for i in (0, 2, 2)]
    for child in children:
        fill(cache, child, rng, int(rng.integers(1, 2 * block_size + 1)))
    everything = sids + children
    assert cache.num_free_blocks < cache.num_blocks
    for i in rng.permutation(len(everything)):
        cache.free(everything[i])
        assert 0 <= cache.num_free_blocks <= cache.num_blocks
    assert cache.num_free_blocks == cache.num_blocks
    stats = cache.stats()
    assert stats.blocks_used == 0 and stats.blocks_free == cache.num_blocks
    # The pool is fully usable again.
    sid = cache.add_sequence()
    fill(cache, sid, rng, cache.num_blocks * block_size)
    assert cache.num_free_blocks == 0


def test_free_exact_block_counts(rng):
    cache = small_cache(num_blocks=10, block_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    fill(cache, a, rng, 9)
    fill(cache, b, rng, 4)
    assert cache.num_free_blocks == 10 - 3 - 1
    cache.free(a)
    assert cache.num_free_blocks == 10 - 1
    cache.free(b)
    assert cache.num_free_blocks == 10


def test_freed_blocks_are_reused_without_stale_data(rng):
    cache = small_cache(num_blocks=3, block_size=4)
    a = cache.add_sequence()
    fill(cache, a, rng, 12)
    cache.free(a)
    b = cache.add_sequence()
    model = fill(cache, b, rng, 5)
    check_against_model(cache, b, model, 1)
    q = toks(rng, 5, heads=HKV)
    out = cache.attend(b, q)
    assert_attention_close(out, ref_attention(q, model.k[0], model.v[0], 0.5, 0), "float32", model.v[0])


# ----------------------------------------------------------------------------------------------
# Copy-on-write


def test_fork_shares_blocks_and_first_write_copies_one_block(rng):
    cache = small_cache(num_blocks=16, block_size=4, num_layers=2)
    parent = cache.add_sequence()
    pmodel = fill(cache, parent, rng, 10, num_layers=2)  # blocks: full, full, partial (2 of 4)
    free0 = cache.num_free_blocks
    assert free0 == 16 - 3
    forks0 = cache.stats().forks
    cow0 = cache.stats().cow_copies

    child = cache.fork(parent)
    assert cache.num_free_blocks == free0  # sharing, no copy
    assert cache.stats().forks == forks0 + 1
    assert cache.stats().cow_copies == cow0
    assert cache.seq_len(child) == 10
    cmodel = pmodel.copy()
    check_against_model(cache, child, cmodel, 2)

    # The child's first write lands in the shared partial block: exactly one block is copied
    # (on every layer, since a block spans all layers).
    append_step(cache, cmodel, child, rng, 1, 2, HKV, D, cache.dtype)
    assert cache.num_free_blocks == free0 - 1
    assert cache.stats().cow_copies == cow0 + 1
    check_against_model(cache, parent, pmodel, 2)
    check_against_model(cache, child, cmodel, 2)

    # The parent's partial block is no longer shared: it writes in place.
    append_step(cache, pmodel, parent, rng, 1, 2, HKV, D, cache.dtype)
    assert cache.num_free_blocks == free0 - 1
    assert cache.stats().cow_copies == cow0 + 1

    # Filling the child's (private) block and spilling into a new one allocates, never copies.
    append_step(cache, cmodel, child, rng, 3, 2, HKV, D, cache.dtype)
    assert cache.num_free_blocks == free0 - 2
    assert cache.stats().cow_copies == cow0 + 1
    check_against_model(cache, parent, pmodel, 2)
    check_against_model(cache, child, cmodel, 2)


def test_fork_at_block_boundary_needs_no_copy(rng):
    cache = small_cache(num_blocks=8, block_size=4)
    parent = cache.add_sequence()
    pmodel = fill(cache, parent, rng, 8)  # two full blocks
    child = cache.fork(parent)
    cmodel = pmodel.copy()
    free0 = cache.num_free_blocks
    fill(cache, child, rng, 1, model=cmodel)
    fill(cache, parent, rng, 1, model=pmodel)
    assert cache.num_free_blocks == free0 - 2  # one new block each
    assert cache.stats().cow_copies == 0
    check_against_model(cache, parent, pmodel, 1)
    check_against_model(cache, child, cmodel, 1)


def test_many_forks_share_then_free(rng):
    cache = small_cache(num_blocks=8, block_size=4)
    parent = cache.add_sequence()
    pmodel = fill(cache, parent, rng, 6)
    kids = [cache.fork(parent) for _ in range(5)]
    assert len(set(kids + [parent])) == 6
    assert cache.num_free_blocks == 6
    assert cache.stats().forks == 5
    cache.free(parent)
    assert cache.num_free_blocks == 6  # still held by the children
    for kid in kids:
        check_against_model(cache, kid, pmodel, 1)
    for kid in kids[:-1]:
        cache.free(kid)
        assert cache.num_free_blocks == 6
    cache.free(kids[-1])
    assert cache.num_free_blocks == 8


def test_fork_of_empty_sequence(rng):
    cache = small_cache(num_blocks=4, block_size=4)
    a = cache.add_sequence()
    b = cache.fork(a)
    assert cache.seq_len(b) == 0 and cache.num_free_blocks == 4
    mb = fill(cache, b, rng, 2)
    assert cache.seq_len(a) == 0
    check_against_model(cache, b, mb, 1)


def test_truncate_releases_blocks_and_cow_after_truncate(rng):
    cache = small_cache(num_blocks=12, block_size=4)
    a = cache.add_sequence()
    amodel = fill(cache, a, rng, 11)  # 3 blocks
    cache.truncate(a, 5)  # keeps 2 blocks
    amodel.truncate(5)
    assert cache.num_free_blocks == 12 - 2
    cache.truncate(a, 4)  # exactly one full block
    amodel.truncate(4)
    assert cache.num_free_blocks == 12 - 1
    check_against_model(cache, a, amodel, 1)
    fill(cache, a, rng, 8, model=amodel)  # back to 3 blocks
    assert cache.num_free_blocks == 12 - 3

    b = cache.fork(a)
    bmodel = amodel.copy()
    cache.truncate(b, 6)  # drops its reference to the third block, still held by a
    bmodel.truncate(6)
    assert cache.num_free_blocks == 12 - 3
    cow0 = cache.stats().cow_copies
    fill(cache, b, rng, 1, model=bmodel)  # writes into block 1, shared with a: one copy
    assert cache.num_free_blocks == 12 - 4
    assert cache.stats().cow_copies == cow0 + 1
    check_against_model(cache, a, amodel, 1)
    check_against_model(cache, b, bmodel, 1)
    cache.free(a)
    assert cache.num_free_blocks == 12 - 2  # a's private third block and its share of block 1
    cache.truncate(b, 0)
    bmodel.truncate(0)
    assert cache.num_free_blocks == 12
    check_against_model(cache, b, bmodel, 1)
    fill(cache, b, rng, 3, model=bmodel)
    check_against_model(cache, b, bmodel, 1)


# ----------------------------------------------------------------------------------------------
# Statistics


def test_stats_counters_move_as_expected(rng):
    cache = small_cache(num_blocks=10, block_size=2)
    a = cache.add_sequence()
    fill(cache, a, rng, 7)  # 4 blocks
    s = cache.stats()
    assert (s.blocks_total, s.blocks_used, s.blocks_free) == (10, 4, 6)
    assert s.peak_blocks_used == 4
    b = cache.fork(a)
    s = cache.stats()
    assert s.forks == 1 and s.blocks_used == 4 and s.cow_copies == 0
    fill(cache, b, rng, 1)  # copy the shared partial block
    s = cache.stats()
    assert s.cow_copies == 1 and s.blocks_used == 5 and s.peak_blocks_used == 5
    c = cache.fork(b)
    assert cache.stats().forks == 2
    cache.free(a)
    cache.free(b)
    cache.free(c)
    s = cache.stats()
    assert s.blocks_used == 0 and s.blocks_free == 10
    assert s.peak_blocks_used == 5  # peak survives frees
    d = cache.add_sequence()
    fill(cache, d, rng, 2)
    s = cache.stats()
    assert s.blocks_used == 1 and s.peak_blocks_used == 5
    assert s.forks == 2 and s.cow_copies == 1  # cumulative
    assert s.blocks_free == cache.num_free_blocks
    assert s.blocks_used + s.blocks_free == s.blocks_total


# ----------------------------------------------------------------------------------------------
# Metadata bounds


def test_max_blocks_per_seq(rng):
    cache = small_cache(num_blocks=8, block_size=4, max_blocks_per_seq=2)
    a = cache.add_sequence()
    fill(cache, a, rng, 8)
    before = snapshot(cache, [a])
    with pytest.raises(ValueError):
        cache.append(a, toks(rng, 1), toks(rng, 1))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError):
        cache.append_batch([a], toks(rng, 1), toks(rng, 1))
    assert_unchanged(cache, before)
    b = cache.add_sequence()
    before = snapshot(cache, [a, b])
    with pytest.raises(ValueError):
        cache.append(b, toks(rng, 9), toks(rng, 9))
    assert_unchanged(cache, before)
    # Truncating makes room again.
    cache.truncate(a, 5)
    fill(cache, a, rng, 3)
    assert cache.seq_len(a) == 8


def test_max_seqs_bounds_live_sequences(rng):
    cache = small_cache(num_blocks=8, block_size=4, max_seqs=3)
    sids = [cache.add_sequence() for _ in range(3)]
    assert len(set(sids)) == 3
    fill(cache, sids[0], rng, 2)
    before = snapshot(cache, sids)
    with pytest.raises((RuntimeError, ValueError, MemoryError)):
        cache.add_sequence()
    assert_unchanged(cache, before)
    with pytest.raises((RuntimeError, ValueError, MemoryError)):
        cache.fork(sids[0])
    assert_unchanged(cache, before)
    cache.free(sids[1])
    new = cache.add_sequence()  # a freed slot is reusable
    assert new not in (sids[0], sids[2])
    assert cache.seq_len(new) == 0


def test_sequence_ids_are_distinct_ints(rng):
    cache = small_cache(num_blocks=8, max_seqs=16)
    sids = [cache.add_sequence() for _ in range(10)]
    assert all(isinstance(s, int) for s in sids)
    assert len(set(sids)) == 10
    child = cache.fork(sids[3])
    assert isinstance(child, int) and child not in sids


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


# ----------------------------------------------------------------------------------------------
# Truncate


def test_truncate_invalid_lengths(rng):
    cache = small_cache(num_blocks=8)
    sid = cache.add_sequence()
    model = fill(cache, sid, rng, 5)
    before = snapshot(cache, [sid])
    for bad in (-1, -100, 6, 100):
        with pytest.raises(ValueError):
            cache.truncate(sid, bad)
        assert_unchanged(cache, before)
    cache.truncate(sid, 5)  # no-op
    assert_unchanged(cache, before)
    cache.truncate(sid, 2)
    model.truncate(2)
    check_against_model(cache, sid, model, 1)
    with pytest.raises(ValueError):
        cache.truncate(sid, 3)
    check_against_model(cache, sid, model, 1)


def test_kept_positions_without_eviction(rng):
    cache = small_cache(num_blocks=8, block_size=3)
    sid = cache.add_sequence()
    kept = cache.kept_positions(sid)
    assert kept.dtype == np.int64 and kept.shape == (0,)
    fill(cache, sid, rng, 7)
    np.testing.assert_array_equal(cache.kept_positions(sid), np.arange(7))
    cache.truncate(sid, 4)
    np.testing.assert_array_equal(cache.kept_positions(sid), np.arange(4))
    child = cache.fork(sid)
    np.testing.assert_array_equal(cache.kept_positions(child), np.arange(4))


def test_contains_tells_live_ids():
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2)
    sid = cache.add_sequence()
    assert sid in cache
    assert sid + 1 not in cache and "x" not in cache and -1 not in cache
    cache.free(sid)
    assert sid not in cache
