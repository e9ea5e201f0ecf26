"""Coverage-guided fuzzing of PagedKVCache with atheris (see tests/fuzz/program.py).

    pip install atheris
    tools/fuzz.sh CORPUS_DIR -runs=1000000        # the search (in-place build)
    tools/fuzz.sh --replay CORPUS_DIR             # what it kept, under ASan + UBSan

Coverage comes from the library's Python layer (pagedkv/*.py, instrumented by atheris; the Cython
core is built by GCC, which atheris cannot instrument) and from program.FEEDBACK: each call's
(previous call, call, outcome, shape of the sequence it named) counts as a branch of its own.  A failure is an exception outside the
documented ones, a raised call that changed the cache, broken block accounting, or (on replay) a
sanitizer report; save the crashing input under tests/fuzz/regressions/
(tests/reliability/test_fuzz_programs.py runs them all).
"""
import atexit
import os
import shlex
import shutil
import sys
import tempfile

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Only the library is instrumented: the program decoder and the checks are most of a run's time,
# and instrumenting them too cost about a third of the executions per second.  Within it, branch
# coverage only: atheris's comparison tracing (libFuzzer's hints for matching compared values in
# the input) cost about a tenth of the executions per second and has little to match, since the
# program decoder maps bytes to values by modulo and choice.  Not instrumented either: modules
# with no decisions worth steering towards (statistics arithmetic, RoPE tables, the version).
UNINSTRUMENTED = {"pagedkv.stats", "pagedkv.rope", "pagedkv._version"}
try:
    from atheris.import_hook import HookManager
    _hooks = HookManager({"pagedkv"}, UNINSTRUMENTED, True, trace_dataflow=False)
except (ImportError, TypeError):  # another atheris: its public hook (comparisons traced too)
    _hooks = atheris.instrument_imports(include=["pagedkv"], exclude=sorted(UNINSTRUMENTED))
with _hooks:
    import pagedkv  # noqa: F401
import program  # noqa: E402

#: extra coverage counters for program.FEEDBACK's features (hashed into this many)
FEATURES = 1 << 14
_COUNTERS = [atheris._reserve_counter() for _ in range(FEATURES)]


def _feedback(f, _counters=_COUNTERS):
    # looked up at each call: atheris.Setup replaces the module's functions with the ones
    # bound to libFuzzer (a reference taken before it reaches a stub)
    atheris._trace_branch(_counters[(f * 0x9E3779B1 >> 7) % FEATURES])


program.FEEDBACK = _feedback


def _argv():
    """sys.argv with argv[0] a program: libFuzzer's -fork and -jobs modes run argv[0] with the
    flags, so it becomes a shell script that starts this file under this interpreter."""
    if not any(a.startswith(("-fork=", "-jobs=", "-workers=")) for a in sys.argv[1:]):
        return sys.argv
    d = tempfile.mkdtemp(prefix="pagedkv-fuzz-cmd-")
    atexit.register(shutil.rmtree, d, True)
    cmd = os.path.join(d, "fuzz_cache")
    with open(cmd, "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} '
                f'{shlex.quote(os.path.abspath(__file__))} "$@"\n')
    os.chmod(cmd, 0o755)
    return [cmd] + sys.argv[1:]


def main():
    atheris.Setup(_argv(), program.run_program)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
