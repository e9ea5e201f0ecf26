#!/usr/bin/env bash
# Fuzzing of PagedKVCache (tests/fuzz/): coverage-guided search, then replay under the sanitizers.
#
#   tools/fuzz.sh [CORPUS_DIR] [-runs=N] [-max_total_time=S] ...   # atheris, coverage-guided
#   tools/fuzz.sh --replay CORPUS_DIR...                            # every input, ASan + UBSan
#
# All cores: one long-lived fuzzer per core sharing the corpus directory (each writes its log to
# fuzz-<n>.log in the current directory; -runs counts per worker):
#   tools/fuzz.sh CORPUS_DIR -jobs=$(nproc) -workers=$(nproc) -max_total_time=3600
# or libFuzzer's fork mode (short-lived children, merged corpus): -fork=$(nproc).  Before a long
# run, seed the corpus with the saved regressions: cp tests/fuzz/regressions/* CORPUS_DIR/.
# Inputs are capped at 1,024 bytes (a program runs at most MAX_OPS = 16 calls, which rarely need
# more); pass -max_len=N to change it.  OMP_NUM_THREADS defaults to 1 (tiny pools).
#
# Why two steps: atheris's coverage feedback and GCC's AddressSanitizer runtime cannot share a
# process (atheris ships its ASan runtime for Clang builds; with GCC's preloaded the coverage
# counters never register and the fuzzer degrades to random inputs).  So the search runs over
# the ordinary in-place build (python setup.py build_ext --inplace; PYTHON picks the interpreter,
# with atheris installed) and every input it keeps, plus each crash, is replayed against the
# sanitizer build (tools/sanitize.sh's venv, built when missing).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ "${1:-}" == --replay ]]; then
    shift
    VENV="${PAGEDKV_SANITIZE_VENV:-/tmp/pagedkv-sanitize-venv}"
    if [[ ! -x "$VENV/bin/pytest" ]]; then "$ROOT/tools/sanitize.sh" --run true; fi
    # sanitize.sh runs the command from a scratch directory: pass the inputs as absolute paths
    paths=()
    for p in "$@"; do paths+=("$(realpath "$p")"); done
    REUSE=1 exec "$ROOT/tools/sanitize.sh" --run "$VENV/bin/python" "$ROOT/tests/fuzz/replay.py" \
        "${paths[@]}"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ART="${PAGEDKV_FUZZ_ARTIFACTS:-/tmp/pagedkv-fuzz-artifacts}"
mkdir -p "$ART"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" \
    "$ROOT/tests/fuzz/fuzz_cache.py" -artifact_prefix="$ART/" -print_final_stats=1 -max_len=1024 \
    "$@"
