# The kernel calls of CacheCore: append, append_batch, attend, attend_batch,
# gather, and the scratch the attention kernels work in.  Included by
# _core.pyx (one extension module).
#
# Each function runs with the cache's lock held (the CacheCore method around
# it takes it) and in three phases: check every argument (_checks.pxi) and
# plan the blocks (_seqtable.pxi), then convert the arrays (which may copy),
# then change the sequences and call the C code of include/pagedkv/ without
# the GIL.  Anything that raises does so before the cache changes.  These are
# the hot paths: C calls only, no Python objects made but the arrays in and
# out.


cdef int _ensure_scratch(CacheCore core, int threads) except -1:
    """Kernel scratch and split-K partial states for `threads` threads."""
    if threads <= core.scratch_threads:
        return 0
    stride = pkv_scratch_bytes(core.block_size, core.head_dim, core.csize)
    free(core.scratch_raw)
    free(core.partial_raw)
    core.scratch_raw = NULL
    core.partial_raw = NULL
    core.scratch_threads = 0
    core.scratch = _zalloc(stride * threads, &core.scratch_raw)
    core.partial = _zalloc(2 * threads * pkv_partial_slot_bytes(core.head_dim, core.csize),
                           &core.partial_raw)
    core.scratch_stride = stride
    core.scratch_threads = threads
    return 0


cdef int _set_rope(CacheCore core, object cos, object sin) except -1:
    """The RoPE tables the kernels rotate queries and keys by (checked), kept alive
    by the cache: [max_pos, half] each, and their transposes for the keys."""
    dt = np.float32 if core.compute == PKV_F32 else np.float64
    cos = np.require(cos, dt, ("C_CONTIGUOUS", "ALIGNED"))
    sin = np.require(sin, dt, ("C_CONTIGUOUS", "ALIGNED"))
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError("rope tables must be two arrays of equal shape [max_pos, half]")
    half = cos.shape[1]
    if half < 1 or 2 * half > core.head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={core.head_dim}]")
    if cos.shape[0] < core.max_blocks_per_seq * core.block_size:
        raise ValueError("rope tables must cover max_blocks_per_seq * block_size positions")
    core._rope_cos = cos
    core._rope_sin = sin
    # keys are rotated a vector of consecutive positions at a time: [half][max_pos]
    core._rope_cos_t = np.ascontiguousarray(cos.T)
    core._rope_sin_t = np.ascontiguousarray(sin.T)
    core.rope.cos = cnp.PyArray_DATA(cos)
    core.rope.sin = cnp.PyArray_DATA(sin)
    core.rope.cos_t = cnp.PyArray_DATA(core._rope_cos_t)
    core.rope.sin_t = cnp.PyArray_DATA(core._rope_sin_t)
    core.rope.max_pos = cos.shape[0]
    core.rope.half = <int>half
    return 0


# ----------------------------------------------------------------------------
# append

cdef inline void _write(CacheCore core, Seq *s, int layer, int64_t slot0, int64_t n,
                        const char *k, const char *v) noexcept:
    pkv_write_tokens(&core.pool.geom, core.pool.arena, s.table, layer, slot0, n, k, v,
                     core.io)
    s.written[layer] = s.segs.b1 + s.off1


cdef object _append(CacheCore core, object sid, object k, object v, object layer):
    cdef Seq *s = core.seqs.lookup(sid)
    cdef int l = _check_layer(core, layer)
    # shapes, then the plan's checks, then the conversions (which may copy): an n that
    # cannot fit raises before a huge (e.g. broadcast) k or v is copied
    k = _input(core, k, "k", -1, core.num_kv_heads, core.head_dim, "n", False)
    cdef int64_t n = cnp.PyArray_DIMS(k)[0]
    v = _input(core, v, "v", n, core.num_kv_heads, core.head_dim, "n", False)
    cdef _Plan p
    if l == 0:
        core.seqs.plan_grow(s, n, core.sink_tokens, core.window_tokens, &p)
        core.seqs.check_seq_bound(&p)
        core.seqs.check_free(p.new_blocks + p.cow, p.freed)
    else:
        _check_layer_append(s, l, n)
        core.seqs.check_free(core.seqs.shared_in(s, s.segs.b1 - n, s.segs.b1), 0)
    k = _contiguous(core, k)
    v = _contiguous(core, v)
    if l == 0:
        core.seqs.apply_grow(s, &p, n)
        s.step_n = n
    else:
        core.seqs.make_private(s, s.segs.b1 - n, s.segs.b1)
    _write(core, s, l, s.segs.b1 - n, n,
           <const char *>cnp.PyArray_DATA(k), <const char *>cnp.PyArray_DATA(v))
    core.seqs.touch(s)


cdef object _append_batch(CacheCore core, object sids, object k, object v, object layer):
    cdef int l = _check_layer(core, layer)
    cdef int64_t B = _batch_seqs(core, sids)
    cdef int64_t i, needed = 0, freed = 0
    cdef Seq *s
    cdef _Plan *p
    k = _input(core, k, "k", B, core.num_kv_heads, core.head_dim, "B")
    v = _input(core, v, "v", B, core.num_kv_heads, core.head_dim, "B")
    cdef const char *kp = <const char *>cnp.PyArray_DATA(k)
    cdef const char *vp = <const char *>cnp.PyArray_DATA(v)
    cdef size_t tok = core.num_kv_heads * core.head_dim * core.itemsize
    if l == 0:
        for i in range(B):
            p = &core.b_plans[i]
            core.seqs.plan_grow(core.b_seqs[i], 1, core.sink_tokens, core.window_tokens, p)
            core.seqs.check_seq_bound(p)
            needed += p.new_blocks + p.cow
            freed += p.freed
        core.seqs.check_free(needed, freed)
        # every trim first: the check counted the blocks all of them give back, and a
        # sequence early in the batch may need blocks a later one's trim frees (taking them
        # before that trim would find the free queue empty)
        for i in range(B):
            core.seqs.apply_drop(core.b_seqs[i], &core.b_plans[i], _TRIM_STREAMING)
        for i in range(B):
            core.seqs.apply_add(core.b_seqs[i], &core.b_plans[i], 1)
            core.b_seqs[i].step_n = 1
    else:
        for i in range(B):
            s = core.b_seqs[i]
            _check_layer_append(s, l, 1)
            needed += core.seqs.shared_in(s, s.segs.b1 - 1, s.segs.b1)
        core.seqs.check_free(needed, 0)
        for i in range(B):
            s = core.b_seqs[i]
            core.seqs.make_private(s, s.segs.b1 - 1, s.segs.b1)
    for i in range(B):
        s = core.b_seqs[i]
        _write(core, s, l, s.segs.b1 - 1, 1, kp + i * tok, vp + i * tok)
        core.seqs.touch(s)


# ----------------------------------------------------------------------------
# attention

cdef int _fill_args(CacheCore core, pkv_attn_args *a, int layer, int hq, double scale,
                    object q, object out, object opts) except -1:
    """The kernel's arguments but the sequences (nseq, nq, tables, segments);
    opts: window / softcap / sinks from _options() (checked there), or None."""
    cdef cnp.ndarray sinks
    a.nthreads = _nthreads if _nthreads > 0 else pkv_max_threads()
    _ensure_scratch(core, a.nthreads)
    a.k = core.pool.plane(layer)
    a.v = core.pool.plane(layer) + core.pool.geom.plane_bytes
    a.block_stride = core.pool.geom.block_bytes
    a.scale_offset = core.pool.geom.scale_offset
    a.bs = core.block_size
    a.hkv = core.num_kv_heads
    a.hq = hq
    a.d = core.head_dim
    a.tables = core.b_tables
    a.segs = core.b_segs
    a.q = cnp.PyArray_DATA(q)
    a.out = cnp.PyArray_DATA(out)
    a.qo16 = core.io if core.io != core.compute else 0
    a.scale = scale
    a.rope = &core.rope if core.has_rope else NULL
    a.scratch = core.scratch
    a.scratch_stride = core.scratch_stride
    a.partial = core.partial
    a.partial_slots = 2 * core.scratch_threads
    a.plan_out = core.plan
    a.window = 0
    a.softcap = 0.0
    a.sinks = NULL
    if opts is not None:
        window, softcap, sinks = opts
        a.window = window
        a.softcap = softcap
        if sinks is not None:
            a.sinks = <const double *>cnp.PyArray_DATA(sinks)
    return 0


cdef object _attend(CacheCore core, object sid, object q, object layer, object scale,
                    object out, object window, object softcap, object sinks):
    cdef Seq *s = core.seqs.lookup(sid)
    cdef int l = _check_layer(core, layer)
    cdef int hq
    q = _query(core, q, -1, "n", &hq, False)  # converted once n is known to be attendable
    cdef int64_t n = cnp.PyArray_DIMS(q)[0]
    cdef double sc = _scale(core, scale)
    opts = _options(window, softcap, sinks, hq)
    _check_attendable(core, s, l, n)
    q = _contiguous(core, q)
    out = _output(core, out, n, hq)
    cdef pkv_attn_args a
    _fill_args(core, &a, l, hq, sc, q, out, opts)
    core.b_tables[0] = s.table
    core.b_segs[0] = s.segs
    a.nseq = 1
    a.nq = n
    cdef pkv_attn_fn fn = core.kernels.decode if n == 1 else core.kernels.prefill
    with nogil:
        fn(&a)
    core.seqs.touch(s)
    return out


cdef int _attend_seqs(CacheCore core, object sids, int64_t B, int layer,
                      bint keep) except -1:
    """Look up and check the B = _batch_len(sids) sequences for one query each at
    their newest token; fill the batch's tables and segments (b_seqs too when keep)."""
    cdef int64_t i
    cdef Seq *s
    for i in range(B):
        s = core.seqs.lookup(sids[i])
        _check_attendable(core, s, layer, 1)
        if keep:
            core.b_seqs[i] = s
        core.b_tables[i] = s.table
        core.b_segs[i] = s.segs
    return 0


cdef object _attend_batch(CacheCore core, object sids, object q, object layer, object scale,
                          object out, object window, object softcap, object sinks):
    cdef int l = _check_layer(core, layer)
    cdef int64_t B, i
    cdef int hq
    B = _batch_len(core, sids)
    q = _query(core, q, B, "B", &hq)
    cdef double sc = _scale(core, scale)
    opts = _options(window, softcap, sinks, hq)
    _attend_seqs(core, sids, B, l, True)
    out = _output(core, out, B, hq)
    cdef pkv_attn_args a
    _fill_args(core, &a, l, hq, sc, q, out, opts)
    a.nseq = B
    a.nq = 1
    with nogil:
        core.kernels.decode(&a)
    for i in range(B):
        core.seqs.touch(core.b_seqs[i])
    return out


# ----------------------------------------------------------------------------
# gather

cdef object _gather(CacheCore core, object sid, object layer):
    cdef Seq *s = core.seqs.lookup(sid)
    cdef int l = _check_layer(core, layer)
    cdef pkv_segs g = s.segs
    cdef int64_t held = pkv_held(&g), n0 = g.a1 - g.a0
    cdef size_t tok = core.num_kv_heads * core.head_dim * core.itemsize
    k = cnp.PyArray_EMPTY(3, [held, core.num_kv_heads, core.head_dim], core.typenum, 0)
    v = cnp.PyArray_EMPTY(3, [held, core.num_kv_heads, core.head_dim], core.typenum, 0)
    cdef char *kp = <char *>cnp.PyArray_DATA(k)
    cdef char *vp = <char *>cnp.PyArray_DATA(v)
    with nogil:
        pkv_read_tokens(&core.pool.geom, core.pool.arena, s.table, l, g.a0, g.a1, kp, vp,
                        core.io)
        pkv_read_tokens(&core.pool.geom, core.pool.arena, s.table, l, g.b0, g.b1,
                        kp + n0 * tok, vp + n0 * tok, core.io)
    return k, v
