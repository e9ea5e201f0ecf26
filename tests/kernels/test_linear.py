"""pagedkv.linear (include/pagedkv/linear.h): y = x W^T + b for a decode step's few rows.

Against a float64 NumPy reference over random shapes (rows across the kernel's 3-row tile, K
odd and even across the vector width, N across the 4-row tile and the thread split), float32
and float64, with and without bias, 1 and 2 threads, on every SIMD path the machine runs.
Tolerance: |y - ref| <= rtol * sum_k |x_k w_k| (+ |b|), rtol 1e-5 for float32 and 1e-12 for
float64 (the kernel sums in the compute dtype, in its own order).  Bad arguments raise before
anything is written.
"""
import textwrap

import numpy as np
import pytest

import pagedkv
from test_simd_paths import SUPPORTED, run_script

RTOL = {np.float32: 1e-5, np.float64: 1e-12}


def _check(rng, dtype, m, k, n, bias, threads):
    x = rng.standard_normal((m, k)).astype(dtype)
    w = rng.standard_normal((n, k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None
    old = pagedkv.get_num_threads()
    pagedkv.set_num_threads(threads)
    try:
        y = pagedkv.linear(x, w, b)
    finally:
        pagedkv.set_num_threads(old)
    assert y.dtype == dtype and y.shape == (m, n)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T + (0.0 if b is None else b.astype(np.float64))
    mag = np.abs(x64) @ np.abs(w64).T + (0.0 if b is None else np.abs(b.astype(np.float64)))
    bad = np.abs(y - ref) > RTOL[dtype] * mag
    assert not bad.any(), (m, k, n, bias, threads, np.argwhere(bad)[:5])


def check_random_shapes(seed, trials):
    rng = np.random.default_rng(seed)
    for t in range(trials):
        dtype = (np.float32, np.float64)[t % 2]
        m = int(rng.integers(1, 70))
        k = int(rng.integers(1, 10)) if t % 4 == 0 else int(rng.integers(1, 600))
        n = int(rng.integers(1, 90))
        _check(rng, dtype, m, k, n, bool(t % 3), 1 + t % 2)
    # enough work for the threads to split the output columns (N not a multiple of 4)
    for dtype in (np.float32, np.float64):
        _check(rng, dtype, 24, 512, 2051, True, 2)
        _check(rng, dtype, 3, 1000, 4001, False, 2)


def test_random_shapes_against_reference():
    check_random_shapes(7, 120)


SCRIPT = textwrap.dedent(
    """
    import os, pagedkv
    assert pagedkv.simd_backend() == os.environ["PAGEDKV_SIMD"]
    from test_linear import check_random_shapes
    check_random_shapes(len(os.environ["PAGEDKV_SIMD"]), 60)
    print("LINEAR-OK")
    """
)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_every_simd_path(backend):
    run_script(SCRIPT, "LINEAR-OK", PAGEDKV_SIMD=backend, OMP_NUM_THREADS="2")


def test_out_argument_and_conversions():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 20)).astype(np.float32)
    x = rng.standard_normal((5, 40))[:, ::2]          # float64, not contiguous: converted
    out = np.full((5, 37), np.nan, np.float32)
    y = pagedkv.linear(x, w, out=out)
    assert y is out
    np.testing.assert_allclose(out, x.astype(np.float32) @ w.T, rtol=1e-5, atol=1e-5)
    # the weight's dtype is the compute dtype
    y64 = pagedkv.linear(x.astype(np.float32), w.astype(np.float64), [0.5] * 37)
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, x.astype(np.float32).astype(np.float64)
                               @ w.astype(np.float64).T + 0.5, rtol=1e-12, atol=1e-12)


def test_empty_shapes():
    w = np.ones((3, 4), np.float32)
    assert pagedkv.linear(np.ones((0, 4), np.float32), w).shape == (0, 3)
    assert pagedkv.linear(np.ones((2, 4), np.float32), np.ones((0, 4), np.float32)).shape == (2, 0)
    y = pagedkv.linear(np.ones((2, 0), np.float32), np.ones((3, 0), np.float32), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(y, [[1, 2, 3], [1, 2, 3]])


@pytest.mark.parametrize("args, exc, word", [
    (dict(x=np.ones((2, 5), np.float32)), ValueError, "columns"),
    (dict(x=np.ones((2, 4, 1), np.float32)), ValueError, "2-d"),
    (dict(x=np.ones((2, 4), np.int32)), TypeError, "float"),
    (dict(weight=np.ones((3, 4), np.float16)), TypeError, "float32 or float64"),
    (dict(weight=np.ones((3, 4), np.int64)), TypeError, "float32 or float64"),
    (dict(bias=np.ones(4, np.float32)), ValueError, "bias must have 3"),
    (dict(out=np.zeros((2, 3), np.float64)), TypeError, "dtype"),
    (dict(out=np.zeros((3, 2), np.float32)), ValueError, "shape"),
    (dict(out=np.zeros((2, 6), np.float32)[:, ::2]), ValueError, "C-contiguous"),
    (dict(out=[[0.0] * 3] * 2), TypeError, "numpy array"),
])
def test_bad_arguments(args, exc, word):
    call = dict(x=np.ones((2, 4), np.float32), weight=np.ones((3, 4), np.float32), bias=None,
                out=np.full((2, 3), 7.0, np.float32))
    call.update(args)
    before = call["out"].copy() if isinstance(call["out"], np.ndarray) else None
    with pytest.raises(exc, match=word):
        pagedkv.linear(**call)
    if before is not None:
        np.testing.assert_array_equal(call["out"], before)


def test_out_overlapping_an_input_is_refused():
    x = np.ones((2, 4), np.float32)
    w = np.ones((4, 4), np.float32)
    b = np.ones(4, np.float32)
    for out, name in ((x, "x"), (w[:2], "weight"), (np.ones((4, 4), np.float32), None)):
        if name is None:  # out is fine, the bias lies inside it
            with pytest.raises(ValueError, match="overlap bias"):
                pagedkv.linear(x, w, out[3], out=out[2:])
            continue
        with pytest.raises(ValueError, match=f"overlap {name}"):
            pagedkv.linear(x, w, b, out=out)
    np.testing.assert_array_equal(x, 1.0)
