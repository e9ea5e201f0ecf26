# Diagnostics: views of the sequences for the Python layer and the tests
# (kept positions, block tables, the eviction strategies' rankings, internal
# state), the decode read pattern without the arithmetic, and the machine's
# ceilings (read bandwidth, instruction peak).  Included by _core.pyx (one
# extension module).


# ----------------------------------------------------------------------------
# sequences (called with the cache's lock held)

cdef object _kept_positions(CacheCore core, object sid):
    """Original stream positions of the held tokens, in order (int64)."""
    return _seq_kept_positions(core.seqs.lookup(sid))


cdef object _seq_kept_positions(const Seq *s):
    cdef int64_t i, n = 0
    cdef int64_t *p
    out = cnp.PyArray_EMPTY(1, [pkv_held(&s.segs)], cnp.NPY_INT64, 0)
    p = <int64_t *>cnp.PyArray_DATA(out)
    for i in range(s.segs.a0, s.segs.a1):
        p[n] = i + s.off0
        n += 1
    for i in range(s.segs.b0, s.segs.b1):
        p[n] = i + s.off1
        n += 1
    return out


cdef object _table_copy(const Seq *s):
    out = np.empty(s.nblk, dtype=np.int32)
    if s.nblk:
        memcpy(cnp.PyArray_DATA(out), s.table, 4 * s.nblk)
    return out


cdef object _sequence_infos(CacheCore core):
    cdef int64_t i
    cdef Seq *s
    out = []
    for i in range(core.seqs.max_seqs):
        s = &core.seqs.seqs[i]
        if s.sid >= 0:
            out.append((s.sid, s.last_use, s.use_count, pkv_held(&s.segs), s.nblk,
                        s.priority, s.order))
    return out


cdef object _debug_state(CacheCore core, object sid):
    cdef Seq *s = core.seqs.lookup(sid)
    return dict(a0=s.segs.a0, a1=s.segs.a1, b0=s.segs.b0, b1=s.segs.b1, off0=s.off0,
                off1=s.off1, table=_table_copy(s).tolist())


cdef object _debug_snapshot(CacheCore core):
    """Everything a failed call must leave as it was, read in one pass (for the fuzz
    programs, tests/fuzz/program.py, which compare it before and after every call):
    (seqs, pool, inner) with
      seqs:  per live sequence, lowest slot first: (sid, held tokens, kept positions as
             int64 bytes, priority, the held K then V of layer 0, 1, ... as gather returns
             them, all in one bytes object);
      pool:  (num_blocks, free blocks, [(generation, cached, references)] per block,
             cached free blocks);
      inner: (the free queue in hand-out order, per live sequence (sid, block table as
             int32 bytes, written_tokens, (a0, a1, b0, b1, off0, off1))): what the
             invariant checks read beyond the snapshot."""
    cdef int64_t i, n0, held
    cdef int l
    cdef Seq *s
    cdef pkv_segs g
    cdef BlockPool pool = core.pool
    cdef size_t tok = core.num_kv_heads * core.head_dim * core.itemsize, plane
    cdef char *p
    seqs, tables = [], []
    for i in range(core.seqs.max_seqs):
        s = &core.seqs.seqs[i]
        if s.sid < 0:
            continue
        g = s.segs
        held = pkv_held(&g)
        n0 = g.a1 - g.a0
        plane = held * tok
        kv = PyBytes_FromStringAndSize(NULL, 2 * plane * core.num_layers)
        p = PyBytes_AS_STRING(kv)
        for l in range(core.num_layers):
            pkv_read_tokens(&pool.geom, pool.arena, s.table, l, g.a0, g.a1, p, p + plane,
                            core.io)
            pkv_read_tokens(&pool.geom, pool.arena, s.table, l, g.b0, g.b1, p + n0 * tok,
                            p + plane + n0 * tok, core.io)
            p += 2 * plane
        seqs.append((s.sid, held, _seq_kept_positions(s).tobytes(), s.priority, kv))
        tables.append((s.sid, PyBytes_FromStringAndSize(<char *>s.table, 4 * s.nblk),
                       _seq_written_tokens(core, s), (g.a0, g.a1, g.b0, g.b1, s.off0, s.off1)))
    blocks = [(pool.gen[i], bool(pool.cached[i]), pool.refcount[i])
              for i in range(pool.num_blocks)]
    return (seqs, (pool.num_blocks, pool.num_free, blocks, pool.num_cached_free),
            (pool.free_blocks(), tables))


cdef object _written_tokens(CacheCore core, object sid):
    return _seq_written_tokens(core, core.seqs.lookup(sid))


cdef int64_t _seq_written_tokens(CacheCore core, const Seq *s):
    """Tokens written on every layer (the least of the layers' counts)."""
    cdef int64_t w = s.written[0]
    cdef int l
    for l in range(1, core.num_layers):
        w = min(w, s.written[l])
    return w


# ----------------------------------------------------------------------------
# the decode read pattern and the machine's ceilings

cdef object _read_kv_pattern(CacheCore core, object sids, object layer):
    cdef int l = _check_layer(core, layer)
    cdef int64_t B = _batch_len(core, sids)
    _attend_seqs(core, sids, B, l, False)
    cdef int nt = _nthreads if _nthreads > 0 else pkv_max_threads()
    cdef const char *k = core.pool.plane(l)
    cdef size_t plane = core.pool.geom.plane_bytes, nbytes = 0
    cdef uint64_t x
    with nogil:
        x = pkv_read_pattern(k, k + plane, plane, core.pool.geom.block_bytes,
                             core.block_size, B, <const int32_t *const *>core.b_tables,
                             core.b_segs, _simd, nt, &nbytes)
    x ^= x >> 32
    x ^= x >> 16
    x ^= x >> 8
    return int(nbytes), int(x & 0xFF)


def read_bandwidth(nbytes=256 << 20, repeats=5, threads=None):
    """Measure memory read bandwidth (bytes/s, best of `repeats`) with the core's
    SIMD read kernel over a buffer of `nbytes` (should be well above the L3 size)."""
    import time
    cdef int nt = get_num_threads() if threads is None else int(threads)
    if nt < 1:
        raise ValueError(f"threads must be >= 1, got {nt}")
    buf = np.ones(max(int(nbytes) // 4, 1024), dtype=np.float32)
    cdef const void *p = cnp.PyArray_DATA(buf)
    cdef size_t n = buf.size
    cdef double s
    best = 0.0
    with nogil:
        s = pkv_read_sum(p, n, PKV_F32, _simd, nt)  # warm: pages resident, threads up
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        with nogil:
            s = pkv_read_sum(p, n, PKV_F32, _simd, nt)
        dt = time.perf_counter() - t0
        if s != <double>n:
            raise RuntimeError("read kernel returned a wrong sum")
        best = max(best, n * 4 / dt)
    return best


# ----------------------------------------------------------------------------
# instruction peak (include/pagedkv/peak.h)

_PEAK_KINDS = {"fma_f32": PKV_PEAK_FMA_F32, "fma_f64": PKV_PEAK_FMA_F64,
               "dpbusd": PKV_PEAK_DPBUSD, "sdot": PKV_PEAK_SDOT, "dpbf16": PKV_PEAK_DPBF16,
               "dpwssd": PKV_PEAK_DPWSSD}


def _peak_args(kind, simd, threads):
    """(kind index, SIMD index, threads) of a peak probe, checked."""
    if not isinstance(kind, str) or kind not in _PEAK_KINDS:
        raise ValueError(f"unknown instruction kind {kind!r}; expected one of "
                         f"{', '.join(_PEAK_KINDS)}")
    cdef int k = _PEAK_KINDS[kind]
    cdef int s = _simd
    if simd is not None:
        if not isinstance(simd, str) or simd not in _SIMD_NAMES:
            raise ValueError(f"unknown SIMD path {simd!r}; expected one of "
                             f"{', '.join(_SIMD_NAMES)}")
        s = _SIMD_NAMES.index(simd)
        if not pkv_simd_supported(s):
            raise ValueError(f"SIMD path {simd!r} does not run on this machine (it runs "
                             f"{', '.join(simd_supported())})")
    if pkv_peak_width(k, s) == 0:
        raise ValueError(f"no {kind} probe for SIMD path {_SIMD_NAMES[s]!r} in this build")
    nt = int(threads)
    if nt < 1:
        raise ValueError(f"threads must be >= 1, got {nt}")
    return k, s, nt


def _fma_probe(kind="fma_f32", simd=None, iters=1, threads=1, a=0.5, b=1.0):
    """Run the peak loop once, `iters` rounds on each of `threads` threads:
    (lanes done, sum of every final lane).  Lane k of a thread's chains
    starts at k, and each round turns its value c into c * a + b (for the
    tests)."""
    cdef int k, s, nt
    k, s, nt = _peak_args(kind, simd, threads)
    cdef int64_t n = int(iters)
    if n < 0:
        raise ValueError(f"iters must be >= 0, got {n}")
    cdef double fa = float(a), fb = float(b), total = 0.0
    cdef uint64_t lanes
    with nogil:
        lanes = pkv_peak_run(k, s, n, nt, fa, fb, &total)
    return int(lanes), float(total)


def instruction_peak(kind="fma_f32", simd=None, threads=1, seconds=0.05, repeats=20):
    """Measured peak rate of an instruction on this machine, in lanes per second.

    kind: "fma_f32" / "fma_f64", the fused multiply-add the attention kernels
    are built on (one multiply-add of one lane counts 1); "dpbusd", the
    integer dot product of the VNNI paths' int8 scores (vpdpbusd: 64 byte
    products per instruction on "avx512vnni" and "avx512amx", 32 on
    "avxvnni", each counts 1); "sdot", its counterpart on "neondot" (16
    products); "dpbf16", the bfloat16 dot product of the "avx512bf16" path's
    bfloat16 scores (vdpbf16ps: 32 products of bfloat16 pairs per
    instruction); "dpwssd", the int16 dot product of P.V of int8 values where
    the weights are rounded to int16 (cache.quantizes_weights; vpdpwssd: 32
    products of int16 pairs per instruction, the AVX-512 + VNNI paths).
    simd: the path ("scalar", "avx2", "avxvnni", "avx512", "avx512vnni",
    "avx512bf16", "avx512amx", "neon", "neondot"; None: the active one,
    simd_backend()).  threads: threads running the loop at once (OpenMP;
    a build without it runs their loops one after another, so the rate is
    one thread's); the rate is the lanes of all of them / wall time.  The loop
    (include/pagedkv/peak.h: 12 independent FMA chains over SIMD registers)
    is timed for about `seconds` in all, as `repeats` runs of equal length
    after a calibration that also warms up; the best run counts (short runs
    are less likely to lose the CPU to another process on a shared machine).
    Raises ValueError for an unknown kind or path, a path this machine does
    not run, threads < 1, seconds <= 0 or repeats < 1."""
    import math
    import time
    cdef int k, s, nt
    k, s, nt = _peak_args(kind, simd, threads)
    secs = float(seconds)
    if not (secs > 0 and math.isfinite(secs)):
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    nrep = int(repeats)
    if nrep < 1:
        raise ValueError(f"repeats must be >= 1, got {nrep}")
    run_s = secs / nrep
    cdef uint64_t per_round = <uint64_t>nt * PKV_PEAK_CHAINS * pkv_peak_width(k, s)
    cdef int64_t iters = 256
    rate = 0.0  # best rounds per second seen
    # calibration, which also warms up (thread pool started, clocks up): at
    # least 3 runs, until one lasts half a timed run
    for cal in range(64):
        dt = _peak_once(k, s, iters, nt, per_round)
        rate = max(rate, iters / dt)
        if cal >= 2 and dt >= 0.5 * run_s:
            break
        iters = max(iters, min(64 * iters, <int64_t>(rate * run_s) + 1))
    iters = max(256, <int64_t>(rate * run_s))
    best = 0.0
    for _ in range(nrep):
        best = max(best, iters * per_round / _peak_once(k, s, iters, nt, per_round))
    return best


cdef double _peak_once(int k, int s, int64_t iters, int nt, uint64_t per_round) except -1:
    """Seconds one run of the probe took; checks the lanes it counted and its
    checksum: with a = 0.5, b = 1 every FMA lane ends at exactly 2 after >= 256
    rounds (2^-256 times any start is below half an ulp of 2); every dpbusd
    or sdot int32 lane k (16, 8 or 4 per chain) ends at k + 4 * iters, every
    dpwssd one at k + 2 * iters; every
    dpbf16 float32 lane k at k + 2 * iters while that is below 2^24 (exact),
    beyond which the lanes only have to have grown (their sums round)."""
    import time
    cdef uint64_t lanes
    cdef double total = 0.0
    t0 = time.perf_counter()
    with nogil:
        lanes = pkv_peak_run(k, s, iters, nt, 0.5, 1.0, &total)
    dt = time.perf_counter() - t0
    ok = True
    if k == PKV_PEAK_DPBUSD or k == PKV_PEAK_SDOT or k == PKV_PEAK_DPWSSD:
        per = 2 if k == PKV_PEAK_DPWSSD else 4  # products in an int32 lane
        n32 = PKV_PEAK_CHAINS * pkv_peak_width(k, s) // per  # int32 lanes
        want = float(nt * (n32 * (n32 - 1) // 2 + n32 * per * iters))
    elif k == PKV_PEAK_DPBF16:
        n32 = PKV_PEAK_CHAINS * pkv_peak_width(k, s) // 2  # float32 lanes, 2 products each
        start = float(nt * (n32 * (n32 - 1) // 2))
        want = start + float(nt * n32 * 2 * iters)
        if n32 + 2 * iters >= 1 << 24:  # the sums round: the lanes only have to have grown
            ok = start < total <= want
            want = total
    else:
        want = 2.0 * per_round
    if not ok or total != want or lanes != <uint64_t>iters * per_round:
        raise RuntimeError(f"peak probe: {lanes} lanes with checksum {total}, expected "
                           f"{iters * per_round} lanes with checksum {want}")
    return max(dt, 1e-9)
