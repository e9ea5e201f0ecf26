"""Stress: mixed operations from 4 threads on one cache and on 4 caches.

Each worker runs a deterministic script (its own seed) over sequences it owns: add, multi-layer
append, attend, append_batch + attend_batch, gather, fork, truncate, free.  Because a worker's
script depends only on its own sequences, its results must be the same whether it runs alone or
interleaved with the others; the threaded runs are compared with single-threaded runs of the same
scripts, and the block accounting is checked while the workers run and after they finish.
Sized to take a few seconds on 2 cores (PAGEDKV_TEST_PROFILE=long: 10 times the operations).
"""
import sys
import threading

import numpy as np
import pytest

import pagedkv
from profiles import depth
from reference import check_pool_invariants, run_threads

HKV, HQ, D, LAYERS, BS = 2, 4, 8, 2, 4
OPS = depth(800, 8000)
WORKERS = 4


def _new_cache():
    return pagedkv.PagedKVCache(num_blocks=WORKERS * 8 * 64, block_size=BS, num_kv_heads=HKV,
                                head_dim=D, num_layers=LAYERS, dtype="float32",
                                max_seqs=WORKERS * 8 + 4)


def _script(cache, seed, ops=OPS):
    """Run one worker's script; return what it observed (no sequence ids: they differ per run)."""
    rng = np.random.default_rng(seed)
    mine, log = [], []
    tok = lambda n: rng.standard_normal((n, HKV, D)).astype(np.float32)  # noqa: E731
    for _ in range(ops):
        op = rng.choice(["add", "append", "append", "attend", "batch", "gather", "fork",
                         "truncate", "free"])
        if not mine or (op in ("add", "fork") and len(mine) < 8):
            if op == "fork" and mine:
                mine.append(cache.fork(mine[int(rng.integers(len(mine)))]))
            else:
                mine.append(cache.add_sequence())
            log.append(("new", len(mine)))
            continue
        i = int(rng.integers(len(mine)))
        sid = mine[i]
        length = cache.seq_len(sid)
        if op == "append" or (op in ("add", "fork") and length < 40):
            n = int(rng.integers(1, 7))
            for layer in range(LAYERS):
                cache.append(sid, tok(n), tok(n), layer=layer)
        elif op == "attend" and length:
            n = int(rng.integers(1, min(length, 5) + 1))
            q = rng.standard_normal((n, HQ, D)).astype(np.float32)
            log.append(cache.attend(sid, q, layer=int(rng.integers(LAYERS))))
        elif op == "batch":
            pick = sorted(set(int(j) for j in rng.integers(len(mine), size=3)))
            sids = [mine[j] for j in pick]
            for layer in range(LAYERS):
                cache.append_batch(sids, tok(len(sids)), tok(len(sids)), layer=layer)
            q = rng.standard_normal((len(sids), HQ, D)).astype(np.float32)
            log.append(cache.attend_batch(sids, q, layer=LAYERS - 1))
        elif op == "gather":
            log.extend(cache.gather(sid, layer=int(rng.integers(LAYERS))))
        elif op == "truncate" or length > 150:
            cache.truncate(sid, int(rng.integers(0, length + 1)))
        elif op == "free" or len(mine) >= 8:
            cache.free(mine.pop(i))
        log.append(("len", cache.seq_len(sid) if sid in cache else -1))
    log.append(sorted(cache.seq_len(s) for s in mine))
    return log


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@pytest.fixture(autouse=True)
def fast_switching():
    """Switch threads every 20 us instead of 5 ms, so the scripts really interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="module")
def single_threaded():
    return [_script(_new_cache(), seed) for seed in range(WORKERS)]


def test_four_threads_on_one_cache_match_single_threaded_runs(single_threaded):
    cache = _new_cache()
    logs = [None] * WORKERS
    done = threading.Event()
    checks = [0]

    def worker(i):
        def run():
            logs[i] = _script(cache, i)
        return run

    def checker():
        # a whole-pool check holds the lock for a while: pause between checks so the
        # workers, not the checker, get most of the lock
        while not done.wait(0.002):
            check_pool_invariants(cache)
            checks[0] += 1

    def workers_then_stop():
        try:
            run_threads([worker(i) for i in range(WORKERS)])
        finally:
            done.set()

    run_threads([workers_then_stop, checker])
    assert checks[0] > 0
    for i in range(WORKERS):
        _same(logs[i], single_threaded[i])
    check_pool_invariants(cache)
    for sid in cache.sequence_ids():
        cache.free(sid)
    assert cache.num_free_blocks == cache.num_blocks


def test_four_threads_on_four_caches_match_single_threaded_runs(single_threaded):
    caches = [_new_cache() for _ in range(WORKERS)]
    logs = [None] * WORKERS

    def worker(i):
        def run():
            logs[i] = _script(caches[i], i)
        return run

    run_threads([worker(i) for i in range(WORKERS)])
    for i in range(WORKERS):
        _same(logs[i], single_threaded[i])
        check_pool_invariants(caches[i])
