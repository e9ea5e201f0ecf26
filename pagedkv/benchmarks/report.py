"""How every suite reports: units, plain-text tables, the machine header and the JSON."""
from __future__ import annotations

import json
import math
import os
import platform
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from pagedkv.benchmarks.timing import Timing

# ---------------------------------------------------------------------------
# units


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def fmt_time(s: Optional[float]) -> str:
    if not _finite(s):
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs" if s < 1e-5 else f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_num(x: Optional[float], digits: int = 1) -> str:
    return f"{x:.{digits}f}" if _finite(x) else "n/a"


def fmt_pct(x: Optional[float]) -> str:
    return f"{x:.0f}%" if _finite(x) else "n/a"


def fmt_ratio(x: Optional[float]) -> str:
    return f"{x:.2f}x" if _finite(x) else "n/a"


def fmt_spread(res: dict) -> str:
    """(max - min) / median of a result's rounds, as a percentage: how much to
    trust its median."""
    med = res.get("median_s")
    if not med or len(res.get("samples_s", ())) < 2:
        return ""
    return f"{100.0 * (res['max_s'] - res['min_s']) / med:.0f}%"


def timed_cells(res: dict) -> List[str]:
    """The time and spread cells of a result."""
    return [fmt_time(res["median_s"]), fmt_spread(res)]


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def short_dtype(dtype: str) -> str:
    return {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16",
            "int8": "i8"}.get(str(dtype), str(dtype))


# ---------------------------------------------------------------------------
# tables


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Optional[Sequence[bool]] = None) -> str:
    """A plain-text table; `right[i]` right-aligns column i (default: all)."""
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


def section(head: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
            right: Optional[Sequence[bool]] = None) -> str:
    """A suite's report: its heading line(s), then its table."""
    return head + "\n" + table(headers, rows, right)


def suite_section(recs: Sequence[dict], suite: str, head: Callable[[dict], str],
                  headers: Sequence[str], rows_of: Callable[[dict], List[List[str]]],
                  right: Optional[Sequence[bool]] = None) -> str:
    """The report of a suite's records ("" if there are none): ``head(first record)``, then
    a table of ``rows_of(record)`` for each."""
    recs = [r for r in recs if r["suite"] == suite]
    if not recs:
        return ""
    return section(head(recs[0]), headers, [row for r in recs for row in rows_of(r)], right)


def grouped(cfg: Sequence[str], rows: Sequence[Sequence[str]]) -> List[List[str]]:
    """The rows of one configuration: its cells `cfg` on the first row, blanks below."""
    return [list(cfg if i == 0 else [""] * len(cfg)) + list(row) for i, row in enumerate(rows)]


def impl_rows(rec: dict, names: Sequence[str], cells: Callable[[str, dict], List[str]],
              ncols: int, why: Callable[[str], str] = lambda name: "n/a") -> List[List[str]]:
    """A record's rows, one per implementation: ``cells(name, result)`` where it was
    measured, else its name, ``why(name)`` and blanks (`ncols` cells in all)."""
    rows = []
    for name in names:
        res = rec["results"].get(name)
        rows.append(cells(name, res) if res is not None
                    else [name, why(name)] + [""] * (ncols - 2))
    return rows


# ---------------------------------------------------------------------------
# JSON rows


def results_of(timings: Dict[str, Timing],
               extra: Callable[[str, Timing], dict]) -> Dict[str, dict]:
    """{implementation: its timing's JSON (median, min, max, rounds, samples, inner) plus
    ``extra(name, timing)``}: the "results" of a record."""
    return {name: {**tm.as_dict(), **extra(name, tm)} for name, tm in timings.items()}


def machine_info() -> dict:
    import pagedkv
    from pagedkv.benchmarks.common import all_threads

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
