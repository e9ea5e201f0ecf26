"""Soak: mixed operations from several threads on caches of every storage format, with prefix
caching, StreamingLLM and the transformers cache, in epochs, checking invariants and memory.

Caches (each shared by every worker thread): float32, float64, bfloat16 with prefix caching,
float16 with StreamingLLM, int8 (float64 compute) with prefix caching.  Per epoch:

* WORKERS threads each run OPS operations on sequences of their own, in whichever cache the
  operation picks: add (with prefix caching: a prompt's longest cached prefix, then the rest),
  append on every layer, append_batch + attend_batch, attend, gather, fork, truncate, free.  Each
  worker keeps a model of its sequences (kept positions and the stored value of every K/V), and
  checks gather and kept positions exactly and attention against the NumPy reference
  (reference.ref_attention on the stored values, the compute dtype's tolerance).  With prefix
  caching a token's K/V is a function of the prompt's ids up to it, as a model's would be, so a
  prefix hit (possibly on blocks another thread computed) must read back exactly that function.
* One thread generates with a tiny random Llama through ``paged_cache`` (float32 storage: the
  tokens equal transformers' DynamicCache; bfloat16 storage and StreamingLLM: identical to the
  same generation run alone before the soak), resetting each paged cache between generations.
* One thread checks the block accounting of every cache meanwhile
  (reference.check_pool_invariants, under the cache's lock).

After each epoch (threads joined, every worker has freed its sequences): every cache holds no
sequence and has every block free, the invariants hold, and the process's resident memory is
sampled.  Memory must stay flat: after the warm-up epochs RSS may not grow by more than RSS_SLACK.

PAGEDKV_TEST_PROFILE=long runs many more epochs and operations (minutes).
"""
import gc
import os
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import pagedkv
from profiles import depth
from reference import (assert_attention_close, check_pool_invariants, ref_attention, ref_stored,
                       run_threads)

HKV, G, D, LAYERS, BS = 2, 2, 32, 2, 4
HQ = HKV * G
WORKERS = 3
EPOCHS = depth(4, 40)
OPS = depth(150, 1500)          # per worker and epoch
WARMUP = 2                      # epochs before the memory baseline
RSS_SLACK = 16 << 20            # bytes RSS may grow after the warm-up
MAX_OWN = 4                     # live sequences per worker and cache
MAX_LEN = 48                    # tokens per sequence (a prompt's length, with prefix caching)
S, R = 2, 10                    # StreamingLLM sinks and window

SPECS = {
    "float32": dict(dtype="float32"),
    "float64": dict(dtype="float64"),
    "bfloat16-prefix": dict(dtype="float32", kv_dtype="bfloat16", prefix_caching=True),
    "float16-streaming": dict(dtype="float32", kv_dtype="float16",
                              streaming=pagedkv.StreamingLLM(sink_tokens=S, window_tokens=R)),
    "int8-prefix": dict(dtype="float64", kv_dtype="int8", prefix_caching=True),
}


def _new_caches():
    return {name: pagedkv.PagedKVCache(num_blocks=256, block_size=BS, num_kv_heads=HKV,
                                       head_dim=D, num_layers=LAYERS, max_seqs=64, **kw)
            for name, kw in SPECS.items()}


# ----------------------------------------------------------------------
# prompts (prefix caching): three prompts sharing prefixes of 24 and 12 tokens

_BASE = [(7 * i) % 50 + 1 for i in range(24)]
PROMPTS = [_BASE + [60 + i for i in range(24)],
           _BASE + [90 + i for i in range(24)],
           _BASE[:12] + [120 + i for i in range(36)]]
SALTS = [None, "tenant"]


def _token_kv(ids, layer):
    """K and V of the last token of `ids` on `layer`: a function of the ids up to it."""
    seed = zlib.crc32(np.asarray(ids, np.int64).tobytes()) * 4 + layer
    x = np.random.default_rng(seed).standard_normal((2, HKV, D))
    return x[0], x[1]


def _prompt_tables():
    """{(prompt, layer): (K, V)} as float64 [MAX_LEN, HKV, D], computed once."""
    out = {}
    for j, p in enumerate(PROMPTS):
        for layer in range(LAYERS):
            kv = [_token_kv(p[:i + 1], layer) for i in range(len(p))]
            out[j, layer] = (np.stack([k for k, _ in kv]), np.stack([v for _, v in kv]))
    return out


TABLES = _prompt_tables()


# ----------------------------------------------------------------------
# one worker


class Seq:
    """A worker's model of one sequence: kept stream positions and the stored K/V per layer."""

    def __init__(self, prompt=None):
        self.pos = []
        self.k = [[] for _ in range(LAYERS)]
        self.v = [[] for _ in range(LAYERS)]
        self.next = 0
        self.prompt = prompt

    def copy(self):
        c = Seq(self.prompt)
        c.pos, c.next = list(self.pos), self.next
        c.k = [list(x) for x in self.k]
        c.v = [list(x) for x in self.v]
        return c

    def arrays(self, layer, dtype):
        empty = np.zeros((0, HKV, D), dtype)
        k = np.stack(self.k[layer]) if self.k[layer] else empty
        v = np.stack(self.v[layer]) if self.v[layer] else empty
        return k, v


class Worker:
    def __init__(self, caches, seed):
        self.caches = caches
        self.rng = np.random.default_rng(seed)
        self.own = {name: {} for name in caches}    # cache name -> {sid: Seq}
        self.ops = 0

    # -- helpers

    def stored(self, name, x):
        spec = SPECS[name]
        return ref_stored(x, spec.get("kv_dtype"), spec["dtype"])

    def new_kv(self, name, seq, n):
        """K/V [n, HKV, D] in the cache's dtype for the next n tokens of `seq`, and their ids."""
        dtype = np.dtype(SPECS[name]["dtype"])
        if seq.prompt is None:
            x = self.rng.standard_normal((LAYERS, 2, n, HKV, D)).astype(dtype)
            return [(x[layer, 0], x[layer, 1]) for layer in range(LAYERS)], None
        p0 = seq.next
        kv = [(TABLES[seq.prompt, layer][0][p0:p0 + n].astype(dtype),
               TABLES[seq.prompt, layer][1][p0:p0 + n].astype(dtype)) for layer in range(LAYERS)]
        return kv, PROMPTS[seq.prompt][p0:p0 + n]

    def record(self, name, seq, kv):
        """The model side of appending kv (one step of n tokens) to `seq`."""
        n = kv[0][0].shape[0]
        if name.endswith("streaming") and len(seq.pos) > S + R:
            keep = list(range(S)) + list(range(len(seq.pos) - R, len(seq.pos)))
            seq.pos = [seq.pos[i] for i in keep]
            for layer in range(LAYERS):
                seq.k[layer] = [seq.k[layer][i] for i in keep]
                seq.v[layer] = [seq.v[layer][i] for i in keep]
        seq.pos += list(range(seq.next, seq.next + n))
        seq.next += n
        for layer, (k, v) in enumerate(kv):
            seq.k[layer] += list(self.stored(name, k))
            seq.v[layer] += list(self.stored(name, v))

    def room(self, seq, n):
        return min(n, MAX_LEN - seq.next) if seq.prompt is not None else n

    def check_gather(self, name, sid, seq):
        c = self.caches[name]
        np.testing.assert_array_equal(c.kept_positions(sid), np.asarray(seq.pos, np.int64))
        for layer in range(LAYERS):
            k, v = c.gather(sid, layer=layer)
            wk, wv = seq.arrays(layer, c.dtype)
            np.testing.assert_array_equal(k, wk, err_msg=f"{name} sid {sid} layer {layer} K")
            np.testing.assert_array_equal(v, wv, err_msg=f"{name} sid {sid} layer {layer} V")

    def check_attend(self, name, sid, seq, q, out, layer, offset_from_end):
        k, v = seq.arrays(layer, np.dtype(SPECS[name]["dtype"]))
        want = ref_attention(q, k, v, 1.0 / np.sqrt(D), len(seq.pos) - offset_from_end)
        assert_attention_close(out, want, SPECS[name]["dtype"], v,
                               err_msg=f"{name} sid {sid} layer {layer}")

    # -- operations

    def add(self, name):
        c, own = self.caches[name], self.own[name]
        if c._prefix is None:
            sid = c.add_sequence()
            own[sid] = seq = Seq()
            n = int(self.rng.integers(1, 13))
        else:
            j = int(self.rng.integers(len(PROMPTS)))
            m = int(self.rng.integers(1, MAX_LEN + 1))
            salt = SALTS[int(self.rng.integers(len(SALTS)))]
            sid = c.add_sequence(token_ids=PROMPTS[j][:m], cache_salt=salt)
            own[sid] = seq = Seq(j)
            hit = c.seq_len(sid)
            assert hit % BS == 0 and hit <= (m - 1) // BS * BS, (name, m, hit)
            # the hit's K/V: what this prompt's first `hit` tokens compute
            self.record(name, seq, [(TABLES[j, layer][0][:hit], TABLES[j, layer][1][:hit])
                                    for layer in range(LAYERS)])
            n = m - hit
        self.check_gather(name, sid, seq)
        self.append(name, sid, n)

    def append(self, name, sid, n):
        c, seq = self.caches[name], self.own[name][sid]
        n = self.room(seq, n)
        if n <= 0:
            return
        kv, ids = self.new_kv(name, seq, n)
        for layer, (k, v) in enumerate(kv):
            c.append(sid, k, v, layer=layer, token_ids=ids if layer == 0 else None)
        self.record(name, seq, kv)

    def batch(self, name):
        c, own = self.caches[name], self.own[name]
        sids = [s for s in own if self.room(own[s], 1) > 0]
        if not sids:
            return
        pick = sorted(set(int(i) for i in self.rng.integers(len(sids), size=3)))
        sids = [sids[i] for i in pick]
        steps = [self.new_kv(name, own[s], 1) for s in sids]
        for layer in range(LAYERS):
            k = np.concatenate([kv[layer][0] for kv, _ in steps])
            v = np.concatenate([kv[layer][1] for kv, _ in steps])
            ids = [t[0] for _, t in steps] if c._prefix is not None and layer == 0 else None
            c.append_batch(sids, k, v, layer=layer, token_ids=ids)
        for s, (kv, _) in zip(sids, steps):
            self.record(name, own[s], kv)
        layer = int(self.rng.integers(LAYERS))
        q = self.rng.standard_normal((len(sids), HQ, D)).astype(c.dtype)
        out = c.attend_batch(sids, q, layer=layer)
        for i, s in enumerate(sids):
            self.check_attend(name, s, own[s], q[i:i + 1], out[i:i + 1], layer, 1)

    def attend(self, name, sid):
        c, seq = self.caches[name], self.own[name][sid]
        if not seq.pos:
            return
        n = int(self.rng.integers(1, min(len(seq.pos), 6) + 1))
        if name.endswith("streaming"):
            n = 1  # the newest n tokens must be the last step's (a window may have cut others)
        layer = int(self.rng.integers(LAYERS))
        q = self.rng.standard_normal((n, HQ, D)).astype(c.dtype)
        self.check_attend(name, sid, seq, q, c.attend(sid, q, layer=layer), layer, n)

    def step(self):
        name = list(self.caches)[int(self.rng.integers(len(self.caches)))]
        c, own = self.caches[name], self.own[name]
        op = self.rng.choice(["add", "append", "append", "batch", "attend", "gather", "fork",
                              "truncate", "free"])
        self.ops += 1
        if not own or (op in ("add", "fork") and len(own) < MAX_OWN and op == "add"):
            self.add(name)
            return
        sid = list(own)[int(self.rng.integers(len(own)))]
        seq = own[sid]
        if op == "append":
            self.append(name, sid, int(self.rng.integers(1, 7)))
        elif op == "batch":
            self.batch(name)
        elif op == "attend":
            self.attend(name, sid)
        elif op == "gather":
            self.check_gather(name, sid, seq)
        elif op == "fork" and len(own) < MAX_OWN:
            child = c.fork(sid)
            own[child] = seq.copy()
            self.append(name, child, int(self.rng.integers(1, 4)))
            self.check_gather(name, sid, seq)   # the parent is untouched by the child's write
        elif op == "truncate" and not name.endswith("streaming"):
            length = int(self.rng.integers(0, len(seq.pos) + 1))
            c.truncate(sid, length)
            del seq.pos[length:]
            for layer in range(LAYERS):
                del seq.k[layer][length:], seq.v[layer][length:]
            seq.next = length
            self.check_gather(name, sid, seq)
        elif op in ("free", "fork", "add") or seq.next >= MAX_LEN * 2:
            self.check_gather(name, sid, seq)
            c.free(sid)
            del own[sid]

    def run(self, ops):
        for _ in range(ops):
            self.step()
        for name, own in self.own.items():      # the end of an epoch: let every sequence go
            for sid, seq in list(own.items()):
                self.check_gather(name, sid, seq)
                self.caches[name].free(sid)
            own.clear()


# ----------------------------------------------------------------------
# the transformers cache


def _hf_setup():
    """(model, [(paged cache, prompt, expected sequences)]) or None without the hf extra."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from pagedkv.integrations.hf import paged_cache

    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
               pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(1234)
    ours = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    ref = LlamaForCausalLM(LlamaConfig(**cfg)).eval()       # keeps sdpa + DynamicCache
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 96, (1, 12), generator=g)
    new = 16

    def gen(model, cache=None):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  past_key_values=cache)

    jobs = []
    f32 = paged_cache(ours, num_blocks=16, block_size=4)
    jobs.append((f32, gen(ref)))                              # tokens equal DynamicCache's
    for kw in (dict(kv_dtype="bfloat16"),
               dict(kv_dtype="float16", streaming=pagedkv.StreamingLLM(sink_tokens=2,
                                                                       window_tokens=8))):
        cache = paged_cache(ours, num_blocks=16, block_size=4, **kw)
        jobs.append((cache, gen(ours, cache)))                # the same generation, run alone
        cache.reset()
    return ours, gen, jobs


class HFWorker:
    def __init__(self, setup, rounds):
        self.model, self.gen, self.jobs = setup
        self.rounds = rounds
        self.done = 0

    def run(self, epoch):
        import torch
        for i in range(self.rounds):
            cache, want = self.jobs[(epoch * self.rounds + i) % len(self.jobs)]
            got = self.gen(self.model, cache)
            assert torch.equal(got, want), (cache.paged.kv_dtype, got, want)
            assert cache.paged.num_free_blocks < cache.paged.num_blocks
            cache.reset()
            assert cache.paged.num_free_blocks == cache.paged.num_blocks
            assert cache.paged.sequence_ids() == []
            self.done += 1


# ----------------------------------------------------------------------


def _rss():
    """Resident set size in bytes (Linux /proc), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def fast_switching():
    """Switch threads every 20 us instead of 5 ms, so the workers really interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(before)


def test_soak(fast_switching):
    caches = _new_caches()
    hf = _hf_setup()
    hf_worker = HFWorker(hf, rounds=depth(1, 3)) if hf is not None else None
    workers = [Worker(caches, seed=100 + i) for i in range(WORKERS)]
    rss, checks = [], [0]
    t0 = time.perf_counter()
    for epoch in range(EPOCHS):
        stop = threading.Event()

        def checker():
            while not stop.is_set():
                for c in caches.values():
                    check_pool_invariants(c)
                checks[0] += 1
                time.sleep(0.005)

        targets = [lambda w=w: w.run(OPS) for w in workers]
        if hf_worker is not None:
            targets.append(lambda e=epoch: hf_worker.run(e))
        th = threading.Thread(target=checker)
        th.start()
        try:
            run_threads(targets, timeout=None)
        finally:
            stop.set()
            th.join()
        for name, c in caches.items():
            assert c.sequence_ids() == [], name
            assert c.num_free_blocks == c.num_blocks, (name, c.num_free_blocks)
            st = c.stats()
            assert st.sequences_active == 0 and st.blocks_used == 0, (name, st)
            check_pool_invariants(c)
        gc.collect()
        rss.append(_rss())
    elapsed = time.perf_counter() - t0
    ops = sum(w.ops for w in workers)
    mib = [None if r is None else round(r / 2**20, 1) for r in rss]
    print(f"\nsoak: {EPOCHS} epochs, {ops} cache operations from {WORKERS} threads, "
          f"{hf_worker.done if hf_worker else 0} generations, {checks[0]} invariant sweeps, "
          f"{elapsed:.1f} s, RSS MiB per epoch {mib}")
    assert all(w.ops == EPOCHS * OPS for w in workers)
    # Under AddressSanitizer (tools/sanitize.sh preloads libasan) freed memory is held in its
    # quarantine (up to 256 MiB), so RSS grows by design there; the ordinary build checks it.
    under_asan = "libasan" in os.environ.get("LD_PRELOAD", "")
    if rss[WARMUP - 1] is not None and not under_asan:
        grown = rss[-1] - rss[WARMUP - 1]
        assert grown <= RSS_SLACK, f"RSS grew {grown / 2**20:.1f} MiB after warm-up: {mib}"
    prefix = [caches[n].stats() for n in SPECS if SPECS[n].get("prefix_caching")]
    assert all(s.prefix_hit_blocks > 0 for s in prefix), [s.prefix_hit_blocks for s in prefix]
