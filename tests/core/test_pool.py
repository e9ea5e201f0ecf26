"""The block pool and the sequence table through the cache: construction and properties, pool
exhaustion (OutOfBlocksError, atomic), freeing, and the metadata bounds (max_seqs,
max_blocks_per_seq)."""

import dataclasses

import numpy as np
import pytest

import pagedkv
from reference import (
    append_step, assert_attention_close, assert_unchanged, build_random_cache, check_against_model,
    ref_attention, snapshot
)
from small import HKV, D, fill, small_cache, toks


# ----------------------------------------------------------------------------------------------
# Construction and properties


def _vm_flags(addr: int):
    """VmFlags of the mapping holding addr in /proc/self/smaps (None off Linux)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_arena_alignment_and_huge_page_advice():
    """Pools of 2 MiB or more start on a 2 MiB boundary and (on Linux) carry the MADV_HUGEPAGE
    advice, shown as "hg" in the mapping's VmFlags; small pools are 64-byte aligned."""
    big = pagedkv.PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64,
                               num_layers=2)  # 64 blocks of 64 KiB: 4 MiB
    addr, size = big._core.arena_address
    assert size == 64 * 16 * 4 * 64 * 4 * 2 * 2
    assert addr % (2 << 20) == 0
    flags = _vm_flags(addr)
    if flags is not None:
        assert "hg" in flags, flags
    small = small_cache(num_blocks=4, block_size=4)
    addr, size = small._core.arena_address
    assert size < (2 << 20) and addr % 64 == 0



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


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
def test_debug_snapshot_agrees_with_the_per_item_reads(rng, kv_dtype):
    """CacheCore.debug_snapshot (what the fuzz programs compare before and after every call)
    holds what gather, kept_positions, priority, block_table, written_tokens and the pool's
    per-block reads give one by one: over forks, StreamingLLM trims, a pending step and frees."""
    c = pagedkv.PagedKVCache(num_blocks=24, block_size=3, num_kv_heads=2, head_dim=5,
                             num_layers=2, kv_dtype=kv_dtype)
    a = c.add_sequence(priority=1.5)
    for layer in (0, 1):
        c.append(a, *rng.standard_normal((2, 7, 2, 5)).astype(np.float32), layer=layer)
    b = c.fork(a)
    c.append(b, *rng.standard_normal((2, 2, 2, 5)).astype(np.float32))  # layer 1 pending
    d = c.add_sequence()
    for layer in (0, 1):
        c.append(d, *rng.standard_normal((2, 9, 2, 5)).astype(np.float32), layer=layer)
    c.apply_streaming_llm(d, 2, 4)
    c.free(c.add_sequence())
    core = c._core
    seqs, pool, inner = core.debug_snapshot()
    assert [s[0] for s in seqs] == [t[0] for t in inner[1]] == core.sequence_ids() == [a, b, d]
    for (sid, length, kept, prio, kv), (_, table, written, segs) in zip(seqs, inner[1]):
        assert length == core.seq_len(sid)
        assert kept == core.kept_positions(sid).tobytes()
        assert prio == core.priority(sid)
        assert kv == b"".join(x.tobytes() for layer in (0, 1) for x in core.gather(sid, layer))
        assert table == core.block_table(sid).tobytes()
        assert written == core.written_tokens(sid)
        g = core.debug_state(sid)
        assert segs == (g["a0"], g["a1"], g["b0"], g["b1"], g["off0"], g["off1"])
    p = core.pool
    assert pool == (core.num_blocks, core.num_free_blocks,
                    [(p.generation(i), p.is_cached(i, p.generation(i)), p.ref_count(i))
                     for i in range(core.num_blocks)], p.num_cached_free)
    assert inner[0] == p.free_blocks()


def test_a_block_id_added_back_by_resize_starts_above_its_old_generations(rng):
    """(block, generation) names one incarnation of a block for the pool's whole life: a block id
    that a shrink dropped and a growth adds back is handed out at a generation it never had
    (found by the fuzz programs: a block dropped at generation 1, added back at 0 and handed out
    again at 1 had the (block, generation) of its old contents)."""
    c = pagedkv.PagedKVCache(num_blocks=6, block_size=1, num_kv_heads=HKV, head_dim=D,
                             max_blocks_per_seq=16, prefix_caching=True)
    p = c._core.pool
    seen = {}  # block id -> the generations it has had

    def note():
        for i in range(c.num_blocks):
            seen.setdefault(i, set()).add(p.generation(i))

    def fill(sid, n):
        c.append(sid, *rng.standard_normal((2, n, HKV, D)).astype(np.float32))
        note()

    a = c.add_sequence()
    fill(a, 5)
    assert [p.generation(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    for shrink, grow in ((1, 6), (3, 8), (2, 9)):
        c.truncate(a, 1)
        before = {i: set(g) for i, g in seen.items()}
        c.resize(shrink)
        c.resize(grow)
        for i in range(shrink, grow):  # added back (or new): above every generation it had
            assert p.generation(i) > max(before.get(i, {-1})), (shrink, grow, i)
        b = c.add_sequence()
        fill(b, grow - 1)
        for blk in c.block_table(b).tolist():
            assert p.generation(blk) not in before.get(blk, set()), (shrink, grow, blk)
        c.free(b)
