"""Prefix caching: hash-chained full blocks reused by add_sequence(token_ids=...)."""

import itertools

import numpy as np
import pytest

import pagedkv
from reference import snapshot, assert_unchanged, check_pool_invariants

HKV, D, HQ = 2, 8, 4


def kv_for(tokens, layer, dtype=np.float32):
    """K/V that are a pure function of (token id, position, layer): what a model's
    projection of a shared prefix would give."""
    t = np.asarray(tokens, dtype=np.float64)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float64)[:, None, None]
    grid = np.arange(HKV * D, dtype=np.float64).reshape(1, HKV, D)
    k = np.sin(0.37 * t + 0.011 * grid + 0.1 * layer + 0.003 * pos)
    v = np.cos(0.23 * t - 0.017 * grid + 0.2 * layer + 0.002 * pos)
    return k.astype(dtype), v.astype(dtype)


def make(num_blocks=256, block_size=16, layers=2, **kw):
    return pagedkv.PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=HKV,
                                head_dim=D, num_layers=layers, prefix_caching=True, **kw)


def prefill(cache, sid, tokens, start=None):
    """Append tokens[start:] on every layer (start: what the cache already holds)."""
    start = cache.seq_len(sid) if start is None else start
    for layer in range(cache.num_layers):
        k, v = kv_for(tokens, layer)
        cache.append(sid, k[start:], v[start:], layer=layer,
                     token_ids=tokens[start:] if layer == 0 else None)


def test_shared_1000_token_prompt_hits_62_blocks_and_attends_bit_for_bit(rng):
    cache = make(num_blocks=200)
    prompt = rng.integers(0, 32000, 1000).tolist()
    a = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(a) == 0
    prefill(cache, a, prompt)
    b = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(b) == 992
    st = cache.stats()
    assert st.prefix_hit_blocks == 62 and st.prefix_hit_tokens == 992
    assert st.prefix_miss_blocks == 62  # the first lookup found nothing
    assert st.prefix_hit_rate == pytest.approx(0.5)
    np.testing.assert_array_equal(cache.block_table(b), cache.block_table(a)[:62])
    prefill(cache, b, prompt)  # the caller appends the rest: 8 tokens
    assert cache.seq_len(b) == 1000
    # a fresh computation: the same K/V appended in full to a cache without prefix caching
    fresh = pagedkv.PagedKVCache(num_blocks=200, block_size=16, num_kv_heads=HKV, head_dim=D,
                                 num_layers=2)
    f = fresh.add_sequence()
    for layer in range(2):
        k, v = kv_for(prompt, layer)
        fresh.append(f, k[:992], v[:992], layer=layer)
    for layer in range(2):
        k, v = kv_for(prompt, layer)
        fresh.append(f, k[992:], v[992:], layer=layer)
    q = rng.standard_normal((8, HQ, D), dtype=np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(cache.attend(b, q, layer=layer),
                                      fresh.attend(f, q, layer=layer))
        np.testing.assert_array_equal(cache.gather(b, layer)[0], fresh.gather(f, layer)[0])
    # decode on b after the hit: private blocks from here on, a's blocks untouched
    k1 = rng.standard_normal((1, HKV, D), dtype=np.float32)
    ka = cache.gather(a, 0)[0].copy()
    for layer in range(2):
        cache.append(b, k1, k1, layer=layer)
    np.testing.assert_array_equal(cache.gather(a, 0)[0], ka)


def test_block_registered_only_when_every_layer_wrote_it():
    cache = make(layers=3)
    prompt = list(range(40))
    a = cache.add_sequence(token_ids=prompt)
    k, v = kv_for(prompt, 0)
    cache.append(a, k, v, layer=0, token_ids=prompt)
    cache.append(a, *kv_for(prompt, 1), layer=1)
    assert cache.seq_len(cache.add_sequence(token_ids=prompt)) == 0  # layer 2 not written
    cache.append(a, *kv_for(prompt, 2), layer=2)
    assert cache.seq_len(cache.add_sequence(token_ids=prompt)) == 32


def test_reuse_capped_so_one_token_is_left_to_compute():
    cache = make()
    prompt = list(range(48))  # exactly 3 blocks
    a = cache.add_sequence(token_ids=prompt)
    prefill(cache, a, prompt)
    b = cache.add_sequence(token_ids=prompt)
    assert cache.seq_len(b) == 32  # not 48: the last token's logits must be computed
    assert cache.seq_len(cache.add_sequence(token_ids=prompt[:33])) == 32
    assert cache.seq_len(cache.add_sequence(token_ids=prompt[:32])) == 16
    assert cache.seq_len(cache.add_sequence(token_ids=[])) == 0


def test_token_ids_from_append_and_partial_matches():
    cache = make()
    a = cache.add_sequence()
    toks = list(range(100, 150))
    prefill(cache, a, toks)  # ids given to append, not to add_sequence
    other = toks[:20] + [7] * 30  # diverges inside block 1
    b = cache.add_sequence(token_ids=other)
    assert cache.seq_len(b) == 16
    # unknown ids (append without token_ids) register nothing
    c = cache.add_sequence()
    for layer in range(2):
        cache.append(c, *kv_for(list(range(500, 540)), layer), layer=layer)
    assert cache.seq_len(cache.add_sequence(token_ids=list(range(500, 540)))) == 0


def test_cache_salt_keeps_prefixes_apart():
    cache = make()
    p = list(range(40))
    a = cache.add_sequence(token_ids=p, cache_salt="tenant-a")
    prefill(cache, a, p)
    assert cache.seq_len(cache.add_sequence(token_ids=p, cache_salt="tenant-b")) == 0
    assert cache.seq_len(cache.add_sequence(token_ids=p)) == 0
    assert cache.seq_len(cache.add_sequence(token_ids=p, cache_salt="tenant-a")) == 32


def test_hit_on_freed_but_cached_blocks():
    cache = make(num_blocks=64)
    p = list(range(64))
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    cache.free(a)
    st = cache.stats()
    assert st.blocks_used == 0 and st.cached_free_blocks == 4  # all 4 full blocks registered
    b = cache.add_sequence(token_ids=p)
    assert cache.seq_len(b) == 48  # capped: one token left to compute
    assert cache.stats().cached_free_blocks == 1 and cache.stats().blocks_used == 3
    k_ref = kv_for(p, 1)[0][:48]
    np.testing.assert_array_equal(cache.gather(b, 1)[0], k_ref)


def test_freed_cached_blocks_are_reused_least_recently_freed_first_tail_before_head():
    cache = make(num_blocks=8, layers=1)
    p1, p2 = list(range(33)), list(range(1000, 1033))
    a = cache.add_sequence(token_ids=p1)
    prefill(cache, a, p1)  # blocks 0, 1, 2 (2 holds one token)
    b = cache.add_sequence(token_ids=p2)
    prefill(cache, b, p2)  # blocks 3, 4, 5
    ta, tb = cache.block_table(a).tolist(), cache.block_table(b).tolist()
    cache.free(a)  # freed first
    cache.free(b)
    assert cache.stats().cached_free_blocks == 4
    # the pool hands out never-used blocks 6, 7, then a's blocks tail first, then b's
    order = cache._core.pool.free_blocks()
    assert order[:2] == [6, 7]
    assert order[2:5] == ta[::-1] and order[5:] == tb[::-1]
    # taking 4 blocks (64 tokens) reuses 6, 7 and a's tail (2) and a's block 1: a's head
    # block 0 and all of b's chain stay hit-able
    c = cache.add_sequence()
    cache.append(c, *kv_for(list(range(64)), 0), layer=0)
    assert cache.seq_len(cache.add_sequence(token_ids=p2)) == 32
    d = cache.add_sequence(token_ids=p1)
    assert cache.seq_len(d) == 16  # block 0 survived, block 1 was handed out


def test_forced_hash_collision_returns_no_wrong_kv(monkeypatch):
    cache = make(layers=1)
    monkeypatch.setattr(cache._prefix, "_hash", lambda parent, tokens, salt: 42)
    p1, p2 = list(range(40)), list(range(900, 940))
    a = cache.add_sequence(token_ids=p1)
    prefill(cache, a, p1)
    b = cache.add_sequence(token_ids=p2)  # every key collides with p1's block 0
    assert cache.seq_len(b) == 0
    prefill(cache, b, p2)
    np.testing.assert_array_equal(cache.gather(b, 0)[0], kv_for(p2, 0)[0])
    # same first block, different second: the colliding key must not chain on
    p3 = p1[:16] + list(range(700, 724))
    c = cache.add_sequence(token_ids=p3)
    assert cache.seq_len(c) == 16
    np.testing.assert_array_equal(cache.gather(c, 0)[0], kv_for(p1, 0)[0][:16])


def test_fork_truncate_and_rewrite_keep_the_index_honest(rng):
    cache = make(layers=1)
    p = list(range(48))
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    c = cache.fork(a)
    cache.truncate(a, 20)  # block 1 kept partly: the next append rewrites it in place
    new = list(range(5000, 5028))
    k, v = kv_for(list(range(20)) + new, 0)
    cache.append(a, k[20:], v[20:], layer=0, token_ids=new)
    # the old block 1 is still the fork's (copy-on-write): prompt p still hits 32 tokens
    d = cache.add_sequence(token_ids=p)
    assert cache.seq_len(d) == 32
    np.testing.assert_array_equal(cache.gather(d, 0)[0], kv_for(p, 0)[0][:32])
    # and a's new contents are found under their own ids
    e = cache.add_sequence(token_ids=list(range(20)) + new)
    assert cache.seq_len(e) == 32
    np.testing.assert_array_equal(cache.gather(e, 0)[0], cache.gather(a, 0)[0][:32])
    for s in (a, c, d, e):
        cache.free(s)
    # a private block truncated and rewritten in place is no longer hit-able under its old ids
    f = cache.add_sequence(token_ids=p)
    prefill(cache, f, p)
    g = cache.add_sequence(token_ids=p)
    prefill(cache, g, p)
    cache.free(f)
    cache.truncate(g, 20)
    cache.append(g, k[20:], v[20:], layer=0, token_ids=new)
    h = cache.add_sequence(token_ids=p)
    assert cache.seq_len(h) == 16  # block 0 still cached, block 1 forgotten
    np.testing.assert_array_equal(cache.gather(h, 0)[0], kv_for(p, 0)[0][:16])


def test_beam_search_width_4_never_leaks(rng):
    bs = 8
    cache = make(num_blocks=400, block_size=bs, layers=2)
    prompt = rng.integers(0, 100, 37).tolist()
    root = cache.add_sequence(token_ids=prompt)
    prefill(cache, root, prompt)
    beams = [root] + [cache.fork(root) for _ in range(3)]
    for step in range(200):
        survivors = rng.choice(4, size=4, replace=True)
        new = [cache.fork(beams[i]) for i in survivors]
        for s in beams:
            cache.free(s)
        beams = new
        tok = rng.integers(0, 100, 4).tolist()
        for layer in range(2):
            k = rng.standard_normal((4, HKV, D), dtype=np.float32)
            cache.append_batch(beams, k, k, layer=layer, token_ids=tok if layer == 0 else None)
        if step % 50 == 0:
            # another request with the same prompt reuses the cached prefix
            extra = cache.add_sequence(token_ids=prompt)
            assert cache.seq_len(extra) == 32
            cache.free(extra)
    refs = {}
    for s in beams:
        for b in cache.block_table(s).tolist():
            refs[b] = refs.get(b, 0) + 1
    for b, n in refs.items():
        assert cache._core.ref_count(b) == n
    assert cache.stats().blocks_used == len(refs)
    for s in beams:
        cache.free(s)
    st = cache.stats()
    assert st.blocks_used == 0 and st.blocks_free == 400
    assert 0 < st.cached_free_blocks <= 400
    assert all(cache._core.ref_count(b) == 0 for b in range(400))


def test_prefix_caching_refuses_streaming_and_token_ids_without_it():
    with pytest.raises(ValueError, match="StreamingLLM"):
        make(streaming=pagedkv.StreamingLLM(4, 32))
    with pytest.raises(TypeError, match="prefix_caching"):
        pagedkv.PagedKVCache(8, 4, 1, 4, prefix_caching=1)
    plain = pagedkv.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)
    s = plain.add_sequence()
    k = np.zeros((2, 1, 4), np.float32)
    with pytest.raises(TypeError, match="prefix_caching=True"):
        plain.add_sequence(token_ids=[1, 2, 3])
    with pytest.raises(TypeError, match="prefix_caching=True"):
        plain.append(s, k, k, token_ids=[1, 2])
    with pytest.raises(TypeError, match="prefix_caching=True"):
        plain.append_batch([s], k[:1], k[:1], token_ids=[1])
    assert plain.seq_len(s) == 0
    cache = make()
    a = cache.add_sequence()
    with pytest.raises(ValueError, match="prefix_caching"):
        cache.apply_streaming_llm(a, 4, 8)


def test_bad_token_ids_raise_and_change_nothing():
    cache = make()
    a = cache.add_sequence()
    k, v = kv_for(list(range(4)), 0)
    before = snapshot(cache, [a])
    with pytest.raises(ValueError, match="3 ids for 4 tokens"):
        cache.append(a, k, v, token_ids=[1, 2, 3])
    with pytest.raises(TypeError, match="integers"):
        cache.append(a, k, v, token_ids=[1.5, 2, 3, 4])
    with pytest.raises(ValueError, match="one-dimensional"):
        cache.add_sequence(token_ids=[[1, 2]])
    with pytest.raises(TypeError, match="sequence of ints"):
        cache.add_sequence(token_ids="abc")
    with pytest.raises(TypeError, match="hashable"):
        cache.add_sequence(token_ids=[1], cache_salt=[1])
    assert_unchanged(cache, before)
    assert cache.sequence_ids() == [a]


def test_add_sequence_hit_out_of_slots_changes_nothing():
    cache = make(max_seqs=2, layers=1)
    p = list(range(40))
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    b = cache.add_sequence(token_ids=p)
    before = snapshot(cache, [a, b])
    st = cache.stats()
    with pytest.raises(RuntimeError, match="max_seqs"):
        cache.add_sequence(token_ids=p)
    assert_unchanged(cache, before)
    assert cache.stats().prefix_hit_blocks == st.prefix_hit_blocks


def test_auto_evict_releases_prefix_state():
    cache = make(num_blocks=6, layers=1, auto_evict=True)
    p = list(range(40))
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)  # 3 blocks
    b = cache.add_sequence()
    evicted = cache.append(b, *kv_for(list(range(60)), 0), layer=0)  # 4 blocks: evicts a
    assert evicted == (a,)
    assert a not in cache._prefix._seqs
    c = cache.add_sequence(token_ids=p)
    assert cache.seq_len(c) == 32  # b took the 3 never-used blocks and a's tail block
    np.testing.assert_array_equal(cache.gather(c, 0)[0], kv_for(p, 0)[0][:32])


def test_index_stays_bounded_under_churn(rng):
    cache = make(num_blocks=12, block_size=4, layers=1)
    for r in range(60):
        p = rng.integers(0, 50, 13).tolist()  # 3 full blocks each, mostly new prompts
        s = cache.add_sequence(token_ids=p)
        prefill(cache, s, p)
        cache.free(s)
        assert cache._prefix.num_entries <= cache.num_blocks
    assert cache.stats().cached_free_blocks <= cache.num_blocks


def test_roll_back_into_the_head_and_recompute_keeps_the_chain_hit_able():
    # regression: after a roll-back into block 0 the recomputed head got a new index entry; the
    # old blocks 1.. (still cached) named the old head as parent, and the parent check was by
    # identity, so registration stopped at block 1 for good and every later block of the
    # sequence stayed unregistered (found by tests/reliability/test_state_machine_prefix.py's model)
    cache = make(num_blocks=16, block_size=2, layers=2)
    p = list(range(1, 8))                    # blocks (1,2) (3,4) (5,6), then 7
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    cache.truncate(a, 1)                     # inside block 0: rewritten in place on append
    q = p + [8, 9, 10, 11]                   # the same ids again, then two more blocks
    prefill(cache, a, q)
    b = cache.add_sequence(token_ids=q + [0])
    assert cache.seq_len(b) == 10            # blocks 0-4; before the fix 2 (block 0 only)
    for layer in range(2):
        k, v = kv_for(q, layer)
        np.testing.assert_array_equal(cache.gather(b, layer)[0], k[:10])
        np.testing.assert_array_equal(cache.gather(b, layer)[1], v[:10])


def test_block_shared_at_truncate_then_written_in_place_is_no_longer_a_hit():
    # regression: truncating into a registered block that another sequence shared left it
    # registered (only a private block was forgotten); once the other sequence let go of it, the
    # next append wrote into it in place and a hit on the old ids read the new token's K/V
    # (found by tests/reliability/test_state_machine_prefix.py's model)
    cache = make(num_blocks=8, block_size=2, layers=2)
    p = [1, 2, 3, 4, 5]
    w = cache.add_sequence(token_ids=p)
    prefill(cache, w, p)                      # blocks (1, 2) (3, 4) registered
    y = cache.fork(w)
    cache.truncate(y, 3)                      # inside block 1, shared with w
    cache.free(w)                             # y holds block 1 alone now
    z = np.full((1, HKV, D), -99.0, np.float32)
    for layer in range(2):
        cache.append(y, z, z, layer=layer)    # in place, position 3 (ids unknown)
    assert (cache.gather(y, 1)[0][3] == -99.0).all()
    h = cache.add_sequence(token_ids=p)
    assert cache.seq_len(h) == 2              # block 1 holds other contents; before the fix 4
    for layer in range(2):
        np.testing.assert_array_equal(cache.gather(h, layer)[0], kv_for(p, layer)[0][:2])


def test_second_computation_of_a_prefix_stays_hit_able():
    # regression: the index kept only the first copy of a prefix computed twice (both missed);
    # once the first copy's blocks were handed out again, the live second copy was never found
    cache = make(num_blocks=6, block_size=2, layers=1)
    p = [1, 2, 3, 4, 5]
    w = cache.add_sequence(token_ids=p)
    s = cache.add_sequence(token_ids=p)      # both miss: nothing is cached yet
    prefill(cache, w, p)
    prefill(cache, s, p)                     # the same blocks computed again
    check_pool_invariants(cache)
    cache.free(w)
    x = cache.add_sequence()
    cache.append(x, *kv_for(list(range(6)), 0), layer=0)  # takes w's blocks
    h = cache.add_sequence(token_ids=p)
    assert cache.seq_len(h) == 4             # s still holds both full blocks
    assert cache.block_table(h).tolist() == cache.block_table(s)[:2].tolist()
    np.testing.assert_array_equal(cache.gather(h, 0)[0], kv_for(p, 0)[0][:4])
    check_pool_invariants(cache)


# ---- several computations of one prefix ---------------------------------------------------------

def flood(cache):
    """A sequence without token ids takes every free block (the cached free ones too, so the
    copies freed before are gone), then goes."""
    n = cache.num_free_blocks * cache.block_size
    x = cache.add_sequence()
    if n:
        for layer in range(cache.num_layers):
            cache.append(x, *kv_for(list(range(n)), layer), layer=layer)
    assert cache.num_free_blocks == 0 and cache.stats().cached_free_blocks == 0
    cache.free(x)
    check_pool_invariants(cache)


def valid_entries(cache):
    """Index entries still valid (stale ones are dropped when next looked at)."""
    prefix = cache._prefix
    return sum(1 for e in prefix._entries() if prefix._valid(e))


def computed_copies(cache, p, n):
    """n sequences that all missed p (nothing cached yet) and then computed it."""
    sids = [cache.add_sequence(token_ids=p) for _ in range(n)]
    assert all(cache.seq_len(s) == 0 for s in sids)
    for s in sids:
        prefill(cache, s, p)
    check_pool_invariants(cache)
    return sids


def assert_hit(cache, p, tokens, holders):
    """add_sequence(p) reuses `tokens` tokens, read from blocks some sequence of `holders` holds
    at the same places, with p's K/V on every layer; the lookup's counters add up.  The probe
    is freed again (its blocks stay with the holders)."""
    bs = cache.block_size
    st0 = cache.stats()
    h = cache.add_sequence(token_ids=p)
    assert cache.seq_len(h) == tokens
    table = cache.block_table(h).tolist()
    for i, b in enumerate(table):
        assert any(cache.block_table(s).tolist()[i:i + 1] == [b] for s in holders), (i, b)
    for layer in range(cache.num_layers):
        k, v = kv_for(p, layer)
        got_k, got_v = cache.gather(h, layer)
        np.testing.assert_array_equal(got_k, k[:tokens])
        np.testing.assert_array_equal(got_v, v[:tokens])
    st1 = cache.stats()
    lookups = (len(p) - 1) // bs
    assert st1.prefix_hit_blocks - st0.prefix_hit_blocks == tokens // bs
    assert st1.prefix_miss_blocks - st0.prefix_miss_blocks == lookups - tokens // bs
    assert st1.prefix_hit_tokens - st0.prefix_hit_tokens == tokens
    assert st1.prefix_miss_tokens - st0.prefix_miss_tokens == len(p) - tokens
    check_pool_invariants(cache)
    cache.free(h)
    check_pool_invariants(cache)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_three_computations_the_live_copy_is_hit_whichever_goes_first(order):
    cache = make(num_blocks=12, block_size=2, layers=2)
    p = [7, 1, 8, 2, 8, 1, 8]                # 3 full blocks and one token
    sids = computed_copies(cache, p, 3)
    assert valid_entries(cache) == 9         # every copy registered: 3 blocks each
    live = list(sids)
    for i in order:
        assert_hit(cache, p, 6, live)
        cache.free(sids[i])
        live.remove(sids[i])
        flood(cache)                         # the freed copy's blocks are handed out again
        assert valid_entries(cache) == 3 * len(live)
    assert_hit(cache, p, 0, [])              # no copy left


def test_freed_copies_stay_hit_able_and_a_held_copy_is_preferred():
    cache = make(num_blocks=16, block_size=2, layers=1)
    p = [3, 1, 4, 1, 5]
    a, b = computed_copies(cache, p, 2)
    used = cache.stats().blocks_used
    cache.free(a)                            # a's 3 blocks free, its 2 full ones still cached
    assert cache.stats().cached_free_blocks == 2
    assert_hit(cache, p, 4, [b])             # b's blocks, not a's taken back
    assert cache.stats().blocks_used == used - 3 and cache.stats().cached_free_blocks == 2
    cache.free(b)
    assert cache.stats().cached_free_blocks == 4  # both copies, free and hit-able
    h = cache.add_sequence(token_ids=p)
    assert cache.seq_len(h) == 4
    assert cache.stats().cached_free_blocks == 2  # one copy taken back, the other still free
    np.testing.assert_array_equal(cache.gather(h, 0)[0], kv_for(p, 0)[0][:4])
    check_pool_invariants(cache)


def test_counters_count_lookups_not_copies():
    cache = make(num_blocks=16, block_size=2, layers=1)
    p = [1, 1, 2, 2, 3]
    computed_copies(cache, p, 2)
    st = cache.stats()
    # two lookups that found nothing: 2 blocks missed each; registering the copies counts nothing
    assert (st.prefix_hit_blocks, st.prefix_miss_blocks) == (0, 4)
    assert (st.prefix_hit_tokens, st.prefix_miss_tokens) == (0, 10)
    assert cache._prefix.num_entries == 4
    h = cache.add_sequence(token_ids=p)
    st = cache.stats()
    assert (st.prefix_hit_blocks, st.prefix_miss_blocks) == (2, 4)
    assert (st.prefix_hit_tokens, st.prefix_miss_tokens) == (4, 11)
    assert st.prefix_hit_rate == pytest.approx(2 / 6)
    prefill(cache, h, p)                     # the last token: no full block, nothing registered
    assert cache._prefix.num_entries == 4
    check_pool_invariants(cache)


def test_capped_hit_recomputes_the_last_block_and_that_copy_is_kept():
    # a prompt of whole blocks hits all but its last block; the caller computes that block again
    cache = make(num_blocks=8, block_size=2, layers=1)
    p = [5, 6, 7, 8]                         # exactly 2 blocks
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    b = cache.add_sequence(token_ids=p)
    assert cache.seq_len(b) == 2             # capped
    prefill(cache, b, p)                     # block 1 computed a second time
    check_pool_invariants(cache)
    cache.free(a)                            # block 0 stays (b shares it), a's block 1 goes free
    flood(cache)
    assert_hit(cache, p + [9], 4, [b])       # b's own block 1; before the fix 2


def test_loaded_copy_is_kept_beside_the_original(tmp_path):
    cache = make(num_blocks=12, block_size=2, layers=2)
    p = [2, 7, 1, 8, 2]
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)
    cache.save(a, tmp_path / "a.pkv")
    c = cache.load(tmp_path / "a.pkv")       # a second copy of the same blocks, registered
    check_pool_invariants(cache)
    assert cache._prefix.num_entries == 4
    cache.free(a)
    flood(cache)
    assert_hit(cache, p, 4, [c])


def test_truncated_or_rewritten_copy_is_not_hit_the_other_is():
    cache = make(num_blocks=16, block_size=2, layers=2)
    p = [4, 4, 2, 2, 9]
    a, b = computed_copies(cache, p, 2)
    # a truncated into its block 0 and rewritten with other ids: a's copy is gone (its block 1
    # went to the free queue, still p's: the flood hands it out), b's is hit
    cache.truncate(a, 1)
    new = [4, 6, 6, 6, 6]
    prefill(cache, a, new)
    check_pool_invariants(cache)
    flood(cache)
    assert_hit(cache, p, 4, [b])
    assert_hit(cache, new, 4, [a])           # a's new contents under their own ids
    # b truncated into its block 1 (no ids for the rewritten token): only block 0 is left of
    # p, and it is b's (a's block 0 holds other ids now)
    cache.truncate(b, 3)
    z = np.full((1, HKV, D), -99.0, np.float32)
    for layer in range(2):
        cache.append(b, z, z, layer=layer)
    check_pool_invariants(cache)
    assert_hit(cache, p, 2, [b])


def test_copy_shared_at_truncate_then_written_in_place_is_not_hit_the_other_is():
    cache = make(num_blocks=16, block_size=2, layers=2)
    p = [1, 2, 3, 4, 5]
    a, b = computed_copies(cache, p, 2)
    f = cache.fork(a)
    cache.truncate(f, 3)                     # inside block 1, shared with a: stays registered
    cache.free(a)                            # f holds a's block 1 alone now
    z = np.full((1, HKV, D), -99.0, np.float32)
    for layer in range(2):
        cache.append(f, z, z, layer=layer)   # written in place: a's block 1 is not p's any more
    assert (cache.gather(f, 1)[0][3] == -99.0).all()
    check_pool_invariants(cache)
    assert_hit(cache, p, 4, [b, f])          # block 0 from either copy, block 1 from b
    h = cache.add_sequence(token_ids=p)
    assert cache.block_table(h)[1] == cache.block_table(b)[1]
    cache.free(h)
    cache.free(b)
    flood(cache)
    assert_hit(cache, p, 2, [f])             # f still holds a's block 0


def test_fork_keeps_a_copy_live_after_its_computer_goes():
    cache = make(num_blocks=16, block_size=2, layers=2)
    p = [8, 6, 7, 5, 3, 0, 9]
    a, b = computed_copies(cache, p, 2)
    c = cache.fork(a)                        # shares a's copy
    cache.free(a)
    cache.free(b)
    flood(cache)                             # b's copy is gone; a's lives on in the fork
    assert_hit(cache, p, 6, [c])
    # the fork computes on: its new full blocks are registered after a's (by content)
    more = p + [1, 2, 3]
    prefill(cache, c, more)
    check_pool_invariants(cache)
    assert_hit(cache, more + [4], 10, [c])
    # a fork of a hit, and the fork of the fork: still one copy of each block, still hit-able
    h = cache.add_sequence(token_ids=more + [4])
    g = cache.fork(h)
    cache.free(c)
    cache.free(h)
    assert_hit(cache, more + [4], 10, [g])
    # the last holder truncates into block 1 and rewrites it: blocks 1.. are gone, block 0 stays
    cache.truncate(g, 3)
    for layer in range(2):
        k, v = kv_for([8, 6, 7, 0], layer)
        cache.append(g, k[3:], v[3:], layer=layer, token_ids=[0] if layer == 0 else None)
    check_pool_invariants(cache)
    assert_hit(cache, p, 2, [g])
    assert_hit(cache, [8, 6, 7, 0, 1], 4, [g])


def test_step_written_again_after_a_fork_registers_the_copy():
    # a later layer may write the newest step again; where its blocks are shared (a fork) the
    # core copies them first: the sequence then holds a copy of registered blocks, entered too
    cache = make(num_blocks=16, block_size=2, layers=2)
    p = [1, 2, 3, 4]
    a = cache.add_sequence(token_ids=p)
    prefill(cache, a, p)                     # one step of 4 tokens: blocks 0 and 1
    c = cache.fork(a)
    k, v = kv_for(p, 1)
    cache.append(a, k, v, layer=1)           # the step again on layer 1: a's blocks copied
    assert not set(cache.block_table(a).tolist()) & set(cache.block_table(c).tolist())
    check_pool_invariants(cache)
    assert valid_entries(cache) == 4
    cache.free(c)
    flood(cache)
    assert_hit(cache, p + [5], 4, [a])


def test_copies_under_a_forced_hash_collision(monkeypatch):
    # every key collides: a key's copies hold one content; another content under the same key
    # is not registered (nor anything after it), and a hit is still verified
    cache = make(num_blocks=16, block_size=2, layers=1)
    monkeypatch.setattr(cache._prefix, "_hash", lambda parent, tokens, salt: 42)
    p = [1, 2, 3, 4, 5]
    a, b = computed_copies(cache, p, 2)      # block 0 twice; block 1 collides with block 0
    assert cache._prefix.num_entries == 2
    cache.free(a)
    flood(cache)
    assert_hit(cache, p, 2, [b])
    q = [9, 9, 3, 4, 5]                      # collides with p's block 0: a miss, not registered
    s = cache.add_sequence(token_ids=q)
    assert cache.seq_len(s) == 0
    prefill(cache, s, q)
    check_pool_invariants(cache)
    assert_hit(cache, q, 0, [])


def test_loaded_sequence_keeps_its_cache_salt(tmp_path):
    cache = make(block_size=2, layers=1)
    p = [1, 2, 3, 4, 5]
    a = cache.add_sequence(token_ids=p, cache_salt="tenant-a")
    prefill(cache, a, p)
    cache.save(a, tmp_path / "a.pkv")
    cache.load(tmp_path / "a.pkv")
    assert cache.seq_len(cache.add_sequence(token_ids=p)) == 0  # another tenant (no salt)


def test_loaded_salt_separates_tenants_in_a_fresh_cache(tmp_path):
    src = make(block_size=2, layers=1)
    p = [1, 2, 3, 4, 5]
    for name, salt in (("str", "tenant-a"), ("int", 7), ("other", ("tenant", "b"))):
        a = src.add_sequence(token_ids=p, cache_salt=salt)
        prefill(src, a, p)
        src.save(a, tmp_path / f"{name}.pkv")
        dst = make(block_size=2, layers=1)
        loaded = dst.load(tmp_path / f"{name}.pkv")
        assert dst.seq_len(loaded) == 5
        assert dst.seq_len(dst.add_sequence(token_ids=p)) == 0           # no salt: no hit
        assert dst.seq_len(dst.add_sequence(token_ids=p, cache_salt="x")) == 0
        hit = dst.seq_len(dst.add_sequence(token_ids=p, cache_salt=salt))
        # a salt JSON cannot hold exactly is not stored: that copy is never registered
        assert hit == (0 if name == "other" else 4)
