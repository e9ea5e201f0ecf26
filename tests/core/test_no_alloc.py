"""The hot path allocates nothing: appending, attention and decode steps reuse the pool.

tracemalloc sees every Python-level allocation (objects and numpy data buffers).  It is started
before the warm-up, so anything created once (caches of method lookups, first-touch structures)
is already counted in the "before" figure; the measured loop must then not grow the traced
current size.  RSS catches C-level growth (malloc in the core, pages faulted in for the first
time): the warm-up fills the whole pool once so every page of the K/V buffers is already resident.
"""

import gc
import os
import tracemalloc

import numpy as np

import pagedkv
import pytest
from reference import ref_stored

# every storage dtype under float32 arrays (None: float32 itself); conversion happens in C
KV_DTYPES = [None, "bfloat16", "float16", "int8"]

HKV, D, BS = 8, 128, 16
N_APPENDS = 10_000
KIB = 1024
MIB = 1024 * 1024
#: under tools/sanitize.sh (ASan preloaded) freed memory sits in the allocator's quarantine (up
#: to 256 MiB) instead of being reused, so resident size grows with any malloc/free pair,
#: tracemalloc's own bookkeeping included: RSS is no measure of growth there and is not checked
#: (tracemalloc's figures and the block counts still are)
RSS_LIMIT = None if "libasan" in os.environ.get("LD_PRELOAD", "") else MIB


def rss_bytes():
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class _Traced:
    """Start tracemalloc for the duration of a test, stopping it even when the test fails."""

    def __enter__(self):
        self.was_tracing = tracemalloc.is_tracing()
        if not self.was_tracing:
            tracemalloc.start()
        return self

    def __exit__(self, *exc):
        if not self.was_tracing:
            tracemalloc.stop()
        return False


def _growth(cache, loop):
    """Run loop() with the garbage collector off; return how much it grew: blocks taken from
    the pool, traced bytes (current, and peak over the start), resident bytes."""
    gc.collect()
    gc.disable()
    try:
        free, rss = cache.num_free_blocks, rss_bytes()
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loop()
        current, peak = tracemalloc.get_traced_memory()
        return dict(blocks=free - cache.num_free_blocks, traced=current - start,
                    peak=peak - start, rss=rss_bytes() - rss)
    finally:
        gc.enable()


def _one_token_appender(cache, rng, warm):
    """A new sequence, one token's K and V, and cache.append, after `warm` appends of it."""
    sid = cache.add_sequence()
    k = rng.standard_normal((1, HKV, D)).astype(np.float32)
    v = rng.standard_normal((1, HKV, D)).astype(np.float32)
    append = cache.append
    for _ in range(warm):
        append(sid, k, v)
    assert cache.seq_len(sid) == warm
    return sid, k, v, append


def _touch_whole_pool(cache, rng):
    """Write every slot of every block once (so its pages are resident), then give them back."""
    sid = cache.add_sequence()
    chunk = 512
    remaining = cache.num_blocks * cache.block_size
    k = rng.standard_normal((chunk, HKV, D)).astype(np.float32)
    while remaining:
        n = min(chunk, remaining)
        cache.append(sid, k[:n], k[:n])
        remaining -= n
    assert cache.num_free_blocks == 0
    cache.free(sid)
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_single_token_appends_allocate_nothing(rng, kv_dtype):
    warm = 2 * BS  # warm-up ends on a block boundary, so the loop's block count is exact
    needed = -(-(warm + N_APPENDS) // BS)
    with _Traced():
        cache = pagedkv.PagedKVCache(
            num_blocks=needed + 3, block_size=BS, num_kv_heads=HKV, head_dim=D, dtype="float32",
            kv_dtype=kv_dtype,
        )
        _touch_whole_pool(cache, rng)
        sid, k, v, append = _one_token_appender(cache, rng, warm)

        def loop():
            for _ in range(N_APPENDS):
                append(sid, k, v)

        grew = _growth(cache, loop)
    assert cache.seq_len(sid) == warm + N_APPENDS
    assert grew["blocks"] == -(-N_APPENDS // BS) == 625
    assert grew["traced"] < KIB and (RSS_LIMIT is None or grew["rss"] < RSS_LIMIT), grew
    # And the tokens really landed.
    gk, gv = cache.gather(sid)
    np.testing.assert_array_equal(gk[-1], ref_stored(k, kv_dtype, np.float32)[0])
    np.testing.assert_array_equal(gv[warm + 1234], ref_stored(v, kv_dtype, np.float32)[0])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_single_token_append_creates_no_temporary_arrays(rng, kv_dtype):
    """Not even a transient copy: the traced peak stays within 1 KiB of the starting size
    (a copied [8, 128] f32 token alone would be 4 KiB)."""
    with _Traced():
        cache = pagedkv.PagedKVCache(
            num_blocks=40, block_size=BS, num_kv_heads=HKV, head_dim=D, dtype="float32",
            kv_dtype=kv_dtype,
        )
        sid, k, v, append = _one_token_appender(cache, rng, BS)

        def loop():
            for _ in range(500):
                append(sid, k, v)

        grew = _growth(cache, loop)
    assert cache.seq_len(sid) == BS + 500
    assert grew["peak"] < KIB, grew


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_step_with_out_allocates_nothing(rng, kv_dtype):
    """append_batch + attend_batch(out=) for a batch of sequences, repeated: no growth."""
    batch, steps, hq = 4, 300, 32
    prompt = 40
    blocks_per_seq = -(-(prompt + 50 + steps) // BS)
    with _Traced():
        cache = pagedkv.PagedKVCache(
            num_blocks=batch * blocks_per_seq, block_size=BS, num_kv_heads=HKV, head_dim=D,
            dtype="float32", kv_dtype=kv_dtype,
        )
        _touch_whole_pool(cache, rng)
        sids = np.array([cache.add_sequence() for _ in range(batch)], dtype=np.int64)
        prefill = rng.standard_normal((prompt, HKV, D)).astype(np.float32)
        for sid in sids:
            cache.append(int(sid), prefill, prefill)
        k = rng.standard_normal((batch, HKV, D)).astype(np.float32)
        v = rng.standard_normal((batch, HKV, D)).astype(np.float32)
        q = rng.standard_normal((batch, hq, D)).astype(np.float32)
        out = np.empty((batch, hq, D), dtype=np.float32)
        append_batch, attend_batch = cache.append_batch, cache.attend_batch
        for _ in range(50):
            append_batch(sids, k, v)
            attend_batch(sids, q, out=out)

        def loop():
            for _ in range(steps):
                append_batch(sids, k, v)
                attend_batch(sids, q, out=out)

        grew = _growth(cache, loop)
    length = prompt + 50 + steps
    assert all(cache.seq_len(int(s)) == length for s in sids)
    assert grew["blocks"] == batch * (-(-length // BS) - -(-(prompt + 50) // BS))
    assert grew["traced"] < KIB and (RSS_LIMIT is None or grew["rss"] < RSS_LIMIT), grew
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attend_with_out_creates_no_temporary_arrays(rng, kv_dtype):
    hq = 32
    with _Traced():
        cache = pagedkv.PagedKVCache(num_blocks=16, block_size=BS, num_kv_heads=HKV, head_dim=D,
                                     kv_dtype=kv_dtype)
        sids = np.array([cache.add_sequence() for _ in range(2)], dtype=np.int64)
        tokens = rng.standard_normal((100, HKV, D)).astype(np.float32)
        for sid in sids:
            cache.append(int(sid), tokens, tokens)
        q1 = rng.standard_normal((1, hq, D)).astype(np.float32)
        qb = rng.standard_normal((2, hq, D)).astype(np.float32)
        out1 = np.empty_like(q1)
        outb = np.empty_like(qb)
        sid0 = int(sids[0])
        attend, attend_batch = cache.attend, cache.attend_batch
        for _ in range(20):
            attend(sid0, q1, out=out1)
            attend_batch(sids, qb, out=outb)

        def loop():
            for _ in range(300):
                attend(sid0, q1, out=out1)
                attend_batch(sids, qb, out=outb)

        grew = _growth(cache, loop)
    assert grew["traced"] < KIB and grew["peak"] < KIB, grew
    np.testing.assert_allclose(out1, cache.attend(sid0, q1), rtol=1e-6, atol=1e-6)
