"""Whole-sequence eviction strategies (LRU, LFU, longest-first, priority) and the automatic mode."""

import numpy as np
import pytest

import pagedkv
from pagedkv.eviction import EvictionStrategy, SequenceInfo, eviction_order, select_victim
from reference import assert_unchanged, snapshot

BS, HKV, D = 4, 1, 4


@pytest.fixture(autouse=True)
def one_thread():
    prev = pagedkv.get_num_threads()
    pagedkv.set_num_threads(1)
    yield
    pagedkv.set_num_threads(prev)


def make(num_blocks=64, **kw):
    return pagedkv.PagedKVCache(num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV,
                                head_dim=D, **kw)


def tok(n, value=1.0):
    return np.full((n, HKV, D), value, np.float32)


def use(cache, sid, appends=0, attends=0):
    for _ in range(appends):
        cache.append(sid, tok(1), tok(1))
    q = np.ones((1, HKV, D), np.float32)
    for _ in range(attends):
        cache.attend(sid, q)


def drain(cache):
    """Evict by the strategy until empty; check each victim is gone and its blocks are free."""
    order = []
    while True:
        expected = cache.select_eviction_target()
        before = cache.num_free_blocks
        # the blocks only the victim holds (forks share theirs)
        blocks = None if expected is None else sum(
            cache._core.ref_count(int(b)) == 1 for b in cache.block_table(expected))
        sid = cache.evict()
        assert sid == expected
        if sid is None:
            return order
        order.append(sid)
        assert cache.num_free_blocks == before + blocks
        with pytest.raises(KeyError):
            cache.seq_len(sid)
        with pytest.raises(KeyError):
            cache.append(sid, tok(1), tok(1))
        assert sid not in cache.sequence_ids()


# ----------------------------------------------------------------------------------------------
# choice order of each strategy


def test_lru_order():
    cache = make(eviction_strategy="lru")
    a, b, c, d = (cache.add_sequence() for _ in range(4))
    for s in (a, b, c, d):
        use(cache, s, appends=3)
    use(cache, b, attends=1)        # b, then a, are the most recent
    use(cache, a, appends=1)
    assert cache.eviction_order() == [c, d, b, a]
    assert cache.eviction_order(exclude=[c]) == [d, b, a]
    assert cache.select_eviction_target(exclude=(c, d)) == b
    assert drain(cache) == [c, d, b, a]
    assert cache.num_free_blocks == cache.num_blocks


def test_lfu_order_counts_appends_and_attends_with_lru_tie_break():
    cache = make(eviction_strategy=EvictionStrategy.LFU)
    a, b, c, d = (cache.add_sequence() for _ in range(4))
    use(cache, a, appends=2, attends=3)   # 5 uses
    use(cache, b, appends=1, attends=1)   # 2 uses, used before c
    use(cache, c, appends=2)              # 2 uses
    use(cache, d, appends=7)              # 7 uses
    assert [cache.sequence_info(s).use_count for s in (a, b, c, d)] == [5, 2, 2, 7]
    assert cache.eviction_order() == [b, c, a, d]
    use(cache, b, attends=1)  # b: 3 uses now
    assert cache.eviction_order() == [c, b, a, d]
    # batch calls count once per sequence
    cache.append_batch([c, d], tok(2), tok(2))
    cache.attend_batch([c, d], np.ones((2, HKV, D), np.float32))
    assert cache.sequence_info(c).use_count == 4
    assert drain(cache) == [b, c, a, d]


def test_longest_first_by_tokens_then_blocks_then_lru():
    cache = make(eviction_strategy="LONGEST")
    a, b, c, d, e, f = (cache.add_sequence() for _ in range(6))
    cache.append(a, tok(10), tok(10))
    cache.append(b, tok(30), tok(30))
    cache.append(c, tok(30), tok(30))     # ties with b on tokens and blocks; used after b
    cache.append(d, tok(5), tok(5))
    cache.append(e, tok(4), tok(4))       # 4 tokens in 1 block
    cache.append(f, tok(12), tok(12))
    cache.apply_streaming_llm(f, 1, 3)    # 4 tokens left, spread over 2 blocks
    assert (cache.seq_len(f), cache.num_seq_blocks(f)) == (4, 2)
    assert cache.eviction_order() == [b, c, a, d, f, e]
    use(cache, b, attends=1)              # now c is the less recently used of the tie
    assert drain(cache) == [c, b, a, d, f, e]


def test_priority_order_set_priority_and_fork_inherits():
    cache = make(eviction_strategy="priority")
    a = cache.add_sequence(priority=5)
    b = cache.add_sequence(priority=-1)
    c = cache.add_sequence(priority=5)
    d = cache.add_sequence()              # default priority 0
    for s in (c, a, b, d):
        use(cache, s, appends=2)          # c is used before a
    assert cache.priority(d) == 0
    assert cache.eviction_order() == [b, d, c, a]
    cache.set_priority(d, 10.5)
    assert cache.eviction_order() == [b, c, a, d]
    child = cache.fork(b)
    assert cache.priority(child) == -1
    assert cache.eviction_order() == [b, child, c, a, d]
    with pytest.raises(KeyError):
        cache.set_priority(12345, 1)
    for bad in [float("nan"), "high", None, True]:
        with pytest.raises((TypeError, ValueError)):
            cache.add_sequence(priority=bad)
    assert drain(cache) == [b, child, c, a, d]


def test_ranking_ties_fall_back_to_recency_then_creation_order():
    def info(sid, last, count=0, tokens=0, blocks=0, priority=0.0, order=0):
        return SequenceInfo(sid, last, count, tokens, blocks, priority, order)

    seqs = [info(7, last=3, order=2), info(8, last=3, order=0), info(9, last=1, order=5)]
    for st in EvictionStrategy:
        assert eviction_order(st, seqs) == [9, 8, 7]
        assert select_victim(st.value, seqs) == 9
    seqs = [info(1, 9, count=4, tokens=8, blocks=2, priority=3),
            info(2, 8, count=4, tokens=8, blocks=3, priority=1),
            info(3, 7, count=9, tokens=2, blocks=1, priority=3)]
    assert eviction_order("lru", seqs) == [3, 2, 1]
    assert eviction_order("lfu", seqs) == [2, 1, 3]
    assert eviction_order("longest", seqs) == [2, 1, 3]
    assert eviction_order("priority", seqs) == [2, 3, 1]
    assert select_victim("lru", []) is None


def test_strategy_names_and_validation():
    for name in ["lru", "LFU", " longest ", "Priority"]:
        assert EvictionStrategy.parse(name).value == name.strip().lower()
    assert EvictionStrategy.parse(EvictionStrategy.LRU) is EvictionStrategy.LRU
    assert EvictionStrategy("lfu") is EvictionStrategy.LFU
    for bad in ["fifo", "", 3, None]:
        with pytest.raises(ValueError):
            EvictionStrategy.parse(bad)
    with pytest.raises(ValueError):
        make(eviction_strategy="random")
    for bad in [1.5, -0.1]:
        with pytest.raises(ValueError):
            make(eviction_threshold=bad)
    with pytest.raises(TypeError):
        make(eviction_threshold="high")
    with pytest.raises(TypeError):
        make(on_evict=42)
    cache = make()
    assert cache.eviction_strategy is EvictionStrategy.LRU
    cache.eviction_strategy = "Longest"
    assert cache.eviction_strategy is EvictionStrategy.LONGEST
    with pytest.raises(ValueError):
        cache.eviction_strategy = "mru"
    cache.eviction_threshold = 0.5
    with pytest.raises(ValueError):
        cache.eviction_threshold = 1.01
    assert cache.eviction_threshold == 0.5


# ----------------------------------------------------------------------------------------------
# evict, evict_to_threshold, statistics


def test_evict_named_sequence_reports_and_frees():
    events = []
    cache = make(on_evict=lambda sid, cause: events.append((sid, cause)))
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, tok(9), tok(9))       # 3 blocks
    cache.append(b, tok(5, 2.0), tok(5, 2.0))
    with pytest.raises(KeyError):
        cache.evict(999)
    assert events == [] and cache.stats().evicted_sequences == 0
    assert cache.evict(np.int64(a)) == a
    assert events == [(a, "manual")]
    with pytest.raises(KeyError):
        cache.gather(a)
    with pytest.raises(KeyError):
        cache.evict(a)
    assert cache.num_free_blocks == cache.num_blocks - 2
    assert cache.gather(b)[0].tolist() == tok(5, 2.0).tolist()
    rec = cache.eviction_log[-1]
    assert (rec.sid, rec.cause, rec.strategy, rec.tokens, rec.blocks, rec.blocks_freed) == (
        a, "manual", None, 9, 3, 3)
    new = cache.add_sequence()
    assert new != a                       # ids are never reused
    with pytest.raises(KeyError):
        cache.seq_len(a)
    s = cache.stats()
    assert (s.evicted_sequences, s.evicted_tokens, s.evicted_blocks) == (1, 9, 3)
    assert s.evictions_by_cause == {"manual.sequences": 1, "manual.tokens": 9,
                                    "manual.blocks": 3}
    assert (s.sequences_added, s.sequences_freed, s.sequences_active) == (3, 0, 2)
    cache.free(b)
    s = cache.stats()
    assert (s.sequences_freed, s.sequences_active, s.evicted_sequences) == (1, 1, 1)


def test_evicting_a_forked_parent_keeps_shared_blocks():
    cache = make(eviction_strategy="lru")
    parent = cache.add_sequence()
    cache.append(parent, tok(10, 3.0), tok(10, 3.0))   # 3 blocks
    child = cache.fork(parent)
    cache.append(child, tok(1, 4.0), tok(1, 4.0))      # copies the shared partial block
    assert cache.select_eviction_target() == parent
    free = cache.num_free_blocks
    assert cache.evict() == parent
    rec = cache.eviction_log[-1]
    assert (rec.blocks, rec.blocks_freed, rec.cause, rec.strategy) == (3, 1, "strategy", "lru")
    assert cache.num_free_blocks == free + 1
    k, _ = cache.gather(child)
    assert k[:10].tolist() == tok(10, 3.0).tolist() and k[10].tolist() == tok(1, 4.0)[0].tolist()


def test_evict_to_threshold():
    events = []
    cache = make(num_blocks=20, eviction_strategy="longest", eviction_threshold=0.5,
                 on_evict=lambda sid, cause: events.append((sid, cause)))
    sids = [cache.add_sequence() for _ in range(4)]
    for i, sid in enumerate(sids):
        cache.append(sid, tok(4 * (i + 1)), tok(4 * (i + 1)))   # 1, 2, 3, 4 blocks
    assert cache.stats().utilization == pytest.approx(0.5)
    assert cache.evict_to_threshold() == []                    # 10/20 <= 0.5 already
    assert cache.evict_to_threshold(0.2) == [sids[3], sids[2]]  # 10 -> 6 -> 3 blocks used
    assert events == [(sids[3], "threshold"), (sids[2], "threshold")]
    assert cache.num_free_blocks == 17
    assert cache.evict_to_threshold(0.0, exclude=[sids[1]]) == [sids[0]]
    assert cache.sequence_ids() == [sids[1]]
    assert cache.evict_to_threshold(0.0) == [sids[1]]
    assert cache.evict() is None
    with pytest.raises(ValueError):
        cache.evict_to_threshold(2.0)
    s = cache.stats()
    assert s.evictions_by_cause == {"threshold.sequences": 4, "threshold.tokens": 40,
                                    "threshold.blocks": 10}


def test_stats_split_streaming_and_sequence_causes():
    cache = make(streaming=pagedkv.StreamingLLM(2, 4))
    a, b = cache.add_sequence(), cache.add_sequence()
    for _ in range(10):
        cache.append(a, tok(1), tok(1))   # 3 tokens evicted, no block wholly
    cache.append(b, tok(8), tok(8))
    cache.evict(b)
    s = cache.stats()
    assert s.evicted_tokens == 3 + 8 and s.evicted_blocks == 0 + 2
    assert s.evictions_by_cause == {"streaming_llm.tokens": 3, "manual.sequences": 1,
                                    "manual.tokens": 8, "manual.blocks": 2}


def test_callback_exception_propagates_after_the_eviction_is_recorded():
    def boom(sid, cause):
        raise RuntimeError("callback failed")

    cache = make(on_evict=boom)
    a = cache.add_sequence()
    with pytest.raises(RuntimeError, match="callback failed"):
        cache.evict(a)
    assert a not in cache.sequence_ids() and cache.stats().evicted_sequences == 1


# ----------------------------------------------------------------------------------------------
# automatic mode


def test_default_mode_keeps_core_append_and_evicts_nothing():
    cache = make(num_blocks=4)
    assert cache.append == cache._core.append              # no Python wrapper on the hot path
    assert cache.append_batch == cache._core.append_batch
    assert not cache.auto_evict
    a, b = cache.add_sequence(), cache.add_sequence()
    assert cache.append(a, tok(16), tok(16)) is None
    with pytest.raises(pagedkv.OutOfBlocksError):
        cache.append(b, tok(1), tok(1))
    assert cache.stats().evicted_sequences == 0 and cache.seq_len(a) == 16


def test_auto_evict_evicts_just_enough_by_strategy():
    events = []
    cache = make(num_blocks=12, auto_evict=True, eviction_strategy="lru",
                 on_evict=lambda sid, cause: events.append((sid, cause)))
    assert cache.auto_evict and isinstance(cache, pagedkv.PagedKVCache)
    a, b, c, d = (cache.add_sequence() for _ in range(4))
    for i, s in enumerate((a, b, c)):
        assert cache.append(s, tok(16, i), tok(16, i)) == ()   # 4 blocks each: pool full
    use(cache, a, attends=1)                                    # b is now least recent
    assert cache.num_free_blocks == 0
    assert cache.append(d, tok(5, 9.0), tok(5, 9.0)) == (b,)   # needs 2, b frees 4
    assert events == [(b, "out_of_blocks")]
    with pytest.raises(KeyError):
        cache.seq_len(b)
    assert cache.gather(a)[0].tolist() == tok(16, 0).tolist()
    assert cache.gather(c)[0].tolist() == tok(16, 2).tolist()
    assert cache.num_free_blocks == 2
    # 8 more blocks: c (least recent now) and then a must go; never d itself
    assert cache.append(d, tok(40), tok(40)) == (c, a)
    assert cache.sequence_ids() == [d] and cache.seq_len(d) == 45
    assert [r.cause for r in cache.eviction_log] == ["out_of_blocks"] * 3
    s = cache.stats()
    assert s.evictions_by_cause["out_of_blocks.sequences"] == 3
    assert s.evicted_sequences == 3 and s.evicted_tokens == 48


def test_auto_evict_raises_without_evicting_when_room_cannot_be_made():
    cache = make(num_blocks=6, auto_evict=True, max_blocks_per_seq=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, tok(8), tok(8))
    cache.append(b, tok(12), tok(12))
    before = snapshot(cache, [a, b])
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append(b, tok(20), tok(20))   # needs 5; evicting a would free only 2
    assert info.value.needed == 5
    assert_unchanged(cache, before)
    assert len(cache.eviction_log) == 0
    lone = make(num_blocks=2, auto_evict=True, max_blocks_per_seq=8)
    s = lone.add_sequence()
    with pytest.raises(pagedkv.OutOfBlocksError):
        lone.append(s, tok(9), tok(9))      # nothing else to evict
    assert lone.seq_len(s) == 0


def test_auto_evict_batch_never_evicts_a_batch_member():
    cache = make(num_blocks=5, auto_evict=True, eviction_strategy="lfu")
    a, b, c = (cache.add_sequence() for _ in range(3))
    cache.append(a, tok(4), tok(4))
    cache.append(b, tok(4), tok(4))
    cache.append(c, tok(12), tok(12))
    use(cache, c, attends=5)               # c is the most used; a and b are in the batch
    assert cache.append_batch([a, b], tok(2), tok(2)) == (c,)
    assert cache.sequence_ids() == [a, b] and cache.seq_len(a) == 5


def test_auto_evict_a_fork_parent_releases_the_shared_block():
    """The child's append needs a copy of a shared block; evicting the parent (the LRU
    choice) makes the block private, so the copy and the extra block are not needed."""
    cache = make(num_blocks=6, auto_evict=True)
    parent, other = cache.add_sequence(), cache.add_sequence()
    cache.append(parent, tok(6, 1.0), tok(6, 1.0))   # 2 blocks, the last partly filled
    cache.append(other, tok(16, 2.0), tok(16, 2.0))  # 4 blocks: pool full
    child = cache.fork(parent)
    assert cache.num_free_blocks == 0
    assert cache.append(child, tok(1, 3.0), tok(1, 3.0)) == (parent,)
    assert set(cache.sequence_ids()) == {other, child}
    k, _ = cache.gather(child)
    assert k[:, 0, 0].tolist() == [1.0] * 6 + [3.0]
    assert cache.stats().cow_copies == 0


def test_auto_evict_with_streaming_and_layers(rng):
    """Automatic mode composes with StreamingLLM and multi-layer steps."""
    cache = make(num_blocks=8, auto_evict=True, num_layers=2,
                 streaming=pagedkv.StreamingLLM(1, 6), rope=pagedkv.RoPE())
    a, b = cache.add_sequence(), cache.add_sequence()
    for layer in range(2):
        cache.append(a, tok(20), tok(20), layer=layer)   # 5 blocks
    for layer in range(2):
        assert cache.append(b, tok(3), tok(3), layer=layer) == ()
    assert cache.num_free_blocks == 2
    # a's next step trims it back to 1 + 6 tokens before growing, freeing blocks: no eviction
    for layer in range(2):
        assert cache.append(a, tok(1), tok(1), layer=layer) == ()
    assert cache.seq_len(a) == 8 and cache.stats().evicted_sequences == 0
    # b's prompt needs more than the pool has even after its own trim: a goes
    for layer in range(2):
        cache.append(b, tok(1), tok(1), layer=layer)
    got = cache.append(b, tok(24), tok(24), layer=0)
    assert got == (a,)
    cache.append(b, tok(24), tok(24), layer=1)
    q = np.ones((24, HKV, D), np.float32)
    assert cache.attend(b, q, layer=1).shape == (24, HKV, D)


def test_auto_evict_toggle():
    cache = make(num_blocks=4)
    cache.auto_evict = True
    assert cache.auto_evict and type(cache).__name__ == "PagedKVCache"
    assert "auto_evict='lru'" in repr(cache)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, tok(16), tok(16))
    assert cache.append(b, tok(1), tok(1)) == (a,)
    cache.auto_evict = False
    assert type(cache) is pagedkv.PagedKVCache and cache.append == cache._core.append
    assert cache.append(b, tok(1), tok(1)) is None

    class MyCache(pagedkv.PagedKVCache):
        pass

    mine = MyCache(num_blocks=4, block_size=BS, num_kv_heads=HKV, head_dim=D, auto_evict=True)
    assert isinstance(mine, MyCache) and mine.auto_evict
    mine.auto_evict = False
    assert type(mine) is MyCache
