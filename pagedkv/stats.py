"""Cache statistics: the CacheStats dataclass and how a snapshot is taken.

Every figure has one source: block counts and cumulative block counters come
from the pool, sequence counts and StreamingLLM evictions from the sequence
table (``pagedkv/_seqtable.pxi``), user frees from the core, whole-sequence
evictions from the evictor (``pagedkv/eviction.py``).  Nothing is derived by
subtracting one mirror of a counter from another.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict

from pagedkv.eviction import CAUSE_ONE_SHOT, CAUSE_STREAMING


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a PagedKVCache's memory and activity.

    Block counts are physical blocks of the pool (one block holds
    ``block_size`` tokens of K and V for every layer).  Token slots count the
    slots of the blocks held by live sequences: a block shared by forks
    counts once per sequence in ``token_slots_allocated``.
    """

    blocks_total: int
    blocks_free: int
    blocks_used: int
    peak_blocks_used: int
    utilization: float            # blocks_used / blocks_total
    tokens_held: int              # tokens held by live sequences (shared ones once per sequence)
    token_slots_allocated: int    # block slots of the blocks live sequences hold
    internal_fragmentation: float # 1 - tokens_held / token_slots_allocated
    bytes_per_block: int
    bytes_total: int
    bytes_used: int
    sequences_active: int
    sequences_added: int
    sequences_freed: int
    blocks_allocated: int         # cumulative
    blocks_freed: int             # cumulative
    cow_copies: int
    forks: int
    evicted_tokens: int
    evicted_blocks: int
    evicted_sequences: int
    evictions_by_cause: Dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"blocks {self.blocks_used}/{self.blocks_total} used ({self.utilization:.1%}, "
            f"peak {self.peak_blocks_used}), {self.sequences_active} sequences, "
            f"{self.tokens_held} tokens in {self.token_slots_allocated} slots "
            f"({self.internal_fragmentation:.1%} fragmentation), "
            f"{self.cow_copies} COW copies, {self.evicted_tokens} tokens evicted"
        )


def collect(core, evictor) -> CacheStats:
    """A CacheStats snapshot of a cache core and its SequenceEvictor."""
    pool, seqs = core.pool, core.seqs
    infos = core.sequence_infos()
    tokens = sum(row[3] for row in infos)
    slots = sum(row[4] for row in infos) * core.block_size
    used = pool.num_blocks - pool.num_free
    bpb = pool.bytes_per_block
    (stream_tok, stream_blk), (shot_tok, shot_blk) = seqs.trimmed()
    evicted = evictor.counts()
    by_cause = {}

    def put(cause, unit, n):
        if n:
            by_cause[f"{cause}.{unit}"] = int(n)

    put(CAUSE_STREAMING, "tokens", stream_tok)
    put(CAUSE_STREAMING, "blocks", stream_blk)
    put(CAUSE_ONE_SHOT, "tokens", shot_tok)
    put(CAUSE_ONE_SHOT, "blocks", shot_blk)
    for cause, (nseq, ntok, nblk) in evicted.items():
        put(cause, "sequences", nseq)
        put(cause, "tokens", ntok)
        put(cause, "blocks", nblk)
    return CacheStats(
        blocks_total=pool.num_blocks,
        blocks_free=pool.num_free,
        blocks_used=used,
        peak_blocks_used=pool.peak_used,
        utilization=used / pool.num_blocks,
        tokens_held=tokens,
        token_slots_allocated=slots,
        internal_fragmentation=1.0 - tokens / slots if slots else 0.0,
        bytes_per_block=bpb,
        bytes_total=bpb * pool.num_blocks,
        bytes_used=bpb * used,
        sequences_active=len(infos),
        sequences_added=seqs.seqs_added,
        sequences_freed=core.seqs_freed,
        blocks_allocated=pool.blocks_allocated,
        blocks_freed=pool.blocks_freed,
        cow_copies=pool.cow_copies,
        forks=seqs.forks,
        evicted_tokens=stream_tok + shot_tok + sum(c[1] for c in evicted.values()),
        evicted_blocks=stream_blk + shot_blk + sum(c[2] for c in evicted.values()),
        evicted_sequences=sum(c[0] for c in evicted.values()),
        evictions_by_cause=by_cause,
    )
