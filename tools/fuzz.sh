#!/usr/bin/env bash
# Fuzzing of PagedKVCache (tests/fuzz/): coverage-guided search, then replay under the sanitizers.
#
#   tools/fuzz.sh [CORPUS_DIR] [-runs=N] [-max_total_time=S] ...   # atheris, coverage-guided
#   tools/fuzz.sh --replay CORPUS_DIR...                            # every input, ASan + UBSan
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
ART="${PAGEDKV_FUZZ_ARTIFACTS:-/tmp/pagedkv-fuzz-artifacts}"
mkdir -p "$ART"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" \
    "$ROOT/tests/fuzz/fuzz_cache.py" -artifact_prefix="$ART/" -print_final_stats=1 "$@"
