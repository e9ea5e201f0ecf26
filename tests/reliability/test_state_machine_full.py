"""Stateful test over every public operation against a pure-Python model (full_machine.py
describes the model, the rules and the invariants): the machine in every mode and storage dtype.
"""
from full_machine import SETTINGS, FullMachine


class StreamingMachine(FullMachine):
    """StreamingLLM on (1 sink, 4 recent), float32, block size 2."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 10, 2, 1, 3, 3, 2, 4
    DTYPE = "float32"
    STREAMING = (1, 4)


class TightMachine(FullMachine):
    """A tiny pool with a per-sequence bound: appends often fail, eviction often runs."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 5, 4, 1, 1, 2, 1, 4
    MAX_BLOCKS_PER_SEQ = 3


# ---- storage dtypes ------------------------------------------------------------------------------

class Bf16Machine(FullMachine):
    """bfloat16 storage, float32 compute."""
    DTYPE, KV_DTYPE = "float32", "bfloat16"


class Int8Machine(FullMachine):
    """int8 storage, float32 compute; head_dim 36: two scale groups (32 + 4) per head vector."""
    NUM_BLOCKS, BS, HKV, G, D, LAYERS, MAX_SEQS = 10, 2, 1, 2, 36, 2, 4
    DTYPE, KV_DTYPE = "float32", "int8"


class F16StreamingMachine(StreamingMachine):
    """float16 storage, float64 compute, with StreamingLLM."""
    DTYPE, KV_DTYPE = "float64", "float16"


class F32InF64TightMachine(TightMachine):
    """float32 storage, float64 compute, in the tiny pool."""
    DTYPE, KV_DTYPE = "float64", "float32"


TestFull = FullMachine.TestCase
TestStreaming = StreamingMachine.TestCase
TestTight = TightMachine.TestCase
TestBf16 = Bf16Machine.TestCase
TestInt8 = Int8Machine.TestCase
TestF16Streaming = F16StreamingMachine.TestCase
TestF32InF64Tight = F32InF64TightMachine.TestCase
for _case in (TestFull, TestStreaming, TestTight, TestBf16, TestInt8, TestF16Streaming,
              TestF32InF64Tight):
    _case.settings = SETTINGS
del _case
