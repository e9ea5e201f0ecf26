"""The fuzz harness's programs in every test run: the saved regressions (inputs that once failed,
tests/fuzz/regressions/) and a bounded number of random byte strings (PAGEDKV_TEST_PROFILE=long:
50 times as many)."""
import os

import numpy as np
import pytest

from fuzz.program import run_program
from profiles import depth

HERE = os.path.dirname(os.path.abspath(__file__))
REGRESSIONS = os.path.join(HERE, "fuzz", "regressions")


@pytest.mark.parametrize("name", sorted(os.listdir(REGRESSIONS)) if os.path.isdir(REGRESSIONS)
                         else [])
def test_saved_regression(name):
    with open(os.path.join(REGRESSIONS, name), "rb") as f:
        run_program(f.read())


@pytest.mark.parametrize("seed", range(8))
def test_random_programs(seed):
    rng = np.random.default_rng(seed)
    for _ in range(depth(40, 2000)):
        run_program(rng.integers(0, 256, size=int(rng.integers(1, 400)), dtype=np.uint8).tobytes())
