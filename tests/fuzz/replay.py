"""Run saved fuzz inputs (files or directories of files) through tests/fuzz/program.py.

    python tests/fuzz/replay.py CORPUS_DIR...     (tools/fuzz.sh --replay: under the sanitizers)

Exits non-zero on the first failing input and names it."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import program  # noqa: E402


def main(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p))
        else:
            files.append(p)
    t0 = time.perf_counter()
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        try:
            program.run_program(data)
        except Exception:
            print(f"replay: {path} failed", file=sys.stderr)
            raise
    ok = sum(n for (_, outcome), n in program.OUTCOMES.items() if outcome == "ok")
    print(f"replay: {len(files)} inputs, {sum(program.OUTCOMES.values())} calls ({ok} succeeded), "
          f"no failure, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
