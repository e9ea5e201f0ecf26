"""How every suite times (see benchmarks/README.md).

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
  With ``rewarm`` (the decode suite) each sample is also preceded by one
  untimed call, so that a sample's first call does not pay for re-reading
  what the implementation timed before it evicted (which, in samples of a
  few calls, favoured whichever of a pair ran second; measurements in
  benchmarks/README.md).
* Reported: the median per-call time over the rounds (plus min and max), and
  for each baseline the *paired* ratio: the median over rounds of
  (baseline time / pagedkv time) measured in the same round.

The suites whose calls last seconds (hf, serve, prefix) time single calls with
``timed_call`` in rounds ordered by ``round_order``, and summarise them with
``median`` and ``paired_median`` the same way.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

PAGEDKV = "pagedkv"


def median(xs: Iterable[float]) -> float:
    return float(statistics.median(list(xs)))


def paired_median(base: Sequence[float], ours: Sequence[float]) -> float:
    """Median over rounds of base/ours, each pair measured in the same round: > 1 means
    ours is faster."""
    return median(b / o for b, o in zip(base, ours))


def round_order(names: Sequence[str], r: int, rotate: bool = False) -> List[str]:
    """The order of round r: reversed on odd rounds, or (``rotate``) the names rotated by r,
    so that which goes first rotates."""
    names = list(names)
    if rotate:
        k = r % len(names)
        return names[k:] + names[:k]
    return names if r % 2 == 0 else names[::-1]


def timed_call(fn: Callable[[], object], gap: float = 0.0) -> Tuple[float, object]:
    """(seconds, result) of one call of fn, after `gap` idle seconds."""
    if gap:
        time.sleep(gap)
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


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


def measure(impls: Dict[str, Impl], settings, repeats: Optional[int] = None,
            warmup: int = 1, prior: Optional[Dict[str, float]] = None,
            rewarm: bool = False) -> Dict[str, Timing]:
    """Interleaved timing of every implementation (see the module docstring).

    `settings`: a ``common.Settings`` (repeats, target, gap, budget).  `prior`: seconds of
    one call already made (it then replaces the warm-up and the first calibration call).
    `rewarm`: one untimed call before every sample (see the module docstring).
    When a configuration has used more than ``settings.budget`` seconds after at least 3
    rounds, the remaining rounds are dropped (and a note says so)."""
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
        for name in round_order(names, r):
            pause = settings.gap
            if prev is not None and prev.cooldown and not impls[name].cooldown:
                pause = max(pause, prev.cooldown)
            if pause:
                time.sleep(pause)
            if rewarm:
                _timed(impls[name], 1)
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
    return paired_median(base.samples, ours.samples)


def paired_ratios(timings: Dict[str, Timing], ours: str = PAGEDKV,
                  skip: Sequence[str] = ()) -> Dict[str, float]:
    """{name: paired ratio of its time to ours} for every other implementation."""
    return {name: paired_ratio(tm, timings[ours]) for name, tm in timings.items()
            if name != ours and name not in skip}
