"""Every SIMD path the machine supports, and 1 vs 2 threads, agree with the reference.

The kernel path is chosen once at import (``pagedkv.simd_backend()``), so each configuration runs in a fresh
interpreter with PAGEDKV_SIMD / OMP_NUM_THREADS set in its environment.
"""

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pagedkv

KERNEL_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(KERNEL_TESTS_DIR)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pagedkv.__file__)))


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86-64, aarch64
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
SUPPORTED = ["scalar"]
if {"avx2", "fma", "f16c"} <= FLAGS:  # F16C: float16 storage (include/pagedkv/simd.h)
    SUPPORTED.append("avx2")
    if "avx_vnni" in FLAGS:
        SUPPORTED.append("avxvnni")  # AVX2 with int8 keys scored by the VEX-encoded vpdpbusd
if {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl"} <= FLAGS:
    SUPPORTED.append("avx512")  # what include/pagedkv/simd.h requires (F, DQ, BW, VL)
if platform.machine().lower() in ("aarch64", "arm64"):
    SUPPORTED.append("neon")  # Advanced SIMD: part of every AArch64 CPU
    if "asimddp" in FLAGS and sys.platform.startswith("linux"):
        SUPPORTED.append("neondot")  # the dot product extension (built by GCC on Linux)
if "avx512" in SUPPORTED and "avx512_vnni" in FLAGS:
    SUPPORTED.append("avx512vnni")  # AVX-512 with int8 keys scored by vpdpbusd
    if "avx512_bf16" in FLAGS:
        SUPPORTED.append("avx512bf16")  # ... and bfloat16 keys scored by vdpbf16ps
    if {"amx_tile", "amx_bf16"} <= FLAGS and sys.platform.startswith("linux"):
        SUPPORTED.append("avx512amx")  # ... and bfloat16 keys scored in AMX tiles
UNSUPPORTED = [name for name in ("avx2", "avx512", "neon", "avx512vnni", "avxvnni", "neondot", "avx512amx",
                                    "avx512bf16")
               if name not in SUPPORTED]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import pagedkv
    from reference import (assert_attention_close, build_random_cache, math_scale,
                           random_tokens, ref_attention)

    wanted = os.environ.get("PAGEDKV_SIMD")
    if wanted:
        got = pagedkv.simd_backend()
        assert got == wanted, (got, wanted)
    rng = np.random.default_rng(20261122)
    for dtype in ("float32", "float64"):
        for block_size, head_dim, hkv, ratio, lengths in (
            (16, 128, 2, 4, [1500, 37, 2049]),
            (3, 3, 1, 8, [29, 1, 10]),
            (64, 67, 2, 1, [130, 700]),
            (1, 17, 2, 2, [5, 40]),
        ):
            cache, sids, models = build_random_cache(
                rng, lengths=lengths, block_size=block_size, num_kv_heads=hkv, head_dim=head_dim,
                dtype=dtype, max_chunk=256)
            hq = hkv * ratio
            q = random_tokens(rng, len(sids), hq, head_dim, dtype)
            out = cache.attend_batch(sids, q)
            for b, sid in enumerate(sids):
                m = models[sid]
                exp = ref_attention(q[b:b + 1], m.k[0], m.v[0], math_scale(head_dim), len(m) - 1)
                assert_attention_close(out[b:b + 1], exp, dtype, m.v[0], cache=cache)
            for sid in sids:
                m = models[sid]
                n = min(len(m), 70)
                qp = random_tokens(rng, n, hq, head_dim, dtype)
                outp = cache.attend(sid, qp)
                exp = ref_attention(qp, m.k[0], m.v[0], math_scale(head_dim), len(m) - n)
                assert_attention_close(outp, exp, dtype, m.v[0], cache=cache)
    print("SIMD-OK", pagedkv.simd_backend() if hasattr(pagedkv, "simd_backend") else "?")
    """
)


# int8 or bfloat16 keys (KV_DTYPE) in float32 on the forced path: decode and prefill against the
# reference on the stored values, with the query as that path scores it (query_as_scored:
# rounded to int8 on the integer dot paths for int8 keys, to bfloat16 on avx512bf16 for
# bfloat16 keys where blocks hold 16 keys or more; as given otherwise: the AMX scores of
# bfloat16 keys on avx512amx, where a tile has more than 4 query rows of a head and blocks hold
# 16 keys, keep the query's float32 precision) and float32's tolerance; every output saved
# where OUT_NPZ says, so paths can be compared with each other
SCRIPT_STORAGE = textwrap.dedent(
    """
    import os
    import numpy as np
    import pagedkv
    from reference import (assert_attention_close, math_scale, query_as_scored, random_tokens,
                           ref_attention)

    assert pagedkv.simd_backend() == os.environ["PAGEDKV_SIMD"]
    kv_dtype = os.environ["KV_DTYPE"]
    seed, shapes, ns = {
        "int8": (20261126, ((16, 128, 2, 4, 700), (8, 67, 2, 3, 301), (64, 96, 1, 8, 130),
                            (5, 33, 2, 2, 97), (24, 64, 2, 4, 250)), (1, 9)),
        "bfloat16": (20261127, ((16, 128, 2, 4, 700), (32, 67, 2, 3, 301), (64, 96, 1, 8, 130),
                                (16, 256, 1, 5, 200), (16, 300, 1, 2, 90), (8, 64, 2, 4, 100),
                                (16, 33, 3, 16, 77)), (1, 2, 9, 40)),
    }[kv_dtype]
    rng = np.random.default_rng(seed)
    outs = []
    for block_size, head_dim, hkv, ratio, length in shapes:
        cache = pagedkv.PagedKVCache(num_blocks=length // block_size + 2, block_size=block_size,
                                     num_kv_heads=hkv, head_dim=head_dim, kv_dtype=kv_dtype)
        sid = cache.add_sequence()
        cache.append(sid, random_tokens(rng, length, hkv, head_dim, "float32"),
                     random_tokens(rng, length, hkv, head_dim, "float32"))
        kg, vg = cache.gather(sid)
        for n in ns:
            q = random_tokens(rng, n, hkv * ratio, head_dim, "float32")
            out = cache.attend_batch([sid], q) if n == 1 else cache.attend(sid, q)
            qs, sc = query_as_scored(cache, q, math_scale(head_dim))
            assert_attention_close(out, ref_attention(qs, kg, vg, sc, length - n), "float32", vg,
                                   cache=cache)
            outs.append((f"bs{block_size}_d{head_dim}_n{n}", out))
    if os.environ.get("OUT_NPZ"):
        np.savez(os.environ["OUT_NPZ"], **dict(outs))
    print("STORAGE-OK", kv_dtype)
    """
)


def run_storage(backend, kv_dtype, **env_updates):
    return run_script(SCRIPT_STORAGE, f"STORAGE-OK {kv_dtype}", PAGEDKV_SIMD=backend,
                      KV_DTYPE=kv_dtype, **env_updates)


def run_script(script, marker, timeout=300, **env_updates):
    """Run `script` in a fresh interpreter (the tests folder importable) with env_updates set
    (e.g. PAGEDKV_SIMD=...); assert it exits 0 and prints `marker`; return its stdout."""
    env = dict(os.environ)
    env.update(env_updates)
    env["PYTHONPATH"] = os.pathsep.join(
        [PKG_PARENT, TESTS_DIR, KERNEL_TESTS_DIR]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
        cwd=TESTS_DIR,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert marker in proc.stdout
    return proc.stdout


def _run(env_updates):
    return run_script(SCRIPT, "SIMD-OK", **env_updates)


@pytest.mark.parametrize("backend", SUPPORTED)
def test_forced_simd_backend_matches_reference(backend):
    _run({"PAGEDKV_SIMD": backend})


@pytest.mark.parametrize("backend", SUPPORTED)
def test_int8_keys_on_every_path_match_the_reference(backend):
    run_storage(backend, "int8")


@pytest.mark.parametrize("backend", SUPPORTED)
def test_bf16_keys_on_every_path_match_the_reference(backend):
    run_storage(backend, "bfloat16")


@pytest.mark.skipif("avx512amx" not in SUPPORTED, reason="needs AMX (amx_tile, amx_bf16)")
def test_amx_scores_agree_with_the_vector_path(tmp_path):
    """avx512amx scores bfloat16 keys in AMX tiles where more than 4 query rows share a tile
    (the query in three bfloat16 parts: float32's 24 bits), avx512vnni with float32 FMAs over
    the widened keys: the outputs agree to float32 rounding of the scores, in every shape,
    including those the AMX path leaves to the vector kernels (4 rows or fewer, blocks of fewer
    than 16 keys, heads wider than 256)."""
    got = {}
    for b in ("avx512amx", "avx512vnni"):
        run_storage(b, "bfloat16", OUT_NPZ=str(tmp_path / f"{b}.npz"))
        with np.load(tmp_path / f"{b}.npz") as z:
            got[b] = {k: z[k] for k in z.files}
    assert len(got["avx512amx"]) == 28
    for k, a in got["avx512amx"].items():
        b = got["avx512vnni"][k]
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()), err_msg=k)


@pytest.mark.skipif(not {"avxvnni", "avx512vnni"} <= set(SUPPORTED), reason="needs both VNNI paths")
def test_both_vnni_paths_round_the_query_alike(tmp_path):
    """Where both round the query (blocks of >= 16 keys), avxvnni and avx512vnni quantize it the
    same way (one in scalar code, one in AVX-512) and sum each group's products exactly in int32,
    so their scores are the same bits; only the float steps after them differ in vector width.
    Their outputs agree to a few float32 ulps, far closer than either is to the reference."""
    got = {}
    for b in ("avxvnni", "avx512vnni"):
        run_storage(b, "int8", OUT_NPZ=str(tmp_path / f"{b}.npz"))
        with np.load(tmp_path / f"{b}.npz") as z:
            got[b] = {k: z[k] for k in z.files}
    both = [k for k in got["avxvnni"] if int(k[2:].split("_")[0]) >= 16]
    assert len(both) == 6
    for k in both:
        a, b = got["avxvnni"][k], got["avx512vnni"][k]
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_thread_count_matches_reference(threads):
    _run({"OMP_NUM_THREADS": threads})


def test_default_backend_is_a_supported_one():
    assert pagedkv.simd_backend() in SUPPORTED
    assert pagedkv.simd_supported() == SUPPORTED


def _import_with(value):
    env = dict(os.environ, PAGEDKV_SIMD=value, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", "import pagedkv"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=TESTS_DIR)


@pytest.mark.parametrize("backend", UNSUPPORTED)
def test_forcing_a_path_this_machine_lacks_fails_at_import(backend):
    proc = _import_with(backend)
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr and f"PAGEDKV_SIMD='{backend}'" in proc.stderr
    assert "runs only scalar" in proc.stderr


def test_forcing_an_unknown_path_names_the_known_ones():
    proc = _import_with("sse9")
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr
    assert "expected one of scalar, avx2, avx512, neon" in proc.stderr
