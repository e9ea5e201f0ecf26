"""The decode read ceiling (read_kv_pattern, include/pagedkv/kvread.h), the
decode loop's work split and prefetching against 1 thread and the reference,
and the C harness benchmarks/c/decode_ceiling.c."""

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import pagedkv
from reference import ref_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _xor_bytes(*arrays):
    x = 0
    for a in arrays:
        x ^= int(np.bitwise_xor.reduce(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
    return x


def _filled(rng, lengths, block_size, hkv, d, dtype, num_layers=1, spare_seqs=0):
    """A cache holding one sequence per length, appended in random chunks
    round-robin so the blocks of the sequences interleave in the pool."""
    nblk = sum(-(-n // block_size) for n in lengths)
    cache = pagedkv.PagedKVCache(num_blocks=nblk + 3, block_size=block_size, num_kv_heads=hkv,
                                 head_dim=d, dtype=dtype, num_layers=num_layers,
                                 max_seqs=len(lengths) + spare_seqs)
    sids = [cache.add_sequence() for _ in lengths]
    kv = {sid: [(rng.standard_normal((n, hkv, d)).astype(dtype),
                 rng.standard_normal((n, hkv, d)).astype(dtype)) for _ in range(num_layers)]
          for sid, n in zip(sids, lengths)}
    done = dict.fromkeys(sids, 0)
    while any(done[s] < n for s, n in zip(sids, lengths)):
        for sid, n in zip(sids, lengths):
            if done[sid] == n:
                continue
            e = min(n, done[sid] + int(rng.integers(1, 3 * block_size)))
            for layer in range(num_layers):
                k, v = kv[sid][layer]
                cache.append(sid, k[done[sid]:e], v[done[sid]:e], layer=layer)
            done[sid] = e
    return cache, sids, kv


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_kv_pattern_reads_every_held_byte_once(dtype, threads):
    rng = np.random.default_rng(81 + threads)
    for block_size, hkv, d, lengths in ((16, 2, 32, [300, 17, 64]), (5, 3, 7, [1, 49, 50]),
                                        (1, 1, 3, [9, 4])):
        for layer, num_layers in ((0, 1), (1, 2)):
            cache, sids, kv = _filled(rng, lengths, block_size, hkv, d, dtype, num_layers)
            itemsize = np.dtype(dtype).itemsize
            before = pagedkv.get_num_threads()
            try:
                pagedkv.set_num_threads(threads)
                nbytes, xor = cache.read_kv_pattern(sids, layer=layer)
            finally:
                pagedkv.set_num_threads(0)
            assert pagedkv.get_num_threads() == before
            blocks = sum(-(-n // block_size) for n in lengths)
            assert nbytes == 2 * blocks * block_size * hkv * d * itemsize
            # slots past a sequence's length were never written: zero, neutral for XOR
            want = _xor_bytes(*[a for sid in sids for a in kv[sid][layer]])
            assert xor == want
            # a subset and a repeated order read just those sequences
            nb1, x1 = cache.read_kv_pattern([sids[1]], layer=layer)
            assert nb1 == 2 * -(-lengths[1] // block_size) * block_size * hkv * d * itemsize
            assert x1 == _xor_bytes(*kv[sids[1]][layer])


def test_read_kv_pattern_rejects_bad_input_and_changes_nothing():
    rng = np.random.default_rng(3)
    cache, sids, kv = _filled(rng, [40, 7], 16, 2, 8, "float32", spare_seqs=1)
    state = [cache.gather(s) for s in sids]
    with pytest.raises(KeyError):
        cache.read_kv_pattern([sids[0], 12345])
    with pytest.raises(ValueError, match="layer"):
        cache.read_kv_pattern(sids, layer=1)
    empty = cache.add_sequence()
    with pytest.raises(ValueError, match="empty"):
        cache.read_kv_pattern([empty])
    for s, (k, v) in zip(sids, state):
        np.testing.assert_array_equal(cache.gather(s)[0], k)
        np.testing.assert_array_equal(cache.gather(s)[1], v)
    assert cache.read_kv_pattern(sids)[1] == _xor_bytes(*kv[sids[0]][0], *kv[sids[1]][0])


TOL = {"float32": 2e-5, "float64": 1e-12}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_work_split_matches_one_thread_and_reference(dtype):
    """Threads split a batch by sequence and head group, and one sequence by
    key chunks (split-K); the prefetch cursor walks blocks across segment and
    chunk boundaries: every split gives the 1-thread result."""
    rng = np.random.default_rng(17)
    cases = ((16, 8, 4, 64, [2100, 33, 900]),   # many heads per item, mid-block ends
             (16, 8, 4, 64, [4100]),            # one sequence: head split, then split-K
             (7, 3, 2, 33, [1500, 600]),        # odd block size, head_dim, head count
             (64, 1, 8, 16, [3000]))            # one KV head: split-K only
    for block_size, hkv, ratio, d, lengths in cases:
        cache, sids, kv = _filled(rng, lengths, block_size, hkv, d, dtype)
        hq = hkv * ratio
        q = rng.standard_normal((len(sids), hq, d)).astype(dtype)
        outs = {}
        before = pagedkv.get_num_threads()
        try:
            for t in (1, 2, 3):
                pagedkv.set_num_threads(t)
                outs[t] = cache.attend_batch(sids, q)
        finally:
            pagedkv.set_num_threads(0)
        assert pagedkv.get_num_threads() == before
        scale = 1 / np.sqrt(d)
        for b, sid in enumerate(sids):
            k, v = kv[sid][0]
            exp = ref_attention(q[b:b + 1], k, v, scale, k.shape[0] - 1)
            atol = TOL[dtype] * np.abs(v).max()
            for t in (1, 2, 3):
                np.testing.assert_allclose(outs[t][b:b + 1], exp, rtol=TOL[dtype], atol=atol)
                np.testing.assert_allclose(outs[t][b], outs[1][b], rtol=TOL[dtype], atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_over_two_segments_matches_reference(dtype):
    """StreamingLLM leaves a sequence two slot segments (sinks, then the window),
    which the decode loop and its prefetch cursor walk one after the other."""
    rng = np.random.default_rng(23)
    bs, hkv, d, ratio = 16, 4, 40, 2
    for sink, window, n in ((4, 200, 700), (20, 37, 300), (0, 64, 129)):
        cache = pagedkv.PagedKVCache(num_blocks=200, block_size=bs, num_kv_heads=hkv,
                                     head_dim=d, dtype=dtype)
        sid = cache.add_sequence()
        k = rng.standard_normal((n, hkv, d)).astype(dtype)
        v = rng.standard_normal((n, hkv, d)).astype(dtype)
        cache.append(sid, k, v)
        cache.apply_streaming_llm(sid, sink, window)
        kept = cache.kept_positions(sid)
        q = rng.standard_normal((1, hkv * ratio, d)).astype(dtype)
        exp = ref_attention(q, k[kept], v[kept], 1 / np.sqrt(d), len(kept) - 1)
        for t in (1, 2):
            pagedkv.set_num_threads(t)
            try:
                out = cache.attend_batch([sid], q)
            finally:
                pagedkv.set_num_threads(0)
            np.testing.assert_allclose(out, exp, rtol=TOL[dtype],
                                       atol=TOL[dtype] * np.abs(v).max())


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the harness")
def test_c_harness_builds_and_checks_decode(tmp_path):
    """benchmarks/c/decode_ceiling.c compiles with the portable flags and its
    decode agrees with its own double reference (it exits 1 otherwise), over
    float32, float64, int8, bfloat16 and float16 storage (int8 in blocks of
    16 keys: the integer dot paths' scores where the machine has them; of 8:
    the widened keys)."""
    exe = tmp_path / "decode_ceiling"
    src = os.path.join(ROOT, "benchmarks", "c", "decode_ceiling.c")
    subprocess.run(["cc", "-O1", "-std=c11", "-D_POSIX_C_SOURCE=200112L", "-fopenmp",
                    "-I" + os.path.join(ROOT, "include"), src, "-o", str(exe), "-lm"],
                   check=True, capture_output=True, timeout=600)  # a guard against a hang only
    for args in (["f32", "3", "70", "2", "3", "8", "2", "36", "16"],
                 ["f64", "1", "300", "1", "3", "6", "3", "17", "5"],
                 ["i8", "2", "200", "2", "3", "8", "2", "64", "16"],
                 ["i8", "1", "150", "1", "3", "4", "4", "72", "8"],
                 ["bf16", "2", "90", "2", "3", "8", "2", "40", "16"],
                 ["f16", "1", "77", "1", "3", "3", "3", "33", "7"]):
        proc = subprocess.run([str(exe)] + args, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "of pattern" in proc.stdout and "max error" in proc.stdout


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the probe")
def test_overlap_probe_builds_and_reports_every_variant(tmp_path):
    """benchmarks/c/overlap_probe.c compiles with the portable flags and, on a
    CPU with AVX-512 F or AVX2 + FMA, reports the read and the four
    arithmetic loads with their vector instructions per line, on 512-bit
    vectors and (asked for, or without AVX-512) on 256-bit ones, and with
    AVX-512 + VNNI int8's integer products in four layouts; elsewhere it says
    it measured nothing."""
    exe = tmp_path / "overlap_probe"
    src = os.path.join(ROOT, "benchmarks", "c", "overlap_probe.c")
    subprocess.run(["cc", "-O1", "-std=c11", "-D_DEFAULT_SOURCE", "-I" + os.path.join(ROOT, "include"),
                    src, "-o", str(exe)], check=True, capture_output=True, timeout=600)
    ops = {("avx512", "f32"): [0, 1, 2, 4, 8], ("avx512", "bf16"): [0, 4, 6, 10, 18],
           ("avx2", "f32"): [0, 2, 4, 8, 16], ("avx2", "bf16"): [0, 8, 12, 20, 36]}
    for isa in ("", "avx2"):
        for kind in ("f32", "bf16"):
            env = dict(os.environ, PKV_PROBE_ISA=isa)
            proc = subprocess.run([str(exe), kind, "2", "100", "3"], capture_output=True,
                                  text=True, timeout=60, env=env)
            assert proc.returncode == 0, proc.stderr
            if "nothing measured" in proc.stdout:
                continue
            used = proc.stdout.split("isa=")[1].split()[0]
            assert used in ("avx512", "avx2") and (used == "avx2" or isa != "avx2")
            rows = [ln.split() for ln in proc.stdout.splitlines() if "of read" in ln]
            assert [r[0] for r in rows] == ["read", "R=1", "R=2", "R=4", "R=8"]
            assert [int(r[1]) for r in rows] == ops[used, kind]
            assert rows[0][-3] == "100.0%"
    # int8's integer products in the kernels' layouts and the shuffle-free ones (AVX-512 + VNNI)
    proc = subprocess.run([str(exe), "i8", "2", "100", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if "nothing measured" not in proc.stdout:
        rows = [ln.split() for ln in proc.stdout.splitlines() if "of read" in ln]
        assert [r[0] for r in rows] == ["read", "now", "Kquad", "Vpair", "both"]
        assert [float(r[1]) for r in rows] == [0.0, 9.5, 8.0, 8.5, 7.0]
        assert rows[0][-3] == "100.0%" and all(float(r[-3].rstrip("%")) > 0 for r in rows)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the probe")
def test_omp_region_probe_builds_and_times_each_case(tmp_path):
    """benchmarks/c/omp_region.c compiles with the portable flags, times an empty
    parallel region in its three cases under both wait policies (each part of a
    region no longer than the region itself) and refuses fewer than 2 threads."""
    exe = tmp_path / "omp_region"
    src = os.path.join(ROOT, "benchmarks", "c", "omp_region.c")
    subprocess.run(["cc", "-O1", "-std=c11", "-D_DEFAULT_SOURCE", "-fopenmp", src, "-o", str(exe)],
                   check=True, capture_output=True, timeout=600)
    for policy in ("passive", "active"):
        env = dict(os.environ, OMP_WAIT_POLICY=policy)
        proc = subprocess.run([str(exe), "2", "5"], capture_output=True, text=True, timeout=60,
                              env=env)
        assert proc.returncode == 0, proc.stderr
        assert f"OMP_WAIT_POLICY={policy}" in proc.stdout
        rows = [ln for ln in proc.stdout.splitlines() if "region" in ln and "caller starts" in ln]
        assert [ln.split("region")[0].strip() for ln in rows] == [
            "back to back", "after 200 us of work", "after 1 ms asleep"]
        for ln in rows:
            region, caller, worker, rest = map(float, re.findall(r"\d+\.\d+", ln))
            assert region > 0 and 0 <= caller <= region and 0 <= worker <= region
            assert 0 <= rest <= region
    bad = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
