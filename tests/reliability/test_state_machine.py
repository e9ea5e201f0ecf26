"""Stateful property test: random add/append/append_batch/fork/truncate/free sequences against a
pure-Python model.

The model keeps, per sequence, the tokens appended on every layer (``reference.SeqModel``) and a
block table of abstract block ids with reference counts, following the copy-on-write rules of the
contract: ``fork`` shares every block, a write into a shared partially filled block copies that one
block, ``truncate`` drops the blocks past the new length, ``free`` drops them all.  From it the
number of free blocks is exact, and so is whether an append must fail with OutOfBlocksError (pool)
or ValueError (``max_blocks_per_seq``).

Checked after every step: gather() equals the model exactly, seq_len, kept_positions, the free
count (never below 0, never above num_blocks), and stats; attention steps compare with the NumPy
reference.  After freeing everything at the end, every block is free again.
"""

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from profiles import depth
from reference import (
    SeqModel,
    assert_attention_close,
    blocks_for,
    check_against_model,
    math_scale,
    ref_attention,
)

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


class PagedKVModelMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 14
    BLOCK_SIZE = 3
    HKV = 2
    HQ = 4
    D = 4
    LAYERS = 2
    DTYPE = "float64"
    MAX_SEQS = 6
    MAX_BLOCKS_PER_SEQ = 6

    def __init__(self):
        super().__init__()
        self.cache = pagedkv.PagedKVCache(
            self.NUM_BLOCKS, self.BLOCK_SIZE, self.HKV, self.D, self.LAYERS, self.DTYPE,
            max_seqs=self.MAX_SEQS, max_blocks_per_seq=self.MAX_BLOCKS_PER_SEQ)
        self.seqs = {}  # sid -> SeqModel
        self.tables = {}  # sid -> list of abstract block ids
        self.refs = {}  # abstract block id -> reference count (> 0)
        self.next_block = 0
        self.forks = 0
        # A batch in which two sequences share the partial block they both write into may copy it
        # once (the second writer then owns it) or twice; cow_copies is bounded, not exact.
        self.cow_lo = 0
        self.cow_hi = 0

    # ---- model helpers ------------------------------------------------------------------------

    def predicted_free(self):
        return self.NUM_BLOCKS - len(self.refs)

    def _new_block(self, refs):
        self.next_block += 1
        refs[self.next_block] = 1
        return self.next_block

    def _decref(self, refs, block):
        refs[block] -= 1
        if refs[block] == 0:
            del refs[block]

    def _simulate_append(self, tables, refs, sid, n):
        """Apply an n-token append of sid to (tables, refs) in place; return (blocks taken, copies)."""
        table = tables[sid]
        length = len(self.seqs[sid])
        taken = copies = 0
        if length % self.BLOCK_SIZE and refs[table[-1]] > 1:
            old = table[-1]
            self._decref(refs, old)
            table[-1] = self._new_block(refs)
            taken += 1
            copies += 1
        grow = blocks_for(length + n, self.BLOCK_SIZE) - blocks_for(length, self.BLOCK_SIZE)
        for _ in range(grow):
            table.append(self._new_block(refs))
            taken += 1
        return taken, copies

    def _needs_copy_alone(self, sid):
        length = len(self.seqs[sid])
        return bool(length % self.BLOCK_SIZE) and self.refs[self.tables[sid][-1]] > 1

    def _tokens(self, seed, n, heads):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n, heads, self.D)).astype(self.DTYPE)

    def _pick(self, data, nonempty=False):
        choices = sorted(s for s in self.seqs if not nonempty or len(self.seqs[s]) > 0)
        return data.draw(st.sampled_from(choices))

    def _unchanged_model_check(self):
        for sid, model in self.seqs.items():
            check_against_model(self.cache, sid, model, self.LAYERS)
        assert self.cache.num_free_blocks == self.predicted_free()

    # ---- rules ----------------------------------------------------------------------------------

    @initialize(count=st.integers(min_value=1, max_value=3))
    def start_with_sequences(self, count):
        for _ in range(count):
            self._add()

    @precondition(lambda self: len(self.seqs) < self.MAX_SEQS)
    @rule()
    def add_sequence(self):
        self._add()

    def _add(self):
        sid = self.cache.add_sequence()
        assert isinstance(sid, int)
        assert sid not in self.seqs
        self.seqs[sid] = SeqModel(self.LAYERS, self.HKV, self.D, self.DTYPE)
        self.tables[sid] = []
        assert self.cache.seq_len(sid) == 0

    @precondition(lambda self: len(self.seqs) > 0)
    @rule(data=st.data(), n=st.integers(min_value=1, max_value=7), seed=SEEDS)
    def append(self, data, n, seed):
        self._append(self._pick(data), n, seed)

    def _append(self, sid, n, seed):
        length = len(self.seqs[sid])
        over_bound = blocks_for(length + n, self.BLOCK_SIZE) > self.MAX_BLOCKS_PER_SEQ
        tables = {s: list(t) for s, t in self.tables.items()}
        refs = dict(self.refs)
        saved_next = self.next_block
        needed, copies = self._simulate_append(tables, refs, sid, n)
        out_of_blocks = needed > self.predicted_free()
        ks = [self._tokens(seed + 2 * layer, n, self.HKV) for layer in range(self.LAYERS)]
        vs = [self._tokens(seed + 2 * layer + 1, n, self.HKV) for layer in range(self.LAYERS)]
        if over_bound or out_of_blocks:
            event("append rejected: " + ("max_blocks_per_seq" if over_bound else "out of blocks"))
            self.next_block = saved_next
            expected = (ValueError,) if over_bound else ()
            expected += (pagedkv.OutOfBlocksError,) if out_of_blocks else ()
            with pytest.raises(expected) as info:
                self.cache.append(sid, ks[0], vs[0], layer=0)
            if isinstance(info.value, pagedkv.OutOfBlocksError):
                assert info.value.needed == needed
                assert info.value.available == self.predicted_free()
            self._unchanged_model_check()
            return
        for layer in range(self.LAYERS):
            self.cache.append(sid, ks[layer], vs[layer], layer=layer)
            self.seqs[sid].extend(layer, ks[layer], vs[layer])
        if copies:
            event("append copied a shared block")
        self.tables, self.refs = tables, refs
        self.cow_lo += copies
        self.cow_hi += copies

    @precondition(lambda self: len(self.seqs) > 0)
    @rule(data=st.data(), seed=SEEDS, form=st.sampled_from(["list", "tuple", "int64", "int32"]))
    def append_batch(self, data, seed, form):
        batch = data.draw(
            st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=len(self.seqs), unique=True)
        )
        over_bound = any(
            blocks_for(len(self.seqs[s]) + 1, self.BLOCK_SIZE) > self.MAX_BLOCKS_PER_SEQ for s in batch
        )
        # Exact need: the batch applied in order (a block shared by two writers is copied once).
        tables = {s: list(t) for s, t in self.tables.items()}
        refs = dict(self.refs)
        saved_next = self.next_block
        exact = copies = 0
        for sid in batch:
            taken, copied = self._simulate_append(tables, refs, sid, 1)
            exact += taken
            copies += copied
        # Upper bound: every writer of a shared partial block copies it.
        naive = sum(
            int(self._needs_copy_alone(s))
            + blocks_for(len(self.seqs[s]) + 1, self.BLOCK_SIZE)
            - blocks_for(len(self.seqs[s]), self.BLOCK_SIZE)
            for s in batch
        )
        naive_copies = sum(int(self._needs_copy_alone(s)) for s in batch)
        free = self.predicted_free()
        if form == "list":
            sids = list(batch)
        elif form == "tuple":
            sids = tuple(batch)
        else:
            sids = np.array(batch, dtype=form)
        ks = [self._tokens(seed + 2 * layer, len(batch), self.HKV) for layer in range(self.LAYERS)]
        vs = [self._tokens(seed + 2 * layer + 1, len(batch), self.HKV) for layer in range(self.LAYERS)]

        must_fail = over_bound or exact > free
        may_fail = must_fail or naive > free
        if must_fail:
            event("append_batch rejected: " + ("max_blocks_per_seq" if over_bound else "out of blocks"))
            self.next_block = saved_next
            expected = (ValueError,) if over_bound else ()
            expected += (pagedkv.OutOfBlocksError,) if exact > free else ()
            with pytest.raises(expected) as info:
                self.cache.append_batch(sids, ks[0], vs[0], layer=0)
            if isinstance(info.value, pagedkv.OutOfBlocksError):
                assert exact <= info.value.needed <= naive
                assert info.value.available == free
            self._unchanged_model_check()
            return
        try:
            self.cache.append_batch(sids, ks[0], vs[0], layer=0)
        except pagedkv.OutOfBlocksError as err:
            if not may_fail:
                raise
            # A conservative pre-check (every sharer copies) is allowed; it must not change anything.
            self.next_block = saved_next
            assert exact <= err.needed <= naive and err.available == free
            self._unchanged_model_check()
            return
        for b, sid in enumerate(batch):
            self.seqs[sid].extend(0, ks[0][b : b + 1], vs[0][b : b + 1])
        for layer in range(1, self.LAYERS):
            self.cache.append_batch(sids, ks[layer], vs[layer], layer=layer)
            for b, sid in enumerate(batch):
                self.seqs[sid].extend(layer, ks[layer][b : b + 1], vs[layer][b : b + 1])
        if copies:
            event("append_batch copied a shared block")
        self.tables, self.refs = tables, refs
        self.cow_lo += copies
        self.cow_hi += naive_copies

    @precondition(lambda self: 0 < len(self.seqs) < self.MAX_SEQS)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(self._pick(data))

    def _fork(self, parent):
        free_before = self.cache.num_free_blocks
        child = self.cache.fork(parent)
        assert child not in self.seqs
        assert self.cache.num_free_blocks == free_before  # sharing allocates nothing
        self.seqs[child] = self.seqs[parent].copy()
        self.tables[child] = list(self.tables[parent])
        for block in self.tables[child]:
            self.refs[block] += 1
        self.forks += 1
        return child

    @precondition(lambda self: 0 < len(self.seqs) < self.MAX_SEQS)
    @rule(data=st.data(), n=st.integers(min_value=1, max_value=4), seed=SEEDS, child_writes=st.booleans())
    def fork_then_write(self, data, n, seed, child_writes):
        """The common beam-search pattern: fork, then one side writes at once (often into the
        shared partial block)."""
        parent = self._pick(data)
        child = self._fork(parent)
        self._append(child if child_writes else parent, n, seed)

    @precondition(lambda self: len(self.seqs) > 0)
    @rule(data=st.data())
    def truncate(self, data):
        sid = self._pick(data)
        length = data.draw(st.integers(min_value=0, max_value=len(self.seqs[sid])))
        self.cache.truncate(sid, length)
        self.seqs[sid].truncate(length)
        keep = blocks_for(length, self.BLOCK_SIZE)
        for block in self.tables[sid][keep:]:
            self._decref(self.refs, block)
        del self.tables[sid][keep:]

    @precondition(lambda self: len(self.seqs) > 0)
    @rule(data=st.data(), beyond=st.sampled_from([-1, "len+1", -1000]))
    def truncate_invalid(self, data, beyond):
        sid = self._pick(data)
        bad = len(self.seqs[sid]) + 1 if beyond == "len+1" else beyond
        with pytest.raises(ValueError):
            self.cache.truncate(sid, bad)
        self._unchanged_model_check()

    @precondition(lambda self: len(self.seqs) > 0)
    @rule(data=st.data())
    def free(self, data):
        sid = self._pick(data)
        self.cache.free(sid)
        for block in self.tables.pop(sid):
            self._decref(self.refs, block)
        del self.seqs[sid]
        with pytest.raises(KeyError):
            self.cache.seq_len(sid)
        with pytest.raises(KeyError):
            self.cache.free(sid)
        if not self.seqs:
            # Everything freed: every block is back.  Start a new sequence so the run goes on
            # (otherwise only add_sequence would be enabled).
            assert self.cache.num_free_blocks == self.NUM_BLOCKS
            self._add()

    @precondition(lambda self: any(len(m) > 0 for m in self.seqs.values()))
    @rule(data=st.data(), seed=SEEDS)
    def decode_attention(self, data, seed):
        live = sorted(s for s in self.seqs if len(self.seqs[s]) > 0)
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        layer = data.draw(st.integers(min_value=0, max_value=self.LAYERS - 1))
        q = self._tokens(seed, len(batch), self.HQ)
        out = self.cache.attend_batch(batch, q, layer=layer)
        assert out.shape == q.shape
        for b, sid in enumerate(batch):
            model = self.seqs[sid]
            expected = ref_attention(
                q[b : b + 1], model.k[layer], model.v[layer], math_scale(self.D), len(model) - 1
            )
            assert_attention_close(out[b : b + 1], expected, self.DTYPE, model.v[layer])

    @precondition(lambda self: any(len(m) > 0 for m in self.seqs.values()))
    @rule(data=st.data(), seed=SEEDS)
    def prefill_attention(self, data, seed):
        sid = self._pick(data, nonempty=True)
        model = self.seqs[sid]
        n = data.draw(st.integers(min_value=1, max_value=len(model)))
        layer = data.draw(st.integers(min_value=0, max_value=self.LAYERS - 1))
        q = self._tokens(seed, n, self.HQ)
        out = self.cache.attend(sid, q, layer=layer)
        expected = ref_attention(q, model.k[layer], model.v[layer], math_scale(self.D), len(model) - n)
        assert_attention_close(out, expected, self.DTYPE, model.v[layer])

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def contents_match_model(self):
        for sid, model in self.seqs.items():
            check_against_model(self.cache, sid, model, self.LAYERS)

    @invariant()
    def block_accounting(self):
        free = self.cache.num_free_blocks
        assert 0 <= free <= self.NUM_BLOCKS
        assert free == self.predicted_free()
        assert self.cache.num_blocks == self.NUM_BLOCKS
        stats = self.cache.stats()
        assert stats.blocks_total == self.NUM_BLOCKS
        assert stats.blocks_free == free
        assert stats.blocks_used == self.NUM_BLOCKS - free
        assert stats.peak_blocks_used >= stats.blocks_used
        assert stats.forks == self.forks
        assert self.cow_lo <= stats.cow_copies <= self.cow_hi
        for sid, table in self.tables.items():
            assert len(table) == blocks_for(len(self.seqs[sid]), self.BLOCK_SIZE)

    def teardown(self):
        for sid in list(self.seqs):
            self.cache.free(sid)
        assert self.cache.num_free_blocks == self.NUM_BLOCKS
        assert self.cache.stats().blocks_used == 0


class SingleLayerF32Machine(PagedKVModelMachine):
    """Block size 1 (every token its own block), MQA, one layer, float32."""

    NUM_BLOCKS = 20
    BLOCK_SIZE = 1
    HKV = 1
    HQ = 3
    D = 3
    LAYERS = 1
    DTYPE = "float32"
    MAX_SEQS = 5
    MAX_BLOCKS_PER_SEQ = 12


class LargeBlockMachine(PagedKVModelMachine):
    """Blocks larger than most appends, so most writes land in shared partial blocks."""

    NUM_BLOCKS = 7
    BLOCK_SIZE = 8
    HKV = 2
    HQ = 8
    D = 2
    LAYERS = 3
    DTYPE = "float64"
    MAX_SEQS = 6
    MAX_BLOCKS_PER_SEQ = 3


MACHINE_SETTINGS = settings(deadline=None, **depth(
    dict(max_examples=50, stateful_step_count=30),
    dict(max_examples=2000, stateful_step_count=100, derandomize=False, print_blob=True)))

TestPagedKVModel = PagedKVModelMachine.TestCase
TestPagedKVModel.settings = MACHINE_SETTINGS
TestSingleLayerF32 = SingleLayerF32Machine.TestCase
TestSingleLayerF32.settings = MACHINE_SETTINGS
TestLargeBlock = LargeBlockMachine.TestCase
TestLargeBlock.settings = MACHINE_SETTINGS
