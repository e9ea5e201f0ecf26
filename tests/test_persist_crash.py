"""cache.save is crash-consistent: a save killed at any instant, one that fails, and
concurrent saves to one path leave the old file or a new complete one, never a torn
one, and at most one temporary file per target (pagedkv/persist.py, module docstring)."""

import errno
import os
import random
import select
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pagedkv
from pagedkv import persist
from persist_crash_saver import CONTENTS, build, content, make_cache

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SAVER = os.path.join(TESTS_DIR, "persist_crash_saver.py")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pagedkv.__file__)))
NAME = "seq.pkv"
TMP = "." + NAME + persist.TMP_SUFFIX
EXPECTED = {which: content(which) for which in CONTENTS}


def held(path):
    """Which known content the file at `path` holds ("A" or "B"); fails on anything else."""
    cache = make_cache()
    sid = cache.load(path)  # raises CacheFileError on a torn file
    got = [cache.gather(sid, layer) for layer in range(cache.num_layers)]
    for which, want in EXPECTED.items():
        if all(np.array_equal(k, wk) and np.array_equal(v, wv)
               for (k, v), (wk, wv) in zip(got, want)):
            return which
    raise AssertionError(f"{path} loads, but holds neither known content")


def saver_process(path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_ROOT, TESTS_DIR, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, SAVER, os.fspath(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    if line != b"ready\n":
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the saver did not start: {line!r} {err.decode(errors='replace')}")
    return proc


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_save_killed_at_random_points_leaves_old_or_new_file(tmp_path):
    path = tmp_path / NAME
    probe = make_cache()
    sid = build(probe, "A")
    t0 = time.perf_counter()
    probe.save(sid, tmp_path / "probe")  # how long one save takes on this machine
    per_save = time.perf_counter() - t0
    os.unlink(tmp_path / "probe")
    rng = random.Random(1234)
    killed_mid_write, exists = 0, False
    for _ in range(12):
        proc = saver_process(path)
        try:
            time.sleep(rng.uniform(0, 4 * per_save))  # into one of the first few saves
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        others = sorted(set(os.listdir(tmp_path)) - {NAME})
        assert others in ([], [TMP])  # at most one temporary file, the fixed one
        killed_mid_write += others == [TMP]
        if exists:
            assert path.exists()  # once saved, a killed save never removes the file
        if path.exists():
            exists = True
            assert held(path) in CONTENTS
    # the kills landed both between saves and inside them (a left temporary file)
    assert exists and killed_mid_write >= 1, (exists, killed_mid_write)
    # a normal save reuses a stale temporary file and leaves none
    (tmp_path / TMP).write_bytes(b"stale " * 1000)
    probe.save(sid, path)
    assert os.listdir(tmp_path) == [NAME]
    assert held(path) == "A"


def test_concurrent_saves_to_one_path_never_tear(tmp_path):
    path = tmp_path / NAME
    cache = make_cache()
    sids = {which: build(cache, which) for which in CONTENTS}
    errors = []

    def saver(which, n):
        try:
            for _ in range(n):
                cache.save(sids[which], path)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(which, 6)) for which in CONTENTS]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # readers meanwhile see whole files only
        if path.exists():
            assert held(path) in CONTENTS
    for t in threads:
        t.join()
    assert not errors
    assert held(path) in CONTENTS
    assert os.listdir(tmp_path) == [NAME]


@pytest.mark.skipif(persist.fcntl is None, reason="the fixed temporary name needs fcntl.flock")
def test_save_waits_for_a_concurrent_saver_and_never_writes_into_its_renamed_file(tmp_path):
    import fcntl
    path, tmp = tmp_path / NAME, tmp_path / TMP
    cache = make_cache()
    sid = build(cache, "A")
    # play a concurrent saver that holds the temporary file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"the other saver's file")
    done = []
    t = threading.Thread(target=lambda: done.append(cache.save(sid, path)))
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and not path.exists()  # it waits for the lock
        os.replace(tmp, path)  # the other saver finishes: its file is the target now
        assert path.read_bytes() == b"the other saver's file"
    finally:
        os.close(fd)  # releases the lock
        t.join(60)
    assert done and done[0] == os.path.getsize(path)  # no error: it opened a fresh file
    assert held(path) == "A"
    assert os.listdir(tmp_path) == [NAME]


class _FailingFile:
    """A file object whose payload write stops halfway with `exc`."""

    def __init__(self, f, exc):
        self._f, self._exc, self._writes = f, exc, 0

    def write(self, data):
        self._writes += 1
        if self._writes == 2:  # the blocks
            data = memoryview(data)
            self._f.write(data[:len(data) // 2])
            raise self._exc
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def _boom(*_args, **_kw):
    raise OSError(errno.EIO, "injected failure")


@pytest.mark.parametrize("tmp_name", ["fixed", "unique"])
@pytest.mark.parametrize("where", ["write-disk-full", "write-interrupt", "fsync", "replace"])
def test_failed_save_leaves_old_file_and_no_temporary(tmp_path, monkeypatch, where, tmp_name):
    path = tmp_path / NAME
    cache = make_cache()
    a, b = build(cache, "A"), build(cache, "B")
    cache.save(b, path)
    old = path.read_bytes()
    if tmp_name == "unique":
        monkeypatch.setattr(persist, "fcntl", None)  # as on Windows
    if where.startswith("write"):
        exc = (OSError(errno.ENOSPC, "No space left on device") if where == "write-disk-full"
               else KeyboardInterrupt())
        real_fdopen = os.fdopen
        monkeypatch.setattr(persist.os, "fdopen",
                            lambda *a, **kw: _FailingFile(real_fdopen(*a, **kw), exc))
    else:
        monkeypatch.setattr(persist.os, where, _boom)
    with pytest.raises(BaseException) as info:
        cache.save(a, path)
    assert isinstance(info.value, (OSError, KeyboardInterrupt))
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == [NAME]
    assert cache.save(a, path) == os.path.getsize(path)  # and the next save works
    assert held(path) == "A" and os.listdir(tmp_path) == [NAME]


def test_bad_paths_raise_and_leave_nothing(tmp_path):
    cache = make_cache()
    sid = build(cache, "A")
    with pytest.raises(FileNotFoundError):
        cache.save(sid, tmp_path / "missing" / NAME)
    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):
        cache.save(sid, tmp_path / "adir")  # a directory is not replaced
    assert os.listdir(tmp_path) == ["adir"] and os.listdir(tmp_path / "adir") == []


def test_stale_larger_temporary_file_is_emptied_before_reuse(tmp_path):
    path = tmp_path / NAME
    (tmp_path / TMP).write_bytes(os.urandom(3 * 1024 * 1024) * 3)  # larger than the file
    cache = make_cache()
    sid = build(cache, "B")
    assert cache.save(sid, path) == os.path.getsize(path)
    assert held(path) == "B" and os.listdir(tmp_path) == [NAME]


def test_names_too_long_for_the_fixed_temporary_name_fall_back(tmp_path, monkeypatch):
    name = "n" * 250  # fits NAME_MAX (255); "." + name + ".pagedkv-tmp" does not
    try:
        (tmp_path / name).write_bytes(b"")
    except OSError:
        pytest.skip("the file system does not take 250-byte names")
    cache = make_cache()
    sid = build(cache, "A")
    assert cache.save(sid, tmp_path / name) == os.path.getsize(tmp_path / name)
    assert held(tmp_path / name) == "A" and os.listdir(tmp_path) == [name]
    monkeypatch.setattr(persist.os, "replace", _boom)
    with pytest.raises(OSError, match="injected"):
        cache.save(sid, tmp_path / name)
    assert os.listdir(tmp_path) == [name]


@pytest.mark.skipif(os.name == "nt", reason="directories are not synced on Windows")
def test_data_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    path = tmp_path / NAME
    cache = make_cache()
    sid = build(cache, "A")
    real_fsync, synced = os.fsync, []

    def fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), path.exists()))
        real_fsync(fd)

    monkeypatch.setattr(persist.os, "fsync", fsync)
    cache.save(sid, path)
    assert synced == [(False, False), (True, True)]  # the file before, the directory after

    def fsync_dir_fails(code):
        def fsync(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            real_fsync(fd)
        return fsync

    # a file system that cannot sync a directory: skipped
    monkeypatch.setattr(persist.os, "fsync", fsync_dir_fails(errno.EINVAL))
    cache.save(sid, path)
    # an I/O error is raised, though the new file is already in place
    path.unlink()
    monkeypatch.setattr(persist.os, "fsync", fsync_dir_fails(errno.EIO))
    with pytest.raises(OSError) as info:
        cache.save(sid, path)
    assert info.value.errno == errno.EIO
    assert held(path) == "A" and os.listdir(tmp_path) == [NAME]
