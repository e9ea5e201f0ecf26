"""The fuzz harness's programs in every test run: the saved regressions (inputs that once failed,
tests/fuzz/regressions/) and a bounded number of random byte strings (1,200; PAGEDKV_TEST_PROFILE=long:
40,000)."""
import os

import numpy as np
import pytest

import pagedkv

from fuzz.program import run_program
from profiles import depth

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REGRESSIONS = os.path.join(HERE, "fuzz", "regressions")


@pytest.mark.parametrize("name", sorted(os.listdir(REGRESSIONS)) if os.path.isdir(REGRESSIONS)
                         else [])
def test_saved_regression(name):
    with open(os.path.join(REGRESSIONS, name), "rb") as f:
        run_program(f.read())


@pytest.mark.parametrize("seed", range(8))
def test_random_programs(seed):
    rng = np.random.default_rng(seed)
    for _ in range(depth(150, 5000)):
        run_program(rng.integers(0, 256, size=int(rng.integers(1, 400)), dtype=np.uint8).tobytes())


def _first_failure(monkeypatch, name, broken, tries=3000):
    """Replace PagedKVCache.<name> by `broken` and run random programs until one fails; return the
    failure's message (None if none did)."""
    monkeypatch.setattr(pagedkv.PagedKVCache, name, broken)
    rng = np.random.default_rng(1)
    for _ in range(tries):
        try:
            run_program(rng.integers(0, 256, size=int(rng.integers(64, 400)),
                                     dtype=np.uint8).tobytes())
        except AssertionError as e:
            return str(e)
    return None


def test_harness_catches_a_raised_call_that_changed_the_cache(monkeypatch):
    truncate = pagedkv.PagedKVCache.truncate

    def broken(self, sid, length):
        truncate(self, sid, length)
        raise ValueError("injected after the truncation")
    msg = _first_failure(monkeypatch, "truncate", broken)
    assert msg is not None and "a truncate that raised ValueError changed the cache" in msg, msg


def test_harness_catches_a_read_only_call_that_changed_the_cache(monkeypatch):
    save = pagedkv.PagedKVCache.save

    def broken(self, sid, path):
        written = save(self, sid, path)
        if self.seq_len(sid):
            self.truncate(sid, self.seq_len(sid) - 1)
        return written
    msg = _first_failure(monkeypatch, "save", broken)
    assert msg is not None and "a successful save changed the cache" in msg, msg


def test_harness_checks_the_accounting_after_a_call_that_changed_it(monkeypatch):
    """A call that succeeds and breaks the prefix index's state (checked only after calls that
    changed something) is caught."""
    fork = pagedkv.PagedKVCache.fork

    def broken(self, sid):
        child = fork(self, sid)
        if self._prefix is not None:
            self._prefix._seqs.pop(child, None)
        return child
    msg = _first_failure(monkeypatch, "fork", broken)
    assert msg is not None, "no program noticed a forked sequence missing from the prefix state"
