"""The integer dot-product probe benchmarks/c/dot_peak.c: it builds, runs,
and its loops compute what they claim (checksums against an exact model of
the instructions), so the rates it reports are of that work."""

import os
import platform
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NBUF = 64
ROWS = [0x00030002, 0x7F81F009, 0x10203040, 0xF0E0D0C9]


def _probe_buffer():
    """The probe's buffer as NBUF entries of 64 signed bytes (its fill rule)."""
    data = []
    for k in range(NBUF * 16):
        h = (k * 2654435761) & 0xFFFFFFFF
        data += [((h >> (8 * j)) % 255) - 127 for j in range(4)]
    return [data[e * 64:(e + 1) * 64] for e in range(NBUF)]


def _s16(lo, hi):
    v = lo | hi << 8
    return v - 65536 if v >= 32768 else v


def _s8(b):
    return b - 256 if b >= 128 else b


def _expected(n):
    """Checksums (mod 2^32) of madd_i16 and maddubs_i8 after n iterations."""
    entries = _probe_buffer()
    t16 = t8 = 0
    for e, x in enumerate(entries):
        count = n // NBUF + (1 if e < n % NBUF else 0)
        xb = [v & 0xFF for v in x]
        s16 = s8 = 0
        for row in ROWS:
            rb = [(row >> (8 * j)) & 0xFF for j in range(4)]
            b_lo, b_hi = _s16(rb[0], rb[1]), _s16(rb[2], rb[3])
            q = [_s8(v) for v in rb]
            for lane in range(16):  # 8 lanes of each of the two vectors
                w = xb[4 * lane:4 * lane + 4]
                s16 += _s16(w[0], w[1]) * b_lo + _s16(w[2], w[3]) * b_hi
                s8 += sum(q[j] * x[4 * lane + j] for j in range(4))
        t16 += count * s16
        t8 += count * s8
    return t16 % 2**32, t8 % 2**32


def _expected_512(n):
    """Checksums (mod 2^32) of dpbusd_512 and dpwssd_512 after n iterations: iteration i reads
    entries i and i + 1 (mod NBUF), each one 64-byte vector of 16 int32 lanes."""
    entries = _probe_buffer()
    tb = tw = 0
    for e, x in enumerate(entries):
        # times entry e is read: as the first vector (i = e mod NBUF) and the second (i + 1 = e)
        count = sum(n // NBUF + (1 if k < n % NBUF else 0) for k in (e, (e - 1) % NBUF))
        xb = [v & 0xFF for v in x]
        sb = sw = 0
        for row in ROWS:
            rb = [(row >> (8 * j)) & 0xFF for j in range(4)]
            b_lo, b_hi = _s16(rb[0], rb[1]), _s16(rb[2], rb[3])
            for lane in range(16):
                w = xb[4 * lane:4 * lane + 4]
                sb += sum(w[j] * _s8(rb[j]) for j in range(4))  # unsigned x signed
                sw += _s16(w[0], w[1]) * b_lo + _s16(w[2], w[3]) * b_hi
        tb += count * sb
        tw += count * sw
    return tb % 2**32, tw % 2**32


def _expected_widened(n):
    """Sums of the widening loops after n iterations: value k of each buffer is 1 + k % 7, rows
    1, 2, 3 and 4; iteration i reads entries i and i + 1 (mod NBUF) of 16 values, or (the
    bfloat16 pairs) entry i of 32."""
    def entry(e, width):
        e %= NBUF
        return sum(1 + k % 7 for k in range(e * width, (e + 1) * width))
    two = sum(entry(i, 16) + entry(i + 1, 16) for i in range(n)) * 10
    pair = sum(entry(i, 32) for i in range(n)) * 10
    return {"bf16_fma_512": two, "bf16pair_fma_512": pair, "f16_fma_512": two, "i8_fma_512": two}


def _build(tmp_path, opt):
    """The probe built into tmp_path at optimisation level `opt`."""
    exe = tmp_path / "dot_peak"
    subprocess.run(["cc", opt, "-std=c11", "-D_POSIX_C_SOURCE=200112L",
                    os.path.join(ROOT, "benchmarks", "c", "dot_peak.c"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the probe")
def test_dot_peak_probe_computes_what_it_claims(tmp_path):
    exe = _build(tmp_path, "-O2")
    n = 100_003  # not a multiple of the buffer's entries
    proc = subprocess.run([str(exe), str(n), "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    if "nothing measured" in proc.stdout:
        assert platform.machine().lower() not in ("x86_64", "amd64") or "AVX2" in proc.stdout
        pytest.skip(proc.stdout.strip())
    rates = dict(re.findall(r"^(\w+)\s+([0-9.]+)", proc.stdout, re.M))
    assert set(rates) >= {"fma_f32", "madd_i16", "maddubs_i8"}, proc.stdout
    assert all(float(rates[k]) > 0 for k in ("fma_f32", "madd_i16", "maddubs_i8"))
    sums = dict(re.findall(r"^(\w+).*checksum (\d+)$", proc.stdout, re.M))
    e16, e8 = _expected(n)
    assert int(sums["madd_i16"]) == e16
    assert int(sums["maddubs_i8"]) == e8
    if "dpbusd_512" in sums:  # AVX512_VNNI: its 512-bit loops, checked the same way
        eb, ew = _expected_512(n)
        assert int(sums["dpbusd_512"]) == eb
        assert int(sums["dpwssd_512"]) == ew
        assert float(rates["dpbusd_512"]) > 0 and float(rates["dpwssd_512"]) > 0
    widened = {k: float(v) for k, v in re.findall(r"^(\w+_fma_512)\s.*sum (\d+)$", proc.stdout, re.M)}
    if "fma_f32_512" in rates:  # AVX-512: the float32 tile over widened storage
        assert set(widened) >= {"bf16pair_fma_512", "f16_fma_512", "i8_fma_512"}, proc.stdout
        want = _expected_widened(n)
        for name, got in widened.items():
            assert got == want[name], (name, got, want[name])
            assert float(rates[name]) > 0


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the probe")
def test_dot_peak_probe_rejects_bad_arguments(tmp_path):
    exe = _build(tmp_path, "-O1")
    proc = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert proc.returncode == 2 and "usage" in proc.stderr
