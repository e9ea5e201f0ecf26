"""Copy-on-write forks (shared blocks, the first write copies one block) and truncation."""

import numpy as np
import pytest

import pagedkv
from reference import append_step, assert_unchanged, check_against_model, snapshot
from small import HKV, D, fill, small_cache


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
