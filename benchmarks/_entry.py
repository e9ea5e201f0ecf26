"""The one entry of the scripts in this folder: `pagedkv bench` with a preset first part of
its command line (see benchmarks/README.md).  From a source checkout built in place, run
without installing, the checkout is put on the import path first."""
import os
import sys


def importable() -> None:
    """Make `import pagedkv` work from a checkout that is not installed."""
    try:
        import pagedkv  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench(*preset: str) -> int:
    """`pagedkv bench PRESET... ARGS...`, ARGS being this script's own arguments."""
    importable()
    from pagedkv.cli import main  # noqa: PLC0415

    return main(["bench", *preset, *sys.argv[1:]])
