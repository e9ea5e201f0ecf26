"""Shared fixtures for the pagedkv test suite."""

import os
import sys
import zlib

import numpy as np
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)  # so test modules can `import reference`

try:
    from hypothesis import settings

    # Deterministic runs that leave no example database behind in the work tree.
    settings.register_profile("pagedkv", derandomize=True, database=None, deadline=None)
    settings.load_profile("pagedkv")
except ImportError:  # pragma: no cover - hypothesis is a test requirement
    pass


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's node id: deterministic, and different per test."""
    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    return np.random.default_rng(seed)
