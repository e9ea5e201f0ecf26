#!/usr/bin/env bash
# Coverage-guided fuzzing (atheris) of the sanitizer build: tests/fuzz/fuzz_cache.py.
#
#   tools/fuzz.sh -runs=1000000 [-max_total_time=SECONDS] [CORPUS_DIR]
#
# Builds the ASan + UBSan venv first unless REUSE=1 finds one (see tools/sanitize.sh) and
# installs atheris into it.  Crashing inputs are written to $PAGEDKV_FUZZ_ARTIFACTS (default
# /tmp/pagedkv-fuzz-artifacts/); copy them to tests/fuzz/regressions/ once fixed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PAGEDKV_SANITIZE_VENV:-/tmp/pagedkv-sanitize-venv}"
if [[ "${REUSE:-0}" != 1 || ! -x "$VENV/bin/pytest" ]]; then
    "$ROOT/tools/sanitize.sh" --run true
fi
"$VENV/bin/python" -c "import atheris" 2>/dev/null || "$VENV/bin/python" -m pip install --quiet atheris
ART="${PAGEDKV_FUZZ_ARTIFACTS:-/tmp/pagedkv-fuzz-artifacts}"
mkdir -p "$ART"
REUSE=1 exec "$ROOT/tools/sanitize.sh" --run "$VENV/bin/python" "$ROOT/tests/fuzz/fuzz_cache.py" \
    -artifact_prefix="$ART/" -print_final_stats=1 "$@"
