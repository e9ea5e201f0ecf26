"""The instruction-peak probe (include/pagedkv/peak.h, pagedkv._core.instruction_peak)
and the L2 size the decode benchmark sizes its cache-resident case from."""
import math

import pytest

import pagedkv
from pagedkv._core import _fma_probe, instruction_peak
from pagedkv.benchmarks.decode import _parse_cache_size, l2_cache_bytes, peak_kind

KINDS = ("fma_f32", "fma_f64")
CHAINS = 12  # PKV_PEAK_CHAINS in peak.h
# lanes per register of each path: (f32, f64)
WIDTH = {"scalar": (1, 1), "avx2": (8, 4), "avx512": (16, 8), "neon": (4, 2),
         "avx512vnni": (16, 8), "avxvnni": (8, 4), "neondot": (4, 2), "avx512amx": (16, 8),
         "avx512bf16": (16, 8)}  # FMA loops: the base path's
# (kind, int32 lanes per register) of each path's integer dot probe (4 byte products a lane)
DOT_PROBE = {"avx512vnni": ("dpbusd", 16), "avxvnni": ("dpbusd", 8), "neondot": ("sdot", 4),
             "avx512amx": ("dpbusd", 16), "avx512bf16": ("dpbusd", 16)}
# the paths with the int16 dot probe (vpdpwssd: AVX-512 + VNNI)
WSSD_PATHS = ("avx512vnni", "avx512amx", "avx512bf16")
PATHS = pagedkv.simd_supported()


def _width(kind, simd):
    return WIDTH[simd][KINDS.index(kind)]


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_peak_is_positive_and_finite(kind, simd):
    rate = instruction_peak(kind, simd=simd, threads=1, seconds=0.005, repeats=3)
    assert isinstance(rate, float) and math.isfinite(rate) and rate > 0


def test_peak_with_two_threads_and_the_active_path():
    rate = instruction_peak("fma_f32", threads=2, seconds=0.005, repeats=3)
    assert math.isfinite(rate) and rate > 0


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_probe_counts_the_lanes_it_computes(kind, simd, threads):
    """lanes = threads * chains * width * iters, and the lanes hold what that
    many rounds of c = c * 0.5 + 1 give from c = k (exact in binary floating
    point: 2 + (k - 2) / 2^n), so the loop ran every round it counted."""
    n_lanes = CHAINS * _width(kind, simd)
    for iters in (0, 1, 2, 3, 17):
        lanes, total = _fma_probe(kind, simd=simd, iters=iters, threads=threads)
        assert lanes == threads * n_lanes * iters
        want = threads * sum(2 + (k - 2) * 2.0 ** -iters for k in range(n_lanes))
        assert total == want, (iters, total, want)


@pytest.mark.parametrize("kind", KINDS)
def test_probe_uses_a_as_factor_and_b_as_addend(kind):
    # c = c * 1 + 0.25, five times: lane k ends at k + 1.25
    for simd in PATHS:
        n_lanes = CHAINS * _width(kind, simd)
        lanes, total = _fma_probe(kind, simd=simd, iters=5, a=1.0, b=0.25)
        assert lanes == 5 * n_lanes
        assert total == sum(k + 1.25 for k in range(n_lanes))


def test_default_path_is_the_active_one():
    active = pagedkv.simd_backend()
    for kind in KINDS:
        assert _fma_probe(kind, iters=4)[0] == 4 * CHAINS * _width(kind, active)


@pytest.mark.parametrize("simd", [s for s in PATHS if s in DOT_PROBE])
@pytest.mark.parametrize("threads", [1, 2])
def test_dot_probe_counts_its_products(simd, threads):
    """vpdpbusd / sdot chains: 4 byte products per int32 lane (64 per AVX-512 instruction, 32
    per AVX-VNNI one, 16 per sdot), 12 chains; lane k starts at k and gains 4 * 1 * 1 a round,
    so the lanes sum to an exact checksum."""
    kind, w = DOT_PROBE[simd]
    for iters in (0, 1, 2, 17):
        lanes, total = _fma_probe(kind, simd=simd, iters=iters, threads=threads)
        assert lanes == threads * CHAINS * 4 * w * iters
        assert total == threads * sum(k + 4 * iters for k in range(CHAINS * w))
    rate = instruction_peak(kind, simd=simd, threads=1, seconds=0.005, repeats=3)
    assert math.isfinite(rate) and rate > 0


@pytest.mark.parametrize("simd", [s for s in PATHS if s in WSSD_PATHS])
@pytest.mark.parametrize("threads", [1, 2])
def test_int16_dot_probe_counts_its_products(simd, threads):
    """vpdpwssd chains: 2 int16 products per int32 lane (32 per instruction), 12 chains; lane k
    starts at k and gains 1 * 1 + 1 * 1 a round, so the lanes sum to an exact checksum."""
    for iters in (0, 1, 2, 17):
        lanes, total = _fma_probe("dpwssd", simd=simd, iters=iters, threads=threads)
        assert lanes == threads * CHAINS * 32 * iters
        assert total == threads * sum(k + 2 * iters for k in range(CHAINS * 16))
    rate = instruction_peak("dpwssd", simd=simd, threads=1, seconds=0.005, repeats=3)
    assert math.isfinite(rate) and rate > 0


@pytest.mark.skipif("avx512bf16" not in PATHS, reason="needs AVX512_BF16")
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_dot_probe_counts_its_products(threads):
    """vdpbf16ps chains: 2 bfloat16 products per float32 lane (32 per instruction), 12 chains;
    lane k starts at k and gains 1 * 1 + 1 * 1 a round, so the lanes sum to an exact checksum."""
    for iters in (0, 1, 2, 17):
        lanes, total = _fma_probe("dpbf16", simd="avx512bf16", iters=iters, threads=threads)
        assert lanes == threads * CHAINS * 32 * iters
        assert total == threads * sum(k + 2 * iters for k in range(CHAINS * 16))
    rate = instruction_peak("dpbf16", simd="avx512bf16", threads=1, seconds=0.005, repeats=3)
    assert math.isfinite(rate) and rate > 0


def test_dot_probes_only_on_their_paths():
    for simd in PATHS:
        if simd != "avx512bf16":
            with pytest.raises(ValueError, match="no dpbf16 probe"):
                instruction_peak("dpbf16", simd=simd)
        for kind in ("dpbusd", "sdot"):
            if DOT_PROBE.get(simd, (None,))[0] != kind:
                with pytest.raises(ValueError, match=f"no {kind} probe"):
                    instruction_peak(kind, simd=simd)
        if simd not in WSSD_PATHS:
            with pytest.raises(ValueError, match="no dpwssd probe"):
                instruction_peak("dpwssd", simd=simd)


def test_bad_arguments_raise_value_error():
    missing = [s for s in WIDTH if s not in PATHS]  # neon on x86-64, the x86 paths elsewhere
    assert missing
    bad = [dict(kind="fma_f16"), dict(kind="dpbf8"), dict(kind=None), dict(kind=0),
           dict(simd="sse2"), dict(simd="AVX2"), dict(simd=1), dict(simd=missing[0]),
           dict(threads=0), dict(threads=-2),
           dict(seconds=0), dict(seconds=-1.0), dict(seconds=float("nan")),
           dict(seconds=float("inf")), dict(repeats=0)]
    for kwargs in bad:
        with pytest.raises(ValueError):
            instruction_peak(**kwargs)
    for kwargs in bad[:10] + [dict(iters=-1)]:
        with pytest.raises(ValueError):
            _fma_probe(**kwargs)


def test_cache_size_parsing_and_l2():
    assert _parse_cache_size("1024K\n") == 1 << 20
    assert _parse_cache_size("2M") == 2 << 20
    assert _parse_cache_size("512") == 512
    size, source = l2_cache_bytes()
    assert size > 0 and source in ("sysfs", "assumed")
    assert (peak_kind("float32"), peak_kind("float64")) == ("fma_f32", "fma_f64")
