"""Plain NumPy reference for the pagedkv tests (a helper module, not a test file).

Everything here is written against the public API (the README and the docstrings) only:

* ``ref_attention`` is a direct, unoptimised attention computed in float64.
* ``TOL`` is the tolerance table.  For a cache of dtype ``T`` the kernels must match the reference
  with ``rtol = TOL[T]`` and ``atol = rtol * max(|v|)`` where ``v`` are the values the queries read
  (the absolute part covers outputs that are near zero because positive and negative values cancel).
  Use :func:`assert_attention_close`, which applies exactly that rule.
* ``build_random_cache`` fills a fresh cache with random tokens in interleaved chunks and returns a
  model of what was appended, so a test can compare ``gather`` / ``attend`` against it.
* ``snapshot`` / ``assert_unchanged`` capture everything observable about a cache, to check that a
  call that raised left it as it was.
"""

import math
import threading

import numpy as np

from pagedkv.prefix import _same_prefix

TOL = {np.float32: 1e-5, np.float64: 1e-12}


def tol_for(dtype):
    """rtol for a cache dtype given as a string, numpy type or numpy dtype."""
    return TOL[np.dtype(dtype).type]


def blocks_for(length, block_size):
    """Blocks needed to hold ``length`` tokens (no eviction)."""
    return -(-int(length) // int(block_size))


def ref_attention(q, k, v, scale, causal_offset):
    """Reference attention, computed in float64.

    Args:
        q: [n, Hq, D] queries.
        k, v: [L, Hkv, D] keys and values, Hq % Hkv == 0.  Query head h reads KV head
            h // (Hq // Hkv) (the KV heads are repeated, as GQA/MQA do).
        scale: multiplier of the dot products.
        causal_offset: query i (0-based) attends to keys 0 .. causal_offset + i inclusive.  For
            ``attend`` with n queries over a sequence of L tokens this is L - n; for one decode query
            at the newest token it is L - 1.

    Returns:
        [n, Hq, D] float64.
    """
    q64 = np.asarray(q, dtype=np.float64)
    k64 = np.asarray(k, dtype=np.float64)
    v64 = np.asarray(v, dtype=np.float64)
    n, hq, d = q64.shape
    length, hkv, d_k = k64.shape
    assert d == d_k and v64.shape == k64.shape
    assert hq % hkv == 0, (hq, hkv)
    assert 0 <= causal_offset and causal_offset + n <= length, (causal_offset, n, length)
    group = hq // hkv
    k_rep = np.repeat(k64, group, axis=1)  # [L, Hq, D]: column h holds KV head h // group
    v_rep = np.repeat(v64, group, axis=1)
    scores = np.einsum("nhd,lhd->hnl", q64, k_rep) * float(scale)  # [Hq, n, L]
    rows = np.arange(n)[:, None]
    cols = np.arange(length)[None, :]
    allowed = cols <= causal_offset + rows  # [n, L]
    scores = np.where(allowed[None, :, :], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", weights, v_rep)


def query_as_scored(cache, q, scale):
    """(q, scale) as ``cache``'s kernels score the keys with them.

    Where ``cache.quantizes_queries`` (int8 keys on an integer dot product, the documented query
    rounding), each group of 32 values of a head vector (in float32, before the softmax scale,
    which the kernels apply to the scores) is rounded to int8 steps of max |x| / 127 (ties to
    even); the result holds the rounded values times their steps.  Where
    ``cache.rounds_queries_bf16`` (bfloat16 keys scored with vdpbf16ps), each value (in float32)
    is rounded to bfloat16, to nearest even.  Otherwise q as given.
    """
    if getattr(cache, "rounds_queries_bf16", False):
        return ref_round_float(np.asarray(q, dtype=np.float32), "bfloat16"), scale
    if not cache.quantizes_queries:
        return q, scale
    x = np.asarray(q, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.float64)
    for g0 in range(0, x.shape[-1], 32):
        g = x[..., g0:g0 + 32]
        amax = np.abs(g).max(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
        steps = np.rint((g * inv).astype(np.float32))
        out[..., g0:g0 + 32] = steps.astype(np.float64) * (amax / np.float32(127.0)).astype(np.float64)
    return out, scale


def ref_attention_options(q, k, v, scale, causal_offset, window=None, softcap=None, sinks=None):
    """``ref_attention`` with the kernel options, in float64.

    window: query i (at key index causal_offset + i) sees keys j with
        causal_offset + i - window < j <= causal_offset + i (transformers' sliding mask).
    softcap: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
    sinks: [Hq] logits, one per query head, added to the softmax denominator (no value):
        weights = exp(s_j) / (sum_j exp(s_j) + exp(sink)).
    """
    q64 = np.asarray(q, dtype=np.float64)
    k64 = np.asarray(k, dtype=np.float64)
    v64 = np.asarray(v, dtype=np.float64)
    n, hq, d = q64.shape
    length, hkv, _ = k64.shape
    group = hq // hkv
    k_rep = np.repeat(k64, group, axis=1)
    v_rep = np.repeat(v64, group, axis=1)
    scores = np.einsum("nhd,lhd->hnl", q64, k_rep) * float(scale)  # [Hq, n, L]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    last = causal_offset + np.arange(n)[:, None]
    cols = np.arange(length)[None, :]
    allowed = cols <= last
    if window is not None:
        allowed &= cols > last - window
    scores = np.where(allowed[None, :, :], scores, -np.inf)
    mx = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        mx = np.maximum(mx, np.asarray(sinks, np.float64)[:, None, None])
    weights = np.exp(scores - mx)
    den = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[:, None, None] - mx)
    return np.einsum("hnl,lhd->nhd", weights / den, v_rep)


def weights_tol(cache):
    """What ``cache``'s rounding of the attention weights to int16 (``cache.quantizes_weights``:
    P.V of int8 values on vpdpwssd, include/pagedkv/attn_pvdot.h) may add to an output, as a
    fraction of max |v|: each weight moves by at most half of its tile's unit (the tile's largest
    weight times its largest value scale / 32767), so a row by at most (keys of a tile) / 65534
    of max |v|.  0 where the cache does not round them."""
    if cache is None or not getattr(cache, "quantizes_weights", False):
        return 0.0
    bs = cache.block_size
    # the tile there, decode's and prefill's: PKV_I16_TILE_KEYS = 128 (attn_args.h)
    tile = bs if bs >= 128 else (128 // bs) * bs
    return tile / 65534.0


def assert_attention_close(actual, expected, dtype, values, err_msg="", cache=None):
    """Compare with rtol = TOL[dtype] and atol = (rtol + weights_tol(cache)) * max(|values|)."""
    rtol = tol_for(dtype)
    vmax = float(np.max(np.abs(np.asarray(values, dtype=np.float64)))) if np.size(values) else 1.0
    atol = (rtol + weights_tol(cache)) * max(vmax, np.finfo(np.float64).tiny)
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol, err_msg=err_msg
    )


def random_tokens(rng, n, heads, head_dim, dtype):
    """Standard-normal [n, heads, D] array already in ``dtype`` (so what is stored is exact)."""
    return rng.standard_normal((n, heads, head_dim)).astype(np.dtype(dtype))


class SeqModel:
    """What was appended to one sequence, per layer: ``k[layer]`` and ``v[layer]`` are [len, Hkv, D]."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype):
        empty = np.zeros((0, num_kv_heads, head_dim), dtype=np.dtype(dtype))
        self.k = [empty.copy() for _ in range(num_layers)]
        self.v = [empty.copy() for _ in range(num_layers)]

    def __len__(self):
        return self.k[0].shape[0]

    def copy(self):
        other = SeqModel.__new__(SeqModel)
        other.k = [a.copy() for a in self.k]
        other.v = [a.copy() for a in self.v]
        return other

    def extend(self, layer, k, v):
        """Layer 0 grows the sequence; layer l > 0 overwrites the newest n positions."""
        n = k.shape[0]
        if layer == 0:
            self.k[0] = np.concatenate([self.k[0], k])
            self.v[0] = np.concatenate([self.v[0], v])
        else:
            length = len(self)
            base_k = self.k[layer]
            base_v = self.v[layer]
            if base_k.shape[0] < length:  # positions not written on this layer yet
                pad = np.zeros((length - base_k.shape[0],) + base_k.shape[1:], base_k.dtype)
                base_k = np.concatenate([base_k, pad])
                base_v = np.concatenate([base_v, pad])
            base_k = base_k[:length].copy()
            base_v = base_v[:length].copy()
            base_k[length - n:] = k
            base_v[length - n:] = v
            self.k[layer] = base_k
            self.v[layer] = base_v

    def truncate(self, length):
        self.k = [a[:length].copy() for a in self.k]
        self.v = [a[:length].copy() for a in self.v]


def append_step(cache, model, sid, rng, n, num_layers, num_kv_heads, head_dim, dtype):
    """One model step for one sequence: append n random tokens on every layer, layer 0 first."""
    for layer in range(num_layers):
        k = random_tokens(rng, n, num_kv_heads, head_dim, dtype)
        v = random_tokens(rng, n, num_kv_heads, head_dim, dtype)
        cache.append(sid, k, v, layer=layer)
        model.extend(layer, k, v)


def build_random_cache(
    rng,
    *,
    lengths,
    block_size,
    num_kv_heads,
    head_dim,
    num_layers=1,
    dtype="float32",
    num_blocks=None,
    spare_blocks=3,
    max_chunk=None,
    **cache_kwargs,
):
    """A fresh cache holding one sequence per entry of ``lengths``, filled with random tokens.

    Chunks of random size (1..max_chunk) are appended to randomly chosen sequences, so the
    sequences' blocks interleave in the pool.  Each chunk is written on every layer (layer 0 first).

    Returns:
        (cache, sids, models): ``models[sid]`` is a :class:`SeqModel` of what was appended.
    """
    import pagedkv

    dtype = np.dtype(dtype)
    if num_blocks is None:
        num_blocks = sum(blocks_for(length, block_size) for length in lengths) + spare_blocks
    if max_chunk is None:
        max_chunk = max(1, 2 * block_size + 1)
    cache = pagedkv.PagedKVCache(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        dtype=dtype.name,
        **cache_kwargs,
    )
    sids = [cache.add_sequence() for _ in lengths]
    models = {sid: SeqModel(num_layers, num_kv_heads, head_dim, dtype) for sid in sids}
    remaining = dict(zip(sids, lengths))
    while True:
        active = [sid for sid in sids if remaining[sid] > 0]
        if not active:
            break
        sid = active[int(rng.integers(len(active)))]
        n = int(rng.integers(1, min(max_chunk, remaining[sid]) + 1))
        append_step(cache, models[sid], sid, rng, n, num_layers, num_kv_heads, head_dim, dtype)
        remaining[sid] -= n
    return cache, sids, models


def mid_block_length(rng, block_size, max_blocks):
    """A random length that ends inside a block (when block_size > 1), spanning 1..max_blocks blocks."""
    full = int(rng.integers(0, max_blocks))
    if block_size == 1:
        return full + 1
    return full * block_size + int(rng.integers(1, block_size))


def snapshot(cache, sids, layers=(0,)):
    """Everything observable about ``sids`` and the pool (for atomicity checks)."""
    stats = cache.stats()
    state = {
        "num_free_blocks": cache.num_free_blocks,
        "stats": (stats.blocks_total, stats.blocks_free, stats.blocks_used, stats.cow_copies, stats.forks),
        "seqs": {},
    }
    for sid in sids:
        gathered = []
        for layer in layers:
            k, v = cache.gather(sid, layer=layer)
            gathered.append((np.array(k, copy=True), np.array(v, copy=True)))
        state["seqs"][sid] = (
            cache.seq_len(sid),
            np.array(cache.kept_positions(sid), copy=True),
            gathered,
        )
    return state


def assert_unchanged(cache, before, layers=(0,)):
    after = snapshot(cache, list(before["seqs"]), layers)
    assert after["num_free_blocks"] == before["num_free_blocks"]
    assert after["stats"] == before["stats"]
    for sid, (length, kept, gathered) in before["seqs"].items():
        length2, kept2, gathered2 = after["seqs"][sid]
        assert length2 == length, (sid, length, length2)
        np.testing.assert_array_equal(kept2, kept)
        for (k, v), (k2, v2) in zip(gathered, gathered2):
            assert k2.shape == k.shape and v2.shape == v.shape
            np.testing.assert_array_equal(k2, k)
            np.testing.assert_array_equal(v2, v)


def check_against_model(cache, sid, model, num_layers):
    """gather / seq_len / kept_positions agree exactly with a SeqModel."""
    length = len(model)
    assert cache.seq_len(sid) == length
    kept = np.asarray(cache.kept_positions(sid))
    assert kept.dtype == np.int64
    np.testing.assert_array_equal(kept, np.arange(length, dtype=np.int64))
    for layer in range(num_layers):
        k, v = cache.gather(sid, layer=layer)
        assert k.dtype == cache.dtype and v.dtype == cache.dtype
        assert k.shape == model.k[layer].shape, (k.shape, model.k[layer].shape)
        assert v.shape == model.v[layer].shape
        assert k.flags.c_contiguous and v.flags.c_contiguous
        np.testing.assert_array_equal(k, model.k[layer])
        np.testing.assert_array_equal(v, model.v[layer])


def math_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------
# storage dtypes (kv_dtype): what a stored value reads back as, written from the contract
# (round to nearest, ties to even; int8 symmetric with a float32 scale per 32 values)

KV_DTYPES = ("bfloat16", "float16", "int8")

# max |attention error| / max |output| against the float64 reference on the exact K/V (issue 8's
# bounds), for keys of normal spread
KV_TOL = {"bfloat16": 1e-2, "float16": 1e-2, "int8": 3e-2, "float32": 1e-5, "float64": 1e-12}
# the same with a few key channels 20x larger: the storage itself loses more there (bfloat16's
# 8-bit significand on the large scores; int8's group scale, set by the outlier, leaves the other
# 31 channels of its group few levels).  Worst over benchmarks/accuracy.py's grid (10 seeds x 4
# shapes): bf16 4.6e-2, f16 3.6e-3, int8 1.5e-1 (docs/performance.md, "Accuracy of the storage
# formats"); bounds ~30% above.
KV_TOL_OUTLIER = {"bfloat16": 6e-2, "float16": 5e-3, "int8": 2e-1, "float32": 1e-5,
                  "float64": 1e-12}

_FORMATS = {  # significand bits (with the implicit one), smallest normal exponent, largest finite
    "bfloat16": (8, -126, float.fromhex("0x1.fep127")),
    "float16": (11, -14, 65504.0),
}


def ref_round_float(x, fmt):
    """x rounded to bfloat16 / float16 (nearest, ties to even, overflow to inf), as float64.

    Computed from frexp and rint on float64 (exact scalings), independently of the bit tricks
    the C code uses."""
    bits, emin, max_finite = _FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = np.frexp(a)  # a = f * 2**e, 0.5 <= f < 1
        quantum = np.maximum(e - bits, emin - bits + 1)  # exponent of one unit in the last place
        y = np.ldexp(np.rint(np.ldexp(a, -quantum)), quantum)
        y = np.where(y > max_finite, np.inf, y)
    y = np.copysign(y, x)
    return np.where(np.isnan(x), np.nan, y)


def ref_int8(x, dtype):
    """Dequantized int8 storage of x [..., D] for compute dtype `dtype`: per group of 32 values of
    the last axis, scale = float32(max finite |x| / 127), q = clip(rint(x / scale)) (as x * (1 /
    scale) in float64), value = dtype(q) * dtype(scale); a group with NaN/inf reads as NaN."""
    dtype = np.dtype(dtype)
    x64 = np.asarray(x, dtype=np.float64)
    out = np.empty(x64.shape, dtype=dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for g0 in range(0, x64.shape[-1], 32):
            g = x64[..., g0:g0 + 32]
            finite = np.isfinite(g)
            amax = np.where(finite, np.abs(g), 0.0).max(axis=-1, keepdims=True)
            scale = (amax / 127.0).astype(np.float32)
            inv = np.where(scale > 0, 1.0 / scale.astype(np.float64), 0.0)
            q = np.clip(np.rint(g * inv), -127, 127)
            deq = q.astype(dtype) * scale.astype(dtype)
            out[..., g0:g0 + 32] = np.where(finite.all(axis=-1, keepdims=True), deq, np.nan)
    return out


def ref_stored(x, kv_dtype, dtype):
    """What K/V values x (compute dtype `dtype`) read back as from a cache storing kv_dtype."""
    dtype = np.dtype(dtype)
    x = np.asarray(x, dtype=dtype)
    if kv_dtype is None or kv_dtype == dtype.name:
        return x.copy()
    if kv_dtype == "float32":
        with np.errstate(over="ignore"):
            return x.astype(np.float32).astype(dtype)
    if kv_dtype == "int8":
        return ref_int8(x, dtype)
    return ref_round_float(x, kv_dtype).astype(dtype)


def check_pool_invariants(cache):
    """Block accounting of a whole cache, read in one hold of its lock.

    Every block's reference count equals the number of block-table entries naming it, the free
    queue holds exactly the unreferenced blocks, free + used == total, and stats agree.  (When a
    feature adds references, such as a prefix index, count them here.)
    """
    core = cache._core  # the facade's queries below are the core's own methods
    with core.hold():
        seqs = [(sid, core.block_table(sid).tolist(), core.seq_len(sid))
                for sid in core.sequence_ids()]
        ref_count = core.pool.ref_count
        counts = [ref_count(b) for b in range(core.num_blocks)]
        check_accounting(cache, seqs, counts, core.pool.free_blocks(), core.num_free_blocks)


def check_accounting(cache, seqs, counts, free_queue, num_free, with_stats=True):
    """check_pool_invariants on what was read of the cache (call with its lock held, or with
    nothing changed since the reads): seqs [(sid, block table as a list, seq_len)] of every live
    sequence, counts every block's reference count, free_queue pool.free_blocks(), num_free
    num_free_blocks.  with_stats=False leaves out the checks of stats() (the fuzz programs,
    which check it once a program: stats() holds no state of its own)."""
    core = cache._core
    num_blocks, bs = core.num_blocks, core.block_size
    refs = [0] * num_blocks
    tokens = 0
    assert len(counts) == num_blocks, (len(counts), num_blocks)
    for sid, table, n in seqs:
        assert len(table) == core.num_seq_blocks(sid)
        assert len(set(table)) == len(table), f"sequence {sid} names a block twice: {table}"
        for b in table:
            assert 0 <= b < num_blocks, f"sequence {sid} names block {b} of {num_blocks}"
            refs[b] += 1
        tokens += n
        assert n <= len(table) * bs
    if refs != list(counts):
        b = next(b for b in range(num_blocks) if refs[b] != counts[b])
        raise AssertionError(f"block {b}: ref count {counts[b]}, referenced {refs[b]} times")
    free = [b for b in range(num_blocks) if not refs[b]]
    assert num_free == len(free), (num_free, len(free))
    assert sorted(free_queue) == free  # the queue: each free block once
    if with_stats:
        stats = cache.stats()
        assert stats.blocks_free + stats.blocks_used == stats.blocks_total == num_blocks
        assert stats.tokens_held == tokens
        cached_free = stats.cached_free_blocks
    else:
        cached_free = core.pool.num_cached_free
    prefix = getattr(cache, "_prefix", None)
    if prefix is not None:
        check_prefix_index(cache, prefix, counts, cached_free)


def check_prefix_index(cache, prefix, counts, cached_free):
    """The prefix index against the pool and the live sequences (call with the cache's lock held).

    A prefix index adds no references: a registered block whose last reference went stays on the
    free queue, `cached`, until it is handed out again (counted above as free).  Here: the index
    maps each key to a non-empty list of entries (the registered copies of one content), each
    keyed by its own hash; every entry sits on a block of its own (``_by_block`` names exactly the
    index's entries), so the index never holds more entries than the pool has blocks; the blocks
    marked cached are exactly the blocks of the valid entries; the free ones among them are
    `cached_free` (stats().cached_free_blocks); the valid copies under one key hold the same
    token ids, salt and parent chain (a collision is never registered beside them).  Per live
    sequence (and only those: freeing and eviction release the state): its chain names its own
    blocks, each entry valid and in the index, with the sequence's token ids and salt, each
    chained to the one before it by content; and the chain covers every full block written on
    every layer whose ids are known (a live copy is always registered, so always hit-able),
    unless a hash collision stopped it (possible only where a test replaced ``_hash``)."""
    core = cache._core
    pool = core.pool
    n = cache.num_blocks
    bs = cache.block_size
    generation, is_cached = pool.generation, pool.is_cached
    cached = [b for b in range(n) if is_cached(b, generation(b))]
    assert cached_free == sum(1 for b in cached if counts[b] == 0), (cached_free, cached)
    entries = []
    for key, copies in prefix._index.items():
        assert isinstance(copies, list) and copies, (key, copies)
        assert all(key == e.key for e in copies)
        entries += copies
        valid = [e for e in copies if prefix._valid(e)]
        for e in valid[1:]:
            c = valid[0]
            assert (e.tokens, e.salt) == (c.tokens, c.salt) and _same_prefix(e.parent, c.parent), (
                f"key {key}: copies with other contents {c.tokens} {e.tokens}")
    assert prefix.num_entries == len(entries) <= n, (len(entries), n)
    assert len({id(e) for e in entries}) == len(entries), "an entry listed twice"
    assert len(prefix._by_block) == len(entries), (len(prefix._by_block), len(entries))
    assert all(prefix._by_block.get(e.block) is e for e in entries), "_by_block out of step"
    valid = sorted(e.block for e in entries if prefix._valid(e))
    assert valid == cached, f"valid index entries on blocks {valid}, cached blocks {cached}"
    assert sorted(prefix._seqs) == sorted(cache.sequence_ids())
    forced = "_hash" in vars(prefix)  # a test forces hash collisions
    for sid, st in prefix._seqs.items():
        table = cache.block_table(sid).tolist()
        assert len(st.chain) * bs <= cache.seq_len(sid), (sid, len(st.chain), cache.seq_len(sid))
        for i, e in enumerate(st.chain):
            assert e.block == table[i], f"sequence {sid} block {i}: entry on {e.block}, holds {table[i]}"
            assert prefix._valid(e) and prefix._by_block.get(e.block) is e, (sid, i)
            assert e.tokens == tuple(st.tokens[i * bs:(i + 1) * bs]), (sid, i)
            assert e.salt is st.salt or e.salt == st.salt, (sid, i)
            assert _same_prefix(e.parent, st.chain[i - 1] if i else None), (sid, i)
        full = min(core.written_tokens(sid), len(st.tokens)) // bs
        assert len(st.chain) == full or forced and len(st.chain) < full, (
            f"sequence {sid}: {len(st.chain)} blocks registered of {full} full with known ids")


def rope_rotate(x, positions, theta=10000.0, rotary_dim=None):
    """Rotate-half RoPE of x [m, H, D] at positions [m], in float64."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    rd = d if rotary_dim is None else rotary_dim
    half = rd // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) / half)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    x0, x1 = x[..., :half], x[..., half:rd]
    out[..., :half] = x0 * c - x1 * s
    out[..., half:rd] = x1 * c + x0 * s
    return out


def run_threads(targets, timeout=300):
    """Run the callables in threads; re-raise the first failure here."""
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # re-raised below
                errors.append(e)
        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread still runs"
    if errors:
        raise errors[0]
