"""Shared machinery of the benchmark suites.

Timing method (see benchmarks/README.md):

* Every implementation of one configuration is measured in the same loop,
  interleaved: round r runs A, B, C, ... once each (the order is reversed on
  odd rounds, so none always follows the same neighbour), and this is repeated
  ``repeats`` times.  Slow drifts of the machine (other processes, frequency,
  thermal) then hit every implementation alike.
* A *sample* is ``inner`` back-to-back calls timed together with
  ``time.perf_counter``; ``inner`` is calibrated per implementation so that one
  sample lasts about ``target`` seconds (1 for calls that are already longer).
  Per-call time = sample time / inner.
* Before the rounds, every implementation runs ``warmup`` untimed calls.
* Reported: the median per-call time over the rounds (plus min and max), and
  for each baseline the *paired* ratio: the median over rounds of
  (baseline time / pagedkv time) measured in the same round.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

PAGEDKV = "pagedkv"

# ---------------------------------------------------------------------------
# settings shared by all suites


@dataclass
class Settings:
    """What one ``pagedkv bench`` run measures and how hard."""

    threads: List[int]
    dtypes: List[str]
    # storage dtypes the decode suite also times (same data, kv_dtype=...), vs pagedkv f32/f64
    kv_dtypes: List[str] = field(default_factory=lambda: ["bfloat16", "float16", "int8"])
    repeats: int = 5
    quick: bool = False
    tiny: bool = False           # test-only: minute shapes, finishes in seconds
    long: bool = False           # hf suite: also the 1b-layers model at 16,384 tokens
    hf_models: tuple = ()        # hf suite: models to run (empty: its defaults)
    use_torch: bool = True
    target: float = 0.05         # seconds per timed sample
    gap: float = 0.01            # idle seconds before each sample (lets spinning thread pools sleep)
    budget: Optional[float] = None  # seconds per configuration after which rounds stop (>= 3)
    blas_cooldown: float = 0.2   # idle seconds after a multi-threaded NumPy (BLAS) sample
    progress: Optional["Progress"] = None
    bandwidth: Dict[int, float] = field(default_factory=dict)  # threads -> bytes/s
    notes: List[str] = field(default_factory=list)

    def bw(self, threads: int) -> Optional[float]:
        """Measured read bandwidth (bytes/s) at this thread count, if measured."""
        return self.bandwidth.get(int(threads))

    def cooldown_after_blas(self, threads: int) -> float:
        """Idle time after a sample of a NumPy baseline measured for a row of
        `threads` threads.  OpenBLAS workers spin for ~0.1 s after a call
        (measured: the next 2-thread pagedkv call ran ~70% slower 0-50 ms
        later, and a 1-thread one ~50% slower on a busy 2-CPU machine); that
        time is taken from whichever implementation runs next.  Not needed
        when threadpoolctl holds BLAS to one thread."""
        if threads <= 1 and _blas_limited():
            return 0.0
        return self.blas_cooldown

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def all_threads() -> int:
    """Logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def parse_threads(text: str) -> List[int]:
    """'1,all' -> [1, N]; duplicates removed, order kept."""
    out: List[int] = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        n = all_threads() if part in ("all", "max") else int(part)
        if n < 1:
            raise ValueError(f"thread counts must be >= 1, got {n}")
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("no thread count given")
    return out


_DTYPE_ALIASES = {"f32": "float32", "float32": "float32", "fp32": "float32",
                  "f64": "float64", "float64": "float64", "fp64": "float64"}


def parse_dtypes(text: str) -> List[str]:
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {part!r}; expected f32 or f64")
        if _DTYPE_ALIASES[part] not in out:
            out.append(_DTYPE_ALIASES[part])
    if not out:
        raise ValueError("no dtype given")
    return out


_KV_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "fp16": "float16",
               "float16": "float16", "i8": "int8", "int8": "int8"}


def parse_kv_dtypes(text: str) -> List[str]:
    """'bf16,f16,i8' -> storage dtype names; 'none' or '' -> []."""
    out: List[str] = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part or part == "none":
            continue
        if part not in _KV_ALIASES:
            raise ValueError(f"unknown kv dtype {part!r}; expected bf16, f16, i8 or none")
        if _KV_ALIASES[part] not in out:
            out.append(_KV_ALIASES[part])
    return out


def short_dtype(dtype: str) -> str:
    return {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16",
            "int8": "i8"}.get(str(dtype), str(dtype))


# ---------------------------------------------------------------------------
# thread control


def load_torch(settings: Settings):
    """The torch module, or None (not installed or --no-torch)."""
    if not settings.use_torch:
        return None
    try:
        import torch  # noqa: PLC0415 - optional, slow to import
    except ImportError:
        settings.note("torch is not installed: torch columns are n/a "
                      "(pip install 'pagedkv[bench]')")
        return None
    return torch


class ThreadScope:
    """Sets the thread count of pagedkv, torch and (if threadpoolctl is
    installed) NumPy's BLAS for the duration of a ``with`` block."""

    def __init__(self, threads: int, torch=None):
        self.threads = int(threads)
        self.torch = torch
        self._limiter = None

    def __enter__(self):
        import pagedkv

        self._prev = pagedkv.get_num_threads()
        pagedkv.set_num_threads(self.threads)
        if self.torch is not None:
            self._prev_torch = self.torch.get_num_threads()
            self.torch.set_num_threads(self.threads)
        try:
            from threadpoolctl import threadpool_limits  # noqa: PLC0415 - optional
        except ImportError:
            self._limiter = None
        else:
            self._limiter = threadpool_limits(limits=self.threads, user_api="blas")
        return self

    def __exit__(self, *exc):
        import pagedkv

        pagedkv.set_num_threads(self._prev)
        if self.torch is not None:
            self.torch.set_num_threads(self._prev_torch)
        if self._limiter is not None:
            self._limiter.restore_original_limits()
        return False


def _blas_limited() -> bool:
    try:
        import threadpoolctl  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def numpy_threads_note() -> str:
    try:
        import threadpoolctl  # noqa: F401, PLC0415
    except ImportError:
        env = [f"{k}={os.environ[k]}" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                 "MKL_NUM_THREADS") if k in os.environ]
        how = ", ".join(env) if env else "its default"
        return ("NumPy baselines use as many BLAS threads as the environment gives them "
                f"({how}; threadpoolctl is not installed, so the 'thr' column does not "
                "apply to NumPy)")
    return "NumPy's BLAS threads are limited to the 'thr' column with threadpoolctl"


# ---------------------------------------------------------------------------
# timing


@dataclass
class Timing:
    """Per-call seconds of one implementation in one configuration."""

    samples: List[float]  # per-call seconds, one per round
    inner: int            # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def as_dict(self) -> dict:
        return {"median_s": self.median, "min_s": min(self.samples), "max_s": max(self.samples),
                "rounds": len(self.samples), "samples_s": list(self.samples),
                "inner": self.inner}


@dataclass
class Impl:
    """One implementation under test.

    ``run(n)`` performs n calls back to back (keeping the loop inside lets a
    µs-scale call be timed without a Python closure call per iteration).
    ``setup()`` runs untimed before every sample (e.g. to rewind a cache).
    ``inner`` fixes the calls per sample instead of calibrating it.
    ``cooldown``: idle seconds between one of its samples and a following
    sample of an implementation without a cooldown (see
    ``Settings.cooldown_after_blas``; two BLAS users in a row need none: the
    spinning workers serve the second one).
    """

    run: Callable[[int], None]
    setup: Optional[Callable[[], None]] = None
    inner: Optional[int] = None
    cooldown: float = 0.0


def _timed(impl: Impl, n: int) -> float:
    if impl.setup is not None:
        impl.setup()
    t0 = time.perf_counter()
    impl.run(n)
    return time.perf_counter() - t0


def calibrate(impl: Impl, target: float, max_inner: int = 100_000,
              first: Optional[float] = None) -> int:
    """Calls per sample so that a sample lasts about `target` seconds.
    `first`: an already measured duration of one call (saves a call)."""
    if impl.inner is not None:
        return impl.inner
    n = 1
    for i in range(4):
        dt = first if (i == 0 and first is not None) else _timed(impl, n)
        if dt >= 0.5 * target or n >= max_inner:
            break
        n = min(max_inner, max(n + 1, int(math.ceil(n * target / max(dt, 1e-7)))))
    return n


def timed_once(impls: Dict[str, Impl]) -> Dict[str, float]:
    """Run every implementation once (a warm-up, e.g. for a correctness
    check); returns the seconds each took, for ``measure(prior=...)``."""
    return {name: _timed(impl, 1) for name, impl in impls.items()}


def measure(impls: Dict[str, Impl], settings: Settings, repeats: Optional[int] = None,
            warmup: int = 1, prior: Optional[Dict[str, float]] = None) -> Dict[str, Timing]:
    """Interleaved timing of every implementation (see the module docstring).

    `prior`: seconds of one call already made (it then replaces the warm-up
    and the first calibration call).  When a configuration has used more
    than ``settings.budget`` seconds after at least 3 rounds, the remaining
    rounds are dropped (and a note says so)."""
    repeats = settings.repeats if repeats is None else repeats
    names = list(impls)
    prior = prior or {}
    for name in names:
        if name not in prior:
            for _ in range(warmup):
                _timed(impls[name], 1)
    inner = {name: calibrate(impls[name], settings.target, first=prior.get(name))
             for name in names}
    samples: Dict[str, List[float]] = {name: [] for name in names}
    # the warm-up and calibration calls may have just run a BLAS user
    initial = max((impls[n].cooldown for n in names), default=0.0)
    if initial:
        time.sleep(initial)
    t0 = time.perf_counter()
    prev = None
    for r in range(max(1, repeats)):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            pause = settings.gap
            if prev is not None and prev.cooldown and not impls[name].cooldown:
                pause = max(pause, prev.cooldown)
            if pause:
                time.sleep(pause)
            samples[name].append(_timed(impls[name], inner[name]) / inner[name])
            prev = impls[name]
        if (settings.budget is not None and r + 1 >= min(3, repeats) and r + 1 < repeats
                and time.perf_counter() - t0 > settings.budget):
            settings.note(f"a time budget ({settings.budget:.0f} s per configuration) cut some "
                          "slow configurations to fewer rounds than --repeats (at least 3; "
                          "'rounds' in the JSON)")
            break
    return {name: Timing(samples[name], inner[name]) for name in names}


def paired_ratio(base: Timing, ours: Timing) -> float:
    """Median over rounds of base/ours: > 1 means pagedkv is faster."""
    return statistics.median(b / o for b, o in zip(base.samples, ours.samples))


# ---------------------------------------------------------------------------
# correctness of the baselines


def check_close(name: str, got, want, dtype) -> float:
    """Raise unless `got` matches `want` (pagedkv's output); return the error.

    Tolerance: relative 1e-4 for f32, 1e-10 for f64, measured against the
    largest magnitude of `want` (outputs are averages that can be near 0)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"baseline {name}: shape {got.shape} differs from pagedkv's "
                             f"{want.shape}")
    rtol = 1e-4 if np.dtype(dtype) == np.float32 else 1e-10
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    if not np.isfinite(err) or err > rtol:
        raise AssertionError(f"baseline {name} does not compute what pagedkv computes: "
                             f"max relative error {err:.3g} > {rtol:g}")
    return err


# ---------------------------------------------------------------------------
# progress bar


class Progress:
    """A one-line progress bar on stderr (a plain line per step when stderr is
    not a terminal, nothing when disabled)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = max(int(total), 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.label = ""

    def add_total(self, n: int) -> None:
        self.total += int(n)

    def start(self, label: str) -> None:
        self.label = label
        self._draw()

    def step(self, label: Optional[str] = None) -> None:
        self.done = min(self.done + 1, self.total)
        if label is not None:
            self.label = label
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        frac = self.done / self.total
        width = 24
        fill = int(round(frac * width))
        bar = "#" * fill + "-" * (width - fill)
        text = (f"[{bar}] {self.done:>3}/{self.total:<3} {_fmt_elapsed(el):>6}  "
                f"{self.label}")
        if self.tty:
            cols = 100
            self.stream.write("\r" + text[:cols].ljust(cols))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def _fmt_elapsed(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


# ---------------------------------------------------------------------------
# formatting


def fmt_time(s: Optional[float]) -> str:
    if s is None or not math.isfinite(s):
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs" if s < 1e-5 else f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_num(x: Optional[float], digits: int = 1) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


def fmt_pct(x: Optional[float]) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.0f}%"


def fmt_ratio(x: Optional[float]) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.2f}x"


def fmt_spread(res: dict) -> str:
    """(max - min) / median of a result's rounds, as a percentage: how much to
    trust its median."""
    med = res.get("median_s")
    if not med or len(res.get("samples_s", ())) < 2:
        return ""
    return f"{100.0 * (res['max_s'] - res['min_s']) / med:.0f}%"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Optional[Sequence[bool]] = None) -> str:
    """A plain-text table; `right[i]` right-aligns column i (default: all but
    text columns named in headers are right-aligned)."""
    ncol = len(headers)
    if right is None:
        right = [True] * ncol
    width = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            width[i] = max(width[i], len(cell))

    def line(cells):
        parts = []
        for i, c in enumerate(cells):
            parts.append(c.rjust(width[i]) if right[i] else c.ljust(width[i]))
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in width)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


# ---------------------------------------------------------------------------
# machine description and JSON


def machine_info() -> dict:
    import pagedkv

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "logical_cpus": all_threads(),
        "numpy": np.__version__,
        "pagedkv": pagedkv.__version__,
        "simd_backend": pagedkv.simd_backend(),
        "simd_supported": pagedkv.simd_supported(),
        "openmp": pagedkv.has_openmp(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                           "MKL_NUM_THREADS", "PAGEDKV_SIMD")
                if k in os.environ},
    }
    try:
        import threadpoolctl  # noqa: PLC0415

        info["threadpoolctl"] = threadpoolctl.__version__
    except ImportError:
        info["threadpoolctl"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _clean(obj):
    """JSON-safe copy: non-finite floats become None, numpy scalars plain."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else None
    return obj


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(_clean(data), f, indent=1)
        f.write("\n")
