"""The `pagedkv` command line: `bench` end to end on test-only shapes, and `demo`."""
import importlib.util
import json
import math
import sys
import types

import numpy as np
import pytest

import pagedkv
from pagedkv.cli import main

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _bench(tmp_path, *args):
    path = tmp_path / "bench.json"
    rc = main(["bench", "--tiny", "--no-progress", "--repeats", "2", "--json", str(path), *args])
    assert rc == 0
    return json.loads(path.read_text())


def test_bench_bandwidth_and_decode(tmp_path, capsys):
    data = _bench(tmp_path, "--suites", "bandwidth,decode", "--threads", "1,all")
    threads = data["meta"]["threads"]
    assert threads[0] == 1
    bw = [r for r in data["records"] if r["suite"] == "bandwidth"]
    assert sorted(r["threads"] for r in bw) == sorted(threads)
    assert all(_positive_finite(r["bytes_per_s"]) for r in bw)

    dec = [r for r in data["records"] if r["suite"] == "decode"]
    # 2 dtypes x 2 (B, L) configurations x thread counts
    assert len(dec) == 2 * 2 * len(threads)
    assert {r["dtype"] for r in dec} == {"float32", "float64"}
    want = {"pagedkv", "numpy", "numpy-gather"} | ({"torch-sdpa"} if HAVE_TORCH else set())
    kv_rows = {"pagedkv-bf16": 1e-2, "pagedkv-f16": 1e-2, "pagedkv-i8": 3e-2}  # storage bounds
    want |= set(kv_rows)
    reads = {"kv-pattern read", "kv-pattern read-bf16", "kv-pattern read-f16", "kv-pattern read-i8"}
    for r in dec:
        assert r["kv_dtypes"] == ["bfloat16", "float16", "int8"]
        # torch in bfloat16 beside the bfloat16 storage of a float32 run
        torch16 = {"torch-sdpa-bf16"} if HAVE_TORCH and r["dtype"] == "float32" else set()
        assert set(r["results"]) == want | reads | torch16
        assert set(r["ratios"]) == (want | torch16) - {"pagedkv"}
        # decode as a percentage of the pattern read of the same rounds (storage dtypes:
        # of their own pool's)
        for name in {"pagedkv"} | set(kv_rows):
            assert _positive_finite(r["results"][name]["pct_pattern"])
        assert all(_positive_finite(x) for x in r["ratios"].values())
        for res in r["results"].values():
            assert _positive_finite(res["median_s"])
            assert _positive_finite(res["gbps"]) and _positive_finite(res["pct_bw"])
            assert len(res["samples_s"]) == 2
        for name, res in r["results"].items():
            if name in kv_rows:  # storage dtypes: within their accuracy, and really rounded
                assert 0 < res["max_rel_err_vs_pagedkv"] <= kv_rows[name]
            elif name == "torch-sdpa-bf16":  # checked within bfloat16's bound
                assert res["max_rel_err_vs_pagedkv"] <= kv_rows["pagedkv-bf16"]
            elif name != "pagedkv" and name not in reads:  # each baseline was checked
                assert res["max_rel_err_vs_pagedkv"] <= 1e-4
    # the kernel with K/V in L2 against the measured FMA peak, 1 thread, every storage dtype
    peaks = {r["kind"]: r for r in data["records"] if r["suite"] == "instruction-peak"}
    # int8 keys in float32 scored with an integer dot product on these paths
    dot = {"avx512vnni": "dpbusd", "avx512amx": "dpbusd", "avxvnni": "dpbusd",
           "avx512bf16": "dpbusd", "neondot": "sdot"}.get(pagedkv.simd_backend())
    # ... and bfloat16 keys in float32 with vdpbf16ps on avx512bf16 (if the run stores bfloat16)
    bf16_dot = pagedkv.simd_backend() == "avx512bf16" and "pagedkv-bf16" in kv_rows
    # ... and int8 values' P.V in float32 with vpdpwssd where the kernels round the weights to int16
    pvi = pagedkv.PagedKVCache(num_blocks=1, block_size=16, num_kv_heads=1, head_dim=64,
                               kv_dtype="int8").quantizes_weights
    assert set(peaks) == ({"fma_f32", "fma_f64"} | ({dot} if dot else set())
                          | ({"dpbf16"} if bf16_dot else set()) | ({"dpwssd"} if pvi else set()))
    assert all(_positive_finite(r["lanes_per_s"]) and r["threads"] == 1 for r in peaks.values())
    l2 = [r for r in data["records"] if r["suite"] == "decode-l2"]
    assert sorted(r["dtype"] for r in l2) == ["float32", "float64"]
    for r in l2:
        assert r["threads"] == 1 and r["B"] == 1 and r["l2_bytes"] > 0
        assert r["peak_lanes_per_s"] == peaks[r["peak_kind"]]["lanes_per_s"]
        assert set(r["results"]) == {"pagedkv"} | set(kv_rows)
        for res in r["results"].values():
            assert res["L"] >= 1 and res["kv_bytes"] <= r["l2_bytes"] // 2
            assert res["fma_lanes"] == 2 * r["Hq"] * res["L"] * r["D"]
            assert _positive_finite(res["lanes_per_s"]) and _positive_finite(res["pct_peak"])
            fma = r["peak_kind"]
            scored = dot and res["kv_dtype"] == "int8" and r["dtype"] == "float32"
            bf16 = bf16_dot and res["kv_dtype"] == "bfloat16" and r["dtype"] == "float32"
            assert res["peak_kinds"] == ["dpbf16" if bf16 else dot if scored else fma,
                                         "dpwssd" if scored and pvi else fma]
            half = res["fma_lanes"] / 2  # scores and P.V each at their instruction's peak
            best = sum(half / peaks[k]["lanes_per_s"] for k in res["peak_kinds"])
            assert math.isclose(res["pct_peak"], 100 * best / res["median_s"])
            assert len(res["samples_s"]) == 2
    assert [d["dtype"] for d in data["targets"]["decode_l2"]] == ["float32", "float64"]
    out = capsys.readouterr().out
    assert "Decode" in out and "Targets" in out and "pagedkv speedup" in out
    assert "pagedkv-i8" in out
    assert "Instruction peaks of one core" in out and "Decode with K/V in L2" in out
    assert "%peak" in out


def test_bench_decode_without_kv_dtypes(tmp_path):
    data = _bench(tmp_path, "--suites", "decode", "--threads", "1", "--dtypes", "f32",
                  "--no-torch", "--kv-dtypes", "none")
    dec = [r for r in data["records"] if r["suite"] == "decode"]
    assert dec and all(r["kv_dtypes"] == [] for r in dec)
    assert all(set(r["results"]) == {"pagedkv", "kv-pattern read", "numpy", "numpy-gather"} for r in dec)
    l2 = [r for r in data["records"] if r["suite"] == "decode-l2"]
    assert len(l2) == 1 and set(l2[0]["results"]) == {"pagedkv"}


def test_bench_prefill_append_without_torch(tmp_path, capsys):
    data = _bench(tmp_path, "--suites", "prefill,append", "--threads", "1", "--dtypes", "f32",
                  "--no-torch")
    pre = [r for r in data["records"] if r["suite"] == "prefill"]
    app = [r for r in data["records"] if r["suite"] == "append"]
    kv_rows = {"pagedkv-bf16", "pagedkv-f16", "pagedkv-i8"}  # the default --kv-dtypes
    assert len(pre) == 1 and set(pre[0]["results"]) == {"pagedkv", "numpy"} | kv_rows
    assert pre[0]["kv_dtypes"] == ["bfloat16", "float16", "int8"]
    assert _positive_finite(pre[0]["results"]["pagedkv"]["gflops"])
    assert _positive_finite(pre[0]["ratios"]["numpy"])
    for name in kv_rows:  # timed, and checked within the storage's bound
        assert _positive_finite(pre[0]["ratios"][name])
        assert 0 < pre[0]["results"][name]["max_rel_err_vs_pagedkv"] <= 3e-2
    # the arrays' own storage (append, append_batch), then append into each narrower storage
    assert [(r["call"], r["kv_dtype"]) for r in app] == [
        ("append", "float32"), ("append_batch", "float32"), ("append", "bfloat16"),
        ("append", "float16"), ("append", "int8")]
    for r in app:
        assert set(r["results"]) == {"pagedkv", "numpy"}
        assert _positive_finite(r["ratios"]["numpy"])
        alloc = r["results"]["pagedkv"]["tracemalloc"]
        assert alloc["calls"] > 0 and alloc["peak_bytes"] >= 0
    assert data["targets"]["append"]["us_per_call"] > 0
    out = capsys.readouterr().out
    assert "n/a" in out  # the torch rows
    assert "f32 as bf16" in out and "f32 as i8" in out


def test_bench_streaming_unavailable_is_said(tmp_path, monkeypatch):
    from pagedkv.benchmarks import runner

    monkeypatch.setattr(runner, "STREAMING_MODULE", "pagedkv.benchmarks._no_such_module")
    data = _bench(tmp_path, "--suites", "streaming")
    (rec,) = [r for r in data["records"] if r["suite"] == "streaming"]
    assert rec["available"] is False and "unavailable" in rec["reason"]


def test_bench_streaming_runs_the_module_when_present(tmp_path, monkeypatch, capsys):
    from pagedkv.benchmarks import runner

    calls = []
    fake = types.ModuleType("fake_streaming")

    def run(tokens=100_000, sink=4, window=1020, quick=False):
        calls.append((tokens, quick))
        return {"tokens": tokens, "paged_us_median": 12.5}

    fake.run = run
    monkeypatch.setitem(sys.modules, "fake_streaming", fake)
    monkeypatch.setattr(runner, "STREAMING_MODULE", "fake_streaming")
    data = _bench(tmp_path, "--suites", "streaming")
    (rec,) = [r for r in data["records"] if r["suite"] == "streaming"]
    assert rec["available"] is True and rec["result"]["paged_us_median"] == 12.5
    assert calls and calls[0][1] is True
    assert "paged_us_median" in capsys.readouterr().out


def test_bench_prefix_suite(tmp_path, capsys):
    data = _bench(tmp_path, "--suites", "prefix")
    recs = {r["case"]: r for r in data["records"] if r["suite"] == "prefix"}
    assert set(recs) == {"ttft", "beam", "save_load"}
    t = recs["ttft"]
    assert t["reused_tokens"] == 192 and t["max_rel_diff"] == 0.0  # 200-token prompt, block 16
    assert t["cold_s"] > 0 and t["hit_s"] > 0
    b = recs["beam"]
    assert b["blocks_shared_end"] < b["blocks_private"] and 0 < b["saved"] < 1
    assert recs["save_load"]["save_gbps"] > 0 and recs["save_load"]["load_gbps"] > 0
    out = capsys.readouterr().out
    assert "time to first token" in out and "memory saved by sharing" in out


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--suites", "nonsense"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["bench", "--dtypes", "f16"])


HAVE_HF = HAVE_TORCH and importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not HAVE_HF, reason="the hf extra (transformers, torch) is not installed")
def test_demo_runs(capsys):
    assert main(["demo", "--new-tokens", "4", "--stream-tokens", "300", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identical tokens: yes" in out and "internal fragmentation" in out
    line = next(x for x in out.splitlines() if "blocks held once the window is full" in x)
    lo_hi, bound = line.split(": ")[1].split(" ")[0], line.split("(bound ")[1].split(")")[0]
    assert int(lo_hi.split("..")[1]) <= int(bound)
    assert "positions [0, 1, 2, 3] + " in out


def test_demo_without_the_hf_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "pagedkv demo needs transformers and torch: pip install 'pagedkv[hf]'"


def test_bench_hf_suite(tmp_path, capsys):
    data = _bench(tmp_path, "--suites", "hf", "--threads", "1,2")
    recs = [r for r in data["records"] if r["suite"] == "hf"]
    if not HAVE_HF:
        assert recs == [{"suite": "hf", "available": False}]
        assert "hf suite skipped" in capsys.readouterr().out
        return
    assert [(r["context"], r["threads"]) for r in recs] == [(48, 1), (48, 2), (96, 1), (96, 2)]
    for r in recs:
        assert r["tokens_match"] == {"pagedkv": True, "pagedkv-bfloat16": True}
        assert _positive_finite(r["ratio"])
        assert all(_positive_finite(x) for x in r["ratios"].values())
        assert all(_positive_finite(x) for x in r["prefill_ratios"].values())
        assert all(_positive_finite(x) for x in r["tokens_per_s"].values())
        assert set(r["prefill_s"]) == {"pagedkv", "pagedkv-bfloat16", "dynamic-sdpa"}
    assert "DynamicCache+sdpa tok/s" in capsys.readouterr().out


def test_hf_suite_is_opt_in():
    from pagedkv.benchmarks.runner import parse_suites

    assert "hf" not in parse_suites("all") and parse_suites("decode,hf") == ["decode", "hf"]


def test_bench_serve_suite(tmp_path, capsys):
    data = _bench(tmp_path, "--suites", "serve", "--threads", "1")
    recs = [r for r in data["records"] if r["suite"] == "serve"]
    if not HAVE_HF:
        assert recs == [{"suite": "serve", "available": False}]
        return
    assert [r["workload"] for r in recs] == ["batch", "trace"]
    for r in recs:
        assert all(r["tokens_match"].values()), r["tokens_match"]
        assert _positive_finite(r["ratio_vs_generate_batch"])
        assert _positive_finite(r["ratio_vs_one_by_one"])
        for x in r["results"].values():
            assert _positive_finite(x["tokens_per_s"]) and x["ttft_median_s"] >= 0
    assert any(r["arrivals_s"][-1] > 0 for r in recs)
    assert "TTFT median / p90" in capsys.readouterr().out


def test_serve_suite_is_opt_in():
    from pagedkv.benchmarks.runner import parse_suites

    assert "serve" not in parse_suites("all") and parse_suites("serve") == ["serve"]


@pytest.mark.skipif(not HAVE_HF, reason="the hf extra (transformers, torch) is not installed")
def test_demo_serve_runs(capsys):
    assert main(["demo", "--serve", "--requests", "5", "--new-tokens", "6",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identical tokens: yes" in out and "all returned at the end: yes" in out
    reused = int(out.split(" tokens reused from the prefix cache")[0].split()[-1])
    assert reused > 0      # the shared system prompt


def test_demo_serve_rejects_bad_counts(capsys):
    assert main(["demo", "--serve", "--requests", "0"]) == 2


def test_bench_targets_show_the_small_call_against_its_pattern_read():
    from pagedkv.benchmarks import runner
    t = {"decode": [], "decode_kv": [], "decode_l2": [], "prefill": [], "append": None,
         "small_call": [{"dtype": "float32", "threads": 1, "us_per_call": 3.0,
                         "pattern_us_per_call": 1.2, "torch_us_per_call": 9.0,
                         "ratio_vs_torch": 3.0}]}
    row = [line for line in runner.format_targets(t).splitlines() if "small call" in line]
    assert len(row) == 1 and "2.5x its pattern read (1.20 µs)" in row[0]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "int8"])
def test_append_bench_check_accepts_the_rounding_and_nothing_more(kv_dtype):
    """The append suite's read-back check for narrower storage: the storage's own rounding
    passes, a value off by more than that does not."""
    from pagedkv.benchmarks.append import _close

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 70)).astype(np.float32)
    x[0, 0, :5] = 1e-6  # tiny values: float16's subnormal spacing
    cache = pagedkv.PagedKVCache(4, 16, 2, 70, kv_dtype=kv_dtype)
    sid = cache.add_sequence()
    cache.append(sid, x, x)
    k, _ = cache.gather(sid)
    assert _close(k, x, kv_dtype)
    for at in [(0, 0, 1), (2, 1, 69)]:
        bad = k.copy()
        bad[at] += 0.02 * float(np.abs(x).max())  # 5x int8's half step, far past 16-bit rounding
        assert not _close(bad, x, kv_dtype)


def test_prefill_target_at_each_thread_count():
    """The targets table gives causal prefill f32 L=2048 against torch at 1 thread and at the
    largest count, each with its time, as it does for decode."""
    from pagedkv.benchmarks.runner import compute_targets, format_targets

    def rec(t, secs, torch_secs):
        return {"suite": "prefill", "dtype": "float32", "L": 2048, "threads": t,
                "torch_variant": "enable_gqa",
                "results": {"pagedkv": {"median_s": secs, "gflops": 100.0 / secs},
                            "torch-sdpa": {"median_s": torch_secs, "gflops": 100.0 / torch_secs}},
                "ratios": {"torch-sdpa": torch_secs / secs}}

    records = [rec(1, 0.4, 0.6), rec(2, 0.2, 0.35), rec(4, 0.1, 0.2)]
    t = compute_targets(records, types.SimpleNamespace(threads=[1, 2]))
    assert [(p["threads"], p["time_s"]) for p in t["prefill"]] == [(1, 0.4), (2, 0.2)]
    assert [p["ratio_vs_torch"] for p in t["prefill"]] == pytest.approx([1.5, 1.75])
    rows = [line for line in format_targets(t).splitlines() if line.startswith("prefill causal")]
    assert len(rows) == 2 and "1.50x" in rows[0] and "1.75x" in rows[1]
    assert compute_targets([], types.SimpleNamespace(threads=[1]))["prefill"] == []


@pytest.mark.parametrize("rewarm", [False, True])
def test_measure_rewarm_runs_one_untimed_call_before_each_sample(rewarm):
    """With rewarm, every sample is preceded by one call of the same implementation that the
    sample does not time (the decode suite: each sample then starts on its own data); without
    it the samples follow each other as before.  The log records (name, calls) per run."""
    from pagedkv.benchmarks.common import Settings
    from pagedkv.benchmarks.timing import Impl, measure

    log = []

    def runner(name):
        return lambda n: log.append((name, n))

    impls = {"a": Impl(runner("a"), inner=3), "b": Impl(runner("b"), inner=2)}
    settings = Settings(threads=[1], dtypes=["float32"], gap=0.0)
    timings = measure(impls, settings, repeats=3, rewarm=rewarm)
    assert [len(timings[n].samples) for n in "ab"] == [3, 3]
    want = [("a", 1), ("b", 1)]               # measure's own warm-up, once
    for order in (["a", "b"], ["b", "a"], ["a", "b"]):
        for n in order:
            if rewarm:
                want.append((n, 1))           # the untimed call
            want.append((n, impls[n].inner))  # the sample
    assert log == want


def test_bench_decode_rewarms_every_sample(tmp_path, monkeypatch):
    """Both of the decode suite's timings (the configurations and the decode in L2) ask measure
    for the untimed call before each sample."""
    from pagedkv.benchmarks import decode, timing

    seen = []

    def spy(impls, settings, **kw):
        seen.append(kw.get("rewarm"))
        return timing.measure(impls, settings, **kw)

    monkeypatch.setattr(decode, "measure", spy)
    _bench(tmp_path, "--suites", "decode", "--threads", "1", "--dtypes", "f32",
           "--kv-dtypes", "none", "--no-torch")
    assert len(seen) >= 3 and all(r is True for r in seen)
