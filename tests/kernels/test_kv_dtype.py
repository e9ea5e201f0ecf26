"""Storage dtypes (``kv_dtype``): conversion on write, conversion on load inside the kernels.

Two separate claims, tested separately:

* **Storage.**  ``gather`` returns exactly what the contract says a stored value reads back as
  (``reference.ref_stored``: round to nearest even for bfloat16/float16, the int8 rule with a
  float32 scale per 32 values), ties, subnormals, overflow and NaN/inf included.
* **Kernels.**  Attention over stored K/V matches the float64 reference computed on those same
  read-back values within the *compute* dtype's tolerance (1e-5 / 1e-12): the in-kernel
  conversion loses nothing beyond the storage rounding.  Against the exact (unrounded) K/V the
  error is the storage's: ``KV_TOL`` (bf16/f16 1e-2, int8 3e-2 of max |out|), with normal keys
  and with keys whose few outlier channels are 20x larger.

Every SIMD path the machine supports runs the kernel claims (in a fresh interpreter each).
"""

import re
import textwrap

import numpy as np
import pytest

import pagedkv
from reference import (KV_DTYPES, KV_TOL, KV_TOL_OUTLIER, assert_attention_close, build_random_cache, math_scale,
                       query_as_scored, random_tokens, ref_attention, ref_attention_options, ref_stored, snapshot,
                       assert_unchanged)
from test_simd_paths import SUPPORTED, run_script
from reference import rope_rotate

# (kv_dtype, dtype) pairs below the compute dtype
PAIRS = [(kv, dt) for dt in ("float32", "float64") for kv in KV_DTYPES] + [("float32", "float64")]
PAIR_IDS = [f"{kv}-in-{dt}" for kv, dt in PAIRS]


def _cache(kv_dtype, dtype="float32", num_blocks=64, block_size=16, hkv=2, d=64, **kw):
    return pagedkv.PagedKVCache(num_blocks, block_size, hkv, d, dtype=dtype, kv_dtype=kv_dtype,
                                **kw)


def _roundtrip(kv_dtype, dtype, x):
    """Append x [n, hkv, d] as K and -x as V; return the gathered (k, v).  Blocks of 16
    tokens: K is written into and read from its transposed rows."""
    n, hkv, d = x.shape
    c = _cache(kv_dtype, dtype, num_blocks=-(-n // 16), block_size=16, hkv=hkv, d=d)
    sid = c.add_sequence()
    c.append(sid, x, -x)
    return c.gather(sid)


# ---------------------------------------------------------------------------
# construction, properties, bytes


@pytest.mark.parametrize("kv_dtype,dtype", PAIRS + [(None, "float32"), ("float64", "float64")])
def test_kv_dtype_property_and_bytes(kv_dtype, dtype):
    bs, hkv, d, layers = 16, 3, 70, 2
    c = _cache(kv_dtype, dtype, num_blocks=5, block_size=bs, hkv=hkv, d=d, num_layers=layers)
    name = kv_dtype or dtype
    assert c.kv_dtype == name and c.dtype == np.dtype(dtype)
    item = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[name]
    plane = hkv * bs * d * item
    if name == "int8":  # values, then float32 scales 4-aligned: ceil(70 / 32) = 3 per head vector
        plane = -(-plane // 4) * 4 + hkv * bs * 3 * 4
    expected = -(-(2 * layers * plane) // 64) * 64
    assert c.bytes_per_block == expected
    s = c.stats()
    assert s.bytes_per_block == expected and s.bytes_total == 5 * expected
    assert (f"kv_dtype={name}" in repr(c)) == (name != dtype)


def test_kv_dtype_errors():
    with pytest.raises(TypeError, match="kv_dtype must be"):
        _cache("int4")
    with pytest.raises(TypeError, match="kv_dtype must be"):
        _cache(np.int16)
    with pytest.raises(ValueError, match="kv_dtype='float64' needs dtype='float64'"):
        _cache("float64", "float32")
    assert _cache(np.float16).kv_dtype == "float16"
    assert _cache(np.dtype("int8")).kv_dtype == "int8"


# ---------------------------------------------------------------------------
# storage: what a value reads back as


def _f32_from_bits(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _special_values(kv_dtype, dtype):
    """Ties, near-ties, subnormals, overflow, signed zeros and a random spread of magnitudes."""
    rng = np.random.default_rng(7)
    mags = np.exp(rng.uniform(-100, 100, 600)) * rng.choice([-1, 1], 600)
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 1e5, -1e5, 3.0e38, 3.3961e38,
            6.1e-5, 5.9604645e-08, 2.9802322e-08, 8.9e-08, 1e-39, 1e-45, -1e-41, 1.1754944e-38]
    if kv_dtype == "bfloat16":  # float32 bit patterns exactly halfway, both parities, and next to it
        base = rng.integers(0x00800000, 0x7f000000, 200, dtype=np.uint32) & np.uint32(0xFFFF0000)
        ties = np.concatenate([base | 0x8000, base | 0x18000, base | 0x7FFF, base | 0x8001])
        vals += list(_f32_from_bits(ties).astype(np.float64))
    if kv_dtype == "float16":
        base = rng.integers(0x38800000, 0x47000000, 200, dtype=np.uint32) & np.uint32(0xFFFFE000)
        ties = np.concatenate([base | 0x1000, base | 0x3000, base | 0x0FFF, base | 0x1001])
        vals += list(_f32_from_bits(ties).astype(np.float64))
    if dtype == "float64" and kv_dtype in ("bfloat16", "float16"):
        # a tie of the 16-bit format nudged by far less than a float32 ulp: rounding through
        # float32 first would land on the tie and round to even, which is wrong here
        bits = 8 if kv_dtype == "bfloat16" else 11
        m = rng.integers(2 ** (bits - 1), 2 ** bits, 200).astype(np.float64)
        tie = np.ldexp(m + 0.5, -bits + 1)
        vals += list(tie + np.ldexp(tie, -40)) + list(tie - np.ldexp(tie, -40)) + list(-tie)
    x = np.concatenate([np.array(vals), mags])
    if dtype == "float32":
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)
    return x


@pytest.mark.parametrize("kv_dtype,dtype", [p for p in PAIRS if p[0] != "int8"],
                         ids=[i for p, i in zip(PAIRS, PAIR_IDS) if p[0] != "int8"])
@pytest.mark.parametrize("d", [8, 130])  # 130: the write converts 64 values at a time, then 2
def test_float_storage_rounds_to_nearest_even(kv_dtype, dtype, d):
    x = _special_values(kv_dtype, dtype)
    x = np.concatenate([x, [np.inf, -np.inf, np.nan]]).astype(dtype)
    x = np.concatenate([x, np.zeros((-len(x)) % d, dtype=dtype)]).reshape(-1, 1, d)
    k, v = _roundtrip(kv_dtype, dtype, x)
    assert k.dtype == np.dtype(dtype) and v.dtype == np.dtype(dtype)
    expected = ref_stored(x, kv_dtype, dtype)
    np.testing.assert_array_equal(k, expected)
    np.testing.assert_array_equal(v, ref_stored(-x, kv_dtype, dtype))
    # signs of zeros survive
    assert np.array_equal(np.signbit(k[~np.isnan(k)]), np.signbit(expected[~np.isnan(expected)]))
    if kv_dtype == "float16":  # the reference agrees with numpy's own (correctly rounded) cast
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(expected, x.astype(np.float16).astype(dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("d", [1, 31, 32, 37, 70, 128])
def test_int8_storage_matches_the_quantization_rule(d, dtype):
    rng = np.random.default_rng(d)
    n, hkv = 40, 2
    x = rng.standard_normal((n, hkv, d)) * np.exp(rng.uniform(-30, 30, (n, hkv, 1)))
    x[0] = 0.0                                   # all-zero vectors: scale 0
    x[1, 0, :] = 1e-40 * rng.standard_normal(d)  # tiny (the scale is subnormal in float32)
    x[2, 1, ::3] *= 20.0                         # outlier channels
    x[3] = np.round(x[3] * 4) / 4                # exact halves after scaling are possible
    x = x.astype(dtype)
    k, v = _roundtrip("int8", dtype, x)
    np.testing.assert_array_equal(k, ref_stored(x, "int8", dtype))
    np.testing.assert_array_equal(v, ref_stored(-x, "int8", dtype))
    # the rule's own promise: error at most half a step of the group's scale
    for g0 in range(0, d, 32):
        g = x[..., g0:g0 + 32].astype(np.float64)
        step = np.abs(g).max(axis=-1, keepdims=True) / 127.0
        assert np.all(np.abs(k[..., g0:g0 + 32] - g) <= 0.5 * step * (1 + 1e-6) + 1e-300)


@pytest.mark.parametrize("kv_dtype,dtype", PAIRS, ids=PAIR_IDS)
def test_nan_and_inf_stay_in_their_own_token(kv_dtype, dtype):
    """A token with NaN/inf in some channels changes no other token (int8: no other group of its
    own head vector either), and attention of other sequences is unaffected."""
    rng = np.random.default_rng(3)
    hkv, d, n = 2, 70, 9
    x = rng.standard_normal((n, hkv, d)).astype(dtype)
    bad = x.copy()
    bad[4, 0, 3] = np.nan
    bad[4, 1, 40] = np.inf
    bad[5, 0, 65] = -np.inf
    c = _cache(kv_dtype, dtype, num_blocks=8, block_size=4, hkv=hkv, d=d)
    s_bad, s_ok = c.add_sequence(), c.add_sequence()
    c.append(s_bad, bad, bad)
    c.append(s_ok, x, x)
    k, v = c.gather(s_bad)
    ok = np.ones((n, hkv), dtype=bool)
    ok[4, :] = ok[5, 0] = False
    expected = ref_stored(x, kv_dtype, dtype)
    np.testing.assert_array_equal(k[ok], expected[ok])
    np.testing.assert_array_equal(v[ok], expected[ok])
    if kv_dtype == "int8":  # the other groups of the poisoned head vectors are intact
        np.testing.assert_array_equal(k[4, 0, 32:], expected[4, 0, 32:])
        np.testing.assert_array_equal(k[4, 1, :32], expected[4, 1, :32])
        np.testing.assert_array_equal(k[4, 1, 64:], expected[4, 1, 64:])
        assert np.isnan(k[4, 0, :32]).all() and np.isnan(k[4, 1, 32:64]).all()
    else:
        assert np.isnan(k[4, 0, 3]) and k[4, 1, 40] == np.inf and k[5, 0, 65] == -np.inf
    q = rng.standard_normal((1, 2 * hkv, d)).astype(dtype)
    kg, vg = c.gather(s_ok)
    np.testing.assert_array_equal(kg, expected)
    out = c.attend(s_ok, q)
    assert_attention_close(out, ref_attention(q, kg, vg, math_scale(d), n - 1), dtype, vg, cache=c)


# ---------------------------------------------------------------------------
# kernels: exact in-kernel conversion, then the storage's accuracy


KERNEL_CASES = [  # block_size, head_dim, num_kv_heads, ratio, lengths
    (16, 128, 2, 4, [300, 37, 129]),
    (1, 5, 2, 1, [9, 1]),
    (3, 37, 1, 3, [40, 7]),
    (64, 70, 2, 2, [200, 65]),
    (7, 32, 4, 8, [50]),
]


def _check_kernels(rng, kv_dtype, dtype, case):
    """Decode (batch and single) and prefill against the reference on the read-back K/V."""
    bs, d, hkv, ratio, lengths = case
    cache, sids, models = build_random_cache(
        rng, lengths=lengths, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        max_chunk=64, kv_dtype=kv_dtype)
    hq = hkv * ratio
    q = random_tokens(rng, len(sids), hq, d, dtype)
    out = cache.attend_batch(sids, q)
    for b, sid in enumerate(sids):
        m = models[sid]
        kg, vg = cache.gather(sid)
        np.testing.assert_array_equal(kg, ref_stored(m.k[0], kv_dtype, dtype))
        np.testing.assert_array_equal(vg, ref_stored(m.v[0], kv_dtype, dtype))
        qs, sc = query_as_scored(cache, q[b:b + 1], math_scale(d))
        exp = ref_attention(qs, kg, vg, sc, len(m) - 1)
        assert_attention_close(out[b:b + 1], exp, dtype, vg, cache=cache)
        n = min(len(m), 40)
        qp = random_tokens(rng, n, hq, d, dtype)
        qs, sc = query_as_scored(cache, qp, math_scale(d))
        exp = ref_attention(qs, kg, vg, sc, len(m) - n)
        assert_attention_close(cache.attend(sid, qp), exp, dtype, vg, cache=cache)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-h{c[2]}x{c[3]}")
@pytest.mark.parametrize("kv_dtype,dtype", PAIRS, ids=PAIR_IDS)
def test_kernels_convert_exactly(rng, kv_dtype, dtype, case):
    _check_kernels(rng, kv_dtype, dtype, case)


def _keys(rng, length, hkv, d, outliers):
    k = rng.standard_normal((length, hkv, d))
    if outliers:  # a few channels 20x larger, as real models' keys have
        k[..., rng.choice(d, 4, replace=False)] *= 20.0
    return k


@pytest.mark.parametrize("outliers", [False, True], ids=["normal", "outlier-keys"])
@pytest.mark.parametrize("kv_dtype,dtype", PAIRS, ids=PAIR_IDS)
def test_accuracy_against_the_exact_reference(rng, kv_dtype, dtype, outliers):
    """max |out - exact| / max |exact| within the storage's bound (decode and prefill rows), and
    no worse than the same attention computed in float64 on the stored values (with the query as
    the kernels score it: rounded, where the cache quantizes queries)."""
    bs, hkv, ratio, d, length = 16, 2, 4, 128, 500
    c = _cache(kv_dtype, dtype, num_blocks=40, block_size=bs, hkv=hkv, d=d)
    sid = c.add_sequence()
    k = _keys(rng, length, hkv, d, outliers)
    v = rng.standard_normal((length, hkv, d))
    c.append(sid, k.astype(dtype), v.astype(dtype))
    q = rng.standard_normal((32, hkv * ratio, d))
    out = c.attend(sid, q.astype(dtype))
    exact = ref_attention(q, k.astype(dtype), v.astype(dtype), math_scale(d), length - 32)
    err = np.abs(out - exact).max() / np.abs(exact).max()
    assert err <= (KV_TOL_OUTLIER if outliers else KV_TOL)[kv_dtype], err
    assert err > 0  # the storage really rounds (or the test would not be testing it)
    kg, vg = c.gather(sid)
    qs, sc = query_as_scored(c, q.astype(dtype), math_scale(d))
    storage_only = ref_attention(qs, kg, vg, sc, length - 32)
    floor = np.abs(storage_only - exact).max() / np.abs(exact).max()
    assert err <= floor + 10 * KV_TOL[dtype], (err, floor)


# the SIMD paths that score int8 keys in float32 with an integer dot product, and their key
# vectors' width (include/pagedkv/attention.h: pkv_simd_int8_dot, pkv_dot_scores_apply)
INT8_DOT_LANES = {"avxvnni": 8, "avx512vnni": 16, "avx512amx": 16, "avx512bf16": 16, "neondot": 4}

QUANTIZE_CASES = [  # kv_dtype, dtype, block_size, rope: int8 keys on an integer dot product or not
    ("int8", "float32", 16, False), ("int8", "float32", 64, False), ("int8", "float32", 8, False),
    ("int8", "float32", 5, False), ("int8", "float32", 16, True), ("int8", "float64", 16, False), ("bfloat16", "float32", 16, False),
]


@pytest.mark.parametrize("kv_dtype,dtype,bs,rope", QUANTIZE_CASES)
def test_quantizes_queries_says_what_the_kernels_do(rng, kv_dtype, dtype, bs, rope):
    """cache.quantizes_queries is True exactly on the integer dot paths for int8 keys in float32
    (blocks of at least one vector of keys: 16 on avx512vnni, 8 on avxvnni, 4 on neondot; no
    RoPE); then the output matches the reference with the rounded query
    and not the one with the query as given (the difference is far beyond the tolerance, so the
    check can tell), otherwise the reverse."""
    lanes = INT8_DOT_LANES.get(pagedkv.simd_backend())
    want = (lanes is not None and kv_dtype == "int8" and dtype == "float32" and bs >= lanes
            and not rope)
    _check_query_rounding(rng, kv_dtype, dtype, bs, rope, "quantizes_queries", want)


def _check_query_rounding(rng, kv_dtype, dtype, bs, rope, prop, want):
    """cache.<prop> is `want`; then prefill and decode match the reference with the query as
    the cache scores it (query_as_scored), and where `want`, not the one with the query as
    given (the difference is far beyond the tolerance, so the check can tell)."""
    c = _cache(kv_dtype, dtype, num_blocks=300 // bs + 2, block_size=bs, hkv=2, d=96,
               rope=pagedkv.RoPE(10000.0) if rope else None)
    assert getattr(c, prop) is want
    if rope:
        return  # the reference would need the rotation; the claim above is what this case checks
    sid = c.add_sequence()
    c.append(sid, random_tokens(rng, 300, 2, 96, dtype), random_tokens(rng, 300, 2, 96, dtype))
    kg, vg = c.gather(sid)
    q = random_tokens(rng, 5, 8, 96, dtype)
    qs, sc = query_as_scored(c, q, math_scale(96))
    rounded = ref_attention(qs, kg, vg, sc, 295)
    plain = ref_attention(q, kg, vg, math_scale(96), 295)
    for out, n in ((c.attend(sid, q), 5), (c.attend_batch([sid], q[-1:]), 1)):  # prefill, decode
        assert_attention_close(out, rounded[-n:], dtype, vg, cache=c)
        if want:
            with pytest.raises(AssertionError):
                assert_attention_close(out, plain[-n:], dtype, vg)


def _rounds_weights_cpu():
    """Whether this CPU takes int8 values' P.V on int16 weights where the AVX-512 + VNNI int8
    kernels run (pkv_pv_int16, prefetch.h): an Intel CPU, or an AMD one of family 0x19
    (Zen 3 / Zen 4), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return False
    return "GenuineIntel" in info or (
        "AuthenticAMD" in info and re.search(r"^cpu family\s*:\s*25$", info, re.M) is not None)


WEIGHTS_CASES = [  # kv_dtype, dtype, block_size, ratio: int8 values' P.V on int16 weights or not
    ("int8", "float32", 16, 4), ("int8", "float32", 5, 2), ("int8", "float32", 64, 8),
    ("int8", "float64", 16, 4), ("bfloat16", "float32", 16, 4),
]


@pytest.mark.parametrize("kv_dtype,dtype,bs,ratio", WEIGHTS_CASES)
def test_quantizes_weights_says_what_the_kernels_do(rng, kv_dtype, dtype, bs, ratio):
    """cache.quantizes_weights is True exactly for int8 storage in float32 on the AVX-512 + VNNI
    paths of an Intel or AMD family 0x19 CPU; then decode and prefill stay within the bound of the
    weights' rounding (reference.weights_tol: (keys of a tile) / 65534 of max |v|) of the
    reference with the query as scored, and, the roundings being independent, within 1e-4 of
    max |v| here (they move a row by some 5e-6 of it, beyond the float path's 5e-8, so the check
    can tell); otherwise within float32's tolerance."""
    want = (kv_dtype == "int8" and dtype == "float32" and _rounds_weights_cpu()
            and pagedkv.simd_backend() in ("avx512vnni", "avx512bf16", "avx512amx"))
    d, length = 128, 700
    c = _cache(kv_dtype, dtype, num_blocks=length // bs + 2, block_size=bs, hkv=2, d=d)
    assert c.quantizes_weights is want
    sid = c.add_sequence()
    c.append(sid, random_tokens(rng, length, 2, d, dtype), random_tokens(rng, length, 2, d, dtype))
    kg, vg = c.gather(sid)
    vmax = np.abs(vg).max()
    q = random_tokens(rng, 6, 2 * ratio, d, dtype)
    qs, sc = query_as_scored(c, q, math_scale(d))
    ref = ref_attention(qs, kg, vg, sc, length - 6)
    for out, n in ((c.attend(sid, q), 6), (c.attend_batch([sid], q[-1:]), 1)):  # prefill, decode
        assert_attention_close(out, ref[-n:], dtype, vg, cache=c)
        if want:  # rounded (the float path is within some 5e-8 of max |v| here), but not far
            assert 1e-6 * vmax < np.abs(out - ref[-n:]).max() <= 1e-4 * vmax


BF16_ROUND_CASES = [  # kv_dtype, dtype, block_size, rope: bfloat16 keys scored with vdpbf16ps or not
    ("bfloat16", "float32", 16, False), ("bfloat16", "float32", 64, False),
    ("bfloat16", "float32", 8, False), ("bfloat16", "float32", 16, True),
    ("bfloat16", "float64", 16, False), ("float16", "float32", 16, False),
    ("int8", "float32", 16, False),
]


@pytest.mark.parametrize("kv_dtype,dtype,bs,rope", BF16_ROUND_CASES)
def test_rounds_queries_bf16_says_what_the_kernels_do(rng, kv_dtype, dtype, bs, rope):
    """cache.rounds_queries_bf16 is True exactly on the avx512bf16 path for bfloat16 keys in
    float32 (blocks of at least 16 keys, no RoPE); then the output matches the reference with
    the query rounded to bfloat16 and not the one with the query as given (the difference is far
    beyond float32's tolerance, so the check can tell), otherwise the reverse."""
    want = (pagedkv.simd_backend() == "avx512bf16" and kv_dtype == "bfloat16" and dtype == "float32"
            and bs >= 16 and not rope)
    _check_query_rounding(rng, kv_dtype, dtype, bs, rope, "rounds_queries_bf16", want)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_nan_or_inf_in_a_query_head_stays_in_its_head(kv_dtype):
    """A NaN or infinity in one query head changes no other head's output, also where the query
    is rounded to int8.  A NaN makes every score of its head NaN, and then the head's output is
    NaN on every path; so does an infinity, whose scores are +inf and -inf over keys of either
    sign there (NaN scores where the query is rounded: its group's scale is NaN)."""
    rng = np.random.default_rng(4)
    c = _cache(kv_dtype, num_blocks=8, block_size=16, hkv=2, d=64)
    sid = c.add_sequence()
    c.append(sid, random_tokens(rng, 40, 2, 64, "float32"), random_tokens(rng, 40, 2, 64, "float32"))
    for bad in (np.nan, np.inf, -np.inf):
        q = random_tokens(rng, 1, 8, 64, "float32")
        clean = [c.attend_batch([sid], q), c.attend(sid, q)]
        q[0, 3, 37] = bad
        for out, want in zip((c.attend_batch([sid], q), c.attend(sid, q)), clean):
            np.testing.assert_array_equal(np.delete(out[0], 3, axis=0), np.delete(want[0], 3, axis=0))
            assert np.isnan(out[0, 3]).all()


def _check_bad_key(rng, kv_dtype, dtype, bs, bad, t):
    """A NaN or an infinity in dimension 3 of key t of kv head 0 (length 100, D 64, GQA 4):
    decode of the newest token and a causal prefill of the last 8 (t among them or not) against
    the reference on the stored K/V.  NaN where the reference has NaN and nowhere else: a NaN
    score (a NaN key value; an infinite one in int8, whose group it poisons) or a +inf one makes
    every row that sees it NaN, whatever the key's column in its tile; rows that do not see it
    (the other kv head's, prefill rows before it) keep their values.  The same with a softcap
    and a window (through which a NaN stays NaN and an infinity becomes the cap)."""
    length, hkv, d = 100, 2, 64
    c = _cache(kv_dtype, dtype, num_blocks=length // bs + 2, block_size=bs, hkv=hkv, d=d)
    sid = c.add_sequence()
    k = random_tokens(rng, length, hkv, d, dtype)
    k[t, 0, 3] = bad
    c.append(sid, k, random_tokens(rng, length, hkv, d, dtype))
    kg, vg = c.gather(sid)
    q = random_tokens(rng, 8, 4 * hkv, d, dtype)
    q[:, :4, 3] *= np.sign(q[:, :4, 3]) * rng.choice([-1.0, 1.0], (8, 1))  # +inf and -inf scores
    for out, n in ((c.attend_batch([sid], q[-1:]), 1), (c.attend(sid, q), 8)):
        qs, scale = query_as_scored(c, q[-n:], math_scale(d))
        with np.errstate(invalid="ignore"):
            want = ref_attention(qs, kg, vg, scale, length - n)
        assert_attention_close(out, want, dtype, np.nan_to_num(vg), cache=c,
                               err_msg=f"{kv_dtype} in {dtype}, bs {bs}, key {t} = {bad}, n {n}")
        if np.isnan(bad):  # the case holds what it is about: NaN rows, and rows it leaves alone
            assert np.isnan(want[-1, :4]).all() and not np.isnan(out[:, 4:]).any()
    # the softcap (a NaN stays NaN through it, an infinity becomes the cap) with a window
    qs, scale = query_as_scored(c, q, math_scale(d))
    with np.errstate(invalid="ignore"):
        want = ref_attention_options(qs, kg, vg, scale, length - 8, window=30, softcap=5.0)
    assert_attention_close(c.attend(sid, q, window=30, softcap=5.0), want, dtype, np.nan_to_num(vg),
                           cache=c, err_msg=f"{kv_dtype} in {dtype}, bs {bs}, key {t} = {bad}, softcap")


def _check_bad_keys(rng):
    for kv_dtype, dtype in PAIRS:
        for bs in (15, 16, 64):
            for bad in (np.nan, np.inf):
                for t in (0, 17, 47, 63, 64, 95, 99):
                    _check_bad_key(rng, kv_dtype, dtype, bs, bad, t)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_a_nan_key_makes_every_row_that_sees_it_nan(backend):
    run_script(textwrap.dedent(
        """
        import os
        import numpy as np
        import pagedkv
        from test_kv_dtype import _check_bad_keys

        assert pagedkv.simd_backend() == os.environ["PAGEDKV_SIMD"]
        _check_bad_keys(np.random.default_rng(20261129))
        print("BAD-KEYS-OK")
        """), "BAD-KEYS-OK", PAGEDKV_SIMD=backend)


@pytest.mark.parametrize("bs,d,length", [(16, 128, 300), (5, 70, 97), (64, 33, 130), (300, 64, 700)])
def test_int8_values_where_every_weight_is_equal(bs, d, length):
    """Zero keys make every weight of a row equal, so attention is the mean of the stored values
    (value rows whose every scale group holds a +-127, so all share one scale): float32 accuracy
    on every path, decode and prefill, tiles of 64 keys, blocks narrower than a vector and blocks
    of more than 256 keys."""
    rng = np.random.default_rng(bs)
    c = _cache("int8", "float32", num_blocks=length // bs + 2, block_size=bs, hkv=2, d=d)
    sid = c.add_sequence()
    v = rng.integers(-126, 127, (length, 2, d)).astype(np.float32)
    v[:, :, ::32] = 127.0 * rng.choice([-1.0, 1.0], v[:, :, ::32].shape)  # each group's max
    v *= np.float32(0.01)
    c.append(sid, np.zeros((length, 2, d), np.float32), v)
    kg, vg = c.gather(sid)
    np.testing.assert_array_equal(vg, v)  # stored exactly
    q = random_tokens(rng, 6, 8, d, "float32")
    for out, n in ((c.attend(sid, q), 6), (c.attend_batch([sid], q[-1:]), 1)):
        assert_attention_close(out, ref_attention(q[-n:], kg, vg, math_scale(d), length - n),
                               "float32", vg, cache=c)


# ---------------------------------------------------------------------------
# every feature with every kv_dtype


@pytest.mark.parametrize("kv_dtype,dtype", PAIRS, ids=PAIR_IDS)
def test_rope_streaming_layers_with_kv_dtype(rng, kv_dtype, dtype):
    """StreamingLLM + in-kernel RoPE + 2 layers: the kept tokens read back as the rule says, and
    attention equals the reference on them (rotated by rank)."""
    bs, hkv, d, hq, layers = 4, 2, 40, 4, 2
    rope = pagedkv.RoPE(theta=10000.0, rotary_dim=32)
    c = _cache(kv_dtype, dtype, num_blocks=12, block_size=bs, hkv=hkv, d=d, num_layers=layers,
               streaming=pagedkv.StreamingLLM(sink_tokens=3, window_tokens=9), rope=rope)
    sid = c.add_sequence()
    ks = [[] for _ in range(layers)]
    vs = [[] for _ in range(layers)]
    for step in range(14):
        n = int(rng.integers(1, 4))
        for layer in range(layers):
            k = random_tokens(rng, n, hkv, d, dtype)
            v = random_tokens(rng, n, hkv, d, dtype)
            c.append(sid, k, v, layer=layer)
            ks[layer].append(k)
            vs[layer].append(v)
            kept = c.kept_positions(sid)
            held = len(kept)
            kg, vg = c.gather(sid, layer=layer)
            np.testing.assert_array_equal(
                kg, ref_stored(np.concatenate(ks[layer])[kept], kv_dtype, dtype))
            np.testing.assert_array_equal(
                vg, ref_stored(np.concatenate(vs[layer])[kept], kv_dtype, dtype))
            q = random_tokens(rng, n, hq, d, dtype)
            out = c.attend(sid, q, layer=layer)
            kr = rope_rotate(kg, np.arange(held), 10000.0, 32)
            qr = rope_rotate(q, np.arange(held - n, held), 10000.0, 32)
            assert_attention_close(out, ref_attention(qr, kr, vg, math_scale(d), held - n),
                                   dtype, vg, cache=c)


@pytest.mark.parametrize("kv_dtype,dtype", PAIRS, ids=PAIR_IDS)
def test_fork_cow_and_truncate_with_kv_dtype(rng, kv_dtype, dtype):
    bs, hkv, d = 8, 2, 48
    c = _cache(kv_dtype, dtype, num_blocks=20, block_size=bs, hkv=hkv, d=d)
    parent = c.add_sequence()
    base = random_tokens(rng, 21, hkv, d, dtype)
    c.append(parent, base, 2 * base)
    child = c.fork(parent)
    extra_p = random_tokens(rng, 5, hkv, d, dtype)
    extra_c = random_tokens(rng, 6, hkv, d, dtype)
    c.append(parent, extra_p, extra_p)
    c.append(child, extra_c, extra_c)
    assert c.stats().cow_copies >= 1
    for sid, extra in ((parent, extra_p), (child, extra_c)):
        k, v = c.gather(sid)
        np.testing.assert_array_equal(k, ref_stored(np.concatenate([base, extra]), kv_dtype, dtype))
        np.testing.assert_array_equal(
            v, ref_stored(np.concatenate([2 * base, extra]), kv_dtype, dtype))
    c.truncate(child, 10)
    again = random_tokens(rng, 3, hkv, d, dtype)
    c.append(child, again, again)
    k, v = c.gather(child)
    np.testing.assert_array_equal(k, ref_stored(np.concatenate([base[:10], again]), kv_dtype, dtype))
    q = random_tokens(rng, 2, 2 * hkv, d, dtype)
    qs, sc = query_as_scored(c, q, math_scale(d))
    assert_attention_close(c.attend(child, q), ref_attention(qs, k, v, sc, 11), dtype, v, cache=c)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_save_load_and_atomic_errors_with_kv_dtype(rng, tmp_path, kv_dtype):
    c = _cache(kv_dtype, num_blocks=10, block_size=4, hkv=2, d=40)
    sid = c.add_sequence()
    c.append(sid, random_tokens(rng, 13, 2, 40, "float32"), random_tokens(rng, 13, 2, 40, "float32"))
    before = snapshot(c, [sid])
    with pytest.raises(ValueError, match="shape"):
        c.append(sid, np.zeros((2, 2, 41), np.float32), np.zeros((2, 2, 41), np.float32))
    assert_unchanged(c, before)
    path = tmp_path / "seq.pkv"
    c.save(sid, path)
    c2 = _cache(kv_dtype, num_blocks=10, block_size=4, hkv=2, d=40)
    sid2 = c2.load(path)
    for a, b in zip(c.gather(sid), c2.gather(sid2)):
        np.testing.assert_array_equal(a, b)
    other = "float16" if kv_dtype != "float16" else "bfloat16"
    with pytest.raises(ValueError, match="kv_dtype"):
        _cache(other, num_blocks=10, block_size=4, hkv=2, d=40).load(path)


# ---------------------------------------------------------------------------
# every SIMD path


SCRIPT = textwrap.dedent(
    """
    import os
    import numpy as np
    import pagedkv
    from test_kv_dtype import KERNEL_CASES, PAIRS, _check_kernels

    wanted = os.environ.get("PAGEDKV_SIMD")
    assert pagedkv.simd_backend() == wanted, (pagedkv.simd_backend(), wanted)
    rng = np.random.default_rng(20261123)
    for kv_dtype, dtype in PAIRS:
        for case in KERNEL_CASES:
            _check_kernels(rng, kv_dtype, dtype, case)
    print("KV-SIMD-OK")
    """
)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_every_simd_path_converts_exactly(backend):
    run_script(SCRIPT, "KV-SIMD-OK", PAGEDKV_SIMD=backend)
