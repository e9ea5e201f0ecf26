"""Threads: the kernels release the GIL; one cache serves one call at a time (others wait)."""
import os
import subprocess
import sys
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


def test_one_cache_shared_by_threads_serializes_calls():
    """Concurrent calls on one cache wait for each other (no RuntimeError);
    the cache's contents and the results stay right."""
    rng = np.random.default_rng(8)
    cache, sid, k, v = _filled_cache(rng, length=2000)
    q = rng.standard_normal((1, 8, 32)).astype(np.float32)
    exp = ref_attention(q, k, v, 1 / np.sqrt(32), k.shape[0] - 1)
    errors, wrong, calls = [], [], [0]
    stop = threading.Event()

    def attender():
        while not stop.is_set():
            try:
                out = cache.attend(sid, q)
            except Exception as e:  # none expected: a busy cache makes callers wait
                errors.append(repr(e))
                continue
            calls[0] += 1
            if not np.allclose(out, exp, rtol=1e-5, atol=1e-5 * np.abs(v).max()):
                wrong.append(out)

    def mutator():
        other = cache.add_sequence()
        kk = np.ones((1, 2, 32), np.float32)
        try:
            for _ in range(300):
                cache.append(other, kk, kk)
                cache.truncate(other, 0)
        except Exception as e:
            errors.append(repr(e))
        stop.set()

    threads = [threading.Thread(target=attender) for _ in range(2)] + [threading.Thread(target=mutator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert not wrong
    assert calls[0] > 0
    np.testing.assert_array_equal(cache.gather(sid)[0], k)


def test_a_waiting_caller_releases_the_gil_and_proceeds_after_the_holder():
    rng = np.random.default_rng(3)
    cache, sid, k, _ = _filled_cache(rng, length=40)
    entered, result = threading.Event(), []

    def waiter():
        entered.set()
        result.append(cache.seq_len(sid))      # blocks while the main thread holds the cache

    with cache._core.hold():
        t = threading.Thread(target=waiter)
        t.start()
        assert entered.wait(10)
        spins = 0
        while spins < 200_000:                 # Python runs here: the waiter does not hold the GIL
            spins += 1
        assert result == []                    # still waiting
        cache.append(sid, k[:1], k[:1])        # the holder's own calls nest
    t.join(10)
    assert not t.is_alive()
    assert result == [41]


def test_a_call_from_inside_a_call_on_the_same_thread_raises_and_changes_nothing():
    rng = np.random.default_rng(4)
    cache, sid, k, v = _filled_cache(rng, length=20)
    other = cache.add_sequence()
    free_before = cache.num_free_blocks

    class Sneaky:
        def __array__(self, dtype=None, copy=None):
            cache.free(other)                  # re-enters the cache during input conversion
            return np.zeros((1, 2, 32), np.float32)

    with pytest.raises(TypeError) as info:   # "k must be a float array", caused by:
        cache.append(sid, Sneaky(), Sneaky())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "inside another call" in str(info.value.__cause__)
    assert other in cache and cache.seq_len(sid) == 20
    assert cache.num_free_blocks == free_before
    np.testing.assert_array_equal(cache.gather(sid)[1], v)
    cache.free(other)                          # and the cache is usable afterwards


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_set_num_threads_gives_the_same_result(threads, dtype):
    rng = np.random.default_rng(9)
    cache = pagedkv.PagedKVCache(num_blocks=300, block_size=16, num_kv_heads=1, head_dim=128,
                                 dtype=dtype)
    sid = cache.add_sequence()
    k = rng.standard_normal((4096, 1, 128)).astype(dtype)
    v = rng.standard_normal((4096, 1, 128)).astype(dtype)
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
        # one sequence, one KV head: the only parallelism is split-K over the keys, a chunk
        # per thread, two on 8 threads or more (4096 keys: 256 or more per chunk)
        assert plan == (threads, 1, 2 * threads if threads >= 8 else threads)
    exp = ref_attention(q, k, v, 1 / np.sqrt(128), k.shape[0] - 1)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(out, exp, rtol=tol, atol=tol * np.abs(v).max())
    np.testing.assert_allclose(outb, exp, rtol=tol, atol=tol * np.abs(v).max())


@pytest.mark.skipif(not pagedkv.has_openmp(), reason="a build without OpenMP runs one thread")
@pytest.mark.parametrize("length, plan", [
    (2048, (2, 8, 2)),   # keys enough for two chunks: all 8 KV heads in each item, split-K
    (400, (2, 4, 1)),    # too few keys to split (256 per chunk): the head group splits instead
])
def test_decode_plan_splits_keys_before_heads(length, plan):
    """One sequence on 2 threads: key chunks (every item reads whole K/V planes) unless the
    keys are too few, then smaller head groups; the result matches the reference either way."""
    rng = np.random.default_rng(3)
    cache = pagedkv.PagedKVCache(num_blocks=200, block_size=16, num_kv_heads=8, head_dim=128,
                                 num_layers=2)
    sid = cache.add_sequence()
    for layer in (0, 1):
        k = rng.standard_normal((length, 8, 128)).astype(np.float32)
        v = rng.standard_normal((length, 8, 128)).astype(np.float32)
        cache.append(sid, k, v, layer=layer)
    q = rng.standard_normal((1, 64, 128)).astype(np.float32)
    try:
        pagedkv.set_num_threads(2)
        out = cache.attend_batch([sid], q, layer=1)
        got = cache.last_attention_plan
    finally:
        pagedkv.set_num_threads(0)
    assert got == plan
    exp = ref_attention(q, k, v, 1 / np.sqrt(128), length - 1)
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-5 * np.abs(v).max())


PASSIVE_SCRIPT = """
import numpy as np, pagedkv
rng = np.random.default_rng(5)
pagedkv.set_num_threads(2)
for length in (300, 512):  # K+V 2.3 MiB and 4 MiB, both above PKV_PARALLEL_MIN's work
    cache = pagedkv.PagedKVCache(num_blocks=40, block_size=16, num_kv_heads=8, head_dim=128)
    sid = cache.add_sequence()
    k = rng.standard_normal((length, 8, 128)).astype(np.float32)
    cache.append(sid, k, -k)
    cache.attend_batch([sid], rng.standard_normal((1, 32, 128)).astype(np.float32))
    print("threads", length, cache.last_attention_plan[0])
"""


@pytest.mark.skipif(not pagedkv.has_openmp(), reason="a build without OpenMP runs one thread")
@pytest.mark.parametrize("policy, small", [("passive", 1), (" PASSIVE\t", 1), ("passively", 2),
                                           ("active", 2), (None, 2)])
def test_passive_wait_policy_keeps_small_decode_calls_on_one_thread(policy, small, tmp_path):
    """Under OMP_WAIT_POLICY=passive (as OpenMP reads it: any case, blanks around it) a decode
    call of less than 3 MiB of K+V runs on one thread (waking a sleeping worker costs more than
    it saves); a bigger one, or any call under another policy, on the threads set."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    # the pagedkv this process imported (an installed one, not the source tree's folder)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(pagedkv.__file__)))
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    if policy == "active":
        env["GOMP_SPINCOUNT"] = "1000"  # the idle worker need not spin until the process ends
    proc = subprocess.run([sys.executable, "-c", PASSIVE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["threads", "300", str(small), "threads", "512", "2"]


def test_set_num_threads_rejects_negative():
    with pytest.raises(ValueError):
        pagedkv.set_num_threads(-1)


@pytest.mark.parametrize("n,exc", [(4097, ValueError), (100_000, ValueError), (2**40, ValueError),
                                   (2.0, TypeError), ("2", TypeError), (True, TypeError),
                                   (None, TypeError)])
def test_set_num_threads_rejects_what_it_cannot_run_and_keeps_the_count(n, exc):
    """Found by a review: 100,000 was taken, and the next parallel call ended the process (the
    system refused the threads; libgomp aborts then).  A refused call keeps the count."""
    try:
        pagedkv.set_num_threads(3)
        with pytest.raises(exc, match="number of threads"):
            pagedkv.set_num_threads(n)
        assert pagedkv.get_num_threads() == 3
        pagedkv.set_num_threads(np.int64(4096))  # the largest taken, as any integer type
        assert pagedkv.get_num_threads() == 4096
    finally:
        pagedkv.set_num_threads(0)
