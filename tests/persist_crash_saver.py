"""Helper of tests/test_persist_crash.py (not a test module).

Run as ``python persist_crash_saver.py PATH``: builds the two known contents,
prints "ready", then saves them to PATH alternately, forever, until killed.
Imported, it gives the test the same contents to compare a loaded file with.
"""

import sys

import numpy as np

import pagedkv

TOKENS, HKV, D, LAYERS, BLOCK = 512, 4, 64, 4, 16  # 4 MiB of K/V: a save takes a while
CONTENTS = ("A", "B")


def make_cache():
    return pagedkv.PagedKVCache(num_blocks=2 * TOKENS // BLOCK, block_size=BLOCK,
                                num_kv_heads=HKV, head_dim=D, num_layers=LAYERS,
                                dtype="float32")


def content(which):
    """The K and V of every layer of content `which`, deterministic."""
    rng = np.random.default_rng(CONTENTS.index(which))
    return [(rng.standard_normal((TOKENS, HKV, D)).astype(np.float32),
             rng.standard_normal((TOKENS, HKV, D)).astype(np.float32))
            for _ in range(LAYERS)]


def build(cache, which):
    """A sequence of `cache` holding content `which`; returns its id."""
    sid = cache.add_sequence()
    for layer, (k, v) in enumerate(content(which)):
        cache.append(sid, k, v, layer=layer)
    return sid


def main(path):
    cache = make_cache()
    sids = [build(cache, which) for which in CONTENTS]
    print("ready", flush=True)
    i = 0
    while True:
        cache.save(sids[i % 2], path)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1])
