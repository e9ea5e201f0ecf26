#!/usr/bin/env bash
# Build pagedkv with AddressSanitizer + UndefinedBehaviorSanitizer in its own venv and run the
# whole test suite under it.  Any sanitizer report aborts the run (exit status != 0).
#
#   tools/sanitize.sh                 # the whole suite
#   tools/sanitize.sh tests/test_x.py # or what pytest is given
#   tools/sanitize.sh --run CMD ARGS  # or any command, in the same environment (tools/fuzz.sh)
#
# Environment: PAGEDKV_SANITIZE_VENV (default /tmp/pagedkv-sanitize-venv), REUSE=1 to keep an
# existing venv and build.  Linux + GCC or Clang.  Python itself is not instrumented, so the ASan
# runtime is preloaded; leak detection is off (the interpreter keeps memory until exit).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PAGEDKV_SANITIZE_VENV:-/tmp/pagedkv-sanitize-venv}"
CC="${CC:-gcc}"
if [[ "${REUSE:-0}" != 1 || ! -x "$VENV/bin/pytest" ]]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # build from a clean copy: an in-tree build/ or in-place .so would be reused as up to date
    SRC="$(mktemp -d)"
    tar -C "$ROOT" --exclude=./build --exclude=./.git --exclude='*.so' --exclude='*.egg-info' \
        -cf - . | tar -C "$SRC" -xf -
    PAGEDKV_SANITIZE=address,undefined CC="$CC" \
        "$VENV/bin/python" -m pip install --quiet --no-cache-dir "$SRC[test]"
    rm -rf "$SRC"
fi
# Run from outside the source tree so `import pagedkv` is the sanitized install.
cd "$(mktemp -d)"
ASAN_LIB="$("$CC" -print-file-name=libasan.so)"
[[ -f "$ASAN_LIB" ]] || { echo "sanitize.sh: no libasan.so for $CC" >&2; exit 2; }
SO="$(ls "$VENV"/lib/python3*/site-packages/pagedkv/_core*.so)"
if [[ "$(ldd "$SO")" != *libasan* ]]; then
    echo "sanitize.sh: $SO is not an ASan build" >&2; exit 2
fi
export LD_PRELOAD="$ASAN_LIB"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:check_initialization_order=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export PATH="$VENV/bin:$PATH"
if [[ "${1:-}" == --run ]]; then shift; exec "$@"; fi
if [[ $# -eq 0 ]]; then set -- "$ROOT/tests"; fi
exec "$VENV/bin/pytest" -q -p no:cacheprovider "$@"
