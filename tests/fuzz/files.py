"""The fuzz programs' files: a scratch directory per process, saves and loads of real, damaged and
forged sequence files (the FileOps methods of program.Runner)."""
import atexit
import json
import math
import os
import pathlib
import shutil
import struct
import tempfile
import zlib

import numpy as np

import pagedkv
from fuzz.inputs import ALLOWED, LOAD_ALLOWED, Bytes, _cdiv, _random_bytes, _stream_token


# ----------------------------------------------------------------------
# files (save / load)

_TMP = None
_DIRTY = False
_IN = None  # the bytes in the scratch file "in" (None: unknown)
_PREFIX = struct.Struct("<8sII")


def _tmpdir(saving=False):
    """One scratch directory per process (emptied at the start of every program that follows one
    which saved in it)."""
    global _TMP, _DIRTY
    _DIRTY = _DIRTY or saving
    if _TMP is None:
        # in memory where the system has it: a save syncs its file and directory to disk
        shm = "/dev/shm"
        _TMP = tempfile.mkdtemp(prefix="pagedkv-fuzz-",
                                dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)
        os.mkdir(os.path.join(_TMP, "d"))
        atexit.register(shutil.rmtree, _TMP, True)
    return _TMP


def _clear_tmpdir():
    """Remove what the last program saved ("in", which every load writes first when its
    bytes differ, and the directory "d" stay)."""
    global _DIRTY
    if _TMP is not None and _DIRTY:
        _DIRTY = False
        for name in os.listdir(_TMP):
            if name not in ("d", "in"):
                os.unlink(os.path.join(_TMP, name))


def _split(data):
    """(version, header, payload) of a file whose header parses, else None."""
    if len(data) < _PREFIX.size + 4:
        return None
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != pagedkv.persist.MAGIC or _PREFIX.size + hlen + 4 > len(data):
        return None
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen].decode())
    except ValueError:
        return None
    return version, header, data[_PREFIX.size + hlen:-4]


_FRESH = {}  # (configuration, prefix caching) -> FileOps._fresh_file()
_JSON = json.JSONEncoder(separators=(",", ":"))  # as persist.save writes headers


def _pack(version, header, payload, crc_ok=True, hlen_delta=0):
    """A file with a valid checksum (unless crc_ok is False)."""
    h = _JSON.encode(header).encode()
    body = _PREFIX.pack(pagedkv.persist.MAGIC, version, max(0, len(h) + hlen_delta)) + h + payload
    return body + struct.pack("<I", zlib.crc32(body) ^ (0 if crc_ok else 1))


_JSON_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**62, 2**63, 2**64, 10**30, -2**63, 1.5,
                -0.0, math.nan, math.inf, -math.inf, "", "x", "float32", "int8", [], [1, 2], {},
                {"a": 1}]


def _json_value(b: Bytes, old):
    """A JSON value to put in place of `old`: near it, of another kind, or absurd."""
    if isinstance(old, int) and not isinstance(old, bool) and b.chance(110):
        return old + b.pick([-1, 1, 2, -2, 64, old, -old - 1])
    if isinstance(old, str) and b.chance(80):
        return b.pick(["float32", "float64", "bfloat16", "float16", "int8", "little", "big"])
    if isinstance(old, dict) and old and b.chance(128):
        new = dict(old)
        key = b.pick(sorted(new))
        new[key] = _json_value(b, new[key])
        return new
    return b.pick(_JSON_VALUES)


def _salt_not_kept(data):
    """True when a well-formed sequence file's cache salt is of a type the file cannot hold
    exactly ({"type": "other"}): loading it registers nothing."""
    try:
        (hlen,) = struct.unpack_from("<I", data, 12)
        salt = json.loads(bytes(data[16:16 + hlen])).get("cache_salt")
    except (struct.error, ValueError, AttributeError):
        return False
    return isinstance(salt, dict) and salt.get("type") == "other"


class FileOps:
    """Runner's save / load calls (program.py): what they check is in program.py's docstring."""

    def _save(self, sid):
        b, c = self.b, self.cache
        tmp = _tmpdir(saving=True)
        slot = os.path.join(tmp, f"s{b.int(0, 3)}")
        how = b.int(0, 15)
        bad_type = type(sid) not in (int, np.int32, np.int64, np.uint8)
        if how < 10:
            path = slot
        elif how == 10:
            path = pathlib.Path(slot)
        elif how == 11:
            path = os.fsencode(slot)
        elif how == 12:
            path, self.allowed = os.path.join(tmp, "d"), ALLOWED + (OSError,)
        elif how == 13:
            path, self.allowed = os.path.join(tmp, "nodir", "f"), ALLOWED + (OSError,)
        else:
            path, bad_type = b.pick([None, 3, 1.5, ["p"]]), True
        if self.allowed is ALLOWED:
            self.allowed = (KeyError, ValueError, RuntimeError, MemoryError) + (
                (TypeError,) if bad_type else ())
        target = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
        before = None
        if target is not None and os.path.isfile(target):
            with open(target, "rb") as f:
                before = f.read()
        self.on_fail = lambda: self._save_failed(target, before)

        def save():
            written = c.save(sid, path)
            with open(target, "rb") as f:
                data = f.read()
            assert written == len(data), (written, len(data))
            self.saved[target] = (data, self.seq_contents(sid))
        return save

    def _save_failed(self, target, before):
        """A save that raised leaves its target as it was and no temporary file."""
        if target is not None and before is not None:
            with open(target, "rb") as f:
                assert f.read() == before, "a save that raised changed its target"
        stray = [f for f in os.listdir(_tmpdir())
                 if f.endswith((".tmp", pagedkv.persist.TMP_SUFFIX))]  # unique / fixed name
        assert not stray, f"a save that raised left {stray}"

    def seq_contents(self, sid):
        c = self.cache
        data = [c.gather(sid, layer) for layer in range(self.layers)]
        tokens = c._prefix.tokens_of(sid) if c._prefix is not None else None
        return (c.seq_len(sid), c.kept_positions(sid).tobytes(), c.priority(sid),
                [(k.tobytes(), v.tobytes()) for k, v in data], tokens)

    def _load(self):
        global _IN
        b, c = self.b, self.cache
        tmp = _tmpdir()
        path = os.path.join(tmp, "in")
        prio = None if b.chance(220) else b.pick([0.5, -3, float("nan"), float("inf"), "x",
                                                  10**400, True, np.float32(2)])
        bad_type = isinstance(prio, (bool, str))  # TypeError allowed
        bad_path = False  # OSError allowed
        saved = sorted(self.saved)
        src = b.pick(saved) if saved and b.chance(200) else None
        data, expect = self.saved[src] if src is not None else (self._fresh_file(), None)
        how = b.int(0, 15)
        if how <= 3:
            pass  # as saved (or a fresh forged file)
        elif how == 4:
            data, expect = data[:b.int(0, max(0, len(data) - 1))], None
        elif how == 5:
            data = bytearray(data)
            for _ in range(b.int(1, 3)):
                data[b.int(0, len(data) - 1)] ^= 1 << b.int(0, 7)
            data, expect = bytes(data), None
        elif how == 6:
            data, expect = b.pick([data + b"\0", b"\0" + data, data[:8] + data]), None
        elif how == 7:
            rng = np.random.default_rng(b.byte())
            data, expect = b.pick([
                b"", b"GGUF" + data[4:], data[:8] + b"\x02\0\0\0" + data[12:],
                rng.integers(0, 256, b.int(0, 300), dtype=np.uint8).tobytes(),
                pagedkv.persist.MAGIC + rng.integers(0, 256, 40, dtype=np.uint8).tobytes(),
                json.dumps({"config": {}}).encode()]), None
        elif how <= 13:
            data, expect = self._forge(data), None
        else:
            expect = None
            k = b.int(0, 5)
            path = [os.path.join(tmp, "missing"), os.path.join(tmp, "d"), None, 3,
                    os.fsencode(path), pathlib.Path(path)][k]
            bad_path, bad_type = k < 2, bad_type or k in (2, 3)
        if data != _IN:  # nothing else writes "in" (saves go to s0..s3)
            _IN = None
            fd = os.open(os.path.join(tmp, "in"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                assert os.write(fd, data) == len(data)
            finally:
                os.close(fd)
            _IN = data
        self.allowed = (LOAD_ALLOWED + ((TypeError,) if bad_type else ())
                        + ((OSError,) if bad_path else ()))

        def load():
            sid = c.load(path, priority=prio)
            if expect is not None:
                got = self.seq_contents(sid)
                if prio is not None:
                    expect_p = expect[:2] + (float(prio),) + expect[3:]
                else:
                    expect_p = expect
                if c._prefix is None or _salt_not_kept(data):
                    # a salt JSON cannot hold exactly is not restored: the loaded sequence is
                    # not registered, so it has no token ids (persist.py)
                    got, expect_p = got[:4], expect_p[:4]
                assert got == expect_p, "a loaded sequence differs from the saved one"
        return load

    def _fresh_file(self):
        """A sequence file for this cache's configuration, made here (so programs load and
        forge files without saving first); made once per configuration and process."""
        if self.fresh is not None:
            return self.fresh  # the configuration of a cache never changes
        c = self.cache
        config = pagedkv.persist.config_of(c)
        key = (repr(config), c._prefix is not None)
        self.fresh = _FRESH.get(key)
        if self.fresh is None:
            header = {"config": config,
                      "sequence": dict(nblk=0, a0=0, a1=0, b0=0, b1=0, off0=0, off1=0,
                                       priority=0.0, length=0),
                      "token_ids": [] if c._prefix is not None else None, "payload_bytes": 0}
            self.fresh = _FRESH[key] = _pack(pagedkv.persist.VERSION, header, b"")
        return self.fresh

    def _forge(self, data):
        """`data` with its header rewritten (usually with a valid checksum)."""
        b = self.b
        parts = _split(data)
        if parts is None:
            parts = _split(self._fresh_file())
        version, header, payload = parts
        hlen_delta = 0
        if not isinstance(header, dict):
            header = {"x": header}
        cfg, seq = header.get("config"), header.get("sequence")
        how = b.int(0, 9)
        if how == 0 and isinstance(cfg, dict) and cfg:
            key = b.pick(sorted(cfg))
            cfg[key] = _json_value(b, cfg[key])
        elif how == 1 and isinstance(seq, dict) and seq:
            key = b.pick(sorted(seq))
            seq[key] = _json_value(b, seq[key])
        elif how == 2:
            length = seq.get("length") if isinstance(seq, dict) else 0
            length = length if type(length) is int and 0 <= length < 4096 else 3
            good = [_stream_token(0, i) for i in range(length)]
            header["token_ids"] = b.pick([None, good, good[:-1], good + [0], [1.5] * length,
                                          ["a"] * length, [True] * length, [2**70] * length,
                                          [-1] * length, [[1]] * length, "abc", {}, 3])
        elif how == 3:
            header["payload_bytes"] = _json_value(b, header.get("payload_bytes"))
        elif how == 4:
            header = b.pick([None, [], [header], 3, "x", {}, 1.5])
        elif how == 5:
            header[b.pick(["config", "sequence"])] = b.pick([None, [], [1, 2], "ab", 3, {},
                                                             [["a", 1]], [["nblk", 1]]])
        elif how == 6:
            where = b.pick([header, cfg, seq])
            if isinstance(where, dict) and where:
                del where[b.pick(sorted(where))]
        elif how == 7 or how == 8:
            payload = self._reshape(header, payload)
        elif b.chance(128):
            payload = payload[:b.int(0, len(payload))] if b.chance(128) else payload + bytes(
                b.int(1, 128))
            if b.chance(200):
                header["payload_bytes"] = len(payload)
        else:
            version = b.pick([0, 2, 2**32 - 1, version])
            hlen_delta = b.pick([0, -1, 1, -5])
        return _pack(version, header, payload, crc_ok=b.chance(245), hlen_delta=hlen_delta)

    def _reshape(self, header, payload):
        """Rewrite the sequence part of `header` into a consistent-looking sequence of
        another shape (segments, offsets, blocks), with a payload of the matching size."""
        b, c = self.b, self.cache
        bs, bb = self.bs, c.bytes_per_block
        b1 = b.int(0, min(c.max_blocks_per_seq + 1, 8) * bs)
        if b.chance(128):
            a0 = a1 = b0 = 0
        else:
            b0 = b.int(0, b1)
            a1 = b.int(0, b0)
            a0 = b.int(0, a1)
        offs = [0, 0, 0, 1, bs, 2**61, 2**62 - 1]
        off0, off1 = b.pick(offs), b.pick(offs)
        nblk = _cdiv(b1, bs) + (0 if b.chance(220) else b.pick([1, -1]))
        length = (a1 - a0) + (b1 - b0) + (0 if b.chance(240) else 1)
        kind = b.int(0, 2)
        size = max(0, nblk) * bb
        if kind == 0:
            payload = bytes(size)
        elif kind == 1:
            payload = _random_bytes(b.byte(), size)
        else:
            payload = (payload * (size // max(1, len(payload)) + 1))[:size] if payload else bytes(
                size)
        seq = header.get("sequence")
        if not isinstance(seq, dict):
            seq = header["sequence"] = {}
        seq.update(nblk=nblk, a0=a0, a1=a1, b0=b0, b1=b1, off0=off0, off1=off1, length=length)
        if b.chance(100):
            seq["priority"] = b.pick([math.nan, math.inf, -math.inf, 1e308, -5, "1", None])
        if c._prefix is not None and b.chance(160):
            header["token_ids"] = [_stream_token(b.int(0, 3), i) for i in range(max(0, length))]
        else:
            header["token_ids"] = None
        header["payload_bytes"] = len(payload)
        return payload
