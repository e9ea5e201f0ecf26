"""pagedkv: a paged KV cache with paged attention for CPU LLM inference."""
from pagedkv._core import (
    OutOfBlocksError,
    get_num_threads,
    has_openmp,
    linear,
    set_num_threads,
    simd_backend,
    simd_supported,
)
from pagedkv._version import __version__
from pagedkv.cache import PagedKVCache
from pagedkv.eviction import EvictionRecord, EvictionStrategy
from pagedkv.rope import RoPE
from pagedkv.persist import CacheFileError
from pagedkv.stats import CacheStats, format_stats
from pagedkv.streaming import StreamingLLM

__all__ = [
    "CacheFileError",
    "CacheStats",
    "EvictionRecord",
    "EvictionStrategy",
    "OutOfBlocksError",
    "PagedKVCache",
    "RoPE",
    "StreamingLLM",
    "__version__",
    "format_stats",
    "get_num_threads",
    "has_openmp",
    "linear",
    "set_num_threads",
    "simd_backend",
    "simd_supported",
]
