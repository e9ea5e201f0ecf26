"""How a fuzz program reads its arguments from the bytes: small integers and choices, ids,
arrays (often hostile), token ids and cache salts (program.py runs them)."""
import math

import numpy as np

try:
    import ml_dtypes as _ML_DTYPES  # bfloat16 arrays (the bf16 extra)
except ImportError:  # pragma: no cover
    _ML_DTYPES = None

#: the documented exceptions (program.py's docstring)
ALLOWED = (KeyError, ValueError, TypeError, RuntimeError, MemoryError)
#: load of a real file with a valid priority: a file's contents may only raise these
LOAD_ALLOWED = (ValueError, RuntimeError, MemoryError)


class Bytes:
    """Reads small integers and choices from a byte string (zeros once it runs out)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def left(self):
        return len(self.data) - self.pos

    def byte(self):
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, lo, hi):
        """An int in [lo, hi] (hi - lo < 2**32)."""
        span = hi - lo + 1
        if 0 < span < 256:  # one byte (most calls): what the loop below reads, without the loop
            pos = self.pos
            if pos >= len(self.data):
                return lo
            self.pos = pos + 1
            return lo + self.data[pos] % span
        v = 0
        for _ in range((span.bit_length() + 7) // 8):
            v = (v << 8) | self.byte()
        return lo + v % span

    def pick(self, options):
        span = len(options)
        if 0 < span < 256:  # what int(0, span - 1) reads, inline (most calls)
            pos = self.pos
            if pos >= len(self.data):
                return options[0]
            self.pos = pos + 1
            return options[self.data[pos] % span]
        return options[self.int(0, span - 1)]

    def chance(self, in256):
        pos = self.pos  # byte() < in256, inline
        if pos >= len(self.data):
            return 0 < in256
        self.pos = pos + 1
        return self.data[pos] < in256


def _hostile_int(b: Bytes, good):
    """Mostly `good`; otherwise an int, or not an int, chosen to break things."""
    if b.chance(225):
        return good
    return b.pick([-1, 0, 1, good + 1, good - 1, 2**31, 2**31 - 1, 2**63 - 1, -2**63, 2**64,
                   2**200, -2**200, 1.0, float("nan"), True, False, None, "3", np.int8(1),
                   np.uint64(2**64 - 1), np.int64(-1), np.float32(good), [good]])


_HOSTILE_SIDS = [-1, 0, 1, 7, 2**31, 2**62, 2**64, -2**70, 1.5, True, None, "0", np.int32(0),
                 np.uint8(1), np.float64(0)]


def _sid(b: Bytes, live, freed):
    r = b.byte()
    if live and r < 215:
        return live[r % len(live)]
    if freed and r < 235:
        return freed[r % len(freed)]
    return b.pick(_HOSTILE_SIDS)


#: standard normal values, drawn once: an array's data is a slice of them at an offset the
#: bytes choose (a Generator per array cost more than the call it fed)
_NORMALS = np.random.default_rng(0).standard_normal(1 << 16)


_RANDOM_BYTES = {}


def _random_bytes(seed, n):
    """np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes(), from a stream
    drawn once per seed (a shorter draw of one seed is a prefix of a longer one; building the
    Generator cost more than the call it fed)."""
    have = _RANDOM_BYTES.get(seed, b"")
    if len(have) < n:
        have = _RANDOM_BYTES[seed] = np.random.default_rng(seed).integers(
            0, 256, max(n, 4096), dtype=np.uint8).tobytes()
    return have[:n]


def _normals(b: Bytes, n):
    if n > _NORMALS.size // 2:  # only wrong shapes get here (a 2x-too-large strided base)
        return np.random.default_rng(b.byte()).standard_normal(n)
    start = b.byte() * 127
    return _NORMALS[start:start + n].copy()


def _data(b: Bytes, shape, dtype):
    n = math.prod(shape)
    kind = b.int(0, 7)
    if kind == 0:
        a = np.zeros(n)
    elif kind == 1:
        a = np.full(n, b.pick([np.nan, np.inf, -np.inf, 1e38, -1e308, 5e-324, -0.0]))
    elif kind == 2:  # some NaN / inf among normal values
        a = _normals(b, n)
        a[:: max(1, b.int(1, 7))] = b.pick([np.nan, np.inf, -np.inf])
    else:
        a = _normals(b, n) * b.pick([1.0, 1e-3, 1e3, 1e30])
    # (called with NumPy's floating-point warnings off: Runner.run)
    return a.reshape(shape).astype(dtype) if dtype is not object else a.reshape(shape)


def _array(b: Bytes, n, heads, d, dtype):
    """A [n, heads, d] argument, often wrong in one or more ways."""
    shape = [n, heads, d]
    if b.chance(20):  # wrong shape or ndim
        how = b.int(0, 5)
        if how == 0:
            shape = shape[:2]
        elif how == 1:
            shape = shape + [1]
        elif how == 2:
            shape[b.int(0, 2)] += b.pick([-1, 1, 3])
        elif how == 3:
            shape[0] = 0
        elif how == 4:
            shape = []
        shape = [max(0, s) for s in shape]
    if b.chance(20):
        dtype = b.pick([np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_,
                        np.complex64, np.uint8, object, np.dtype(">f4"), np.dtype(">f8")])
    layout = b.int(0, 9) if b.chance(40) else 0
    if layout == 1 and len(shape) == 3 and shape[0] > 0:  # huge broadcast view (tiny memory)
        base = _data(b, [1] + shape[1:], dtype)
        big = b.pick([2**12, 2**31, 2**40, 2**62])
        try:
            return np.lib.stride_tricks.as_strided(base, [big] + shape[1:],
                                                   [0] + list(base.strides[1:]))
        except (ValueError, MemoryError):
            return base
    a = _data(b, shape, dtype)
    if layout == 2 and a.ndim:  # non-contiguous
        big = _data(b, [s * 2 for s in shape], dtype)
        a = big[tuple(slice(None, None, 2) for _ in shape)]
    elif layout == 3:
        a = np.asfortranarray(a)
    elif layout == 4:
        a.setflags(write=False)
    elif layout == 5 and a.dtype != object:  # misaligned
        raw = np.zeros(a.nbytes + 1, np.uint8)
        a = np.frombuffer(raw[1:].data, dtype=a.dtype, count=a.size).reshape(a.shape)
    elif layout == 6 and a.ndim:
        a = a[::-1]
    elif layout == 7:
        return a.tolist()
    elif layout == 8:
        return b.pick([None, 1.0, "k", b"\x00" * 8, [[1.0]]])
    return a


# ----------------------------------------------------------------------
# token ids, cache salts (prefix caching)

SALTS = [None, None, None, "tenant-a", 7, (1, "b"), -0.0]


def _stream_token(j, p):
    """Token id at stream position p of token stream j.  Streams 0-2 share a prefix of
    different lengths (so prompts hit each other's blocks); stream 3 holds ids >= 2**63 (uint64)."""
    if j == 3:
        return 2**63 + p
    split = (10**9, 9, 4)[j]
    return p % 97 if p < split else (p * 31 + j * 1000003) % 2**31


def _hostile_ids(b: Bytes, good):
    """Token ids for `good` (a list of ints), often wrong in length, type or size."""
    if b.chance(200):
        return good
    n = len(good)
    how = b.int(0, 17)
    if how == 0:
        return good[:-1]
    if how == 1:
        return good + [1]
    if how == 2:
        return []
    if how == 3:
        return [float(t) for t in good]
    if how == 4:
        return [str(t) for t in good]
    if how == 5:
        return [True] * n
    if how == 6:
        return np.array(good, dtype=np.float64)
    if how == 7:
        return np.array([good])  # 2-d
    if how == 8:
        return b.pick([5, "abc", b"ab", 1.5, {1: 2}, {1, 2}, object()])
    if how == 9:
        return [2**64] * n
    if how == 10:
        return [-2**70] * n
    if how == 11:
        return [-1] * n + ([2**63] if n else [])  # int64 and uint64 mixed: float64 in NumPy
    if how == 12:
        return np.array([t % 256 for t in good], dtype=np.uint8)
    if how == 13:
        return [None] * n
    if how == 14:
        return (t for t in good)
    if how == 15:
        return np.array(good, dtype=object)
    if how == 16:
        return [np.int64(t % 2**62) for t in good]
    return [[t] for t in good]


def _cdiv(a, b):
    return -(-a // b)
