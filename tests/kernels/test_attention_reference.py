"""Paged attention and gather against the plain NumPy reference (tests/reference.py).

Every case builds a cache with random tokens appended in interleaved chunks, so the sequences'
blocks are scattered through the pool, and compares:
  * ``gather`` with the appended data, exactly;
  * ``attend`` (n causal queries at the newest n tokens) and ``attend_batch`` (one query per
    sequence at its newest token) with ``ref_attention`` within TOL (rtol, atol = rtol * max|v|).
"""

import itertools

import numpy as np
import pytest

import pagedkv
from reference import (
    SeqModel,
    append_step,
    assert_attention_close,
    blocks_for,
    build_random_cache,
    check_against_model,
    math_scale,
    mid_block_length,
    random_tokens,
    ref_attention,
)

BLOCK_SIZES = [1, 2, 3, 16, 64]
HEAD_DIMS = [1, 3, 64, 128]
RATIOS = [1, 2, 4, 8]
KV_HEADS = [1, 2]
DTYPES = ["float32", "float64"]


def _max_blocks(block_size):
    # Keep sequences at most ~100-200 tokens so hundreds of cases stay fast, but always allow
    # several blocks so block boundaries are crossed.
    return max(3, 100 // block_size)


def _check_attend(cache, sid, model, q, layer=0, scale=None, out=None):
    n = q.shape[0]
    length = len(model)
    result = cache.attend(sid, q, layer=layer, scale=scale, out=out)
    assert result.shape == q.shape
    assert result.dtype == cache.dtype
    eff_scale = math_scale(q.shape[2]) if scale is None else scale
    expected = ref_attention(
        q.astype(cache.dtype), model.k[layer], model.v[layer], eff_scale, length - n
    )
    assert_attention_close(
        result, expected, cache.dtype, model.v[layer], err_msg=f"sid={sid} layer={layer} n={n}"
    )
    return result


# ----------------------------------------------------------------------------------------------
# Prefill: n causal queries, every block size x head dim x GQA ratio x KV heads x dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_matches_reference(rng, block_size, head_dim, ratio, num_kv_heads, dtype):
    num_heads = ratio * num_kv_heads
    lengths = [mid_block_length(rng, block_size, _max_blocks(block_size)) for _ in range(2)]
    cache, sids, models = build_random_cache(
        rng,
        lengths=lengths,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert cache.num_free_blocks == cache.num_blocks - sum(blocks_for(n, block_size) for n in lengths)
    for sid in sids:
        model = models[sid]
        check_against_model(cache, sid, model, 1)
        length = len(model)
        # The whole prompt at once (full causal triangle), then a random suffix of queries.
        for n in (length, int(rng.integers(1, length + 1))):
            q = random_tokens(rng, n, num_heads, head_dim, dtype)
            _check_attend(cache, sid, model, q)


# ----------------------------------------------------------------------------------------------
# The model loop on 1 and 3 layers: for each layer, append then attend (prefill chunks)


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_layered_prefill_model_loop(rng, block_size, dtype, num_layers):
    num_kv_heads = int(rng.choice(KV_HEADS))
    head_dim = int(rng.choice(HEAD_DIMS))
    num_heads = num_kv_heads * int(rng.choice(RATIOS))
    num_seqs = 3
    total = 3 * max(block_size, 4) + 5
    cache = pagedkv.PagedKVCache(
        num_blocks=num_seqs * blocks_for(total + 2 * block_size, block_size) + 2,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        dtype=dtype,
    )
    sids = [cache.add_sequence() for _ in range(num_seqs)]
    models = {s: SeqModel(num_layers, num_kv_heads, head_dim, dtype) for s in sids}
    for _ in range(9):
        sid = sids[int(rng.integers(num_seqs))]
        n = int(rng.integers(1, block_size + 3))
        for layer in range(num_layers):
            k = random_tokens(rng, n, num_kv_heads, head_dim, dtype)
            v = random_tokens(rng, n, num_kv_heads, head_dim, dtype)
            cache.append(sid, k, v, layer=layer)
            models[sid].extend(layer, k, v)
            q = random_tokens(rng, n, num_heads, head_dim, dtype)
            _check_attend(cache, sid, models[sid], q, layer=layer)
    for sid in sids:
        check_against_model(cache, sid, models[sid], num_layers)
        length = len(models[sid])
        if length:
            for layer in range(num_layers):
                n = int(rng.integers(1, length + 1))
                q = random_tokens(rng, n, num_heads, head_dim, dtype)
                _check_attend(cache, sid, models[sid], q, layer=layer)


# ----------------------------------------------------------------------------------------------
# Decode: append_batch + attend_batch, batches of changing composition


def _sid_container(sids, step):
    """Cycle through the accepted forms of a batch of sequence ids."""
    form = step % 4
    if form == 0:
        return list(sids)
    if form == 1:
        return tuple(sids)
    if form == 2:
        return np.asarray(sids, dtype=np.int64)
    return np.asarray(sids, dtype=np.int32)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_batch_matches_reference(rng, block_size, dtype, num_layers, ratio):
    num_kv_heads = int(rng.choice(KV_HEADS))
    head_dim = int(rng.choice(HEAD_DIMS))
    num_heads = ratio * num_kv_heads
    steps = 12
    # The first sequence ends a few tokens before a block boundary so decode crosses it.
    first = max(1, 2 * block_size - 4) if block_size > 4 else 2 * block_size + 1
    lengths = [first] + [mid_block_length(rng, block_size, 3) for _ in range(2)]
    cache, sids, models = build_random_cache(
        rng,
        lengths=lengths,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        dtype=dtype,
        num_blocks=sum(blocks_for(n + steps, block_size) for n in lengths) + 2,
    )
    for step in range(steps):
        if step == 0:
            batch = list(sids)
        else:
            size = int(rng.integers(1, len(sids) + 1))
            batch = [sids[i] for i in rng.permutation(len(sids))[:size]]
        for layer in range(num_layers):
            k = random_tokens(rng, len(batch), num_kv_heads, head_dim, dtype)
            v = random_tokens(rng, len(batch), num_kv_heads, head_dim, dtype)
            cache.append_batch(_sid_container(batch, step), k, v, layer=layer)
            for b, sid in enumerate(batch):
                models[sid].extend(layer, k[b : b + 1], v[b : b + 1])
            q = random_tokens(rng, len(batch), num_heads, head_dim, dtype)
            out = cache.attend_batch(_sid_container(batch, step + layer), q, layer=layer)
            assert out.shape == q.shape and out.dtype == cache.dtype
            for b, sid in enumerate(batch):
                model = models[sid]
                expected = ref_attention(
                    q[b : b + 1], model.k[layer], model.v[layer], math_scale(head_dim), len(model) - 1
                )
                assert_attention_close(
                    out[b : b + 1], expected, dtype, model.v[layer], err_msg=f"step={step} sid={sid}"
                )
    for sid in sids:
        check_against_model(cache, sid, models[sid], num_layers)
    used = sum(blocks_for(len(models[s]), block_size) for s in sids)
    assert cache.num_free_blocks == cache.num_blocks - used


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_single_matches_batch_of_one(rng, block_size, dtype):
    """attend(sid, q[None]) and attend_batch([sid], q[None]) are the same query."""
    cache, sids, models = build_random_cache(
        rng, lengths=[mid_block_length(rng, block_size, 3)] * 2, block_size=block_size,
        num_kv_heads=2, head_dim=64, dtype=dtype,
    )
    for sid in sids:
        q = random_tokens(rng, 1, 8, 64, dtype)
        single = cache.attend(sid, q)
        batched = cache.attend_batch([sid], q)
        expected = ref_attention(q, models[sid].k[0], models[sid].v[0], math_scale(64), len(models[sid]) - 1)
        assert_attention_close(single, expected, dtype, models[sid].v[0])
        assert_attention_close(batched, expected, dtype, models[sid].v[0])


# ----------------------------------------------------------------------------------------------
# scale= and out=


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_explicit_scale_and_out(rng, block_size, dtype):
    head_dim = int(rng.choice(HEAD_DIMS))
    num_kv_heads = 2
    num_heads = 4
    lengths = [mid_block_length(rng, block_size, 3) for _ in range(3)]
    cache, sids, models = build_random_cache(
        rng, lengths=lengths, block_size=block_size, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype,
    )
    for sid in sids:
        model = models[sid]
        length = len(model)
        n = int(rng.integers(1, length + 1))
        scale = float(rng.uniform(0.5, 2.0)) / np.sqrt(head_dim)
        q = random_tokens(rng, n, num_heads, head_dim, dtype)
        out = np.full((n, num_heads, head_dim), np.nan, dtype=dtype)
        result = cache.attend(sid, q, scale=scale, out=out)
        assert result is out
        expected = ref_attention(q, model.k[0], model.v[0], scale, length - n)
        assert_attention_close(out, expected, dtype, model.v[0])
        # The default scale really is 1/sqrt(D): a different scale gives a different answer
        # whenever the attention is not trivially over one key.
        default = cache.attend(sid, q)
        expected_default = ref_attention(q, model.k[0], model.v[0], math_scale(head_dim), length - n)
        assert_attention_close(default, expected_default, dtype, model.v[0])

    q = random_tokens(rng, len(sids), num_heads, head_dim, dtype)
    scale = 0.75 / np.sqrt(head_dim)
    out = np.full(q.shape, np.nan, dtype=dtype)
    result = cache.attend_batch(sids, q, scale=scale, out=out)
    assert result is out
    for b, sid in enumerate(sids):
        model = models[sid]
        expected = ref_attention(q[b : b + 1], model.k[0], model.v[0], scale, len(model) - 1)
        assert_attention_close(out[b : b + 1], expected, dtype, model.v[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.7, -0.4, 0.0])
def test_out_may_be_the_query_array(rng, dtype, scale):
    """out=q: decode reads the query rows in place, and a sequence whose keys fit one tile
    gets its output rows written by P.V; the result is that of separate arrays.  Scales of
    either sign (a non-positive scale multiplies the scores before the softmax's max)."""
    lengths = [5, 64, 150]  # one partial tile, one whole tile, several tiles
    cache, sids, models = build_random_cache(
        rng, lengths=lengths, block_size=16, num_kv_heads=2, head_dim=24, dtype=dtype)
    q = random_tokens(rng, len(sids), 8, 24, dtype)
    want = cache.attend_batch(sids, q.copy(), scale=scale)
    for b, sid in enumerate(sids):
        model = models[sid]
        ref = ref_attention(q[b : b + 1], model.k[0], model.v[0], scale, len(model) - 1)
        assert_attention_close(want[b : b + 1], ref, dtype, model.v[0])
    got = cache.attend_batch(sids, q, scale=scale, out=q)
    assert got is q
    np.testing.assert_array_equal(got, want)
    for b, sid in enumerate(sids):
        one = q[b : b + 1].copy()
        expected = cache.attend(sid, one.copy(), scale=scale)
        assert cache.attend(sid, one, scale=scale, out=one) is one
        np.testing.assert_array_equal(one, expected)


def test_scale_changes_result(rng):
    cache, sids, models = build_random_cache(
        rng, lengths=[20], block_size=4, num_kv_heads=1, head_dim=8, dtype="float64"
    )
    q = random_tokens(rng, 1, 1, 8, "float64")
    a = cache.attend(sids[0], q, scale=0.1)
    b = cache.attend(sids[0], q, scale=2.0)
    assert not np.allclose(a, b)
    assert_attention_close(b, ref_attention(q, models[sids[0]].k[0], models[sids[0]].v[0], 2.0, 19),
                           "float64", models[sids[0]].v[0])


def test_gqa_head_mapping_is_grouped_not_interleaved(rng):
    """Query head h reads KV head h // (Hq // Hkv): heads 0,1 -> KV 0 and heads 2,3 -> KV 1."""
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=2, dtype="float64")
    sid = cache.add_sequence()
    k = np.zeros((3, 2, 2))
    v = np.zeros((3, 2, 2))
    v[:, 0, :] = 1.0   # every value of KV head 0 is 1
    v[:, 1, :] = -5.0  # every value of KV head 1 is -5
    cache.append(sid, k, v)
    q = rng.standard_normal((1, 4, 2))
    out = cache.attend(sid, q)
    np.testing.assert_allclose(out[0, 0:2], 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out[0, 2:4], -5.0, rtol=0, atol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    """With n queries over L tokens, query i sees tokens 0..L-n+i: give each token a distinct value
    and zero keys (uniform weights), so the output is the mean of the visible values."""
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=3, num_kv_heads=1, head_dim=1, dtype="float64")
    sid = cache.add_sequence()
    length = 10
    k = np.zeros((length, 1, 1))
    v = np.arange(length, dtype=np.float64).reshape(length, 1, 1)
    cache.append(sid, k[:4], v[:4])
    cache.append(sid, k[4:], v[4:])
    n = 4
    out = cache.attend(sid, np.ones((n, 1, 1)))
    expected = [np.mean(np.arange(length - n + i + 1)) for i in range(n)]
    np.testing.assert_allclose(out[:, 0, 0], expected, rtol=1e-12)


# ----------------------------------------------------------------------------------------------
# Copy-on-write forks


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fork_divergent_appends(rng, block_size, dtype, num_layers):
    num_kv_heads, head_dim, num_heads = 2, 16, 4
    parent_len = mid_block_length(rng, block_size, 3)
    steps = 6
    cache, sids, models = build_random_cache(
        rng, lengths=[parent_len, mid_block_length(rng, block_size, 2)], block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers, dtype=dtype,
        num_blocks=3 * blocks_for(parent_len + steps * (block_size + 2), block_size) + 12,
    )
    parent, other = sids
    q_parent = random_tokens(rng, parent_len, num_heads, head_dim, dtype)
    before = [cache.attend(parent, q_parent, layer=layer) for layer in range(num_layers)]

    child = cache.fork(parent)
    assert child not in (parent, other)
    models[child] = models[parent].copy()
    check_against_model(cache, child, models[child], num_layers)

    # Only the child writes: the parent's tokens and attention are untouched.
    for _ in range(steps // 2):
        append_step(cache, models[child], child, rng, int(rng.integers(1, block_size + 2)),
                    num_layers, num_kv_heads, head_dim, dtype)
    check_against_model(cache, parent, models[parent], num_layers)
    for layer in range(num_layers):
        after = cache.attend(parent, q_parent, layer=layer)
        assert_attention_close(after, before[layer], dtype, models[parent].v[layer])
        _check_attend(cache, parent, models[parent], q_parent, layer=layer)

    # Then both write different tokens, interleaved with a third sequence.
    for _ in range(steps):
        for sid in (parent, child, other):
            append_step(cache, models[sid], sid, rng, int(rng.integers(1, block_size + 2)),
                        num_layers, num_kv_heads, head_dim, dtype)
    for sid in (parent, child, other):
        check_against_model(cache, sid, models[sid], num_layers)
        length = len(models[sid])
        for layer in range(num_layers):
            q = random_tokens(rng, int(rng.integers(1, length + 1)), num_heads, head_dim, dtype)
            _check_attend(cache, sid, models[sid], q, layer=layer)
    # The shared prefix is still identical in both.
    for layer in range(num_layers):
        kp, vp = cache.gather(parent, layer=layer)
        kc, vc = cache.gather(child, layer=layer)
        np.testing.assert_array_equal(kp[:parent_len], kc[:parent_len])
        np.testing.assert_array_equal(vp[:parent_len], vc[:parent_len])

    # Decode on all three at once.
    q = random_tokens(rng, 3, num_heads, head_dim, dtype)
    out = cache.attend_batch([parent, child, other], q, layer=num_layers - 1)
    for b, sid in enumerate((parent, child, other)):
        model = models[sid]
        expected = ref_attention(q[b : b + 1], model.k[-1], model.v[-1], math_scale(head_dim), len(model) - 1)
        assert_attention_close(out[b : b + 1], expected, dtype, model.v[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fork_of_fork_and_free_parent(rng, block_size, dtype):
    cache, sids, models = build_random_cache(
        rng, lengths=[mid_block_length(rng, block_size, 3)], block_size=block_size,
        num_kv_heads=1, head_dim=8, dtype=dtype, spare_blocks=12,
    )
    root = sids[0]
    a = cache.fork(root)
    b = cache.fork(a)
    models[a] = models[root].copy()
    models[b] = models[root].copy()
    append_step(cache, models[a], a, rng, 2, 1, 1, 8, dtype)
    cache.free(root)
    del models[root]
    append_step(cache, models[b], b, rng, 3, 1, 1, 8, dtype)
    for sid in (a, b):
        check_against_model(cache, sid, models[sid], 1)
        q = random_tokens(rng, len(models[sid]), 2, 8, dtype)
        _check_attend(cache, sid, models[sid], q)


# ----------------------------------------------------------------------------------------------
# Truncate, then keep appending


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_truncate_then_append(rng, block_size, dtype, num_layers):
    num_kv_heads, head_dim, num_heads = 2, 8, 8
    length = mid_block_length(rng, block_size, 4) + block_size
    cache, sids, models = build_random_cache(
        rng, lengths=[length, mid_block_length(rng, block_size, 2)], block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers, dtype=dtype,
        spare_blocks=blocks_for(10 * block_size + 10, block_size) + 4,
    )
    sid = sids[0]
    targets = sorted({0, block_size, int(rng.integers(0, length + 1)), length})
    for target in reversed(targets):  # shrink step by step (including to a block boundary and 0)
        cache.truncate(sid, target)
        models[sid].truncate(target)
        check_against_model(cache, sid, models[sid], num_layers)
    assert cache.seq_len(sid) == 0
    k, v = cache.gather(sid)
    assert k.shape == (0, num_kv_heads, head_dim) and v.shape == (0, num_kv_heads, head_dim)

    for _ in range(4):
        append_step(cache, models[sid], sid, rng, int(rng.integers(1, 2 * block_size + 2)),
                    num_layers, num_kv_heads, head_dim, dtype)
    mid = int(rng.integers(1, len(models[sid]) + 1))
    cache.truncate(sid, mid)
    models[sid].truncate(mid)
    append_step(cache, models[sid], sid, rng, block_size + 1, num_layers, num_kv_heads, head_dim, dtype)
    for s in sids:
        check_against_model(cache, s, models[s], num_layers)
        for layer in range(num_layers):
            q = random_tokens(rng, len(models[s]), num_heads, head_dim, dtype)
            _check_attend(cache, s, models[s], q, layer=layer)
    used = sum(blocks_for(len(models[s]), block_size) for s in sids)
    assert cache.num_free_blocks == cache.num_blocks - used


# ----------------------------------------------------------------------------------------------
# gather, conversions, odd input layouts


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gather_exact_many_sequences(rng, block_size, dtype, num_layers):
    lengths = [mid_block_length(rng, block_size, 4) for _ in range(5)]
    cache, sids, models = build_random_cache(
        rng, lengths=lengths, block_size=block_size, num_kv_heads=2, head_dim=3,
        num_layers=num_layers, dtype=dtype, max_chunk=block_size + 1,
    )
    assert len(set(sids)) == len(sids)
    for sid in sids:
        check_against_model(cache, sid, models[sid], num_layers)


def test_gather_returns_copies(rng):
    cache, sids, models = build_random_cache(rng, lengths=[9], block_size=4, num_kv_heads=2, head_dim=4)
    k, v = cache.gather(sids[0])
    k[...] = 123.0
    v[...] = -7.0
    check_against_model(cache, sids[0], models[sids[0]], 1)


@pytest.mark.parametrize(
    "cache_dtype,input_dtype",
    list(itertools.product(DTYPES, ["float16", "float32", "float64"])),
)
def test_other_float_dtypes_are_converted(rng, cache_dtype, input_dtype):
    cache = pagedkv.PagedKVCache(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=5, dtype=cache_dtype)
    assert cache.dtype == np.dtype(cache_dtype)
    sid = cache.add_sequence()
    k = rng.standard_normal((7, 2, 5)).astype(input_dtype)
    v = rng.standard_normal((7, 2, 5)).astype(input_dtype)
    cache.append(sid, k, v)
    gk, gv = cache.gather(sid)
    assert gk.dtype == np.dtype(cache_dtype)
    np.testing.assert_array_equal(gk, k.astype(cache_dtype))
    np.testing.assert_array_equal(gv, v.astype(cache_dtype))
    q = rng.standard_normal((3, 4, 5)).astype(input_dtype)
    out = cache.attend(sid, q)
    assert out.dtype == np.dtype(cache_dtype)
    expected = ref_attention(q.astype(cache_dtype), gk, gv, math_scale(5), 4)
    assert_attention_close(out, expected, cache_dtype, gv)
    out_b = cache.attend_batch([sid], q[:1])
    assert out_b.dtype == np.dtype(cache_dtype)


def _strided_views(rng, shape, dtype):
    """Several non-contiguous arrays with the same logical contents."""
    base = rng.standard_normal(shape).astype(dtype)
    n, h, d = shape
    wide = np.zeros((n, h, 2 * d), dtype=dtype)
    wide[:, :, ::2] = base
    reversed_ = np.ascontiguousarray(base[::-1])[::-1]
    fortran = np.asfortranarray(base)
    transposed = np.ascontiguousarray(base.transpose(1, 0, 2)).transpose(1, 0, 2)
    views = {
        "strided": wide[:, :, ::2],
        "negative": reversed_,
        "fortran": fortran,
        "transposed": transposed,
    }
    for name, view in views.items():
        if n > 1:
            assert not view.flags.c_contiguous, name
        np.testing.assert_array_equal(view, base)
    return base, views


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["strided", "negative", "fortran", "transposed"])
def test_non_contiguous_inputs_are_read_correctly(rng, dtype, layout):
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=3, num_kv_heads=2, head_dim=4, dtype=dtype)
    sid = cache.add_sequence()
    kbase, kviews = _strided_views(rng, (5, 2, 4), dtype)
    vbase, vviews = _strided_views(rng, (5, 2, 4), dtype)
    cache.append(sid, kviews[layout], vviews[layout])
    gk, gv = cache.gather(sid)
    np.testing.assert_array_equal(gk, kbase)
    np.testing.assert_array_equal(gv, vbase)
    qbase, qviews = _strided_views(rng, (5, 2, 4), dtype)
    out = cache.attend(sid, qviews[layout])
    assert_attention_close(out, ref_attention(qbase, kbase, vbase, 0.5, 0), dtype, vbase)
    # Batched forms, one token for one sequence.
    kb, kbv = _strided_views(rng, (1, 2, 4), dtype)
    vb, vbv = _strided_views(rng, (1, 2, 4), dtype)
    cache.append_batch([sid], kbv[layout], vbv[layout])
    gk, gv = cache.gather(sid)
    np.testing.assert_array_equal(gk[-1:], kb)
    np.testing.assert_array_equal(gv[-1:], vb)
    qb, qbv = _strided_views(rng, (1, 2, 4), dtype)
    out = cache.attend_batch([sid], qbv[layout])
    assert_attention_close(out, ref_attention(qb, gk, gv, 0.5, 5), dtype, gv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_only_inputs_are_accepted(rng, dtype):
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4, dtype=dtype)
    sid = cache.add_sequence()
    k = random_tokens(rng, 6, 2, 4, dtype)
    v = random_tokens(rng, 6, 2, 4, dtype)
    q = random_tokens(rng, 6, 4, 4, dtype)
    for a in (k, v, q):
        a.flags.writeable = False
    cache.append(sid, k, v)
    out = cache.attend(sid, q)
    np.testing.assert_array_equal(cache.gather(sid)[0], k)
    assert_attention_close(out, ref_attention(q, k, v, 0.5, 0), dtype, v)
    kb = random_tokens(rng, 1, 2, 4, dtype)
    vb = random_tokens(rng, 1, 2, 4, dtype)
    qb = random_tokens(rng, 1, 4, 4, dtype)
    sids = np.array([sid])
    for a in (kb, vb, qb, sids):
        a.flags.writeable = False
    cache.append_batch(sids, kb, vb)
    out = cache.attend_batch(sids, qb)
    gk, gv = cache.gather(sid)
    assert_attention_close(out, ref_attention(qb, gk, gv, 0.5, 6), dtype, gv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_byte_swapped_inputs_are_converted_or_rejected_never_misread(rng, dtype):
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=3, dtype=dtype)
    sid = cache.add_sequence()
    k = random_tokens(rng, 2, 1, 3, dtype)
    swapped = k.astype(np.dtype(dtype).newbyteorder())
    np.testing.assert_array_equal(swapped, k)
    try:
        cache.append(sid, swapped, swapped)
    except (TypeError, ValueError):
        assert cache.seq_len(sid) == 0
    else:
        np.testing.assert_array_equal(cache.gather(sid)[0], k)
        np.testing.assert_array_equal(cache.gather(sid)[1], k)


def test_inputs_are_not_modified(rng):
    cache = pagedkv.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4)
    sid = cache.add_sequence()
    k = random_tokens(rng, 5, 2, 4, "float32")
    v = random_tokens(rng, 5, 2, 4, "float32")
    q = random_tokens(rng, 5, 4, 4, "float32")
    copies = [a.copy() for a in (k, v, q)]
    cache.append(sid, k, v)
    cache.attend(sid, q)
    cache.attend_batch([sid], q[:1])
    for a, b in zip((k, v, q), copies):
        np.testing.assert_array_equal(a, b)


def test_returned_arrays_are_independent_of_the_cache(rng):
    """A returned attention output is the caller's: later calls do not overwrite it."""
    cache, sids, models = build_random_cache(rng, lengths=[6, 6], block_size=4, num_kv_heads=1, head_dim=4)
    q = random_tokens(rng, 1, 1, 4, "float32")
    a = cache.attend(sids[0], q)
    a_copy = a.copy()
    b = cache.attend(sids[1], random_tokens(rng, 1, 1, 4, "float32"))
    append_step(cache, models[sids[0]], sids[0], rng, 3, 1, 1, 4, "float32")
    np.testing.assert_array_equal(a, a_copy)
    assert not np.shares_memory(a, b)
