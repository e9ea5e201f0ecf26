"""Coverage-guided fuzzing of PagedKVCache with atheris (see tests/fuzz/program.py).

    pip install atheris
    tools/fuzz.sh [-runs=N] [-max_total_time=S] [corpus_dir]   # against the sanitizer build

Coverage comes from the Python layer (pagedkv/*.py and the program decoder, instrumented by
atheris); the compiled core runs under ASan + UBSan when started by tools/fuzz.sh.  A failure is
an exception outside the documented ones, a raised call that changed the cache, broken block
accounting, or a sanitizer report; save the crashing input under tests/fuzz/regressions/.
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
