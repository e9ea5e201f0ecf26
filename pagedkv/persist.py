"""Save one sequence's K/V to a file and load it back (``cache.save`` / ``cache.load``).

This module owns the file: its format, its checks and the write protocol.  It
reaches the cache through its public properties and two internal methods,
``cache._snapshot(sid)`` (the core's export of the sequence and its policies'
state, e.g. the prefix cache's token ids and salt) and ``cache._restore(meta,
payload, state)`` (import, then the policies are told: ``pagedkv/policy.py``).

File format, version 2 (all integers little-endian)::

    offset  size  field
    0       8     magic  b"PAGEDKV\\x1a"
    8       4     format version (uint32, 2)
    12      4     H = length of the header (uint32)
    16      H     header: UTF-8 JSON object (below)
    16+H    P     the sequence's blocks, raw, in block-table order:
                  nblk * bytes_per_block bytes, exactly as the pool stores them
    16+H+P  4     CRC-32 (zlib) of every byte before it (uint32)

Header keys: ``"config"`` (block_size, num_kv_heads, head_dim, num_layers,
dtype, kv_dtype, bytes_per_block, byteorder, rope: null or {theta,
rotary_dim}, streaming: null or {sink_tokens, window_tokens}), which must
equal the loading cache's; ``"sequence"`` (nblk, the held slots as two
segments a0..a1 and b0..b1, the stream offsets off0/off1 — together the kept
positions — priority, length); ``"token_ids"``: the ids of the held tokens
when a prefix-caching cache knew them, else null (a prefix-caching cache
that loads the file registers its full blocks, so a saved system prompt
becomes a prefix hit); ``"cache_salt"``: the sequence's prefix-cache salt as
{"type": "str" | "int" | "float" | "bool", "value": ...}, or {"type":
"other"} for a salt JSON cannot hold exactly (the loaded sequence is then not
registered: its blocks are never a hit for any salt), or null for none (and
in files written before this key existed); ``"payload_bytes"`` = P.

Version 2 stores K transposed inside each block-head ([dim][slot]) and the
int8 scales as [group][slot] (the pool's layout since that version); a
version 1 file (K [slot][dim], scales [slot][group]) is converted on load.

Saving is crash-consistent: a save killed at any instant (SIGKILL, power
loss) leaves at ``path`` either the previous file or the new complete one,
never a torn one.  The file is written to a temporary file in the target's
directory, ``.<name>.pagedkv-tmp`` for a target ``<name>``, flushed and
fsync'ed, renamed over the target with os.replace (atomic on POSIX and
Windows), and then the directory is fsync'ed so the rename itself is durable
(skipped where a directory cannot be opened, e.g. Windows, or its file system
cannot sync one).  The temporary name is fixed, so a save killed midway leaves
one stale temporary file that the next save to the same path reuses: a
process that crash-loops does not pile up temporary files.  A save that fails
(disk full, bad path, an interrupt...) removes its temporary file, leaves the
old target untouched and raises.  If syncing the directory fails after the
rename, the error is raised too: the new file is then in place, but may not
survive a power loss.

Concurrent saves to one path (threads or processes) are serialized by an
exclusive lock (``fcntl.flock``) on the temporary file: a second saver waits
until the first has renamed its file, then writes its own; the last rename
wins and the file is never torn.  The temporary file is opened without
O_TRUNC and emptied only once locked (truncating on open would cut a file a
concurrent saver is still writing), and a saver that got the lock checks that
the file it locked is still the one under the temporary name (the saver it
waited for may have renamed it over the target meanwhile; it then reopens).
Where the fixed name cannot be used — no fcntl (Windows), a file system
without flock, a name too long for the suffix, a symlink or directory under
that name — the save falls back to a unique temporary name
(``.pagedkv-*.tmp``); it is still removed on failure, but one killed save
can then leave one more stale file behind.

Loading reads and checks the whole file (magic, version, sizes, checksum,
header types, configuration) before the cache changes; a file that does not
fit raises OutOfBlocksError and changes nothing.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import sys
import tempfile
import zlib

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: unique temporary names (see the module docstring)
    fcntl = None

from pagedkv._core import SequenceMetaError
from pagedkv.eviction import check_priority

MAGIC = b"PAGEDKV\x1a"
VERSION = 2
_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int8": 1}
_PREFIX = struct.Struct("<8sII")


class CacheFileError(ValueError):
    """A file that is not a readable pagedkv sequence file (foreign,
    truncated, corrupt, or of an unsupported version)."""


def config_of(cache) -> dict:
    """The configuration a saved sequence must be loaded into."""
    rope = cache.rope
    streaming = cache.streaming
    return {
        "block_size": cache.block_size,
        "num_kv_heads": cache.num_kv_heads,
        "head_dim": cache.head_dim,
        "num_layers": cache.num_layers,
        "dtype": cache.dtype_name,
        "kv_dtype": cache.kv_dtype,
        "bytes_per_block": cache.bytes_per_block,
        "byteorder": sys.byteorder,
        "rope": None if rope is None else {"theta": float(rope.theta),
                                           "rotary_dim": rope.dim(cache.head_dim)},
        "streaming": None if streaming is None else {
            "sink_tokens": streaming.sink_tokens, "window_tokens": streaming.window_tokens},
    }


_SALT_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def _salt_record(salt):
    """The header's record of a prefix-cache salt (see the module docstring)."""
    if salt is None:
        return None
    for name, t in _SALT_TYPES.items():
        if type(salt) is t and not (t is float and salt != salt):  # NaN never equals itself
            return {"type": name, "value": salt}
    return {"type": "other"}


def _salt_from(record, path):
    """(registrable, salt) from a header's cache_salt record."""
    if record is None:
        return True, None
    if not isinstance(record, dict) or record.get("type") not in (*_SALT_TYPES, "other"):
        raise CacheFileError(f"{os.fspath(path)}: malformed cache_salt")
    if record["type"] == "other":
        return False, None
    value = record.get("value")
    if type(value) is not _SALT_TYPES[record["type"]] and not (
            record["type"] == "float" and type(value) is int):
        raise CacheFileError(f"{os.fspath(path)}: malformed cache_salt")
    return True, _SALT_TYPES[record["type"]](value)


TMP_SUFFIX = ".pagedkv-tmp"


def _lock_fixed_tmp(tmp):
    """A descriptor of the temporary file `tmp` (created if missing), exclusively
    locked and emptied; None when the fixed name cannot be used here (see the
    module docstring), and the caller then takes a unique name."""
    if fcntl is None:
        return None
    # no O_TRUNC: the file may be another saver's, still being written
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    while True:
        try:
            fd = os.open(tmp, flags, 0o600)
        except OSError:  # too long a name, a symlink or directory there...
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another save to this path runs
            mine = os.fstat(fd)
            try:
                now = os.stat(tmp, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.ftruncate(fd, 0)  # a stale file from a killed save, or a used one
                return fd
        except OSError:  # no flock on this file system
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        # the saver we waited for renamed (or removed) the file we opened: it may be
        # the target now, so never write to it; open the file now under that name
        os.close(fd)


def _sync_directory(directory):
    """fsync a directory so a rename in it survives a power loss; skipped where
    directories cannot be opened or synced."""
    if os.name == "nt":
        return
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(dfd)


def save(cache, sid, path) -> int:
    """Write sequence `sid` to `path` crash-consistently (see the module
    docstring); returns the bytes written."""
    meta, blocks, state = cache._snapshot(sid)  # the file is written after the lock is left
    header = json.dumps({
        "config": config_of(cache),
        "sequence": meta,
        "token_ids": state.get("token_ids"),
        "cache_salt": _salt_record(state.get("cache_salt")),
        "payload_bytes": int(blocks.nbytes),
    }, separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
    crc = zlib.crc32(blocks, zlib.crc32(head))
    path = os.fsdecode(os.fspath(path))  # a bytes path too (mkstemp's dir= must match prefix=)
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}{TMP_SUFFIX}")
    fd = _lock_fixed_tmp(tmp)
    if fd is None:
        fd, tmp = tempfile.mkstemp(prefix=".pagedkv-", suffix=".tmp", dir=directory)
    with os.fdopen(fd, "wb") as f:  # closing releases the lock, after the rename
        try:
            f.write(head)
            f.write(memoryview(blocks.reshape(-1)))  # 1-D uint8: also when empty
            f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)  # still locked: no other saver is using this file
            except OSError:
                pass
            raise
    _sync_directory(directory)
    return len(head) + blocks.nbytes + 4


def read(path):
    """(header dict, payload as a read-only uint8 array) of a sequence file,
    checked: magic, version, sizes, checksum."""
    with open(os.fspath(path), "rb") as f:
        data = f.read()
    name = os.fspath(path)
    if len(data) < _PREFIX.size + 4:
        raise CacheFileError(f"{name}: {len(data)} bytes is too short for a pagedkv sequence file")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CacheFileError(f"{name}: not a pagedkv sequence file (magic {magic!r})")
    if version not in (1, VERSION):
        raise CacheFileError(f"{name}: format version {version}; this pagedkv reads versions "
                             f"1 and {VERSION}")
    if _PREFIX.size + hlen + 4 > len(data):
        raise CacheFileError(f"{name}: truncated (header of {hlen} bytes, file of {len(data)})")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[:-4]) != crc:
        raise CacheFileError(f"{name}: checksum mismatch (truncated or corrupt file)")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen].decode())
    except (ValueError, RecursionError) as e:
        raise CacheFileError(f"{name}: unreadable header ({e})") from None
    if not (isinstance(header, dict) and isinstance(header.get("config"), dict)
            and isinstance(header.get("sequence"), dict)
            and type(header.get("payload_bytes")) is int and header["payload_bytes"] >= 0):
        raise CacheFileError(f"{name}: unreadable header (config and sequence must be objects, "
                             "payload_bytes an integer >= 0)")
    payload_bytes = header["payload_bytes"]
    start = _PREFIX.size + hlen
    if start + payload_bytes + 4 != len(data):
        raise CacheFileError(f"{name}: {len(data) - start - 4} bytes of blocks, header says "
                             f"{payload_bytes}")
    payload = np.frombuffer(data, dtype=np.uint8, count=payload_bytes, offset=start)
    if version == 1:
        payload = _upgrade_v1(name, header, payload)
    return header, payload


def _upgrade_v1(name, header, payload):
    """The blocks of a version 1 file in the version 2 layout: K of each
    block-head transposed to [dim][slot], int8 scales of both planes to
    [group][slot]."""
    cfg = header["config"]
    try:
        bs, hkv, d, nl = (int(cfg[k]) for k in ("block_size", "num_kv_heads", "head_dim",
                                                "num_layers"))
        kv = cfg.get("kv_dtype") or cfg["dtype"]
        item, bpb = _ITEMSIZE[kv], int(cfg["bytes_per_block"])
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFileError(f"{name}: version 1 file with a malformed config ({e})") from None
    groups = -(-d // 32) if kv == "int8" else 0
    values = hkv * bs * d * item
    scale_off = (values + 3) & ~3 if groups else values
    plane = scale_off + hkv * bs * groups * 4
    if min(bs, hkv, d, nl) < 1 or bpb < 2 * nl * plane or payload.size % bpb:
        raise CacheFileError(f"{name}: version 1 file whose blocks do not match its config")
    blocks = payload.reshape(-1, bpb).copy()
    vdt = np.dtype(f"u{item}") if item > 1 else np.dtype("u1")
    for layer in range(nl):
        for kvi in range(2):
            p0 = (2 * layer + kvi) * plane
            if kvi == 0:
                k = blocks[:, p0:p0 + values].view(vdt).reshape(-1, hkv, bs, d)
                blocks[:, p0:p0 + values] = np.ascontiguousarray(
                    k.transpose(0, 1, 3, 2)).view(np.uint8).reshape(len(blocks), values)
            if groups:
                nsc = hkv * bs * groups * 4
                sc = blocks[:, p0 + scale_off:p0 + scale_off + nsc].view(np.float32)
                sc = sc.reshape(-1, hkv, bs, groups).transpose(0, 1, 3, 2)
                blocks[:, p0 + scale_off:p0 + scale_off + nsc] = np.ascontiguousarray(
                    sc).view(np.uint8).reshape(len(blocks), nsc)
    return blocks.reshape(-1)


def load(cache, path, priority=None) -> int:
    """A new sequence from a file written by save(); returns its id."""
    header, payload = read(path)
    want = config_of(cache)
    got = header["config"]
    diff = [f"{k}: file {got.get(k)!r}, cache {v!r}" for k, v in want.items() if got.get(k) != v]
    if diff:
        raise ValueError(f"{os.fspath(path)} was saved from a cache with another "
                         "configuration: " + "; ".join(diff))
    meta = dict(header["sequence"])
    bad = [k for k in ("nblk", "a0", "a1", "b0", "b1", "off0", "off1", "length")
           if type(meta.get(k)) is not int]
    if bad:
        raise CacheFileError(f"{os.fspath(path)}: malformed sequence header ({', '.join(bad)}: "
                             "missing or not integers)")
    length = (meta["a1"] - meta["a0"]) + (meta["b1"] - meta["b0"])
    if meta["length"] != length:
        raise CacheFileError(f"{os.fspath(path)}: sequence length {meta['length']!r} does "
                             f"not match its segments ({length} tokens)")
    try:
        meta["priority"] = check_priority(meta.get("priority", 0.0))
    except (TypeError, ValueError) as e:
        raise CacheFileError(f"{os.fspath(path)}: malformed sequence header ({e})") from None
    if priority is not None:
        meta["priority"] = priority
    tokens = header.get("token_ids")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != meta.get("length")
                               or not all(type(t) is int for t in tokens)):
        raise CacheFileError(f"{os.fspath(path)}: malformed token_ids")
    registrable, salt = _salt_from(header.get("cache_salt"), path)
    # a salt the file could not keep: its blocks are not registered (see the module docstring)
    try:
        return cache._restore(meta, payload, {"token_ids": tokens if registrable else None,
                                              "cache_salt": salt})
    except SequenceMetaError as e:  # segments, offsets or sizes that describe no sequence
        raise CacheFileError(f"{os.fspath(path)}: {e}") from None
