"""The state machine of full_machine.py with prefix caching on.

Prefix caching (PrefixMachine): token ids come from a 3-token vocabulary and prompts often extend
a live sequence's ids, so prefixes are shared.  K/V of a token whose ids are known is a pure
function of (ids up to and including it, layer), as a model's would be; a prefix hit therefore
must read back exactly that function of the prompt's prefix (the invariant compares every layer),
so a hit on other ids, on a block rewritten in place or on a block not yet written on every layer
fails.  The model also knows which (salt, ids) full blocks ever became registrable: a hit may
only use those (a cross-salt hit fails), and a hit must reach at least the longest prefix of the
prompt that some live sequence holds in full, registrable under the prompt's salt (a missed hit
fails), however many sequences computed it and whichever of them let go of its copy first.
"""
from collections import Counter

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from full_machine import SEEDS, SETTINGS, FullMachine, Held, _count

VOCAB = 3
SALTS = (None, "t")


class PrefixMachine(FullMachine):
    """prefix_caching=True over a 3-token vocabulary; salts None and "t"."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 16, 2, 1, 2, 4, 2, 6
    DTYPE = "float32"
    PREFIX = True
    hits = bounded = recomputed = 0

    def __init__(self):
        super().__init__()
        self.ever = set()            # every (salt, ids of full blocks 0..i) that ever became
        #                              registrable
        self.writers = Counter()     # such a key -> how many computations (or loads) produced it
        self.kv_memo = {}

    def kv_of(self, ids, layer):
        """K/V rows [HKV, D] of the last token of `ids` (a pure function of the ids)."""
        key = (ids, layer)
        if key not in self.kv_memo:
            rng = np.random.default_rng([layer, len(ids), *ids])
            self.kv_memo[key] = rng.standard_normal((2, self.HKV, self.D)).astype(self.DTYPE)
        return self.kv_memo[key]

    def step_kv(self, m, n, seed, ids):
        ks, vs = super().step_kv(m, n, seed, ids)
        start = len(m.pos)
        for p in range(start, min(start + n, len(ids or ()))):
            for l in range(self.LAYERS):
                ks[l][p - start], vs[l][p - start] = self.kv_of(tuple(ids[:p + 1]), l)
        return ks, vs

    @staticmethod
    def next_ids(ids, start, n, given):
        """The cache's known ids after a layer-0 append of n tokens at `start` (PrefixCache)."""
        if len(ids) < start:
            return list(ids)               # earlier ids unknown: these stay unknown too
        if given is not None:
            return ids[:start] + list(given)
        if len(ids) < start + n:
            return ids[:start]
        return list(ids)                   # the prompt's ids name them

    def draw_ids(self, data, m, n, modes=("follow", "new", "none")):
        """Token ids for m's next n tokens: the prompt's where it names them ("follow"), drawn
        ("new"), or none given."""
        start = len(m.pos)
        mode = data.draw(st.sampled_from(modes * 3 if "none" not in modes else
                                         ["follow"] * 3 + ["new"] * 2 + ["none"]))
        if mode == "none":
            return None
        drawn = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        return [m.ids[p] if mode == "follow" and p < len(m.ids) else drawn[p - start]
                for p in range(start, start + n)]

    def layer0_ids(self, data, m, n):
        given = self.draw_ids(data, m, n)
        kw = {} if given is None else {"token_ids": given}
        return kw, self.next_ids(m.ids, len(m.pos), n, given)

    def batch_ids(self, data, batch):
        if data.draw(st.integers(0, 4)):  # mostly with ids (without, the ids after the
            #                                  prompt's are unknown for good)
            given = [self.draw_ids(data, self.model[sid], 1, ("follow", "new")) for sid in batch]
        else:
            given = [None] * len(batch)
        kw = {} if given[0] is None else {"token_ids": [g[0] for g in given]}
        ids = [self.next_ids(self.model[sid].ids, len(self.model[sid].pos), 1, g)
               for sid, g in zip(batch, given)]
        return kw, ids

    def written(self, m):
        done = len(m.pos) - (m.pending[0] if m.pending else 0)
        full = min(done, len(m.ids)) // self.BS
        for i in range(m.elig, full):
            key = (m.salt, tuple(m.ids[:(i + 1) * self.BS]))
            self.ever.add(key)
            self.writers[key] += 1
        m.elig = max(m.elig, full)

    def loaded_copy(self, m):
        # the file holds the ids of the held tokens when all are known; loading registers them
        # (without a salt: only unsalted sequences are saved here, see saveable)
        c = m.copy()
        c.ids = c.ids[:len(c.pos)] if len(c.ids) >= len(c.pos) else []
        c.elig = 0
        return c

    def saveable(self, m):
        # save/load keeps a JSON-representable salt (test_prefix.py), but this model does not
        # follow salts through files: only unsalted sequences are saved here
        return m.salt is None

    def must_hit(self, prompt, salt):
        """Blocks a hit must reach: the prompt's longest prefix of full blocks (up to the cap)
        that some live sequence holds in full, registrable, under the same salt.  Every copy a
        sequence computed (or loaded) is registered, so whichever copies were freed, handed out
        again or truncated into, a live one is found."""
        bs, j = self.BS, 0
        while j < max(len(prompt) - 1, 0) // bs:
            ids = tuple(prompt[:(j + 1) * bs])
            if not any(m.salt == salt and m.elig > j and tuple(m.ids[:(j + 1) * bs]) == ids
                       for m in self.model.values()):
                break
            j += 1
        return j

    @rule(data=st.data(), priority=st.sampled_from([0.0, 2.5]), salt=st.sampled_from(SALTS))
    def add_prompt(self, data, priority, salt):
        """A prompt of its own, or extending some live sequence's ids, under a drawn salt."""
        src = self.pick(data, lambda m: m.ids) if data.draw(st.booleans()) else None
        base = []
        if src is not None:
            ids = self.model[src].ids
            base = ids[:data.draw(st.integers(0, len(ids)))]
        self.add_with_prompt(data, priority, salt, base)

    @precondition(lambda self: any(m.elig for m in self.model.values()))
    @rule(data=st.data(), priority=st.sampled_from([0.0, 2.5]))
    def reuse_prefix(self, data, priority):
        """A prompt starting with a live sequence's registrable blocks, mostly under its salt:
        the lower bound applies."""
        src = self.model[self.pick(data, lambda m: m.elig)]
        bs = self.BS
        base = src.ids[:data.draw(st.integers(bs, max(bs, len(src.ids))))]
        salt = src.salt if data.draw(st.integers(0, 4)) else SALTS[src.salt is None]
        self.add_with_prompt(data, priority, salt, base)

    @initialize(data=st.data(), salt=st.sampled_from(SALTS))
    def start(self, data, salt):
        """A computed prompt of 1..4 blocks to begin with (so later prompts can reuse it)."""
        base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=self.BS,
                                  max_size=4 * self.BS))
        self.add_with_prompt(data, 0.0, salt, base, prefill=True)

    def add_with_prompt(self, data, priority, salt, base, prefill=None, extra=True):
        """add_sequence(token_ids=prompt) (base + up to 5 drawn ids when `extra`), checked
        against the model; then, when `prefill` (None: drawn), append the rest of the prompt.
        Returns the new sequence's id (None when max_seqs are live)."""
        if extra:
            prompt = base + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
        else:
            prompt = list(base)
        bs, cap = self.BS, max(len(prompt) - 1, 0) // self.BS
        no_ids = not prompt and data.draw(st.booleans())  # a salt alone
        lower = self.must_hit(prompt, salt)
        # the bound reaches a block computed more than once (the old index kept only one copy)
        recomputed = any(self.writers[(salt, tuple(prompt[:(j + 1) * bs]))] > 1
                         for j in range(lower))
        c = self.cache
        s0 = c.stats()
        sid, err = self.attempt(lambda: c.add_sequence(
            priority=priority, token_ids=None if no_ids else prompt, cache_salt=salt),
            RuntimeError)
        if err is not None:
            assert len(self.model) == self.MAX_SEQS
            return None
        L = c.seq_len(sid)
        assert L % bs == 0 and lower * bs <= L <= cap * bs, (L, lower, cap)
        for j in range(L // bs):
            assert (salt, tuple(prompt[:(j + 1) * bs])) in self.ever, (salt, prompt, L)
        s1 = c.stats()
        assert s1.prefix_hit_blocks - s0.prefix_hit_blocks == L // bs
        assert s1.prefix_miss_blocks - s0.prefix_miss_blocks == cap - L // bs
        assert s1.prefix_hit_tokens - s0.prefix_hit_tokens == L
        assert s1.prefix_miss_tokens - s0.prefix_miss_tokens == len(prompt) - L
        assert c.priority(sid) == priority
        m = Held(self.LAYERS, self.HKV, self.D, self.DTYPE)
        m.pos, m.next_pos = list(range(L)), L
        for l in range(self.LAYERS):
            kv = [self.kv_of(tuple(prompt[:p + 1]), l) for p in range(L)]
            if kv:
                m.k[l] = self.stored(np.stack([x[0] for x in kv]))
                m.v[l] = self.stored(np.stack([x[1] for x in kv]))
        m.ids, m.salt, m.elig = list(prompt), salt, L // bs
        self.model[sid] = m
        if prefill is None:
            prefill = data.draw(st.booleans())
        if prefill:
            self.compute_rest(data, sid, prompt)
        if L:
            _count(type(self), "hits")
        if lower:
            _count(type(self), "bounded")
        if recomputed:
            _count(type(self), "recomputed")
        return sid

    def compute_rest(self, data, sid, prompt):
        """The caller computes the rest of sid's prompt: ids from the prompt, or given again."""
        L = self.cache.seq_len(sid)
        if len(prompt) > L:
            given = prompt[L:] if data.draw(st.booleans()) else None
            kw = {} if given is None else {"token_ids": given}
            self.append_step(sid, len(prompt) - L, data.draw(SEEDS), kw, list(prompt),
                             data.draw(st.integers(0, 3)) > 0)

    @rule(data=st.data(), salt=st.sampled_from(SALTS))
    def twin_prompts(self, data, salt):
        """Two sequences start with the same prompt before either computes it (both miss what
        is not cached yet), then both compute the rest: two copies of those blocks, both
        registered, so a later prompt finds whichever copy is still live."""
        src = self.pick(data, lambda m: m.ids) if data.draw(st.booleans()) else None
        base = [] if src is None else self.model[src].ids[:data.draw(st.integers(0, 2 * self.BS))]
        prompt = base + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=self.BS,
                                           max_size=3 * self.BS))
        sids = [self.add_with_prompt(data, 0.0, salt, prompt, prefill=False, extra=False)
                for _ in range(2)]
        for sid in sids:
            if sid is not None and sid in self.model and self.model[sid].pending is None:
                self.compute_rest(data, sid, prompt)  # (automatic eviction may take the other)
        # let go of one copy, then look the prompt up again: the other copy must be found
        sids = [s for s in sids if s is not None and s in self.model]
        manner = data.draw(st.sampled_from(["keep", "free", "free_reuse", "truncate"]))
        if manner == "keep" or len(sids) < 2:
            return
        victim = sids[data.draw(st.integers(0, 1))]
        if manner == "truncate":
            if self.model[victim].pending is None:  # into (or before) its last full block
                self.truncate_to(victim, data.draw(st.integers(0, max(0, len(prompt) - 2))))
        else:
            self.cache.free(victim)
            self.drop([victim])
            if manner == "free_reuse":
                self.take_free_blocks(data)
        self.add_with_prompt(data, 0.0, salt, prompt, extra=False)

    def take_free_blocks(self, data):
        """A sequence without ids fills every free block (so the pool hands out the cached
        free ones too), then goes."""
        c = self.cache
        n = c.num_free_blocks * self.BS
        sid, err = self.attempt(lambda: c.add_sequence(), RuntimeError)
        if err is not None:
            return
        self.model[sid] = Held(self.LAYERS, self.HKV, self.D, self.DTYPE)
        if n and self.append_step(sid, n, data.draw(SEEDS), {}, None, True):
            assert c.num_free_blocks == 0
        c.free(sid)
        self.drop([sid])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), sink=st.integers(0, 3), window=st.integers(1, 6))
    def apply_streaming_llm(self, data, sink, window):
        sid = self.pick(data)
        _, err = self.attempt(lambda: self.cache.apply_streaming_llm(sid, sink, window),
                              ValueError)
        assert err is not None and "prefix_caching" in str(err)

    def report_extra(self):
        cls = type(self)
        return (f" hits={cls.__dict__.get('hits', 0)} lower_bounded={cls.__dict__.get('bounded', 0)}"
                f" recomputed={cls.__dict__.get('recomputed', 0)}")


class PrefixInt8Machine(PrefixMachine):
    """Prefix caching over int8 storage, float64 compute, one layer, block size 3."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 12, 3, 2, 1, 8, 1, 4
    DTYPE, KV_DTYPE = "float64", "int8"


TestPrefix = PrefixMachine.TestCase
TestPrefixInt8 = PrefixInt8Machine.TestCase
for _case in (TestPrefix, TestPrefixInt8):
    _case.settings = SETTINGS
del _case
