"""Prefix caching: reuse the K/V of full blocks whose token ids were seen before.

The policy lives here; the mechanics (a block's ``cached`` mark, its
generation, a free queue that hands out the least recently freed block
first and lets a cached free block be taken back) live in the block pool
(``pagedkv/_pool.pxi``).

Every full block a sequence writes is identified by a hash chain::

    hash(block i) = hash((hash(block i-1), token ids of block i, salt))

and entered in an index ``hash -> [_Entry, ...]``: every registered copy of
those contents, one entry per block.  Two sequences that compute the same
prefix (both missed: nothing was cached yet), a prompt whose capped hit
leaves its last full block to compute again, a loaded copy: each registers
its own blocks, so the index keeps every computed copy and a prefix that some
live sequence holds in full is always a hit, whichever copy goes first.
``add_sequence(token_ids=...)`` walks the prompt's chain through the index
and starts the new sequence with the longest run of blocks found
(copy-on-write, as ``fork`` shares), taking a copy some sequence holds where
there is one (a free cached copy is taken back only when no held one is
left).  A hit is verified, never trusted to the hash: the entry's token ids
and salt must equal the prompt's and its parent chain must name the same ids
and salts as the entries matched before it (``_same_prefix``: the same entry,
or another copy of the same prefix), so a hash collision costs a miss, never
another prompt's K/V.  The copies under one key always hold the same contents:
a block whose key is taken by other contents (a collision) is not registered,
nor is anything after it in that sequence.  An entry is valid while its
block's generation is the one recorded when it was registered: the pool bumps
the generation each time it hands the block out again or its contents change
in place (a truncate into it), so stale entries are recognised (and dropped)
on sight, and a block's new entry replaces its old one, so the index never
holds more entries than the pool has blocks.

A block is registered once every layer has written it and its token ids are
known: from ``add_sequence(token_ids=prompt)`` (the prompt's ids cover the
tokens the caller appends next) or from ``append(..., token_ids=...)`` on
layer 0.  At most ``(len(prompt) - 1) // block_size`` blocks are reused, so
at least one prompt token is always left for the caller to compute (its
logits are needed for the next token).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from pagedkv.policy import CachePolicy


class _Entry:
    """One registered full block."""

    __slots__ = ("key", "block", "gen", "parent", "tokens", "salt")

    def __init__(self, key, block, gen, parent, tokens, salt):
        self.key = key          # the hash (the index key)
        self.block = block      # physical block id (rewritten by compaction)
        self.gen = gen          # the block's generation when registered
        self.parent = parent    # the previous block's _Entry, None for the first
        self.tokens = tokens    # tuple of the block's token ids
        self.salt = salt


def _same_prefix(a: Optional[_Entry], b: Optional[_Entry]) -> bool:
    """Whether two parent entries stand for the same token ids and salts all the
    way back to the first block (often the same object; two copies of a prefix,
    or a head registered again after a roll-back, give two)."""
    while a is not b:
        if a is None or b is None or a.tokens != b.tokens or a.salt != b.salt:
            return False
        a, b = a.parent, b.parent
    return True


class _SeqState:
    """What the prefix cache knows of one sequence."""

    __slots__ = ("tokens", "chain", "salt")

    def __init__(self, tokens: List[int], chain: List[_Entry], salt):
        self.tokens = tokens    # token ids of positions [0, len(tokens))
        self.chain = chain      # entries of its first len(chain) blocks (its own blocks')
        self.salt = salt

    def copy(self) -> "_SeqState":
        return _SeqState(list(self.tokens), list(self.chain), self.salt)


def token_list(token_ids, name: str = "token_ids") -> List[int]:
    """token_ids as a list of Python ints (a 1-D sequence of integers)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return [int(t) for t in arr.tolist()]


class PrefixCache(CachePolicy):
    """The prefix index of one cache core, its per-sequence chains and counters;
    a CachePolicy of the PagedKVCache (``pagedkv/policy.py``)."""

    def __init__(self, core):
        self._core = core
        self._pool = core.pool
        self._bs = core.block_size
        self._index: Dict[int, List[_Entry]] = {}  # key -> the copies registered under it
        self._by_block: Dict[int, _Entry] = {}  # block -> the entry in the index on it
        self._seqs: Dict[int, _SeqState] = {}
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.hit_tokens = 0
        self.miss_tokens = 0

    # hashing (a method, so tests can force collisions)
    def _hash(self, parent: Optional[_Entry], tokens: tuple, salt) -> int:
        return hash((None if parent is None else parent.key, tokens, salt))

    def _valid(self, e: _Entry) -> bool:
        return self._pool.is_cached(e.block, e.gen)

    def _entries(self):
        """Every entry in the index (valid or not yet dropped)."""
        for copies in self._index.values():
            yield from copies

    def _copies(self, key: int) -> List[_Entry]:
        """The valid entries under `key`; the stale ones are dropped on sight."""
        copies = self._index.get(key)
        if not copies:
            return []
        valid, stale = [], []
        for e in copies:
            (valid if self._valid(e) else stale).append(e)
        if stale:
            for e in stale:
                if self._by_block.get(e.block) is e:
                    del self._by_block[e.block]
            if valid:
                self._index[key] = valid
            else:
                del self._index[key]
        return valid

    def _remove(self, e: _Entry) -> None:
        """Take `e` out of the index."""
        copies = self._index.get(e.key)
        if copies is not None:
            copies[:] = [c for c in copies if c is not e]
            if not copies:
                del self._index[e.key]
        if self._by_block.get(e.block) is e:
            del self._by_block[e.block]

    # ------------------------------------------------------------------
    # lookup

    def match(self, tokens: List[int], salt=None) -> List[_Entry]:
        """The longest chain of valid cached blocks that starts the prompt
        (at most (len(tokens) - 1) // block_size blocks)."""
        bs = self._bs
        found: List[_Entry] = []
        parent = None
        ref_count = self._pool.ref_count
        for i in range(max(len(tokens) - 1, 0) // bs):
            t = tuple(tokens[i * bs:(i + 1) * bs])
            copies = self._copies(self._hash(parent, t, salt))
            if not copies:
                break
            e = copies[0]  # the copies hold the same contents: one check covers them all
            if e.tokens != t or e.salt != salt or not _same_prefix(e.parent, parent):
                break  # a hash collision: a miss, never another prompt's K/V
            # a copy some sequence holds, else the latest registered (taken back from the queue)
            e = next((c for c in copies if ref_count(c.block) > 0), copies[-1])
            found.append(e)
            parent = e
        return found

    def start(self, priority: float, token_ids, salt) -> int:
        """Every sequence of a prefix-caching cache starts here (the policy hook)."""
        if token_ids is None and salt is None:
            sid = self._core.add_sequence(priority)
            self.new_sequence(sid)
            return sid
        return self.add_sequence([] if token_ids is None else token_ids, priority, salt)

    def add_sequence(self, token_ids, priority: float, salt=None) -> int:
        """A new sequence starting with the cached blocks of the prompt's
        longest cached prefix (see the module docstring)."""
        tokens = token_list(token_ids)
        try:
            hash(salt)
        except TypeError:
            raise TypeError(f"cache_salt must be hashable, got {type(salt).__name__}") from None
        found = self.match(tokens, salt)
        sid = self._core.adopt(np.array([e.block for e in found], dtype=np.int32), priority)
        lookups = max(len(tokens) - 1, 0) // self._bs
        self.hit_blocks += len(found)
        self.miss_blocks += lookups - len(found)
        self.hit_tokens += len(found) * self._bs
        self.miss_tokens += len(tokens) - len(found) * self._bs
        self._seqs[sid] = _SeqState(tokens, found, salt)
        return sid

    # ------------------------------------------------------------------
    # tracking sequences

    def new_sequence(self, sid: int) -> None:
        """An empty sequence added without token ids."""
        self._seqs[int(sid)] = _SeqState([], [], None)

    def appended(self, sid: int, n: int, token_ids: Optional[List[int]]) -> None:
        """Layer 0 of `sid` grew by n tokens (token_ids: theirs, or None)."""
        st = self._seqs.get(int(sid))
        if st is None:
            return
        start = self._core.seq_len(sid) - n
        if len(st.tokens) < start:
            return  # earlier tokens are unknown: nothing after them can be registered
        if token_ids is not None:
            del st.tokens[start:]
            st.tokens.extend(token_ids)
        elif len(st.tokens) < start + n:
            del st.tokens[start:]  # these tokens' ids are unknown

    def register(self, sid: int) -> None:
        """Register the full blocks of `sid` that every layer has written and
        whose token ids are known: each block is entered under its key, beside
        any other copies of the same contents already there."""
        st = self._seqs.get(int(sid))
        if st is None:
            return
        bs = self._bs
        full = min(self._core.written_tokens(sid), len(st.tokens)) // bs
        if full <= len(st.chain):
            return
        table = self._core.block_table(sid)
        while len(st.chain) < full:
            i = len(st.chain)
            parent = st.chain[-1] if st.chain else None
            t = tuple(st.tokens[i * bs:(i + 1) * bs])
            key = self._hash(parent, t, st.salt)
            copies = self._copies(key)
            if copies:
                c = copies[0]
                if c.tokens != t or c.salt != st.salt or not _same_prefix(c.parent, parent):
                    return  # the key is taken by other contents (a collision): stop here
            block = int(table[i])
            e = next((c for c in copies if c.block == block), None)  # registered already
            if e is None:  # another copy of these contents (or the first): register it too
                old = self._by_block.get(block)
                if old is not None:
                    self._remove(old)  # stale (the block was handed out again)
                e = _Entry(key, block, self._pool.mark_cached(block), parent, t, st.salt)
                self._index.setdefault(key, []).append(e)
                self._by_block[block] = e
            st.chain.append(e)

    def rewrote(self, sid: int, n: int) -> None:
        """A layer > 0 append wrote `sid`'s newest n positions.  Only a step written again
        (every layer had it) can touch registered blocks, and where such a block was shared
        the core copied it first: `sid` holds a new copy, not the chain's block, so the chain
        is cut there (register() then enters the copy beside the original)."""
        st = self._seqs.get(int(sid))
        if st is None:
            return
        first = max(self._core.seq_len(sid) - n, 0) // self._bs
        if len(st.chain) <= first:
            return  # the usual case: a step's later layers touch no registered block
        table = self._core.block_table(sid)
        for i in range(first, len(st.chain)):
            if st.chain[i].block != int(table[i]):
                del st.chain[i:]
                return

    def forked(self, parent: int, child: int) -> None:
        st = self._seqs.get(int(parent))
        if st is not None:
            self._seqs[int(child)] = st.copy()

    def truncated(self, sid: int, length: int) -> None:
        st = self._seqs.get(int(sid))
        if st is not None:
            del st.tokens[length:]
            del st.chain[length // self._bs:]

    def released(self, sid: int) -> None:
        """`sid` was freed or evicted."""
        self._seqs.pop(int(sid), None)

    def tokens_of(self, sid: int) -> Optional[List[int]]:
        """The token ids known for `sid`'s held tokens (None when incomplete)."""
        st = self._seqs.get(int(sid))
        if st is None or len(st.tokens) < self._core.seq_len(sid):
            return None
        return st.tokens[:self._core.seq_len(sid)]

    def salt_of(self, sid: int):
        """The cache_salt `sid` was started with (None: none)."""
        st = self._seqs.get(int(sid))
        return None if st is None else st.salt

    def restored(self, sid: int, tokens: List[int], salt=None) -> None:
        """A sequence loaded from a file with these token ids and salt: register it."""
        self._seqs[int(sid)] = _SeqState(list(tokens), [], salt)
        self.register(sid)

    # persistence (the policy hooks; persist.py encodes them)
    def saved(self, sid: int) -> dict:
        return {"token_ids": self.tokens_of(sid), "cache_salt": self.salt_of(sid)}

    def loaded(self, sid: int, state: dict) -> None:
        tokens = state.get("token_ids")
        if tokens is None:
            self.new_sequence(sid)  # unknown ids (or a salt not kept): nothing to register
        else:
            self.restored(sid, tokens, state.get("cache_salt"))

    def trimming(self, sid: int) -> None:
        raise ValueError("apply_streaming_llm cannot be used with prefix_caching: the "
                         "tokens a trimmed sequence holds no longer form a prefix")

    # ------------------------------------------------------------------
    # pool changes

    def prune(self) -> None:
        """Drop the entries whose blocks were handed out again."""
        for key in list(self._index):
            self._copies(key)
        self._by_block = {e.block: e for e in self._entries()}

    def compacted(self, moved_to: np.ndarray) -> None:
        """After compaction: the entries follow their blocks (compacting() pruned
        the index first: an entry must be valid to be followed)."""
        for e in self._entries():
            b = int(moved_to[e.block])
            if b != e.block:
                e.block = b
                e.gen = self._pool.generation(b)
        self.prune()

    compacting = resized = prune

    # the cache's append methods: `inner` (the core's, or the evictor's in automatic
    # mode), then the index entries of what it filled, as one step for other threads
    def wrap_append(self, inner):
        def append(sid, k, v, layer=0, token_ids=None):
            n = _count(k)
            return self._append(inner, (sid, k, v, layer), [(sid, n)], n, token_ids, "tokens")

        append.__doc__ = "Append n tokens' K/V; token_ids (layer 0): their ids, for prefix caching."
        return append

    def wrap_append_batch(self, inner):
        def append_batch(sids, k, v, layer=0, token_ids=None):
            n = _count(sids)
            return self._append(inner, (sids, k, v, layer), [(s, 1) for s in sids] if n else [],
                                n, token_ids, "sequences")

        append_batch.__doc__ = "Append one token per sequence; token_ids (layer 0): one id each."
        return append_batch

    def _append(self, inner, args, pieces, n, token_ids, what):
        """inner(*args), then each (sid, tokens) piece it wrote is registered."""
        ids = _checked_ids(token_ids, n, what)
        with self._core.hold():
            result = inner(*args)
            layer, at = args[3], 0
            for sid, m in pieces:
                self._wrote(sid, m, layer, None if ids is None else ids[at:at + m])
                at += m
        return result

    def _wrote(self, sid: int, n: int, layer: int, ids: Optional[List[int]]) -> None:
        if layer == 0:
            self.appended(sid, n, ids)
        else:
            self.rewrote(sid, n)
        self.register(sid)

    # ------------------------------------------------------------------
    # statistics

    @property
    def num_entries(self) -> int:
        """Index entries, every copy counted (at most one per block: a block's new entry
        replaces its old one)."""
        return sum(len(copies) for copies in self._index.values())

    def counts(self):
        """(hit blocks, miss blocks, hit tokens, miss tokens)."""
        return self.hit_blocks, self.miss_blocks, self.hit_tokens, self.miss_tokens

    def stats(self) -> dict:
        lookups = self.hit_blocks + self.miss_blocks
        return dict(prefix_caching=True, prefix_hit_blocks=self.hit_blocks,
                    prefix_miss_blocks=self.miss_blocks, prefix_hit_tokens=self.hit_tokens,
                    prefix_miss_tokens=self.miss_tokens,
                    prefix_hit_rate=self.hit_blocks / lookups if lookups else 0.0)


def _count(k) -> Optional[int]:
    try:
        return len(k)
    except TypeError:
        return None  # not an array: the core raises the real error


def _checked_ids(token_ids, n: Optional[int], what: str) -> Optional[List[int]]:
    """token_ids as a list of ints, one per appended token (None: none given)."""
    if token_ids is None:
        return None
    ids = token_list(token_ids)
    if n is not None and len(ids) != n:
        raise ValueError(f"token_ids has {len(ids)} ids for {n} {what}")
    return ids
