"""The small cache that the pool, copy-on-write, statistics and error-contract tests share."""

import pagedkv
from reference import SeqModel, append_step, random_tokens

HKV, D = 2, 4


def small_cache(num_blocks=8, block_size=4, num_layers=1, dtype="float32", **kw):
    return pagedkv.PagedKVCache(
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=HKV, head_dim=D,
        num_layers=num_layers, dtype=dtype, **kw,
    )


def toks(rng, n, heads=HKV, dtype="float32"):
    return random_tokens(rng, n, heads, D, dtype)


def fill(cache, sid, rng, n, num_layers=1, model=None):
    model = model if model is not None else SeqModel(num_layers, HKV, D, cache.dtype)
    append_step(cache, model, sid, rng, n, num_layers, HKV, D, cache.dtype)
    return model
