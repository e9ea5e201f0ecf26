"""Attention accuracy of each storage dtype (kv_dtype) against the float64 reference.

For every kv_dtype, pagedkv's attention output (f32 arrays in and out) is compared with attention
computed in float64 on the exact, unrounded K/V, over a grid of shapes and seeds, with keys of
normal spread and with keys whose 4 outlier channels are 20x larger (as real models' keys have).

    max err  = max over cases of  max |out - ref| / max |ref|
    mean rel = mean over cases of  sum |out - ref| / sum |ref|

Each case runs a causal prefill of the last 32 tokens and one decode query per sequence.

With ``--dtype bfloat16`` / ``float16`` the arrays in and out are 16-bit (bfloat16 needs ml_dtypes):
K, V and queries are rounded to that format first, and the reference is computed on the rounded
values, so the error shown is what storage and the output's rounding add.

Usage: python benchmarks/accuracy.py [--seeds N] [--dtype float32|float64|bfloat16|float16]
                                     [--markdown]
"""
import argparse
import math
import os
import sys

import numpy as np

try:
    import pagedkv
except ImportError:  # a source checkout built in place, run without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pagedkv

KV_DTYPES = ("float32", "bfloat16", "float16", "int8")
# block_size, head_dim, num_kv_heads, query heads per kv head, sequence length
SHAPES = [(16, 128, 2, 4, 1000), (16, 64, 4, 2, 300), (1, 37, 1, 8, 200), (64, 128, 8, 1, 700)]
QUERIES = 32


def reference(q, k, v, scale, offset):
    """Causal attention in float64: query i sees keys 0 .. offset + i."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("nhd,lhd->hnl", q, kr) * scale
    mask = np.arange(k.shape[0])[None, :] <= offset + np.arange(n)[:, None]
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", w, vr)


def keys(rng, shape, outliers):
    k = rng.standard_normal(shape)
    if outliers:
        k[..., rng.choice(shape[-1], 4, replace=False)] *= 20.0
    return k


def np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: PLC0415 - only for this dtype
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def measure(kv_dtype, dtype, outliers, seeds):
    """(max err, mean rel) over the grid for one kv_dtype."""
    worst, rels = 0.0, []
    adt = np_dtype(dtype)
    for seed in range(seeds):
        for ci, (bs, d, hkv, ratio, length) in enumerate(SHAPES):
            rng = np.random.default_rng(1000 * seed + ci)
            kv = None if kv_dtype == dtype else kv_dtype
            cache = pagedkv.PagedKVCache(-(-length // bs) + 1, bs, hkv, d, dtype=dtype,
                                         kv_dtype=kv)
            sid = cache.add_sequence()
            k = keys(rng, (length, hkv, d), outliers).astype(adt)
            v = rng.standard_normal((length, hkv, d)).astype(adt)
            cache.append(sid, k, v)
            q = rng.standard_normal((QUERIES, hkv * ratio, d)).astype(adt)
            scale = 1.0 / math.sqrt(d)
            k64, v64 = k.astype(np.float64), v.astype(np.float64)
            pairs = [(cache.attend(sid, q), reference(q.astype(np.float64), k64, v64, scale,
                                                      length - QUERIES)),
                     (cache.attend(sid, q[-1:]), reference(q[-1:].astype(np.float64), k64, v64,
                                                           scale, length - 1))]
            for out, ref in pairs:
                err = np.abs(out.astype(np.float64) - ref)
                worst = max(worst, float(err.max() / np.abs(ref).max()))
                rels.append(float(err.sum() / np.abs(ref).sum()))
    return worst, float(np.mean(rels))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    kv_dtypes = tuple(k for k in KV_DTYPES if k != args.dtype)
    if args.dtype == "float64":
        kv_dtypes = ("float32",) + kv_dtypes
    rows = []
    for kv_dtype in (args.dtype,) + tuple(kv_dtypes):
        row = [kv_dtype]
        for outliers in (False, True):
            worst, mean = measure(kv_dtype, args.dtype, outliers, args.seeds)
            row += [f"{worst:.1e}", f"{mean:.1e}"]
        rows.append(row)
    head = ["kv_dtype", "max err (normal)", "mean rel (normal)", "max err (outlier keys)",
            "mean rel (outlier keys)"]
    print(f"dtype={args.dtype}, {args.seeds} seeds x {len(SHAPES)} shapes, SIMD path "
          f"{pagedkv.simd_backend()}")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
