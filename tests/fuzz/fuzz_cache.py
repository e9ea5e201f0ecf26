"""Coverage-guided fuzzing of PagedKVCache with atheris (see tests/fuzz/program.py).

    pip install atheris
    tools/fuzz.sh CORPUS_DIR -runs=1000000        # the search (in-place build)
    tools/fuzz.sh --replay CORPUS_DIR             # what it kept, under ASan + UBSan

Coverage comes from the Python layer (pagedkv/*.py and the program decoder, instrumented by
atheris).  A failure is an exception outside the documented ones, a raised call that changed the
cache, broken block accounting, or (on replay) a sanitizer report; save the crashing input under
tests/fuzz/regressions/ (tests/test_fuzz_programs.py runs them all).
"""
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["pagedkv", "program", "reference"]):
    import program


def main():
    atheris.Setup(sys.argv, program.run_program)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
