"""Cache statistics: the CacheStats dataclass and how a snapshot is taken.

Every figure has one source: block counts and cumulative block counters come
from the pool, sequence counts and StreamingLLM evictions from the sequence
table (``pagedkv/_seqtable.pxi``), user frees from the core, whole-sequence
evictions from the evictor (``pagedkv/eviction.py``).  Nothing is derived by
subtracting one mirror of a counter from another.

``stats()`` costs O(live sequences) except the fields marked "scan", which
walk the pool's reference counts once (O(num_blocks)).
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
    tokens_per_used_block: float  # tokens_held / blocks_used (> block_size when forks share)
    free_runs: int                # runs of consecutive free block ids (scan)
    largest_free_run: int         # the longest such run, in blocks (scan)
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
    prefix_caching: bool
    prefix_hit_blocks: int        # blocks reused by add_sequence(token_ids=...)
    prefix_miss_blocks: int       # full prompt blocks looked up and not found
    prefix_hit_tokens: int        # prompt tokens whose K/V were reused
    prefix_miss_tokens: int       # prompt tokens left to compute
    prefix_hit_rate: float        # hit blocks / looked-up blocks (0 when none)
    cached_free_blocks: int       # free blocks whose contents are still hit-able
    evictions_by_cause: Dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return format_stats(self)


def format_stats(s: CacheStats) -> str:
    """A readable multi-line report of a CacheStats snapshot."""
    mib = 1024 * 1024
    lines = [
        f"blocks       {s.blocks_used}/{s.blocks_total} used ({s.utilization:.1%}), "
        f"peak {s.peak_blocks_used}, {s.blocks_free} free",
        f"memory       {s.bytes_used / mib:.1f} of {s.bytes_total / mib:.1f} MiB used "
        f"({s.bytes_per_block} bytes per block)",
        f"sequences    {s.sequences_active} active, {s.sequences_added} added, "
        f"{s.sequences_freed} freed, {s.forks} forks, {s.cow_copies} COW copies",
        f"tokens       {s.tokens_held} held in {s.token_slots_allocated} slots "
        f"({s.internal_fragmentation:.1%} internal fragmentation, "
        f"{s.tokens_per_used_block:.1f} tokens per used block)",
        f"free space   {s.free_runs} runs, the largest {s.largest_free_run} blocks",
        f"activity     {s.blocks_allocated} blocks allocated, {s.blocks_freed} freed",
        f"evicted      {s.evicted_tokens} tokens, {s.evicted_blocks} blocks, "
        f"{s.evicted_sequences} sequences",
    ]
    if s.evictions_by_cause:
        lines.append("  by cause   " + ", ".join(
            f"{k} {v}" for k, v in sorted(s.evictions_by_cause.items())))
    if s.prefix_caching:
        lines.append(
            f"prefix cache {s.prefix_hit_blocks} blocks hit, {s.prefix_miss_blocks} missed "
            f"({s.prefix_hit_rate:.1%}), {s.prefix_hit_tokens} prompt tokens reused, "
            f"{s.prefix_miss_tokens} computed, {s.cached_free_blocks} cached free blocks")
    return "\n".join(lines)


_POLICY_DEFAULTS = dict(prefix_caching=False, prefix_hit_blocks=0, prefix_miss_blocks=0,
                        prefix_hit_tokens=0, prefix_miss_tokens=0, prefix_hit_rate=0.0)


def collect(core, evictor, policy_fields=None) -> CacheStats:
    """A CacheStats snapshot of a cache core, its SequenceEvictor and the
    fields its policies fill in (``PolicySet.stats()``: prefix caching's)."""
    pool, seqs = core.pool, core.seqs
    infos = core.sequence_infos()
    tokens = sum(row[3] for row in infos)
    slots = sum(row[4] for row in infos) * core.block_size
    used = pool.num_blocks - pool.num_free
    bpb = pool.bytes_per_block
    (stream_tok, stream_blk), (shot_tok, shot_blk) = seqs.trimmed()
    evicted = evictor.counts()
    runs, largest = pool.free_runs()
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
        tokens_per_used_block=tokens / used if used else 0.0,
        free_runs=runs,
        largest_free_run=largest,
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
        cached_free_blocks=pool.num_cached_free,
        evictions_by_cause=by_cause,
        **{**_POLICY_DEFAULTS, **(policy_fields or {})},
    )
