"""The PagedKVCache facade: its public surface, the out-of-blocks contract, where evictions are
counted, the deprecated ``eviction=`` name, and the pool's free-queue order."""

import warnings

import numpy as np
import pytest

import pagedkv
from reference import assert_unchanged, snapshot

HKV, D = 1, 4


def make(**kw):
    kw.setdefault("num_blocks", 16)
    kw.setdefault("block_size", 4)
    return pagedkv.PagedKVCache(num_kv_heads=HKV, head_dim=D, **kw)


def tok(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, HKV, D)).astype(dtype)


# ----------------------------------------------------------------------------------------------
# public surface


def test_core_internals_are_not_on_the_facade():
    cache = make()
    for name in ("trim", "_set_streaming", "set_streaming", "usage", "_ref_count", "ref_count",
                 "evict_sequence", "sequence_infos", "pool", "seqs", "debug_state"):
        assert not hasattr(cache, name), name
    assert not isinstance(cache, pagedkv._core.CacheCore)


def test_hot_methods_are_the_cores_own():
    cache = make()
    for name in ("append", "attend", "append_batch", "attend_batch", "gather"):
        assert getattr(cache, name) == getattr(cache._core, name), name
        assert getattr(cache, name).__self__ is cache._core


def test_auto_evict_rebinds_append_without_changing_the_class():
    cache = make(num_blocks=4)
    cache.auto_evict = True
    assert type(cache) is pagedkv.PagedKVCache
    assert cache.append != cache._core.append           # the evictor's wrapper
    assert cache.attend == cache._core.attend           # attention is never wrapped
    cache.auto_evict = False
    assert cache.append == cache._core.append
    assert cache.append_batch == cache._core.append_batch


def test_class_level_methods_work_unbound():
    cache = make()
    sid = cache.add_sequence()
    pagedkv.PagedKVCache.append(cache, sid, tok(3), tok(3))
    out = pagedkv.PagedKVCache.attend(cache, sid, tok(1, 1))
    np.testing.assert_array_equal(out, cache.attend(sid, tok(1, 1)))
    k, _ = pagedkv.PagedKVCache.gather(cache, sid)
    np.testing.assert_array_equal(k, tok(3))


def test_geometry_properties():
    cache = make(num_layers=3, max_seqs=5, max_blocks_per_seq=7, dtype="float64")
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
            cache.num_layers, cache.max_seqs, cache.max_blocks_per_seq) == (16, 4, HKV, D, 3, 5, 7)
    assert cache.dtype == np.float64
    # K and V of 3 layers of a block, 64-byte aligned
    assert cache.bytes_per_block == -(-2 * 3 * 4 * HKV * D * 8 // 64) * 64


# ----------------------------------------------------------------------------------------------
# out of blocks when the pool is the limit


def test_pool_bound_raises_out_of_blocks_not_value_error():
    """num_blocks=5, block_size=4, 14 tokens held, 9 more: the pool is what cannot supply them."""
    cache = make(num_blocks=5)
    sid = cache.add_sequence()
    cache.append(sid, tok(14), tok(14))
    before = snapshot(cache, [sid])
    with pytest.raises(pagedkv.OutOfBlocksError) as e:
        cache.append(sid, tok(9, 1), tok(9, 1))
    assert (e.value.needed, e.value.available) == (2, 1)
    assert_unchanged(cache, before)
    # the same through append_batch (one token per sequence, a full pool)
    cache.append(sid, tok(6, 2), tok(6, 2))            # 20 tokens = all 5 blocks
    before = snapshot(cache, [sid])
    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append_batch([sid], tok(1, 3), tok(1, 3))
    assert_unchanged(cache, before)


def test_explicit_per_sequence_bound_still_raises_value_error():
    cache = make(num_blocks=16, max_blocks_per_seq=2)
    sid = cache.add_sequence()
    cache.append(sid, tok(8), tok(8))
    before = snapshot(cache, [sid])
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        cache.append(sid, tok(1), tok(1))
    assert_unchanged(cache, before)


def test_auto_evict_does_not_evict_for_a_request_larger_than_the_pool():
    cache = make(num_blocks=5, auto_evict=True)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, tok(4), tok(4))
    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append(b, tok(24), tok(24))              # 6 blocks > 5 in the pool
    assert a in cache and cache.stats().evicted_sequences == 0


# ----------------------------------------------------------------------------------------------
# evictions under the right cause


def test_streaming_and_one_shot_evictions_are_counted_apart():
    cache = make(streaming=pagedkv.StreamingLLM(1, 3))
    sid = cache.add_sequence()
    for i in range(14):                      # from the 6th append on, one token evicted each
        cache.append(sid, tok(1, i), tok(1, i))
    assert cache.kept_positions(sid).tolist() == [0, 10, 11, 12, 13]   # block 1 (4..7) dropped
    s = cache.stats()
    assert s.evictions_by_cause == {"streaming_llm.tokens": 9, "streaming_llm.blocks": 1}
    other = cache.add_sequence()
    cache.append(other, tok(3), tok(3))      # 3 tokens: under S + R, nothing to trim
    assert cache.apply_streaming_llm(other, 1, 0) == 2
    s = cache.stats()
    assert s.evictions_by_cause == {"streaming_llm.tokens": 9, "streaming_llm.blocks": 1,
                                    "apply_streaming_llm.tokens": 2}
    assert s.evicted_tokens == 11 and s.evicted_blocks == 1


def test_whole_sequence_evictions_are_not_frees():
    cache = make()
    a, b, c = (cache.add_sequence() for _ in range(3))
    for s in (a, b, c):
        cache.append(s, tok(5), tok(5))
    cache.free(a)
    cache.evict(b)
    s = cache.stats()
    assert (s.sequences_added, s.sequences_freed, s.evicted_sequences, s.sequences_active) == (
        3, 1, 1, 1)
    assert s.evictions_by_cause == {"manual.sequences": 1, "manual.tokens": 5,
                                    "manual.blocks": 2}


def test_sequence_info_reports_usage_and_priority():
    cache = make()
    a = cache.add_sequence(priority=2.5)
    cache.append(a, tok(5), tok(5))
    cache.attend(a, tok(1, 1))
    info = cache.sequence_info(a)
    assert (info.sid, info.use_count, info.tokens, info.blocks, info.priority) == (a, 2, 5, 2, 2.5)
    child = cache.fork(a)
    assert cache.sequence_info(child).priority == 2.5
    assert cache.sequence_info(child).order > info.order
    with pytest.raises(KeyError):
        cache.sequence_info(12345)


# ----------------------------------------------------------------------------------------------
# the deprecated name of streaming=


def test_eviction_keyword_is_deprecated_but_works():
    policy = pagedkv.StreamingLLM(1, 2)
    with pytest.warns(DeprecationWarning, match="streaming="):
        cache = make(eviction=policy)
    assert cache.streaming is policy
    with pytest.warns(DeprecationWarning):
        assert cache.eviction is policy
    sid = cache.add_sequence()
    for i in range(6):
        cache.append(sid, tok(1, i), tok(1, i))
    assert cache.kept_positions(sid).tolist() == [0, 3, 4, 5]
    with pytest.raises(TypeError, match="not both"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            make(eviction=policy, streaming=policy)


def test_streaming_keyword_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(streaming=pagedkv.StreamingLLM(1, 2))


# ----------------------------------------------------------------------------------------------
# the pool's free queue


def _pool(lrf, n=8):
    return pagedkv._core.BlockPool(n, 1, 1, 4, 4, 0, lrf)


@pytest.mark.parametrize("lrf", [False, True])
def test_new_pool_hands_out_ids_in_order(lrf):
    assert _pool(lrf).free_blocks() == list(range(8))


def test_default_pool_reuses_the_most_recently_freed_block_tail_last():
    """Without prefix caching freed contents are dead: the warmest block goes out first.
    A freed sequence releases its tail first, so its head is the warmest."""
    cache = make(num_blocks=8)
    pool = cache._core.pool
    assert not pool.lrf
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, tok(12), tok(12))                  # blocks 0, 1, 2
    cache.append(b, tok(8), tok(8))                    # blocks 3, 4
    assert cache.block_table(a).tolist() == [0, 1, 2]
    cache.free(a)                                      # releases 2, 1, 0
    assert pool.free_blocks() == [0, 1, 2, 5, 6, 7]
    cache.free(b)                                      # releases 4, 3
    assert pool.free_blocks() == [3, 4, 0, 1, 2, 5, 6, 7]
    c = cache.add_sequence()
    cache.append(c, tok(16), tok(16))
    assert cache.block_table(c).tolist() == [3, 4, 0, 1]
    cache.truncate(c, 5)                               # keeps 3, 4; releases 1 then 0
    assert pool.free_blocks() == [0, 1, 2, 5, 6, 7]
    assert [pool.ref_count(x) for x in range(8)] == [0, 0, 0, 1, 1, 0, 0, 0]


def test_lrf_pool_hands_out_least_recently_freed_first():
    """The order prefix caching needs: freed blocks stay unused as long as possible, and
    a freed chain's tail goes before its head."""
    core = pagedkv._core.CacheCore(8, 4, HKV, D, lrf=True)
    pool = core.pool
    assert pool.lrf
    a, b = core.add_sequence(), core.add_sequence()
    core.append(a, tok(12), tok(12))                   # blocks 0, 1, 2
    core.append(b, tok(8), tok(8))                     # blocks 3, 4
    core.free(a)                                       # tail first: 2, 1, 0 join the queue
    assert pool.free_blocks() == [5, 6, 7, 2, 1, 0]
    core.free(b)
    assert pool.free_blocks() == [5, 6, 7, 2, 1, 0, 4, 3]
    c = core.add_sequence()
    core.append(c, tok(16), tok(16))
    assert core.block_table(c).tolist() == [5, 6, 7, 2]
