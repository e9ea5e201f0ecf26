"""StreamingLLM over pages against a NumPy model of the paper's evaluation loop.

The model (``PaperLoop``) is the reference implementation's loop written out
plainly: it keeps pre-RoPE keys in lists; before an append of n tokens it cuts a
cache holding more than S + R tokens to its first S plus its R most recent
tokens; then it appends.  Attention rotates the held keys with positions
``arange(m)`` (their rank in the cache) and the n queries with ranks
``m - n .. m - 1``, causal.  RoPE here is an independent rotate-half
implementation, not pagedkv.RoPE.
"""

import math

import numpy as np
import pytest

import pagedkv
from reference import (assert_attention_close, assert_unchanged, check_pool_invariants,
                       ref_attention, rope_rotate, snapshot)


class PaperLoop:
    """StartRecentKVCache semantics, eval mode: evict to S + R, then append."""

    def __init__(self, sink, window, num_layers, kv_heads, head_dim, dtype):
        self.S, self.R = sink, window
        self.pos = []                                   # original stream positions held
        empty = np.zeros((0, kv_heads, head_dim), dtype)
        self.k = [empty.copy() for _ in range(num_layers)]
        self.v = [empty.copy() for _ in range(num_layers)]
        self.next_pos = 0
        self.evicted = 0

    def copy(self):
        other = PaperLoop.__new__(PaperLoop)
        other.__dict__.update(self.__dict__)
        other.pos = list(self.pos)
        other.k = [a.copy() for a in self.k]
        other.v = [a.copy() for a in self.v]
        return other

    def keep(self, idx):
        self.pos = [self.pos[i] for i in idx]
        self.k = [a[idx] for a in self.k]
        self.v = [a[idx] for a in self.v]

    def trim(self, S, R):
        m = len(self.pos)
        if m > S + R:
            self.evicted += m - S - R
            self.keep(list(range(S)) + list(range(m - R, m)))

    def append(self, layer, k, v, streaming=True):
        n = k.shape[0]
        if layer == 0:
            if streaming:
                self.trim(self.S, self.R)
            self.pos += list(range(self.next_pos, self.next_pos + n))
            self.next_pos += n
            self.k[0] = np.concatenate([self.k[0], k])
            self.v[0] = np.concatenate([self.v[0], v])
        else:
            assert self.k[layer].shape[0] == len(self.pos) - n
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])

    def truncate(self, length):
        """Roll back to the first `length` held tokens; the next token follows the last
        one kept (a no-op when nothing is rolled back)."""
        assert length >= 1
        if length < len(self.pos):
            self.keep(list(range(length)))
            self.next_pos = self.pos[-1] + 1

    def attention(self, layer, q, scale, rope):
        m, n = len(self.pos), q.shape[0]
        k = self.k[layer]
        if rope is not None:
            k = rope_rotate(k, np.arange(m), rope.theta, rope.rotary_dim)
            q = rope_rotate(q, np.arange(m - n, m), rope.theta, rope.rotary_dim)
        return ref_attention(q, k, self.v[layer], scale, m - n)


def held_blocks_all_live(cache, sid):
    """Every block in the table holds at least one held slot (no dead block kept)."""
    st = cache._core.debug_state(sid)
    bs = cache.block_size
    slots = list(range(st["a0"], st["a1"])) + list(range(st["b0"], st["b1"]))
    return {s // bs for s in slots} == set(range(len(st["table"])))


def physical_addresses(cache, sid):
    """Stream position -> (physical block, offset) of every held token."""
    st = cache._core.debug_state(sid)
    bs, table = cache.block_size, st["table"]
    slots = list(range(st["a0"], st["a1"])) + list(range(st["b0"], st["b1"]))
    return {int(p): (table[s // bs], s % bs) for p, s in zip(cache.kept_positions(sid), slots)}


def check_step(cache, sid, model, layers, rng, n, hq, rope, dtype, bound_n=None):
    """One model step on every layer: append, attend, compare; then invariants."""
    hkv, d = cache.num_kv_heads, cache.head_dim
    addr_before = physical_addresses(cache, sid)
    cow_before = cache.stats().cow_copies
    for layer in range(layers):
        k = rng.standard_normal((n, hkv, d)).astype(dtype)
        v = rng.standard_normal((n, hkv, d)).astype(dtype)
        q = rng.standard_normal((n, hq, d)).astype(dtype)
        cache.append(sid, k, v, layer=layer)
        model.append(layer, k, v)
        out = cache.attend(sid, q, layer=layer)
        expected = model.attention(layer, q, 1.0 / math.sqrt(d), rope)
        assert_attention_close(out, expected, dtype, model.v[layer],
                               err_msg=f"layer={layer} n={n} held={len(model.pos)}")
    np.testing.assert_array_equal(cache.kept_positions(sid), np.asarray(model.pos, np.int64))
    assert cache.seq_len(sid) == len(model.pos)
    for layer in range(layers):
        k, v = cache.gather(sid, layer=layer)
        np.testing.assert_array_equal(k, model.k[layer])
        np.testing.assert_array_equal(v, model.v[layer])
    ev = cache.streaming
    nb = cache.num_seq_blocks(sid)
    assert nb <= ev.max_blocks(cache.block_size, bound_n or n)
    assert held_blocks_all_live(cache, sid)
    # zero-copy: a token that stays held never moves (unless a block shared with a fork
    # was copied on write)
    addr = physical_addresses(cache, sid)
    moved = [p for p, a in addr_before.items() if p in addr and addr[p] != a]
    assert not moved or cache.stats().cow_copies > cow_before, moved


@pytest.fixture(autouse=True)
def one_thread():
    """These tests make thousands of tiny attention calls: one thread keeps them fast
    (and insensitive to a busy machine); test_threaded_split_over_segments uses two."""
    prev = pagedkv.get_num_threads()
    pagedkv.set_num_threads(1)
    yield
    pagedkv.set_num_threads(prev)


SINKS = [0, 1, 4]
WINDOWS = [1, 7, 64]
BLOCK_SIZES = [1, 4, 16]


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "chunks"])
@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sink", SINKS)
def test_paper_loop(rng, sink, window, block_size, use_rope, multi):
    """2 layers, GQA (2 KV heads, 6 query heads), float64, against the paper's loop."""
    layers, hkv, hq, d, dtype = 2, 2, 6, 8, np.float64
    total = sink + window + 3 * block_size + 13
    if multi:
        # a long prompt first (more than S + R, attended causally in full), then chunks
        steps = [sink + window + block_size + 2]
        while sum(steps) < total:
            steps.append(int(rng.integers(1, 2 * block_size + 6)))
    else:
        steps = [1] * total
    policy = pagedkv.StreamingLLM(sink_tokens=sink, window_tokens=window)
    # the pool holds exactly the bound: exceeding it would raise OutOfBlocksError
    num_blocks = max(policy.max_blocks(block_size, n) for n in steps)
    rope = pagedkv.RoPE(theta=10000.0) if use_rope else None
    cache = pagedkv.PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=hkv,
                                 head_dim=d, num_layers=layers, dtype="float64",
                                 streaming=policy, rope=rope)
    sid = cache.add_sequence()
    model = PaperLoop(sink, window, layers, hkv, d, dtype)
    steady = 0
    for n in steps:
        held_before = len(model.pos)
        check_step(cache, sid, model, layers, rng, n, hq, rope, dtype)
        assert cache.num_free_blocks == num_blocks - cache.num_seq_blocks(sid)
        if held_before > sink + window:
            assert cache.seq_len(sid) == sink + window + n
            steady += 1
    assert steady > 0 and model.evicted > 0
    s = cache.stats()
    assert s.evicted_tokens == model.evicted
    assert s.evictions_by_cause.get("streaming_llm.tokens") == model.evicted
    assert s.cow_copies == 0
    assert s.blocks_allocated - s.blocks_freed == cache.num_seq_blocks(sid)


@pytest.mark.parametrize("multi", [False, True], ids=["decode", "chunks"])
@pytest.mark.parametrize("block_size", [3, 4])
@pytest.mark.parametrize("sink", [1, 4])
def test_window_zero(rng, sink, block_size, multi):
    """R = 0: only the sinks survive each step; a block left with no held token (the one
    the next write would have continued) is freed too, by per-append and one-shot trims."""
    layers, hkv, hq, d = 2, 1, 2, 8
    rope = pagedkv.RoPE()
    policy = pagedkv.StreamingLLM(sink, 0)
    cache = pagedkv.PagedKVCache(num_blocks=64, block_size=block_size, num_kv_heads=hkv,
                                 head_dim=d, num_layers=layers, dtype="float64",
                                 streaming=policy, rope=rope)
    sid = cache.add_sequence()
    model = PaperLoop(sink, 0, layers, hkv, d, np.float64)
    steps = [int(rng.integers(1, 3 * block_size)) if multi else 1 for _ in range(30)]
    for n in [sink + 5] + steps:
        check_step(cache, sid, model, layers, rng, n, hq, rope, np.float64)
        assert cache.num_free_blocks == cache.num_blocks - cache.num_seq_blocks(sid)
    assert cache.apply_streaming_llm(sid, sink, 0) > 0
    model.trim(sink, 0)
    np.testing.assert_array_equal(cache.kept_positions(sid), model.pos)
    assert held_blocks_all_live(cache, sid)
    assert cache.num_seq_blocks(sid) == -(-sink // block_size)
    check_step(cache, sid, model, layers, rng, 2, hq, rope, np.float64)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_paper_loop_float32(rng, block_size, use_rope):
    layers, hkv, hq, d, dtype = 2, 2, 8, 64, np.float32
    policy = pagedkv.StreamingLLM(4, 7)
    rope = pagedkv.RoPE() if use_rope else None
    cache = pagedkv.PagedKVCache(num_blocks=64, block_size=block_size, num_kv_heads=hkv,
                                 head_dim=d, num_layers=layers, dtype="float32",
                                 streaming=policy, rope=rope)
    sid = cache.add_sequence()
    model = PaperLoop(4, 7, layers, hkv, d, dtype)
    for n in [9] + [1] * 30 + [5, 3, 17, 1, 1]:
        check_step(cache, sid, model, layers, rng, n, hq, rope, dtype)


def test_threaded_split_over_segments(rng):
    """Two threads over a long held window split in two segments (sinks + window)."""
    S, R, bs, hkv, hq, d = 3, 600, 4, 2, 8, 32
    rope = pagedkv.RoPE()
    cache = pagedkv.PagedKVCache(num_blocks=256, block_size=bs, num_kv_heads=hkv, head_dim=d,
                                 dtype="float32", streaming=pagedkv.StreamingLLM(S, R), rope=rope)
    sid = cache.add_sequence()
    model = PaperLoop(S, R, 1, hkv, d, np.float32)
    for n in [700, 50, 1, 1, 9]:
        k = rng.standard_normal((n, hkv, d)).astype(np.float32)
        v = rng.standard_normal((n, hkv, d)).astype(np.float32)
        cache.append(sid, k, v)
        model.append(0, k, v)
    st = cache._core.debug_state(sid)
    assert st["a1"] > st["a0"] and st["b1"] > st["b0"] and st["a1"] < st["b0"]
    pagedkv.set_num_threads(2)
    for nq in [1, 9]:
        q = rng.standard_normal((nq, hq, d)).astype(np.float32)
        out = cache.attend(sid, q)
        exp = model.attention(0, q, 1 / math.sqrt(d), rope)
        assert_attention_close(out, exp, np.float32, model.v[0], err_msg=f"nq={nq}")
    q = rng.standard_normal((1, hq, d)).astype(np.float32)
    out = cache.attend_batch([sid], q)
    assert_attention_close(out, model.attention(0, q, 1 / math.sqrt(d), rope), np.float32,
                           model.v[0])


def test_partial_rotary_dim(rng):
    rope = pagedkv.RoPE(theta=500.0, rotary_dim=4)
    cache = pagedkv.PagedKVCache(num_blocks=16, block_size=4, num_kv_heads=1, head_dim=8,
                                 num_layers=1, dtype="float64",
                                 streaming=pagedkv.StreamingLLM(2, 5), rope=rope)
    sid = cache.add_sequence()
    model = PaperLoop(2, 5, 1, 1, 8, np.float64)
    for n in [3, 1, 1, 4, 1, 1, 1, 6, 1, 2]:
        check_step(cache, sid, model, 1, rng, n, 2, rope, np.float64)


def test_paper_section_3_2_example(rng):
    """Cache [0,1,2,3,6,7,8] decoding token 9 uses positions 0..7 (not 0..3,6..9)."""
    S, R, d = 4, 3, 16
    rope = pagedkv.RoPE()
    cache = pagedkv.PagedKVCache(num_blocks=16, block_size=2, num_kv_heads=1, head_dim=d,
                                 dtype="float64", streaming=pagedkv.StreamingLLM(S, R), rope=rope)
    sid = cache.add_sequence()
    k = 3.0 * rng.standard_normal((10, 1, d))
    v = rng.standard_normal((10, 1, d))
    for t in range(9):
        cache.append(sid, k[t:t + 1], v[t:t + 1])
    np.testing.assert_array_equal(cache.kept_positions(sid), [0, 1, 2, 3, 5, 6, 7, 8])
    cache.append(sid, k[9:10], v[9:10])
    held = [0, 1, 2, 3, 6, 7, 8, 9]
    np.testing.assert_array_equal(cache.kept_positions(sid), held)
    q = 3.0 * rng.standard_normal((1, 1, d))
    out = cache.attend(sid, q)

    def expected(positions):
        kr = rope_rotate(k[held], positions)
        qr = rope_rotate(q, positions[-1:])
        return ref_attention(qr, kr, v[held], 1 / math.sqrt(d), len(held) - 1)

    np.testing.assert_allclose(out, expected(np.arange(8)), rtol=1e-12, atol=1e-12)
    # the original positions give a measurably different answer
    assert np.max(np.abs(out - expected(np.array(held)))) > 1e-4


def test_design_example_kept_positions():
    """S=2, R=4 after ten single-token appends: [0, 1, 5, 6, 7, 8, 9]."""
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2,
                                 streaming=pagedkv.StreamingLLM(sink_tokens=2, window_tokens=4))
    sid = cache.add_sequence()
    x = np.zeros((1, 1, 2), np.float32)
    for _ in range(10):
        cache.append(sid, x, x)
    kept = cache.kept_positions(sid)
    assert kept.dtype == np.int64
    assert kept.tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert cache.seq_len(sid) == 7  # the newest token attends to S + R + 1 keys
    assert cache.stats().evicted_tokens == 3


def test_streams_forever_within_max_blocks_per_seq(rng):
    """max_blocks_per_seq counts held blocks: the bound is enough for any length."""
    S, R, bs = 4, 20, 4
    policy = pagedkv.StreamingLLM(S, R)
    bound = policy.max_blocks(bs, 1)
    cache = pagedkv.PagedKVCache(num_blocks=bound, block_size=bs, num_kv_heads=1, head_dim=4,
                                 max_blocks_per_seq=bound, streaming=policy, rope=pagedkv.RoPE())
    sid = cache.add_sequence()
    k = rng.standard_normal((1, 1, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)
    held = []
    for _ in range(2000):
        cache.append(sid, k, k)
        cache.attend(sid, q)
        held.append(cache.num_seq_blocks(sid))
    assert max(held) <= bound
    assert max(held[200:]) - min(held[200:]) <= 1  # flat after the window filled
    assert cache.seq_len(sid) == S + R + 1
    s = cache.stats()
    assert s.blocks_allocated - s.blocks_freed == cache.num_seq_blocks(sid)
    assert s.evicted_tokens == 2000 - (S + R + 1)


def test_batch_decode_streams_each_sequence(rng):
    """append_batch / attend_batch trim every sequence of the batch, on 2 layers."""
    S, R, bs, hkv, hq, d, layers = 2, 5, 4, 2, 4, 8, 2
    rope = pagedkv.RoPE()
    cache = pagedkv.PagedKVCache(num_blocks=40, block_size=bs, num_kv_heads=hkv, head_dim=d,
                                 num_layers=layers, dtype="float64",
                                 streaming=pagedkv.StreamingLLM(S, R), rope=rope)
    sids = [cache.add_sequence() for _ in range(3)]
    models = [PaperLoop(S, R, layers, hkv, d, np.float64) for _ in sids]
    # different prompt lengths so the sequences are out of phase
    for sid, model, n in zip(sids, models, [1, 6, 11]):
        for layer in range(layers):
            k = rng.standard_normal((n, hkv, d))
            cache.append(sid, k, -k, layer=layer)
            model.append(layer, k, -k)
    for _ in range(25):
        for layer in range(layers):
            k = rng.standard_normal((3, hkv, d))
            v = rng.standard_normal((3, hkv, d))
            q = rng.standard_normal((3, hq, d))
            cache.append_batch(sids, k, v, layer=layer)
            out = cache.attend_batch(sids, q, layer=layer)
            for i, model in enumerate(models):
                model.append(layer, k[i:i + 1], v[i:i + 1])
                exp = model.attention(layer, q[i:i + 1], 1 / math.sqrt(d), rope)
                assert_attention_close(out[i:i + 1], exp, np.float64, model.v[layer])
        for sid, model in zip(sids, models):
            np.testing.assert_array_equal(cache.kept_positions(sid), model.pos)
            assert held_blocks_all_live(cache, sid)
    used = sum(cache.num_seq_blocks(s) for s in sids)
    assert cache.num_free_blocks == cache.num_blocks - used


def test_fork_truncate_and_one_shot_trims_random_ops(rng):
    """Random interleaving of steps, forks, truncations, frees and one-shot trims."""
    S, R, bs, hkv, hq, d, layers = 3, 6, 4, 1, 2, 8, 2
    rope = pagedkv.RoPE()
    cache = pagedkv.PagedKVCache(num_blocks=200, block_size=bs, num_kv_heads=hkv, head_dim=d,
                                 num_layers=layers, dtype="float64",
                                 streaming=pagedkv.StreamingLLM(S, R), rope=rope)
    models = {cache.add_sequence(): PaperLoop(S, R, layers, hkv, d, np.float64)}
    for _ in range(300):
        sid = list(models)[int(rng.integers(len(models)))]
        model = models[sid]
        op = rng.random()
        if op < 0.6 or not model.pos:
            n = int(rng.integers(1, 9))
            check_step(cache, sid, model, layers, rng, n, hq, rope, np.float64)
        elif op < 0.7 and len(models) < 6:
            child = cache.fork(sid)
            models[child] = model.copy()
        elif op < 0.8:
            length = int(rng.integers(1, len(model.pos) + 1))
            cache.truncate(sid, length)
            model.truncate(length)
        elif op < 0.9:
            evicted = cache.apply_streaming_llm(sid, S, R)
            before = len(model.pos)
            model.trim(S, R)
            assert evicted == before - len(model.pos)
        elif len(models) > 1:
            cache.free(sid)
            del models[sid]
            continue
        np.testing.assert_array_equal(cache.kept_positions(sid), model.pos)
        for layer in range(layers):
            k, v = cache.gather(sid, layer=layer)
            np.testing.assert_array_equal(k, model.k[layer])
    # every other sequence is intact too (forks never see each other's writes)
    for sid, model in models.items():
        np.testing.assert_array_equal(cache.kept_positions(sid), model.pos)
        for layer in range(layers):
            np.testing.assert_array_equal(cache.gather(sid, layer=layer)[1], model.v[layer])
    for sid in list(models):
        cache.free(sid)
    assert cache.num_free_blocks == cache.num_blocks


# ----------------------------------------------------------------------------------------------
# apply_streaming_llm (one shot)


def _filled(rng, n=50, layers=2, bs=4, eviction=None, num_blocks=64):
    cache = pagedkv.PagedKVCache(num_blocks=num_blocks, block_size=bs, num_kv_heads=1,
                                 head_dim=8, num_layers=layers, dtype="float64",
                                 streaming=eviction, rope=pagedkv.RoPE())
    sid = cache.add_sequence()
    model = PaperLoop(0, 0, layers, 1, 8, np.float64)
    for layer in range(layers):
        k = rng.standard_normal((n, 1, 8))
        v = rng.standard_normal((n, 1, 8))
        cache.append(sid, k, v, layer=layer)
        model.append(layer, k, v, streaming=False)
    return cache, sid, model


def test_apply_streaming_llm_one_shot(rng):
    cache, sid, model = _filled(rng)
    free0 = cache.num_free_blocks
    assert cache.apply_streaming_llm(sid, 4, 8) == 38
    model.trim(4, 8)
    assert cache.kept_positions(sid).tolist() == [0, 1, 2, 3] + list(range(42, 50))
    # slots 4..41 lie in blocks 0..10: blocks 1..9 are wholly evicted (block 10 holds 40, 41)
    assert cache.num_free_blocks == free0 + 9
    assert held_blocks_all_live(cache, sid)
    q = rng.standard_normal((1, 2, 8))
    for layer in range(2):
        np.testing.assert_array_equal(cache.gather(sid, layer=layer)[0], model.k[layer])
    # without an eviction policy the sequence then grows again; attention uses ranks
    for _ in range(5):
        for layer in range(2):
            k = rng.standard_normal((1, 1, 8))
            cache.append(sid, k, k, layer=layer)
            model.append(layer, k, k, streaming=False)
            out = cache.attend(sid, q, layer=layer)
            exp = model.attention(layer, q, 1 / math.sqrt(8), pagedkv.RoPE())
            assert_attention_close(out, exp, np.float64, model.v[layer])
    assert cache.seq_len(sid) == 17
    assert cache.apply_streaming_llm(sid, 4, 8) == 5  # same sizes again: fine
    model.trim(4, 8)
    np.testing.assert_array_equal(cache.kept_positions(sid), model.pos)
    assert cache.apply_streaming_llm(sid, 4, 8) == 0  # nothing more to evict
    s = cache.stats()
    assert s.evictions_by_cause == {"apply_streaming_llm.tokens": 43,
                                    "apply_streaming_llm.blocks": 10}
    assert s.evicted_tokens == 43


def test_apply_streaming_llm_errors_leave_cache_unchanged(rng):
    cache, sid, model = _filled(rng, n=40)
    cache.apply_streaming_llm(sid, 2, 6)
    before = snapshot(cache, [sid], layers=(0, 1))
    # other sizes would leave three runs of tokens
    with pytest.raises(ValueError, match="two runs"):
        cache.apply_streaming_llm(sid, 5, 2)
    assert_unchanged(cache, before, layers=(0, 1))
    for args in [(-1, 4), (2, -1), (0, 0), (1.5, 2)]:
        with pytest.raises((ValueError, TypeError)):
            cache.apply_streaming_llm(sid, *args)
        assert_unchanged(cache, before, layers=(0, 1))
    with pytest.raises(KeyError):
        cache.apply_streaming_llm(sid + 1, 2, 6)
    # in the middle of a step (layer 1 still lacks the newest tokens) a trim would move
    # the slots the pending layer-1 append writes: refused
    k = rng.standard_normal((3, 1, 8))
    cache.append(sid, k, k, layer=0)
    mid = snapshot(cache, [sid], layers=(0,))
    with pytest.raises(ValueError, match="middle of a step"):
        cache.apply_streaming_llm(sid, 0, 1)
    assert_unchanged(cache, mid, layers=(0,))
    cache.append(sid, k, k, layer=1)
    assert cache.apply_streaming_llm(sid, 2, 6) == 3


def test_trim_into_the_newest_step_ends_it(rng):
    """A one-shot trim whose window cuts into the newest step ends that step: appending that
    step again on another layer raises ValueError and changes nothing (it used to write before
    the held tokens, out of the pool: found by the fuzz programs).  A trim that keeps the whole
    step leaves its rewrite on another layer possible."""
    c = pagedkv.PagedKVCache(num_blocks=11, block_size=4, num_kv_heads=1, head_dim=2,
                             num_layers=2, dtype="float64")
    s = c.add_sequence()
    k = rng.standard_normal((5, 1, 2))
    c.append(s, k, k, layer=0)
    c.append(s, k, k, layer=1)
    assert c.apply_streaming_llm(s, 0, 1) == 4
    before = snapshot(c, [s], layers=(0, 1))
    with pytest.raises(ValueError, match="layer 1"):
        c.append(s, k, k, layer=1)
    assert_unchanged(c, before, layers=(0, 1))
    c.compact()
    with pytest.raises(ValueError, match="layer 1"):
        c.append(s, k, k, layer=1)
    assert_unchanged(c, before, layers=(0, 1))
    c.append(s, k[:2], k[:2], layer=0)            # a new step works as ever
    c.append(s, 2 * k[:2], 2 * k[:2], layer=1)
    np.testing.assert_array_equal(c.gather(s, 1)[0], np.concatenate([k[4:], 2 * k[:2]]))
    np.testing.assert_array_equal(c.kept_positions(s), [4, 5, 6])

    # one-token batch steps, a window of 0: nothing of the step is held any more
    b = c.add_sequence()
    for t in range(3):
        c.append_batch([b], k[t:t + 1], k[t:t + 1], layer=0)
        c.append_batch([b], k[t:t + 1], k[t:t + 1], layer=1)
    c.apply_streaming_llm(b, 1, 0)
    before = snapshot(c, [s, b], layers=(0, 1))
    with pytest.raises(ValueError, match="layer 1"):
        c.append_batch([b], k[:1], k[:1], layer=1)
    assert_unchanged(c, before, layers=(0, 1))

    # the window keeps the newest step: its rewrite on layer 1 lands on its own positions
    w = c.add_sequence()
    c.append(w, k, k, layer=0)
    c.append(w, k, k, layer=1)
    c.append(w, k[:2], k[:2], layer=0)
    c.append(w, k[:2], k[:2], layer=1)
    c.apply_streaming_llm(w, 1, 3)
    c.append(w, 3 * k[:2], 3 * k[:2], layer=1)
    np.testing.assert_array_equal(c.kept_positions(w), [0, 4, 5, 6])
    np.testing.assert_array_equal(c.gather(w, 1)[0], np.concatenate([k[:1], k[4:], 3 * k[:2]]))
    np.testing.assert_array_equal(c.gather(w, 0)[0], np.concatenate([k[:1], k[4:], k[:2]]))


@pytest.mark.parametrize("order", ["trimmed last", "trimmed first"])
def test_batch_gets_blocks_a_later_sequence_trims(rng, order):
    """append_batch counts the blocks every sequence's StreamingLLM trim gives back, so a
    sequence before the trimmed one in the batch may need one of them.  The trims used to be
    applied sequence by sequence: that sequence took from an empty free queue, and got the
    block id one past the pool (its K/V written beyond the pool, the free queue's sentinel
    overwritten: found by the fuzz programs)."""
    d = 64
    c = pagedkv.PagedKVCache(num_blocks=8, block_size=1, num_kv_heads=1, head_dim=d,
                             num_layers=2, streaming=pagedkv.StreamingLLM(1, 4))
    a = c.add_sequence()
    ka = rng.standard_normal((8, 1, d)).astype(np.float32)
    for lo, hi in ((0, 5), (5, 8)):  # the second step is held whole until a's next append
        for layer in (0, 1):
            c.append(a, ka[lo:hi], ka[lo:hi], layer=layer)
    assert c.seq_len(a) == 8 and c.num_free_blocks == 0
    b = c.add_sequence()
    x = rng.standard_normal((2, 1, d)).astype(np.float32)
    sids = [b, a] if order == "trimmed last" else [a, b]
    c.append_batch(sids, x, x)                 # a gives back 3 blocks, takes 1; b takes 1
    c.append_batch(sids, 2 * x, 2 * x, layer=1)
    check_pool_invariants(c)
    for s in (a, b):
        assert all(0 <= blk < c.num_blocks for blk in c.block_table(s).tolist())
    ia, ib = sids.index(a), sids.index(b)
    np.testing.assert_array_equal(c.kept_positions(a), [0, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(c.gather(a)[0], np.concatenate([ka[:1], ka[4:], x[ia:ia + 1]]))
    np.testing.assert_array_equal(c.gather(a, 1)[0][-1], 2 * x[ia])
    np.testing.assert_array_equal(c.gather(b)[0], x[ib:ib + 1])
    np.testing.assert_array_equal(c.gather(b, 1)[0], 2 * x[ib:ib + 1])
    assert c.num_free_blocks == 1


def test_streaming_append_out_of_blocks_is_atomic(rng):
    """A streaming append that cannot get blocks evicts nothing and changes nothing."""
    bs = 4
    cache = pagedkv.PagedKVCache(num_blocks=7, block_size=bs, num_kv_heads=1, head_dim=4,
                                 streaming=pagedkv.StreamingLLM(1, 3))
    sid = cache.add_sequence()
    other = cache.add_sequence()
    x = rng.standard_normal((1, 1, 4)).astype(np.float32)
    for _ in range(6):
        cache.append(sid, x, x)  # positions 0..5, held [0, 3, 4, 5] after the last append
    cache.append(other, np.zeros((20, 1, 4), np.float32), np.zeros((20, 1, 4), np.float32))
    assert cache.num_free_blocks == 0
    before = snapshot(cache, [sid, other])
    evicted_before = cache.stats().evicted_tokens
    big = rng.standard_normal((9, 1, 4)).astype(np.float32)
    with pytest.raises(pagedkv.OutOfBlocksError) as info:
        cache.append(sid, big, big)  # the trim frees no block, the write needs 2 more
    assert info.value.needed == 2 and info.value.available == 0
    assert_unchanged(cache, before)
    assert cache.stats().evicted_tokens == evicted_before
    cache.append(sid, x, x)  # a single token fits in the partly filled block
    assert cache.kept_positions(sid).tolist() == [0, 3, 4, 5, 6]


def test_streaming_llm_validation():
    with pytest.raises(ValueError):
        pagedkv.StreamingLLM(-1, 4)
    with pytest.raises(ValueError):
        pagedkv.StreamingLLM(0, 0)
    with pytest.raises(ValueError):
        pagedkv.StreamingLLM(True, 4)
    with pytest.raises(TypeError):
        pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2,
                             streaming=(4, 8))
    p = pagedkv.StreamingLLM(sink_tokens=4, window_tokens=1020)
    assert p.max_blocks(16, 1) == 1 + 64 + 1
    assert p.max_blocks(16, 20) == 1 + 65 + 1
