# Sequence table: one Seq struct per sequence slot, sequence ids, and the
# mechanics that change which blocks a sequence holds (grow, StreamingLLM
# trim, copy-on-write, fork, truncate, free).  Included by _core.pyx.
#
# Growing a sequence is planned first (a _Plan: what would be evicted,
# dropped, copied and taken) and applied only once the whole call is known
# to fit, so a call that raises changes nothing.
#
# Sequence ids are ``epoch * max_seqs + slot``: unique for the life of the
# cache, so a freed id never aliases a newer sequence.


ctypedef struct Seq:
    int64_t sid           # the id; -1 while the slot is free
    int64_t epoch         # bumped when the slot is freed
    int32_t *table        # physical ids of the blocks held, in order (max_blocks_per_seq)
    int64_t nblk          # blocks held
    pkv_segs segs         # held slots (include/pagedkv/types.h); appends go to b1
    int64_t off0, off1    # stream position of a slot = slot + off (segment a / b)
    int64_t *written      # per layer: stream position up to which it is written
    int64_t step_n        # n of the newest layer-0 append (0: none pending)
    int64_t last_use      # cache-wide tick of the latest add / fork / append / attend
    int64_t use_count     # append and attend calls
    int64_t order         # creation order (add_sequence / fork), 0 first
    double priority       # lower is evicted first by the "priority" strategy


# A plan for growing one sequence (computed first, applied only if it fits).
ctypedef struct _Plan:
    pkv_segs segs          # new segments (after eviction, after block drop)
    int64_t off0, off1
    int64_t drop_a         # blocks dropped from the front
    int64_t drop_b_start   # then blocks [drop_b_start, drop_b_start + drop_b) dropped
    int64_t drop_b
    int64_t freed          # dropped blocks that return to the pool (refcount 1)
    int64_t evicted_tokens
    int64_t keep_nblk      # blocks held after the drop
    int64_t new_blocks     # fresh blocks for the write
    int64_t cow            # shared blocks the write must copy first


# causes of StreamingLLM evictions, counted apart
cdef enum:
    _TRIM_STREAMING = 0    # per-append trimming of a StreamingLLM cache
    _TRIM_ONE_SHOT = 1     # apply_streaming_llm(...)


cdef inline void _plan_init(_Plan *p, const Seq *s) noexcept:
    p.segs = s.segs
    p.off0 = s.off0
    p.off1 = s.off1
    p.drop_a = 0
    p.drop_b = 0
    p.drop_b_start = 0
    p.freed = 0
    p.evicted_tokens = 0
    p.keep_nblk = s.nblk
    p.new_blocks = 0
    p.cow = 0


cdef class SequenceTable:
    """Per-sequence metadata over a BlockPool (mechanics only)."""

    cdef:
        BlockPool pool
        readonly int64_t max_seqs
        readonly int64_t max_blocks_per_seq
        int num_layers
        int block_size
        Seq *seqs
        int32_t *slot_stack
        int64_t n_slots_free
        int64_t tick
        int64_t created
        void *_raw[4]
        # cumulative counters
        readonly int64_t seqs_added
        readonly int64_t forks
        int64_t trimmed_tokens[2]   # by cause (_TRIM_*)
        int64_t trimmed_blocks[2]

    def __init__(self, BlockPool pool, int64_t max_seqs, int64_t max_blocks_per_seq):
        cdef int64_t i
        cdef int32_t *tables
        cdef int64_t *written
        self.pool = pool
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_layers = pool.geom.num_layers
        self.block_size = pool.geom.bs
        self.seqs = <Seq *>_zalloc(sizeof(Seq) * max_seqs, &self._raw[0])
        self.slot_stack = <int32_t *>_zalloc(4 * max_seqs, &self._raw[1])
        tables = <int32_t *>_zalloc(4 * max_seqs * max_blocks_per_seq, &self._raw[2])
        written = <int64_t *>_zalloc(8 * max_seqs * self.num_layers, &self._raw[3])
        for i in range(max_seqs):
            self.seqs[i].sid = -1
            self.seqs[i].table = tables + i * max_blocks_per_seq
            self.seqs[i].written = written + i * self.num_layers
            self.slot_stack[i] = <int32_t>(max_seqs - 1 - i)
        self.n_slots_free = max_seqs

    def __dealloc__(self):
        for i in range(4):
            free(self._raw[i])

    # ------------------------------------------------------------------
    # ids

    cdef Seq *lookup(self, object sid) except NULL:
        """The live sequence with this id (TypeError / KeyError otherwise)."""
        cdef long long s
        if type(sid) is not int and (not isinstance(sid, (int, np.integer))
                                     or isinstance(sid, (bool, np.bool_))):
            raise TypeError(f"sequence id must be an int, got {type(sid).__name__}")
        try:
            s = PyLong_AsLongLong(sid) if type(sid) is int else int(sid)
        except OverflowError:
            raise KeyError(f"unknown or freed sequence id {sid!r}") from None
        if s < 0 or self.seqs[s % self.max_seqs].sid != s:
            raise KeyError(f"unknown or freed sequence id {sid!r}")
        return &self.seqs[s % self.max_seqs]

    cdef inline int64_t slot_of(self, const Seq *s) noexcept:
        return s - self.seqs

    def live_ids(self):
        """Ids of the live sequences, lowest slot first."""
        return [self.seqs[i].sid for i in range(self.max_seqs) if self.seqs[i].sid >= 0]

    @property
    def num_live(self):
        return self.max_seqs - self.n_slots_free

    # ------------------------------------------------------------------
    # add / fork / free / truncate

    cdef Seq *new_seq(self, double priority) except NULL:
        """Take a free slot and start an empty sequence in it."""
        cdef int64_t slot
        cdef Seq *s
        if self.n_slots_free == 0:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use (max_seqs)")
        self.n_slots_free -= 1
        slot = self.slot_stack[self.n_slots_free]
        s = &self.seqs[slot]
        s.sid = s.epoch * self.max_seqs + slot
        s.nblk = 0
        memset(&s.segs, 0, sizeof(pkv_segs))
        s.off0 = 0
        s.off1 = 0
        memset(s.written, 0, 8 * self.num_layers)
        s.step_n = 0
        s.use_count = 0
        s.order = self.created
        s.priority = priority
        self.created += 1
        self.seqs_added += 1
        self.tick += 1
        s.last_use = self.tick
        return s

    cdef Seq *fork(self, Seq *parent) except NULL:
        """A new sequence sharing every block of `parent` (copy-on-write)."""
        cdef int64_t i
        cdef Seq *c = self.new_seq(parent.priority)
        memcpy(c.table, parent.table, 4 * parent.nblk)
        for i in range(parent.nblk):
            self.pool.share(parent.table[i])
        c.nblk = parent.nblk
        c.segs = parent.segs
        c.off0 = parent.off0
        c.off1 = parent.off1
        c.step_n = parent.step_n
        memcpy(c.written, parent.written, 8 * self.num_layers)
        self.forks += 1
        return c

    cdef void remove(self, Seq *s) noexcept:
        """Release every block of `s` (tail first: a freed chain's tail is
        handed out again before its head) and free its slot."""
        cdef int64_t i
        for i in range(s.nblk - 1, -1, -1):
            self.pool.release(s.table[i])
        s.nblk = 0
        s.sid = -1
        s.epoch += 1
        self.slot_stack[self.n_slots_free] = <int32_t>self.slot_of(s)
        self.n_slots_free += 1

    cdef void truncate(self, Seq *s, int64_t L) noexcept:
        """Keep the first L held tokens (0 <= L <= held)."""
        cdef pkv_segs g = s.segs
        cdef int64_t n0 = g.a1 - g.a0, keep, i, total
        if L == pkv_held(&g):
            return
        if L == 0:
            s.off1 = g.a0 + s.off0 if n0 > 0 else g.b0 + s.off1
            g.a0 = 0; g.a1 = 0; g.b0 = 0; g.b1 = 0
            s.off0 = s.off1
        elif L <= n0:
            s.off1 = s.off0
            g.b0 = g.a0; g.b1 = g.a0 + L; g.a1 = g.a0
        else:
            g.b1 = g.b0 + (L - n0)
        s.segs = g
        keep = _cdiv(g.b1, self.block_size)
        for i in range(s.nblk - 1, keep - 1, -1):
            self.pool.release(s.table[i])
        if g.b1 % self.block_size and self.pool.refcount[s.table[keep - 1]] == 1:
            # the next append writes into this block in place: its old contents go
            self.pool.forget(s.table[keep - 1])
        s.nblk = keep
        total = g.b1 + s.off1
        for i in range(self.num_layers):
            if s.written[i] > total:
                s.written[i] = total
        s.step_n = 0

    cdef Seq *adopt(self, const int32_t *blocks, int64_t n, double priority) except NULL:
        """A new sequence holding the n given blocks, full and written on every
        layer (a prefix-cache hit); the caller checked n <= max_blocks_per_seq."""
        cdef Seq *s = self.new_seq(priority)
        cdef int64_t i
        for i in range(n):
            self.pool.share(blocks[i])
            s.table[i] = blocks[i]
        s.nblk = n
        s.segs.b1 = n * self.block_size
        for i in range(self.num_layers):
            s.written[i] = s.segs.b1
        return s

    cdef void renumber(self, const int32_t *moved_to) noexcept:
        """Rewrite every block table after the pool moved blocks (compaction)."""
        cdef int64_t i, j
        cdef Seq *s
        for i in range(self.max_seqs):
            s = &self.seqs[i]
            if s.sid >= 0:
                for j in range(s.nblk):
                    s.table[j] = moved_to[s.table[j]]

    cdef inline void touch(self, Seq *s) noexcept:
        self.tick += 1
        s.last_use = self.tick
        s.use_count += 1

    # ------------------------------------------------------------------
    # planning (no state changes)

    cdef int plan_grow(self, const Seq *s, int64_t n, int64_t S, int64_t R,
                       _Plan *p) except -1:
        """Plan the StreamingLLM trim (S >= 0) plus the write of n tokens."""
        cdef int64_t bs = self.block_size
        _plan_init(p, s)
        if S >= 0:
            self.plan_trim(s, S, R, p)
        p.keep_nblk = s.nblk - p.drop_a - p.drop_b
        p.new_blocks = _cdiv(p.segs.b1 + n, bs) - p.keep_nblk
        if p.new_blocks < 0:
            p.new_blocks = 0
        if p.segs.b1 % bs != 0 and n > 0:
            # the partly filled last block is written: copy it first if shared
            # (drops are all before it, so its index in the current table is the last)
            if self.pool.refcount[s.table[s.nblk - 1]] > 1:
                p.cow = 1
        return 0

    cdef int plan_trim(self, const Seq *s, int64_t S, int64_t R, _Plan *p) except -1:
        """StreamingLLM: keep held ranks [0, S) and [h - R, h) (h = held now)."""
        cdef pkv_segs g = p.segs
        cdef int64_t h = pkv_held(&g), n0 = g.a1 - g.a0
        cdef int64_t bs = self.block_size
        cdef int64_t x0[5]
        cdef int64_t x1[5]
        cdef int64_t xo[5]
        cdef int64_t k = 0, i, j, r, lo, hi, ga, gb0, gb1
        if h <= S + R:
            return 0
        # slot intervals of the kept ranks, in rank order
        for r in range(2):
            lo = 0 if r == 0 else h - R
            hi = S if r == 0 else h
            if min(hi, n0) > lo:
                x0[k] = g.a0 + lo; x1[k] = g.a0 + min(hi, n0); xo[k] = p.off0; k += 1
            if hi > max(lo, n0):
                x0[k] = g.b0 + max(lo, n0) - n0; x1[k] = g.b0 + hi - n0; xo[k] = p.off1; k += 1
        # merge touching intervals of one segment
        j = 0
        for i in range(1, k):
            if x0[i] == x1[j] and xo[i] == xo[j]:
                x1[j] = x1[i]
            else:
                j += 1
                x0[j] = x0[i]; x1[j] = x1[i]; xo[j] = xo[i]
        k = j + 1
        # the write segment must end at b1 (possibly empty when R == 0)
        if R == 0 or x1[k - 1] != g.b1:
            lo = g.b1; r = p.off1
            if lo % bs != 0 and (k == 0 or x1[k - 1] <= lo - lo % bs):
                # the block being filled keeps no token: the next write starts a fresh
                # block (same stream position) so this one is dropped with the gap
                lo += bs - lo % bs; r = p.off1 + g.b1 - lo
            x0[k] = lo; x1[k] = lo; xo[k] = r; k += 1
            if k >= 2 and x1[k - 2] == lo and xo[k - 2] == r:
                k -= 1
        if k > 2:
            raise ValueError(
                f"cannot keep sink_tokens={S}, window_tokens={R} of this sequence: its held "
                "tokens would form more than two runs (change StreamingLLM sizes only on "
                "sequences that were not trimmed with other sizes)")
        p.evicted_tokens = h - S - R
        if k == 1:
            p.segs.a0 = x0[0]; p.segs.a1 = x0[0]; p.segs.b0 = x0[0]; p.segs.b1 = x1[0]
            p.off0 = xo[0]; p.off1 = xo[0]
        else:
            p.segs.a0 = x0[0]; p.segs.a1 = x1[0]; p.segs.b0 = x0[1]; p.segs.b1 = x1[1]
            p.off0 = xo[0]; p.off1 = xo[1]
        # whole blocks in the gaps [0, a0) and [a1, b0) go back to the pool
        p.drop_a = p.segs.a0 // bs
        gb0 = _cdiv(p.segs.a1, bs) if p.segs.a1 > p.segs.a0 else p.drop_a
        gb1 = p.segs.b0 // bs
        p.drop_b_start = gb0
        p.drop_b = gb1 - gb0 if gb1 > gb0 else 0
        for i in range(p.drop_a):
            if self.pool.refcount[s.table[i]] == 1:
                p.freed += 1
        for i in range(p.drop_b_start, p.drop_b_start + p.drop_b):
            if self.pool.refcount[s.table[i]] == 1:
                p.freed += 1
        # shift slots by the dropped blocks
        ga = p.drop_a * bs
        gb0 = (p.drop_a + p.drop_b) * bs
        if p.segs.a1 > p.segs.a0:
            p.segs.a0 -= ga; p.segs.a1 -= ga; p.off0 += ga
        p.segs.b0 -= gb0; p.segs.b1 -= gb0; p.off1 += gb0
        if p.segs.a1 == p.segs.a0:
            p.segs.a0 = p.segs.b0; p.segs.a1 = p.segs.b0; p.off0 = p.off1
        p.keep_nblk = s.nblk - p.drop_a - p.drop_b
        return 0

    cdef int check_seq_bound(self, const _Plan *p) except -1:
        """The sequence may hold keep_nblk + new_blocks blocks.  When the bound is
        the pool itself (max_blocks_per_seq >= num_blocks) the pool is what runs
        short: OutOfBlocksError; otherwise the per-sequence bound: ValueError."""
        cdef int64_t after = p.keep_nblk + p.new_blocks
        if after <= self.max_blocks_per_seq:
            return 0
        if self.max_blocks_per_seq >= self.pool.num_blocks:
            raise OutOfBlocksError(p.new_blocks + p.cow, self.pool.num_free + p.freed, True)
        raise ValueError(
            f"the sequence would hold {after} blocks; max_blocks_per_seq is "
            f"{self.max_blocks_per_seq}")

    cdef int check_free(self, int64_t needed, int64_t freed) except -1:
        """The pool can supply `needed` blocks once `freed` are given back."""
        if needed > self.pool.num_free + freed:
            raise OutOfBlocksError(needed, self.pool.num_free + freed)
        return 0

    # ------------------------------------------------------------------
    # applying (cannot fail once checked)

    cdef void apply_drop(self, Seq *s, const _Plan *p, int cause) noexcept:
        """Apply a plan's trim: new segments, dropped blocks back to the pool."""
        cdef int64_t i, n = s.nblk
        s.segs = p.segs
        s.off0 = p.off0
        s.off1 = p.off1
        self.trimmed_tokens[cause] += p.evicted_tokens
        if p.drop_a == 0 and p.drop_b == 0:
            return
        for i in range(p.drop_b_start + p.drop_b - 1, p.drop_b_start - 1, -1):
            self.pool.release(s.table[i])
        for i in range(p.drop_a - 1, -1, -1):
            self.pool.release(s.table[i])
        if p.drop_b:
            memmove(s.table + p.drop_b_start, s.table + p.drop_b_start + p.drop_b,
                    4 * (n - p.drop_b_start - p.drop_b))
        if p.drop_a:
            memmove(s.table, s.table + p.drop_a, 4 * (n - p.drop_a - p.drop_b))
        s.nblk = n - p.drop_a - p.drop_b
        self.trimmed_blocks[cause] += p.drop_a + p.drop_b

    cdef void apply_grow(self, Seq *s, const _Plan *p, int64_t n) noexcept:
        """Trim, copy the last block if shared, add blocks: then b1 += n."""
        self.apply_drop(s, p, _TRIM_STREAMING)
        self.apply_add(s, p, n)

    cdef void apply_add(self, Seq *s, const _Plan *p, int64_t n) noexcept:
        """apply_grow after its trim: copy the last block if shared, add blocks, b1 += n.
        A batch applies every sequence's trim before any of these: its check counted the
        blocks all the trims give back."""
        cdef int64_t i
        if p.cow:
            s.table[s.nblk - 1] = self.pool.copy_on_write(s.table[s.nblk - 1])
        elif n > 0 and s.segs.b1 % self.block_size and self.pool.cached[s.table[s.nblk - 1]]:
            # written in place into a block the prefix cache registered full: held partly
            # again after a truncate while it was shared (so the truncate kept it cached)
            self.pool.forget(s.table[s.nblk - 1])
        for i in range(p.new_blocks):
            s.table[s.nblk] = self.pool.take()
            s.nblk += 1
        s.segs.b1 += n

    cdef int64_t shared_in(self, const Seq *s, int64_t s0, int64_t s1) noexcept:
        """Blocks covering slots [s0, s1) that another sequence shares."""
        cdef int64_t i, shared = 0
        for i in range(s0 // self.block_size, _cdiv(s1, self.block_size)):
            if self.pool.refcount[s.table[i]] > 1:
                shared += 1
        return shared

    cdef void make_private(self, Seq *s, int64_t s0, int64_t s1) noexcept:
        """Copy the shared blocks covering slots [s0, s1) (checked: enough free)."""
        cdef int64_t i
        for i in range(s0 // self.block_size, _cdiv(s1, self.block_size)):
            if self.pool.refcount[s.table[i]] > 1:
                s.table[i] = self.pool.copy_on_write(s.table[i])

    # ------------------------------------------------------------------
    # introspection

    def trimmed(self):
        """StreamingLLM evictions: ((tokens, blocks) per-append, (tokens, blocks) one-shot)."""
        return ((self.trimmed_tokens[_TRIM_STREAMING], self.trimmed_blocks[_TRIM_STREAMING]),
                (self.trimmed_tokens[_TRIM_ONE_SHOT], self.trimmed_blocks[_TRIM_ONE_SHOT]))
