"""Threads: the kernels release the GIL; one cache serves one call at a time."""
import threading

import numpy as np
import pytest

import pagedkv
from reference import ref_attention


def _filled_cache(rng, length=300, hkv=2, d=32):
    cache = pagedkv.PagedKVCache(num_blocks=256, block_size=16, num_kv_heads=hkv, head_dim=d)
    sid = cache.add_sequence()
    k = rng.standard_normal((length, hkv, d)).astype(np.float32)
    v = rng.standard_normal((length, hkv, d)).astype(np.float32)
    cache.append(sid, k, v)
    return cache, sid, k, v


def test_separate_caches_in_parallel_threads_are_correct():
    rng = np.random.default_rng(7)
    jobs = [_filled_cache(rng) for _ in range(4)]
    queries = [rng.standard_normal((1, 8, 32)).astype(np.float32) for _ in jobs]
    results = [None] * len(jobs)

    def work(i):
        cache, sid, _, _ = jobs[i]
        for _ in range(50):
            results[i] = cache.attend(sid, queries[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (cache, sid, k, v), q, out in zip(jobs, queries, results):
        exp = ref_attention(q, k, v, 1 / np.sqrt(32), k.shape[0] - 1)
        np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-5 * np.abs(v).max())


def test_one_cache_shared_by_threads_never_races():
    """Concurrent calls on one cache either run one at a time or raise RuntimeError;
    the cache's contents and the results stay right."""
    rng = np.random.default_rng(8)
    cache, sid, k, v = _filled_cache(rng, length=2000)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    exp = ref_attention(q, k, v, 1 / np.sqrt(32), k.shape[0] - 1)
    errors, wrong = [], []
    stop = threading.Event()

    def attender():
        while not stop.is_set():
            try:
                out = cache.attend(sid, q)
            except RuntimeError as e:
                errors.append(str(e))
                continue
            if not np.allclose(out, exp, rtol=1e-5, atol=1e-5 * np.abs(v).max()):
                wrong.append(out)

    def mutator():
        other = cache.add_sequence()
        kk = np.ones((1, 2, 32), np.float32)
        for _ in range(300):
            try:
                cache.append(other, kk, kk)
                cache.truncate(other, 0)
            except RuntimeError as e:
                errors.append(str(e))
        stop.set()

    threads = [threading.Thread(target=attender) for _ in range(2)] + [threading.Thread(target=mutator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not wrong
    assert all("in use by another thread" in e for e in errors)
    np.testing.assert_array_equal(cache.gather(sid)[0], k)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_set_num_threads_gives_the_same_result(threads, dtype):
    rng = np.random.default_rng(9)
    cache = pagedkv.PagedKVCache(num_blocks=300, block_size=16, num_kv_heads=1, head_dim=128,
                                 dtype=dtype)
    sid = cache.add_sequence()
    k = rng.standard_normal((4000, 1, 128)).astype(dtype)
    v = rng.standard_normal((4000, 1, 128)).astype(dtype)
    cache.append(sid, k, v)
    q = rng.standard_normal((1, 4, 128)).astype(dtype)
    before = pagedkv.get_num_threads()
    try:
        pagedkv.set_num_threads(threads)
        assert pagedkv.get_num_threads() == threads
        out = cache.attend(sid, q)
        plan = cache.last_attention_plan
        outb = cache.attend_batch([sid], q)
    finally:
        pagedkv.set_num_threads(0)
    assert pagedkv.get_num_threads() == before
    if pagedkv.has_openmp():
        # one sequence, one KV head: the only parallelism is split-K over the keys
        assert plan == (threads, 1, threads)
    exp = ref_attention(q, k, v, 1 / np.sqrt(128), k.shape[0] - 1)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(out, exp, rtol=tol, atol=tol * np.abs(v).max())
    np.testing.assert_allclose(outb, exp, rtol=tol, atol=tol * np.abs(v).max())


def test_set_num_threads_rejects_negative():
    with pytest.raises(ValueError):
        pagedkv.set_num_threads(-1)
