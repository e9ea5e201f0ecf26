"""16-bit arrays in and out: ``PagedKVCache(dtype="bfloat16" | "float16")``.

The contract: queries, K/V and outputs are 16-bit; the kernels widen the queries exactly, compute
in float32 over the stored K/V and round the output once (nearest, ties to even).  So two claims:

* **Exactness.**  A 16-bit cache's output is, bit for bit, the float32 cache's output over the
  same stored K/V and the same (widened) queries, rounded once to the 16-bit format
  (``reference.ref_round_float``); ``gather`` returns the stored values rounded to the arrays'
  format, exactly.
* **Accuracy.**  Against the float64 reference over the stored values, the error is the
  output's rounding (half a unit in the last place: 2**-8 relative for bfloat16, 2**-11 for
  float16) plus float32's 1e-5.

``dtype="bfloat16"`` arrays are ``ml_dtypes.bfloat16`` (tests skip those cases when the package
is missing; ``raw16=True`` cases, uint16 bit patterns, always run).
"""

import sys
import textwrap

import numpy as np
import pytest

import pagedkv
from reference import (assert_unchanged, query_as_scored, ref_attention, ref_int8, ref_round_float,
                       snapshot, weights_tol)
from test_simd_paths import SUPPORTED, run_script

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
KV_CHOICES = (None, "float32", "bfloat16", "float16", "int8")
# output rounding: half a unit in the last place, relative
OUT_RTOL = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
VARIANTS = [("bfloat16", True), ("float16", True), ("float16", False),
            pytest.param("bfloat16", False, marks=needs_ml_dtypes)]


def to16(x, dtype, raw16):
    """float64 values -> the cache's 16-bit arrays (rounded to nearest even)."""
    bits = _bits(ref_round_float(x, dtype), dtype)
    if raw16:
        return bits
    return bits.view(np.float16) if dtype == "float16" else bits.view(ml_dtypes.bfloat16)


def _bits(x, fmt):
    """float64 values exactly representable in fmt -> their uint16 patterns."""
    f32 = np.asarray(x, dtype=np.float32)
    if fmt == "bfloat16":
        return (f32.view(np.uint32) >> 16).astype(np.uint16)
    return f32.astype(np.float16).view(np.uint16)


def from16(a, dtype):
    """A cache's 16-bit array -> float64."""
    bits = np.ascontiguousarray(a).view(np.uint16)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def stored(x, kv_dtype):
    """What 16-bit values x (float64) read back as from kv_dtype storage (float32 compute)."""
    if kv_dtype in (None, "float32"):
        return x
    if kv_dtype == "int8":
        return ref_int8(x, np.float32).astype(np.float64)
    return ref_round_float(x, kv_dtype)


def _pair(dtype, raw16, kv_dtype, **geom):
    """A 16-bit cache and a float32 cache holding the same stored K/V."""
    kv = kv_dtype or dtype
    c16 = pagedkv.PagedKVCache(dtype=dtype, kv_dtype=kv_dtype, raw16=raw16, **geom)
    c32 = pagedkv.PagedKVCache(dtype="float32", kv_dtype=kv, **geom)
    return c16, c32


# ---------------------------------------------------------------------------
# construction and errors


@pytest.mark.parametrize("dtype,raw16", VARIANTS)
def test_properties(dtype, raw16):
    c = pagedkv.PagedKVCache(4, 16, 2, 40, num_layers=3, dtype=dtype, raw16=raw16)
    assert c.dtype_name == dtype and c.raw16 == raw16 and c.kv_dtype == dtype
    want = np.uint16 if raw16 else (np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    assert c.dtype == np.dtype(want)
    assert c.bytes_per_block == 2 * 3 * 16 * 2 * 40 * 2  # K+V, layers, slots, heads, dims, bytes
    assert f"dtype={dtype}" in repr(c) and ("raw16=True" in repr(c)) == raw16


def test_construction_errors(monkeypatch):
    with pytest.raises(ValueError, match="raw16=True is for dtype 'bfloat16' or 'float16'"):
        pagedkv.PagedKVCache(4, 16, 2, 8, dtype="float32", raw16=True)
    with pytest.raises(TypeError, match="raw16 must be a bool"):
        pagedkv.PagedKVCache(4, 16, 2, 8, dtype="bfloat16", raw16=1)
    with pytest.raises(ValueError, match="kv_dtype='float64' needs dtype='float64'"):
        pagedkv.PagedKVCache(4, 16, 2, 8, dtype="bfloat16", kv_dtype="float64", raw16=True)
    with pytest.raises(TypeError, match="dtype must be 'float32', 'float64', 'bfloat16' or"):
        pagedkv.PagedKVCache(4, 16, 2, 8, dtype="int8")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    with pytest.raises(ImportError, match="raw16=True"):
        pagedkv.PagedKVCache(4, 16, 2, 8, dtype="bfloat16")
    # float16 needs no extra package, and raw16 works without ml_dtypes
    pagedkv.PagedKVCache(4, 16, 2, 8, dtype="float16")
    pagedkv.PagedKVCache(4, 16, 2, 8, dtype="bfloat16", raw16=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_raw16_takes_only_bit_patterns_and_a_failed_call_changes_nothing(rng, dtype):
    c = pagedkv.PagedKVCache(8, 4, 2, 16, dtype=dtype, raw16=True)
    sid = c.add_sequence()
    x = rng.standard_normal((5, 2, 16))
    c.append(sid, to16(x, dtype, True), to16(-x, dtype, True))
    before = snapshot(c, [sid])
    for bad in (x.astype(np.float32), x.astype(np.float16), x.astype(np.int16)):
        with pytest.raises(TypeError, match="uint16 array of .* bit patterns"):
            c.append(sid, bad, bad)
        with pytest.raises(TypeError, match="uint16 array of .* bit patterns"):
            c.attend(sid, bad)
    with pytest.raises(TypeError, match="out must have dtype uint16"):
        c.attend(sid, to16(x[:1], dtype, True), out=np.empty((1, 2, 16), np.float32))
    assert_unchanged(c, before)


def test_float16_cache_converts_other_float_arrays(rng):
    c = pagedkv.PagedKVCache(8, 4, 2, 16, dtype="float16")
    sid = c.add_sequence()
    x = rng.standard_normal((6, 2, 16))
    c.append(sid, x, x.astype(np.float32))  # float64 / float32 in: rounded to float16
    k, v = c.gather(sid)
    assert k.dtype == np.float16 and v.dtype == np.float16
    np.testing.assert_array_equal(k.astype(np.float64), ref_round_float(x, "float16"))
    np.testing.assert_array_equal(v.astype(np.float64), ref_round_float(x, "float16"))
    with pytest.raises(TypeError, match="must be a float array"):
        c.append(sid, x.astype(np.int32), x)


# ---------------------------------------------------------------------------
# storage


@pytest.mark.parametrize("kv_dtype", KV_CHOICES)
@pytest.mark.parametrize("dtype,raw16", VARIANTS)
def test_gather_returns_the_stored_values(rng, dtype, raw16, kv_dtype):
    n, hkv, d = 37, 3, 70
    x = ref_round_float(rng.standard_normal((n, hkv, d)) * 3, dtype)
    c = pagedkv.PagedKVCache(8, 16, hkv, d, dtype=dtype, kv_dtype=kv_dtype, raw16=raw16)
    sid = c.add_sequence()
    c.append(sid, to16(x, dtype, raw16), to16(-x, dtype, raw16))
    k, v = c.gather(sid)
    assert k.dtype == c.dtype and k.shape == (n, hkv, d)
    want = ref_round_float(stored(x, kv_dtype), dtype)  # the stored value, rounded to the arrays
    np.testing.assert_array_equal(from16(k, dtype), want)
    np.testing.assert_array_equal(from16(v, dtype), ref_round_float(stored(-x, kv_dtype), dtype))
    if kv_dtype in (None, dtype):  # same format: the very bits
        np.testing.assert_array_equal(np.ascontiguousarray(k).view(np.uint16),
                                      to16(x, dtype, True))


# ---------------------------------------------------------------------------
# kernels

def _shapes(rng, count):
    for _ in range(count):
        bs = int(rng.choice([1, 3, 8, 16, 17, 32, 64]))
        d = int(rng.choice([8, 13, 40, 64, 80, 128]))
        hkv = int(rng.integers(1, 4))
        group = int(rng.choice([1, 2, 4, 7]))
        length = int(rng.integers(1, 3 * bs + 40))
        yield bs, d, hkv, group, length


def _check_kernels(rng, dtype, raw16, kv_dtype, count):
    for bs, d, hkv, group, length in _shapes(rng, count):
        hq = hkv * group
        nblk = -(-length // bs)
        geom = dict(num_blocks=2 * nblk + 2, block_size=bs, num_kv_heads=hkv, head_dim=d)
        c16, c32 = _pair(dtype, raw16, kv_dtype, **geom)
        k = ref_round_float(rng.standard_normal((length, hkv, d)), dtype)
        v = ref_round_float(rng.standard_normal((length, hkv, d)), dtype)
        n = int(rng.integers(1, min(length, 9) + 1))
        q = ref_round_float(rng.standard_normal((n, hq, d)), dtype)
        sids16 = [c16.add_sequence(), c16.add_sequence()]
        sids32 = [c32.add_sequence(), c32.add_sequence()]
        for s16, s32, sign in zip(sids16, sids32, (1, -1)):
            c16.append(s16, to16(sign * k, dtype, raw16), to16(v, dtype, raw16))
            c32.append(s32, (sign * k).astype(np.float32), v.astype(np.float32))
        what = f"{dtype} raw16={raw16} kv={kv_dtype} bs={bs} d={d} hkv={hkv} G={group} L={length}"
        # causal prefill of the newest n tokens
        o16 = from16(c16.attend(sids16[0], to16(q, dtype, raw16)), dtype)
        o32 = c32.attend(sids32[0], q.astype(np.float32)).astype(np.float64)
        np.testing.assert_array_equal(o16, ref_round_float(o32, dtype), err_msg=what)
        qs, sc = query_as_scored(c16, q, 1 / np.sqrt(d))
        ref = ref_attention(qs, stored(k, kv_dtype), stored(v, kv_dtype), sc, length - n)
        vmax = np.abs(stored(v, kv_dtype)).max()
        np.testing.assert_allclose(o16, ref, rtol=OUT_RTOL[dtype] + 1e-5,
                                   atol=(1e-5 + weights_tol(c16)) * vmax, err_msg=what)
        # batched decode over both sequences, into a given out
        qb = ref_round_float(rng.standard_normal((2, hq, d)), dtype)
        out = np.empty((2, hq, d), dtype=c16.dtype)
        r = c16.attend_batch(sids16, to16(qb, dtype, raw16), out=out)
        assert r is out
        ob32 = c32.attend_batch(sids32, qb.astype(np.float32)).astype(np.float64)
        np.testing.assert_array_equal(from16(out, dtype), ref_round_float(ob32, dtype),
                                      err_msg=what)


@pytest.mark.parametrize("kv_dtype", KV_CHOICES)
@pytest.mark.parametrize("dtype,raw16", VARIANTS)
def test_kernels_round_the_float32_result_once(rng, dtype, raw16, kv_dtype):
    _check_kernels(rng, dtype, raw16, kv_dtype, count=6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rope_and_streaming_with_16_bit_arrays(rng, dtype):
    """RoPE by cache rank and StreamingLLM trimming: the 16-bit cache is the float32 one, rounded."""
    geom = dict(num_blocks=12, block_size=8, num_kv_heads=2, head_dim=32,
                rope=pagedkv.RoPE(10000.0), streaming=pagedkv.StreamingLLM(4, 20))
    c16 = pagedkv.PagedKVCache(dtype=dtype, raw16=True, **geom)
    c32 = pagedkv.PagedKVCache(dtype="float32", kv_dtype=dtype, **geom)
    s16, s32 = c16.add_sequence(), c32.add_sequence()
    for step in range(12):
        n = int(rng.integers(1, 6))
        k = ref_round_float(rng.standard_normal((n, 2, 32)), dtype)
        v = ref_round_float(rng.standard_normal((n, 2, 32)), dtype)
        q = ref_round_float(rng.standard_normal((n, 8, 32)), dtype)
        c16.append(s16, to16(k, dtype, True), to16(v, dtype, True))
        c32.append(s32, k.astype(np.float32), v.astype(np.float32))
        assert c16.seq_len(s16) == c32.seq_len(s32)
        o16 = from16(c16.attend(s16, to16(q, dtype, True)), dtype)
        o32 = c32.attend(s32, q.astype(np.float32)).astype(np.float64)
        np.testing.assert_array_equal(o16, ref_round_float(o32, dtype), err_msg=f"step {step}")


@pytest.mark.parametrize("dtype,raw16", VARIANTS)
def test_save_load_fork_with_16_bit_arrays(rng, tmp_path, dtype, raw16):
    c = pagedkv.PagedKVCache(16, 8, 2, 24, num_layers=2, dtype=dtype, raw16=raw16)
    sid = c.add_sequence()
    for layer in range(2):
        x = rng.standard_normal((19, 2, 24))
        c.append(sid, to16(x, dtype, raw16), to16(x * 2, dtype, raw16), layer=layer)
    child = c.fork(sid)
    np.testing.assert_array_equal(np.asarray(c.gather(child, 1)[1]).view(np.uint16),
                                  np.asarray(c.gather(sid, 1)[1]).view(np.uint16))
    path = tmp_path / "s.pagedkv"
    c.save(sid, path)
    got = c.load(path)
    for layer in range(2):
        for a, b in zip(c.gather(sid, layer), c.gather(got, layer)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                          np.asarray(b).view(np.uint16))
    other = pagedkv.PagedKVCache(16, 8, 2, 24, num_layers=2, dtype="float32", kv_dtype=dtype)
    with pytest.raises(ValueError, match="dtype"):
        other.load(path)
    assert other.num_free_blocks == 16


SCRIPT = textwrap.dedent(
    """
    import os
    import numpy as np
    import pagedkv
    import test_dtype16 as t
    assert pagedkv.simd_backend() == os.environ["PAGEDKV_SIMD"]
    rng = np.random.default_rng(20261124)
    for dtype in ("bfloat16", "float16"):
        for kv in t.KV_CHOICES:
            t._check_kernels(rng, dtype, True, kv, count=3)
    print("DTYPE16-SIMD-OK")
    """
)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_every_simd_path(backend):
    run_script(SCRIPT, "DTYPE16-SIMD-OK", PAGEDKV_SIMD=backend)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_step_with_16_bit_arrays_allocates_nothing(rng, dtype):
    """append_batch + attend_batch(out=) with raw16 arrays, repeated: no Python-level growth."""
    import gc
    import tracemalloc
    batch, hkv, d, hq, bs = 3, 4, 64, 16, 16
    c = pagedkv.PagedKVCache(num_blocks=batch * 30, block_size=bs, num_kv_heads=hkv, head_dim=d,
                             dtype=dtype, raw16=True)
    sids = np.array([c.add_sequence() for _ in range(batch)], dtype=np.int64)
    k = to16(rng.standard_normal((batch, hkv, d)), dtype, True)
    q = to16(rng.standard_normal((batch, hq, d)), dtype, True)
    out = np.empty((batch, hq, d), dtype=np.uint16)
    tracemalloc.start()
    try:
        for _ in range(20):
            c.append_batch(sids, k, k)
            c.attend_batch(sids, q, out=out)
        gc.collect()
        gc.disable()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            c.append_batch(sids, k, k)
            c.attend_batch(sids, q, out=out)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        gc.enable()
        tracemalloc.stop()
    assert all(c.seq_len(int(s)) == 320 for s in sids)
    assert after - before < 1024, after - before
    assert np.isfinite(from16(out, dtype)).all()
