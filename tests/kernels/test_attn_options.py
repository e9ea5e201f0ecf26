"""Kernel options: sliding window, logit softcapping, learned attention sinks.

Every option on every kernel path (batched decode, single-query decode, causal prefill, split-K
decode), every storage dtype and every SIMD path the machine runs, against the float64 reference
``reference.ref_attention_options`` computed on the stored (gathered) K/V, within the compute
dtype's tolerance.  Random shapes: block sizes 1..64, odd and even head_dim, GQA ratios, lengths
ending mid-block.  Also: the window with StreamingLLM rank positions and in-kernel RoPE, blocks
before the window never read, and bad option values raising with the cache unchanged.
"""

import os
import textwrap

import numpy as np
import pytest

import pagedkv
from reference import (assert_attention_close, assert_unchanged, build_random_cache, math_scale,
                       mid_block_length, query_as_scored, random_tokens, ref_attention_options,
                       snapshot)
from test_simd_paths import SUPPORTED, run_script
from reference import rope_rotate

BLOCK_SIZES = (1, 2, 3, 5, 8, 16, 17, 32, 64)
HEAD_DIMS = (3, 16, 33, 64, 80, 96, 128, 256)
KV_FOR = {"float32": (None, "bfloat16", "float16", "int8"),
          "float64": (None, "float32", "bfloat16", "float16", "int8")}


def _options(rng, hq, max_len, bs):
    window = [None, 1, 2, bs, int(rng.integers(1, max_len + 8))][int(rng.integers(5))]
    softcap = None if rng.random() < 0.4 else float(rng.choice([0.3, 2.0, 30.0, 50.0]))
    sinks = None
    if rng.random() < 0.5:
        sinks = (rng.standard_normal(hq) * 3).astype(rng.choice([np.float32, np.float64]))
    if window is None and softcap is None and sinks is None:
        window = int(rng.integers(1, max_len + 1))
    return window, softcap, sinks


def _case_text(**kw):
    return " ".join(f"{k}={v!r}" for k, v in kw.items() if k != "sinks") + (
        "" if kw.get("sinks") is None else " sinks=on")


def check_options(seed, cases):
    """`cases` random configurations; every option against the reference on every path."""
    rng = np.random.default_rng(seed)
    for _ in range(cases):
        dtype = str(rng.choice(["float32", "float64"]))
        kv = KV_FOR[dtype][int(rng.integers(len(KV_FOR[dtype])))]
        bs = int(rng.choice(BLOCK_SIZES))
        d = int(rng.choice(HEAD_DIMS))
        hkv = int(rng.integers(1, 4))
        hq = hkv * int(rng.choice([1, 2, 4, 5]))
        lengths = [mid_block_length(rng, bs, max(2, 300 // bs)) for _ in range(int(rng.integers(1, 4)))]
        cache, sids, _ = build_random_cache(rng, lengths=lengths, block_size=bs, num_kv_heads=hkv,
                                            head_dim=d, dtype=dtype, kv_dtype=kv, max_chunk=97)
        window, softcap, sinks = _options(rng, hq, max(lengths), bs)
        scale = math_scale(d) if rng.random() < 0.6 else 1.0
        opts = dict(window=window, softcap=softcap, sinks=sinks)
        text = _case_text(dtype=dtype, kv=kv, bs=bs, d=d, hkv=hkv, hq=hq, lengths=lengths,
                          scale=scale, **opts)
        stored = {sid: cache.gather(sid) for sid in sids}
        q = random_tokens(rng, len(sids), hq, d, dtype)
        out = cache.attend_batch(sids, q, scale=scale, **opts)
        for b, sid in enumerate(sids):
            k, v = stored[sid]
            qs, sc = query_as_scored(cache, q[b:b + 1], scale)
            exp = ref_attention_options(qs, k, v, sc, len(k) - 1, **opts)
            assert_attention_close(out[b:b + 1], exp, dtype, v, err_msg="decode " + text, cache=cache)
        for sid in sids:
            k, v = stored[sid]
            for n in {1, int(rng.integers(1, min(len(k), 80) + 1))}:
                qp = random_tokens(rng, n, hq, d, dtype)
                outp = cache.attend(sid, qp, scale=scale, **opts)
                qs, sc = query_as_scored(cache, qp, scale)
                exp = ref_attention_options(qs, k, v, sc, len(k) - n, **opts)
                assert_attention_close(outp, exp, dtype, v, err_msg=f"prefill n={n} " + text,
                                       cache=cache)


def check_split_decode(seed):
    """Long sequences on 2 threads: decode splits the window's keys over threads (split-K)."""
    rng = np.random.default_rng(seed)
    old = pagedkv.get_num_threads()
    pagedkv.set_num_threads(2)
    splits = 0
    try:
        # enough work per call for 2 threads (PKV_PARALLEL_MIN multiply-adds)
        for dtype, kv, bs, window in (("float32", None, 16, 1100), ("float32", "bfloat16", 5, 1300),
                                      ("float64", "int8", 64, 1200), ("float32", "float16", 32, None)):
            cache, sids, _ = build_random_cache(rng, lengths=[2600 + bs // 2, 2100 + 1], block_size=bs,
                                                num_kv_heads=1, head_dim=128, dtype=dtype,
                                                kv_dtype=kv, max_chunk=600)
            sinks = rng.standard_normal(8)
            for opts in (dict(window=window), dict(window=window, softcap=20.0, sinks=sinks)):
                for sid in sids:  # one sequence: too few items for the threads, so keys split
                    k, v = cache.gather(sid)
                    q = random_tokens(rng, 1, 8, 128, dtype)
                    out = cache.attend_batch([sid], q, **opts)
                    splits += cache.last_attention_plan[2] > 1
                    qs, sc = query_as_scored(cache, q, math_scale(128))
                    exp = ref_attention_options(qs, k, v, sc, len(k) - 1, **opts)
                    assert_attention_close(out, exp, dtype, v, err_msg=f"split {dtype} {kv} {opts}",
                                           cache=cache)
    finally:
        pagedkv.set_num_threads(old)
    return splits


def test_options_match_reference():
    check_options(19, 60)


def test_split_decode_with_options():
    splits = check_split_decode(7)
    # under OMP_WAIT_POLICY=passive calls this small run on one thread (attn_args.h:
    # PKV_PASSIVE_PARALLEL_MIN_BYTES; tests/core/test_threads.py)
    if pagedkv.has_openmp() and os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive":
        assert splits > 0  # the split-K path really ran


def test_window_and_sinks_with_streaming_llm_rope():
    """StreamingLLM keeps sinks + a recent window; RoPE positions are ranks in the cache, and the
    sliding window counts ranks too."""
    rng = np.random.default_rng(3)
    hkv, hq, d, bs = 2, 4, 32, 8
    cache = pagedkv.PagedKVCache(64, bs, hkv, d, streaming=pagedkv.StreamingLLM(4, 40),
                                 rope=pagedkv.RoPE(theta=10000.0))
    sid = cache.add_sequence()
    sinks = rng.standard_normal(hq)
    for step in range(60):
        n = int(rng.integers(1, 12))
        cache.append(sid, random_tokens(rng, n, hkv, d, "float32"),
                     random_tokens(rng, n, hkv, d, "float32"))
        k, v = cache.gather(sid)
        held = len(k)
        kr = rope_rotate(k, np.arange(held))
        for window in (1, 9, 30, 1000):
            q = random_tokens(rng, n, hq, d, "float32")
            qr = rope_rotate(q, np.arange(held - n, held))
            out = cache.attend(sid, q, window=window, sinks=sinks)
            exp = ref_attention_options(qr, kr, v, math_scale(d), held - n, window=window,
                                        sinks=sinks)
            assert_attention_close(out, exp, "float32", v, err_msg=f"step {step} window {window}",
                                   cache=cache)
            out1 = cache.attend_batch([sid], q[-1:], window=window, softcap=5.0)
            exp1 = ref_attention_options(qr[-1:], kr, v, math_scale(d), held - 1, window=window,
                                         softcap=5.0)
            assert_attention_close(out1, exp1, "float32", v, cache=cache)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
def test_blocks_before_the_window_are_not_read(kv_dtype):
    """NaN in every token before the first query's window: a kernel that read those blocks
    (even to mask them) would put NaN in the output (0 * NaN)."""
    rng = np.random.default_rng(5)
    bs, hkv, hq, d, total = 16, 2, 4, 64, 3000
    cache = pagedkv.PagedKVCache(total // bs + 2, bs, hkv, d, kv_dtype=kv_dtype)
    sid = cache.add_sequence()
    k = random_tokens(rng, total, hkv, d, "float32")
    v = random_tokens(rng, total, hkv, d, "float32")
    window, n = 500, 37
    first_lo = total - n - window + 1  # the window of the first of the n queries starts here
    k[:first_lo] = np.nan
    v[:first_lo] = np.nan
    cache.append(sid, k, v)
    ks, vs = cache.gather(sid)
    q = random_tokens(rng, n, hq, d, "float32")
    out = cache.attend(sid, q, window=window)
    assert np.isfinite(out).all()
    kf, vf = np.nan_to_num(ks), np.nan_to_num(vs)
    qs, sc = query_as_scored(cache, q, math_scale(d))
    exp = ref_attention_options(qs, kf, vf, sc, total - n, window=window)
    assert_attention_close(out, exp, "float32", vf[first_lo:], cache=cache)
    outd = cache.attend_batch([sid], q[-1:], window=window)
    assert np.isfinite(outd).all()
    assert_attention_close(outd, exp[-1:], "float32", vf[first_lo:], cache=cache)
    # without the window the NaN is read (the check above can fail)
    assert np.isnan(cache.attend_batch([sid], q[-1:])).any()


BAD = [
    (dict(window=0), ValueError, "window"),
    (dict(window=-3), ValueError, "window"),
    (dict(window=True), TypeError, "window"),
    (dict(window=2.5), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=10**400), ValueError, "softcap"),  # beyond the float range: not OverflowError
    (dict(softcap="50"), TypeError, "softcap"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks"),
    (dict(sinks=np.zeros(4, np.int64)), TypeError, "sinks"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(sinks=np.zeros((4, 1))), ValueError, "sinks"),
    (dict(sinks=np.array([0, 0, np.nan, 0])), ValueError, "sinks"),
]


@pytest.mark.parametrize("kwargs,exc,word", BAD, ids=[repr(b[0])[:40] for b in BAD])
def test_bad_option_values_raise_and_change_nothing(kwargs, exc, word):
    rng = np.random.default_rng(1)
    cache, sids, _ = build_random_cache(rng, lengths=[20, 9], block_size=4, num_kv_heads=2,
                                        head_dim=8)
    before = snapshot(cache, sids)
    q = random_tokens(rng, 2, 4, 8, "float32")
    out = np.full((2, 4, 8), 7.0, np.float32)
    with pytest.raises(exc, match=word):
        cache.attend(sids[0], q, out=out, **kwargs)
    with pytest.raises(exc, match=word):
        cache.attend_batch(sids, q, out=out, **kwargs)
    assert (out == 7.0).all()
    assert_unchanged(cache, before)


SCRIPT = textwrap.dedent(
    """
    import os, pagedkv
    assert pagedkv.simd_backend() == os.environ["PAGEDKV_SIMD"]
    from test_attn_options import check_options, check_split_decode
    check_options(1000 + len(os.environ["PAGEDKV_SIMD"]), 40)
    check_split_decode(11)
    print("OPTIONS-OK")
    """
)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_every_simd_path(backend):
    run_script(SCRIPT, "OPTIONS-OK", timeout=600, PAGEDKV_SIMD=backend, OMP_NUM_THREADS="2")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_options_with_16bit_arrays(dtype):
    """16-bit arrays in and out: with every option, the output is bit for bit the float32
    cache's output rounded once (the kernels compute in float32)."""
    from test_dtype16 import _pair, from16, to16
    from reference import ref_round_float

    rng = np.random.default_rng(16)
    for bs, d, hkv, group, length in ((16, 64, 2, 4, 300), (5, 80, 1, 3, 77), (64, 40, 3, 1, 130)):
        hq = hkv * group
        geom = dict(num_blocks=length // bs + 3, block_size=bs, num_kv_heads=hkv, head_dim=d)
        c16, c32 = _pair(dtype, True, None, **geom)
        k = ref_round_float(rng.standard_normal((length, hkv, d)), dtype)
        v = ref_round_float(rng.standard_normal((length, hkv, d)), dtype)
        s16, s32 = c16.add_sequence(), c32.add_sequence()
        c16.append(s16, to16(k, dtype, True), to16(v, dtype, True))
        c32.append(s32, k.astype(np.float32), v.astype(np.float32))
        opts = dict(window=int(rng.integers(1, length)), softcap=7.0,
                    sinks=rng.standard_normal(hq))
        n = 9
        q = ref_round_float(rng.standard_normal((n, hq, d)), dtype)
        o16 = from16(c16.attend(s16, to16(q, dtype, True), **opts), dtype)
        o32 = c32.attend(s32, q.astype(np.float32), **opts).astype(np.float64)
        np.testing.assert_array_equal(o16, ref_round_float(o32, dtype))
        ob16 = from16(c16.attend_batch([s16], to16(q[-1:], dtype, True), **opts), dtype)
        ob32 = c32.attend_batch([s32], q[-1:].astype(np.float32), **opts).astype(np.float64)
        np.testing.assert_array_equal(ob16, ref_round_float(ob32, dtype))
        exp = ref_attention_options(q, k, v, math_scale(d), length - n, **opts)
        np.testing.assert_allclose(o32, exp, rtol=1e-5, atol=1e-5 * np.abs(v).max())
