"""CacheStats counters through a sequence of operations."""

from small import fill, small_cache


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
