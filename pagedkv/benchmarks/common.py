"""What the benchmark suites share besides timing (``timing.py``) and reporting
(``report.py``): the run's settings, thread control, the baselines' check, the progress bar.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from pagedkv.benchmarks.timing import PAGEDKV  # noqa: F401 - the suites' name for pagedkv

NUMPY = "numpy"
BLOCK_SIZE = 16   # tokens per block in every suite

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

    @contextmanager
    def stage(self, label: str):
        """One step of the progress bar: shown as `label` while the block runs, counted
        done when it ends without an exception."""
        if self.progress is not None:
            self.progress.start(label)
        yield
        if self.progress is not None:
            self.progress.step()


@contextmanager
def closing(case):
    """The block's configuration data, freed when it ends (``case.close()``, then a garbage
    collection, so that the next configuration starts with the memory back)."""
    try:
        yield case
    finally:
        case.close()
        gc.collect()


def split_list(text: str) -> List[str]:
    """The non-empty items of a comma-separated option, stripped and lower-cased."""
    return [p for p in (part.strip().lower() for part in str(text).split(",")) if p]


def all_threads() -> int:
    """Logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def parse_threads(text: str) -> List[int]:
    """'1,all' -> [1, N]; duplicates removed, order kept."""
    out: List[int] = []
    for part in split_list(text):
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
    for part in split_list(text):
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
    for part in split_list(text):
        if part == "none":
            continue
        if part not in _KV_ALIASES:
            raise ValueError(f"unknown kv dtype {part!r}; expected bf16, f16, i8 or none")
        if _KV_ALIASES[part] not in out:
            out.append(_KV_ALIASES[part])
    return out


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


def needs_hf(suite: str):
    """Decorates a suite's ``run(settings, torch, transformers)`` into ``run(settings)`` that
    imports torch, transformers and ``pagedkv.integrations.hf`` first, and where they are
    missing notes that the suite is skipped and returns its one "not available" record."""
    def wrap(run):
        @functools.wraps(run)
        def run_suite(settings: Settings) -> List[dict]:
            try:
                import torch  # noqa: PLC0415 - optional extra
                import transformers  # noqa: PLC0415

                import pagedkv.integrations.hf  # noqa: F401, PLC0415
            except ImportError:
                settings.note(f"{suite} suite skipped: transformers and torch are not installed "
                              "(pip install 'pagedkv[hf]')")
                return [{"suite": suite, "available": False}]
            return run(settings, torch, transformers)
        return run_suite
    return wrap


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
# correctness of the baselines


def rel_error(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


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
    err = rel_error(got, want)
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
