"""save / load of one sequence, compact() and resize(), and the statistics report."""

import os
import pathlib

import numpy as np
import pytest

import pagedkv
from pagedkv import persist
from reference import assert_unchanged, snapshot

HKV, D, HQ = 2, 6, 4


def make(dtype="float32", num_blocks=64, block_size=4, layers=2, **kw):
    return pagedkv.PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=HKV,
                                head_dim=D, num_layers=layers, dtype=dtype, **kw)


def fill(cache, sid, n, rng):
    for layer in range(cache.num_layers):
        k = rng.standard_normal((n, HKV, D)).astype(cache.dtype)
        v = rng.standard_normal((n, HKV, D)).astype(cache.dtype)
        cache.append(sid, k, v, layer=layer)


def observe(cache, sid, q):
    """Everything a sequence shows: gather and attention on every layer, positions."""
    out = [cache.seq_len(sid), cache.kept_positions(sid).tolist()]
    for layer in range(cache.num_layers):
        out.append(cache.gather(sid, layer))
        out.append(cache.attend(sid, q[-1:], layer=layer))
    return out


def assert_same(a, b):
    assert a[:2] == b[:2]
    for x, y in zip(a[2:], b[2:]):
        if isinstance(x, tuple):
            for xx, yy in zip(x, y):
                np.testing.assert_array_equal(xx, yy)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("length", [1, 4, 13])
def test_save_load_round_trip_bit_for_bit(tmp_path, rng, dtype, length):
    src = make(dtype, rope=pagedkv.RoPE(10000.0))
    sid = src.add_sequence(priority=2.5)
    fill(src, sid, length, rng)
    q = rng.standard_normal((1, HQ, D)).astype(dtype)
    path = tmp_path / "seq.pkv"
    nbytes = src.save(sid, path)
    assert os.path.getsize(path) == nbytes
    assert not [p for p in os.listdir(tmp_path) if p != "seq.pkv"]  # no temp file left
    dst = make(dtype, rope=pagedkv.RoPE(10000.0))
    dst.add_sequence()  # the loaded sequence gets other blocks and another id
    fill(dst, dst.sequence_ids()[0], 3, rng)
    new = dst.load(path)
    assert dst.priority(new) == 2.5
    assert_same(observe(dst, new, q), observe(src, sid, q))
    # the loaded sequence lives on like any other
    fill(dst, new, 2, rng)
    assert dst.seq_len(new) == length + 2


@pytest.mark.parametrize("how", ["new", "truncated"])
def test_save_load_empty_sequence(tmp_path, rng, how):
    # regression: saving a sequence that holds no block raised TypeError (a memoryview cast of
    # the [0, bytes_per_block] payload); found by tests/reliability/test_state_machine_full.py
    src = make()
    sid = src.add_sequence(priority=1.5)
    if how == "truncated":
        fill(src, sid, 6, rng)
        src.truncate(sid, 0)
    nbytes = src.save(sid, tmp_path / "empty")
    assert os.path.getsize(tmp_path / "empty") == nbytes
    dst = make()
    new = dst.load(tmp_path / "empty")
    assert dst.seq_len(new) == 0 and dst.num_seq_blocks(new) == 0 and dst.priority(new) == 1.5
    assert dst.kept_positions(new).tolist() == src.kept_positions(sid).tolist() == []
    assert dst.num_free_blocks == dst.num_blocks
    fill(dst, new, 5, rng)  # it lives on like any other
    assert dst.kept_positions(new).tolist() == list(range(5))


def test_save_load_streaming_keeps_kept_positions(tmp_path, rng):
    mk = lambda: make(streaming=pagedkv.StreamingLLM(2, 6), rope=pagedkv.RoPE(500.0))
    src = mk()
    sid = src.add_sequence()
    for _ in range(5):
        fill(src, sid, 3, rng)
    kept = src.kept_positions(sid).tolist()
    assert kept[:2] == [0, 1] and kept[-1] == 14 and len(kept) <= 8 + 3
    src.save(sid, tmp_path / "s")
    dst = mk()
    new = dst.load(tmp_path / "s")
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    assert_same(observe(dst, new, q), observe(src, sid, q))
    fill(dst, new, 3, rng)
    fill(src, sid, 3, rng)
    assert dst.kept_positions(new).tolist() == src.kept_positions(sid).tolist()


def test_saved_prompt_becomes_a_prefix_hit(tmp_path, rng):
    src = make(prefix_caching=True)
    prompt = list(range(11))
    sid = src.add_sequence(token_ids=prompt)
    fill(src, sid, 11, rng)
    src.save(sid, tmp_path / "prompt")
    dst = make(prefix_caching=True)
    dst.load(tmp_path / "prompt")
    hit = dst.add_sequence(token_ids=prompt + [99])
    assert dst.seq_len(hit) == 8
    np.testing.assert_array_equal(dst.gather(hit, 1)[0], src.gather(sid, 1)[0][:8])


@pytest.fixture
def saved(tmp_path, rng):
    src = make()
    sid = src.add_sequence()
    fill(src, sid, 9, rng)
    path = tmp_path / "seq.pkv"
    src.save(sid, path)
    return path


def loaded_into_fresh(path, **kw):
    """Try loading into a cache with one sequence; assert a failure changes nothing."""
    cache = make(**kw)
    s = cache.add_sequence()
    fill(cache, s, 5, np.random.default_rng(1))
    before = snapshot(cache, [s], layers=range(cache.num_layers))
    try:
        return cache.load(path)
    except Exception:
        assert_unchanged(cache, before, layers=range(cache.num_layers))
        assert cache.sequence_ids() == [s]
        raise


def test_config_mismatch_raises_and_changes_nothing(saved):
    for kw, field in [(dict(block_size=8), "block_size"), (dict(dtype="float64"), "dtype"),
                      (dict(layers=3), "num_layers"), (dict(rope=pagedkv.RoPE(1e4)), "rope"),
                      (dict(streaming=pagedkv.StreamingLLM(2, 8)), "streaming")]:
        with pytest.raises(ValueError, match=f"another configuration: .*{field}"):
            loaded_into_fresh(saved, **kw)


def test_truncated_flipped_foreign_files_raise_and_change_nothing(saved, tmp_path):
    data = saved.read_bytes()
    assert len(data) > 2048
    bad = tmp_path / "bad"
    cuts = sorted(set(range(0, len(data), 1024)) | {len(data) - 1, 10, 17})
    for cut in cuts:
        bad.write_bytes(data[:cut])
        with pytest.raises(pagedkv.CacheFileError):
            loaded_into_fresh(bad)
    for pos in (3, 9, 20, len(data) // 2, len(data) - 2):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        bad.write_bytes(bytes(flipped))
        with pytest.raises(pagedkv.CacheFileError):
            loaded_into_fresh(bad)
    bad.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(pagedkv.CacheFileError, match="not a pagedkv"):
        loaded_into_fresh(bad)
    wrong_version = bytearray(data)
    wrong_version[8] = 9
    bad.write_bytes(bytes(wrong_version))
    with pytest.raises(pagedkv.CacheFileError, match="version"):
        loaded_into_fresh(bad)
    with pytest.raises(FileNotFoundError):
        loaded_into_fresh(tmp_path / "missing")


def test_load_that_does_not_fit_raises_out_of_blocks(saved):
    with pytest.raises(pagedkv.OutOfBlocksError):
        loaded_into_fresh(saved, num_blocks=3)  # 5 tokens hold 2 blocks, the file needs 3
    with pytest.raises(RuntimeError, match="max_seqs"):
        loaded_into_fresh(saved, max_seqs=1)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        loaded_into_fresh(saved, max_blocks_per_seq=2)


def test_save_is_atomic_and_validates(tmp_path, rng, monkeypatch):
    cache = make()
    sid = cache.add_sequence()
    fill(cache, sid, 6, rng)
    path = tmp_path / "keep"
    path.write_bytes(b"old contents")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(persist.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        cache.save(sid, path)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["keep"]
    monkeypatch.undo()
    with pytest.raises(KeyError):
        cache.save(sid + 1000, path)
    k = rng.standard_normal((1, HKV, D)).astype(np.float32)
    cache.append(sid, k, k, layer=0)  # layer 1 not yet written
    with pytest.raises(ValueError, match="middle of a step"):
        cache.save(sid, path)
    assert path.read_bytes() == b"old contents"


def test_save_empty_sequence_and_bytes_path(tmp_path):
    """Found by the fuzzer: save() of a sequence holding no tokens raised TypeError (a
    zero-size memoryview cast), and a bytes path raised TypeError from tempfile."""
    src = make()
    empty = src.add_sequence(priority=1.5)
    path = os.fsencode(tmp_path / "empty")
    assert src.save(empty, path) == os.path.getsize(path)
    dst = make()
    new = dst.load(path)
    assert dst.seq_len(new) == 0 and dst.priority(new) == 1.5
    assert os.listdir(tmp_path) == ["empty"]


def forged(path, edit):
    """The file at `path` with its header changed by edit(header) and a valid checksum."""
    import json
    import struct
    import zlib
    data = path.read_bytes()
    _, version, hlen = persist._PREFIX.unpack_from(data)
    header = json.loads(data[16:16 + hlen])
    header = edit(header)
    h = json.dumps(header).encode()
    body = persist._PREFIX.pack(persist.MAGIC, version, len(h)) + h + data[16 + hlen:-4]
    out = path.parent / "forged"
    out.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    return out


def _set(part, key, value):
    def edit(header):
        if part is None:
            header[key] = value
        else:
            header[part][key] = value
        return header
    return edit


def _huge(key):
    """sequence[key] = 2**63, its length kept consistent with its segments"""
    def edit(header):
        s = header["sequence"]
        s[key] = 2**63
        s["length"] = s["a1"] - s["a0"] + s["b1"] - s["b0"]
        return header
    return edit


@pytest.mark.parametrize("edit", [
    lambda h: [h],                                     # the header not an object
    _set(None, "config", [1, 2]),                      # AttributeError before
    _set(None, "config", None),
    _set(None, "sequence", 5),                         # TypeError before
    _set(None, "sequence", None),
    _set(None, "sequence", [1, 2]),
    _set(None, "payload_bytes", float("inf")),         # OverflowError before
    _set(None, "payload_bytes", 1.0e3),
    _set("sequence", "b1", float("inf")),              # OverflowError before
    _set("sequence", "nblk", float("inf")),
    _set("sequence", "off1", 2.5),
    _set("sequence", "length", True),
    _set("sequence", "priority", float("nan")),        # loaded with a NaN priority before
    _set("sequence", "priority", float("inf")),
    _set("sequence", "priority", -float("inf")),
    _set("sequence", "priority", "1"),
])
def test_forged_headers_raise_cache_file_error_and_change_nothing(saved, edit):
    """Found by the fuzzer: a header rewritten with a valid checksum raised AttributeError,
    TypeError or OverflowError, or loaded a sequence with a non-finite priority."""
    with pytest.raises(pagedkv.CacheFileError):
        loaded_into_fresh(forged(saved, edit))


@pytest.mark.parametrize("seq", [
    dict(a0=0, a1=2, b0=2, b1=9, off0=5, off1=0),      # window positions before the sinks'
    dict(a0=0, a1=2, b0=4, b1=9, off0=3, off1=0),      # the last sink at 4, the window from 4
    dict(a0=0, a1=2, b0=2, b1=2, off0=9, off1=0),      # sinks only, the next token before them
])
def test_load_rejects_kept_positions_that_do_not_increase(saved, seq):
    """Found by the fuzzer: offsets that made the kept positions repeat or go back loaded."""
    def edit(header):
        s = header["sequence"]
        s.update(seq, nblk=-(-seq["b1"] // 4), length=seq["a1"] - seq["a0"] + seq["b1"] - seq["b0"])
        return header
    with pytest.raises(pagedkv.CacheFileError, match="inconsistent sequence metadata"):
        loaded_into_fresh(forged(saved, edit))


@pytest.mark.parametrize("key", ["b1", "nblk"])
def test_load_rejects_segment_bounds_beyond_int64(saved, key):
    """Found by a review: b1 = 2**63 with a length to match raised OverflowError from the core,
    not the CacheFileError of a corrupt file."""
    with pytest.raises(pagedkv.CacheFileError, match="inconsistent sequence metadata"):
        loaded_into_fresh(forged(saved, _huge(key)))


def test_load_of_a_header_with_more_blocks_than_its_payload_raises_cache_file_error(saved):
    """Segments and block count consistent with each other, one block more than the payload
    holds: the core's size check, reported as a corrupt file (it was a plain ValueError)."""
    def edit(header):
        s = header["sequence"]
        s["b1"] += 4  # block_size 4: one more block
        s["nblk"] += 1
        s["length"] += 4
        return header
    with pytest.raises(pagedkv.CacheFileError, match="bytes of blocks"):
        loaded_into_fresh(forged(saved, edit))


# ----------------------------------------------------------------------
# compaction and resize

def scattered(rng, **kw):
    cache = make(num_blocks=40, **kw)
    sids = [cache.add_sequence() for _ in range(6)]
    for r in range(4):
        for s in sids:
            fill(cache, s, int(rng.integers(1, 6)), rng)
    f = cache.fork(sids[1])
    fill(cache, f, 3, rng)
    cache.free(sids[0])
    cache.free(sids[3])
    return cache


def test_compact_and_resize_preserve_every_sequence(rng):
    cache = scattered(rng)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    live = cache.sequence_ids()
    before = {s: observe(cache, s, q) for s in live}
    used = cache.stats().blocks_used
    top = max(max(cache.block_table(s)) for s in live)
    assert top >= used  # there are holes to close
    with pytest.raises(ValueError, match="compact"):
        snap = snapshot(cache, live, layers=(0, 1))
        cache.resize(used)
    assert_unchanged(cache, snap, layers=(0, 1))
    moved = cache.compact()
    assert moved > 0
    assert max(max(cache.block_table(s)) for s in live) == used - 1
    st = cache.stats()
    assert st.free_runs == 1 and st.largest_free_run == 40 - used
    for s in live:
        assert_same(observe(cache, s, q), before[s])
    assert cache.compact() == 0
    cache.resize(used)
    assert cache.num_blocks == used and cache.num_free_blocks == 0
    for s in live:
        assert_same(observe(cache, s, q), before[s])
    with pytest.raises(pagedkv.OutOfBlocksError):
        fill(cache, live[0], 40, rng)
    cache.resize(used + 50)
    assert cache.num_free_blocks == 50 and cache.stats().blocks_total == used + 50
    fill(cache, live[0], 40, rng)
    for s in live[1:]:
        assert_same(observe(cache, s, q), before[s])
    # ref counts equal the block tables
    refs = {}
    for s in cache.sequence_ids():
        for b in cache.block_table(s).tolist():
            refs[b] = refs.get(b, 0) + 1
    assert all(cache._core.ref_count(b) == refs.get(b, 0) for b in range(cache.num_blocks))


def test_resize_argument_checks(rng):
    cache = scattered(rng)
    snap = snapshot(cache, cache.sequence_ids(), layers=(0, 1))
    for bad, exc in [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                     ("9", TypeError), (2**40, ValueError)]:
        with pytest.raises(exc):
            cache.resize(bad)
    assert_unchanged(cache, snap, layers=(0, 1))


def test_compact_keeps_prefix_index_valid(rng):
    cache = make(num_blocks=30, prefix_caching=True, layers=1)
    p = list(range(13))
    filler = cache.add_sequence()
    fill(cache, filler, 20, rng)  # blocks 0..4
    a = cache.add_sequence(token_ids=p)
    fill(cache, a, 13, rng)
    ka = cache.gather(a, 0)[0]
    cache.free(filler)
    assert cache.compact() > 0
    assert max(cache.block_table(a)) == 3
    b = cache.add_sequence(token_ids=p)
    assert cache.seq_len(b) == 12
    np.testing.assert_array_equal(cache.gather(b, 0)[0], ka[:12])
    cache.free(a)
    cache.free(b)
    cache.resize(2)  # the cached free blocks 2, 3 go away with the shrink
    c = cache.add_sequence(token_ids=p)
    assert cache.seq_len(c) == 8
    np.testing.assert_array_equal(cache.gather(c, 0)[0], ka[:8])


# ----------------------------------------------------------------------
# statistics

def test_stats_report_and_fragmentation(rng):
    cache = make(num_blocks=20)
    a = cache.add_sequence()
    fill(cache, a, 10, rng)  # 3 blocks, 10 of 12 slots
    b = cache.fork(a)
    fill(cache, b, 1, rng)  # copy-on-write of the last block
    st = cache.stats()
    assert st.forks == 1 and st.cow_copies == 1
    assert st.blocks_used == 4 and st.tokens_held == 21
    assert st.token_slots_allocated == 24
    assert st.tokens_per_used_block == pytest.approx(21 / 4)
    assert st.free_runs == 1 and st.largest_free_run == 16
    assert st.peak_blocks_used == 4
    cache.free(a)  # blocks 0, 1 stay (b shares them); block 2 goes
    st = cache.stats()
    assert (st.free_runs, st.largest_free_run) == (2, 16)
    text = str(st)
    assert text == pagedkv.format_stats(st)
    assert len(text.splitlines()) >= 6
    assert "1 forks, 1 COW copies" in text and "largest 16 blocks" in text
    assert "prefix cache" not in text
    pc = make(prefix_caching=True)
    s = pc.add_sequence(token_ids=list(range(9)))
    assert "prefix cache 0 blocks hit, 2 missed" in str(pc.stats())


# ---- files of format version 1 (K row-major inside a block-head) ----------------------------
# tests/data/v1_*.pagedkv were written by pagedkv before the pool stored K transposed; the .npz
# beside each holds what that version's gather() and attend() returned for them.
DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "bfloat16"])
def test_version_1_files_load_into_the_current_layout(kv_dtype):
    want = np.load(DATA / f"v1_{kv_dtype}.npz")
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=40,
                                 num_layers=2, kv_dtype=kv_dtype)
    sid = cache.load(DATA / f"v1_{kv_dtype}.pagedkv")
    assert cache.seq_len(sid) == 7
    for layer in range(2):
        k, v = cache.gather(sid, layer=layer)
        np.testing.assert_array_equal(k, want[f"k{layer}"])
        np.testing.assert_array_equal(v, want[f"v{layer}"])
        out = cache.attend(sid, want["q"], layer=layer)
        np.testing.assert_allclose(out, want[f"o{layer}"], rtol=1e-5, atol=1e-6)


def test_version_1_file_saved_again_is_version_2(tmp_path):
    cache = pagedkv.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=40,
                                 num_layers=2, kv_dtype="int8")
    sid = cache.load(DATA / "v1_int8.pagedkv")
    cache.save(sid, tmp_path / "again.pagedkv")
    assert (tmp_path / "again.pagedkv").read_bytes()[8] == 2
    sid2 = cache.load(tmp_path / "again.pagedkv")
    for layer in range(2):
        np.testing.assert_array_equal(cache.gather(sid, layer=layer)[0],
                                      cache.gather(sid2, layer=layer)[0])
