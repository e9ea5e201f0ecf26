# Whole sequences and blocks in and out of CacheCore: export / import (what
# pagedkv/persist.py saves and loads), adopt (a prefix-cache hit, see
# pagedkv/prefix.py), compaction and resize.  Included by _core.pyx (one
# extension module).
#
# Each function runs with the cache's lock held, checks everything first and
# changes nothing when it raises.


cdef object _export_seq(CacheCore core, object sid):
    cdef Seq *s = core.seqs.lookup(sid)
    cdef int64_t i
    cdef size_t bb = core.pool.geom.block_bytes
    _check_step_done(s, sid, core.num_layers, "export")
    data = np.empty((s.nblk, bb), dtype=np.uint8)
    cdef char *d = <char *>cnp.PyArray_DATA(data)
    for i in range(s.nblk):
        memcpy(d + i * bb, core.pool.block_ptr(s.table[i]), bb)
    meta = dict(nblk=s.nblk, a0=s.segs.a0, a1=s.segs.a1, b0=s.segs.b0, b1=s.segs.b1,
                off0=s.off0, off1=s.off1, priority=s.priority)
    return meta, data


cdef object _import_seq(CacheCore core, object meta, object data):
    cdef size_t bb = core.pool.geom.block_bytes
    cdef int64_t bs = core.block_size, i
    try:
        nblk, a0, a1, b0, b1, off0, off1 = (int(meta[k]) for k in (
            "nblk", "a0", "a1", "b0", "b1", "off0", "off1"))
        priority = float(meta.get("priority", 0.0))
    except (KeyError, TypeError, ValueError) as e:
        raise SequenceMetaError(f"sequence metadata is incomplete or malformed: {e}") from None
    # kept positions (slot + offset of its segment) must increase: the sinks before the window
    if not (0 <= a0 <= a1 <= b0 <= b1 < 2**62 and 0 <= nblk < 2**62 and _cdiv(b1, bs) == nblk
            and 0 <= off0 < 2**62 and 0 <= off1 < 2**62
            and (a0 == a1 or a1 + off0 <= b0 + off1)):
        raise SequenceMetaError(
            f"inconsistent sequence metadata: segments [{a0}, {a1}) [{b0}, {b1}) at "
            f"offsets {off0}, {off1}, {nblk} blocks of {bs} tokens")
    if nblk > core.max_blocks_per_seq:
        raise ValueError(
            f"the sequence holds {nblk} blocks; max_blocks_per_seq is {core.max_blocks_per_seq}")
    cdef cnp.ndarray arr = np.ascontiguousarray(data, dtype=np.uint8)
    if arr.size != nblk * bb:
        raise SequenceMetaError(f"expected {nblk * bb} bytes of blocks, got {arr.size}")
    if core.seqs.n_slots_free == 0:
        raise RuntimeError(f"all {core.max_seqs} sequence slots are in use (max_seqs)")
    core.seqs.check_free(nblk, 0)
    cdef Seq *s = core.seqs.new_seq(priority)
    cdef const char *d = <const char *>cnp.PyArray_DATA(arr)
    for i in range(nblk):
        s.table[i] = core.pool.take()
        memcpy(core.pool.block_ptr(s.table[i]), d + i * bb, bb)
    s.nblk = nblk
    s.segs.a0, s.segs.a1, s.segs.b0, s.segs.b1 = a0, a1, b0, b1
    s.off0, s.off1 = off0, off1
    for i in range(core.num_layers):
        s.written[i] = b1 + off1
    return s.sid


cdef object _adopt(CacheCore core, object blocks, object priority):
    cdef cnp.ndarray arr = np.require(blocks, np.int32, ("C_CONTIGUOUS", "ALIGNED"))
    cdef int64_t n = arr.shape[0] if arr.ndim == 1 else -1, i
    cdef const int32_t *b = <const int32_t *>cnp.PyArray_DATA(arr)
    if n < 0:
        raise ValueError("blocks must be one-dimensional")
    if n > core.max_blocks_per_seq:
        raise ValueError(f"{n} blocks exceed max_blocks_per_seq={core.max_blocks_per_seq}")
    for i in range(n):
        if b[i] < 0 or b[i] >= core.pool.num_blocks or (
                core.pool.refcount[b[i]] == 0 and not core.pool.cached[b[i]]):
            raise ValueError(f"block {b[i]} is neither in use nor cached")
    return core.seqs.adopt(b, n, priority).sid


cdef object _compact(CacheCore core):
    moved_to = np.empty(core.pool.num_blocks, dtype=np.int32)
    cdef int32_t *m = <int32_t *>cnp.PyArray_DATA(moved_to)
    moves = core.pool.compact(m)
    core.seqs.renumber(m)
    return moves, moved_to


cdef object _resize(CacheCore core, object num_blocks):
    n = _positive_int("num_blocks", num_blocks)
    if n > 2**31 - 1:
        raise ValueError(f"num_blocks must be < 2**31, got {n}")
    hi = core.pool.highest_used()
    if n <= hi:
        raise ValueError(
            f"cannot shrink the pool to {n} blocks: block {hi} is in use "
            f"({core.pool.num_blocks - core.pool.num_free} blocks used); call compact() first")
    if n * core.pool.geom.block_bytes > 2**56:
        raise MemoryError(f"the pool would need {n * core.pool.geom.block_bytes} bytes")
    if n != core.pool.num_blocks:
        core.pool.resize(n)
