"""How deep the bounded tests run: ``PAGEDKV_TEST_PROFILE=ci`` (the default) or ``long``.

``long`` gives the state machines, the soak and the random fuzz programs many more steps (minutes
each instead of seconds) and fresh random programs each run.  ``PAGEDKV_STATE_MACHINE=long`` (the
earlier name, state machines only) is still read.  Not ``PAGEDKV_PROFILE``: that one picks the
build's symbols.
"""
import os

PROFILE = (os.environ.get("PAGEDKV_TEST_PROFILE") or os.environ.get("PAGEDKV_STATE_MACHINE")
           or "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"PAGEDKV_TEST_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
LONG = PROFILE == "long"


def depth(ci, long):
    """`ci` under the default profile, `long` under PAGEDKV_TEST_PROFILE=long."""
    return long if LONG else ci
