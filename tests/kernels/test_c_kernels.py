"""The C kernels on their own: tests/c/test_kernels.c, built with the system C compiler and run
on every SIMD path this CPU has (tests/c/run.sh --native-only; the aarch64 half of run.sh, under
qemu, runs from .ci/run).  It checks writes against the pool layout byte for byte, the vector exp,
decode and causal prefill with and without RoPE against a plain C reference over random shapes."""

import os
import shutil
import subprocess

import pytest

RUN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "c", "run.sh")
CC = os.environ.get("CC", "cc")


@pytest.mark.skipif(shutil.which(CC) is None or shutil.which("bash") is None,
                    reason=f"no C compiler ({CC}) or no bash to build tests/c/test_kernels.c")
def test_c_kernels_natively_on_every_path():
    # three builds of the test program and their runs: about 4 minutes on an idle 2-core VM;
    # the limit only guards against a hang (a busy machine took over 5)
    proc = subprocess.run(["bash", RUN, "--native-only", "--trials", "30"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "ALL OK" in proc.stdout
    assert "scalar" in proc.stdout
