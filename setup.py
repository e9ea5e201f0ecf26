"""Build of the pagedkv extension.

Portable flags only: no -march=native and no -mavx2 (the SIMD paths are chosen
at run time, see include/pagedkv/simd.h).  OpenMP is used when the compiler
accepts it; without it the kernels run single-threaded.

Environment:
  PAGEDKV_DEBUG=1    -O0 -g and Cython bounds checks back on (release builds carry no
                     debug information and, on Linux, link stripped: a lean wheel)
  PAGEDKV_PROFILE=1  release optimization with debug information, not stripped (for perf)
  PAGEDKV_OPENMP=0   build without OpenMP
  PAGEDKV_SANITIZE=address,undefined
                     build with AddressSanitizer and/or UndefinedBehaviorSanitizer
                     (-O1 -g; see tools/sanitize.sh for running the tests under it)
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("PAGEDKV_DEBUG", "0") not in ("", "0")
PROFILE = os.environ.get("PAGEDKV_PROFILE", "0") not in ("", "0")


def _sanitizers():
    """The -fsanitize= flags asked for by PAGEDKV_SANITIZE (none when unset)."""
    names = [n.strip() for n in os.environ.get("PAGEDKV_SANITIZE", "").split(",") if n.strip()]
    unknown = sorted(set(names) - {"address", "undefined"})
    if unknown:
        raise SystemExit(f"PAGEDKV_SANITIZE: expected 'address' and/or 'undefined', got {unknown}")
    if not names:
        return []
    return ["-fsanitize=" + ",".join(names), "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-O1", "-g"]


SANITIZE = _sanitizers()


def _compiler_accepts(compiler, flags):
    """True when `compiler` compiles and links an OpenMP program with `flags`."""
    tmp = tempfile.mkdtemp()
    try:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n")
        cmd = list(compiler) + flags + [src, "-o", os.path.join(tmp, "t")] + flags
        return subprocess.run(cmd, capture_output=True).returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class BuildExt(build_ext):
    def build_extensions(self):
        unix = self.compiler.compiler_type == "unix"
        openmp = []
        if os.environ.get("PAGEDKV_OPENMP", "1") != "0":
            if unix and _compiler_accepts(self.compiler.compiler_so[:1], ["-fopenmp"]):
                openmp = ["-fopenmp"]
            elif self.compiler.compiler_type == "msvc":
                openmp = ["/openmp"]
        if not openmp:
            print("pagedkv: building without OpenMP (kernels run single-threaded)", file=sys.stderr)
        for ext in self.extensions:
            if unix:
                opt = ["-O0", "-g"] if DEBUG else ["-O3", "-g" if PROFILE else "-g0"]
                # -fno-wrapv undoes Python's own -fwrapv (signed overflow wraps), which
                # keeps the compiler from widening and strength-reducing the kernels'
                # int arithmetic.  Neither the C headers nor Cython's output rely on
                # wrapping (Cython's also builds with MSVC, which has no such flag), and
                # the sanitizer build (tools/sanitize.sh) checks signed overflow with it.
                ext.extra_compile_args = opt + ["-std=c11", "-fno-strict-aliasing", "-fno-wrapv",
                                                "-Wno-unused-function"] + openmp
                strip = (["-s"] if not (DEBUG or SANITIZE or PROFILE) and sys.platform.startswith("linux")
                         else [])
                ext.extra_link_args = list(openmp) + strip
                if SANITIZE:  # after the optimization flags, so its -O1 wins
                    ext.extra_compile_args += SANITIZE
                    ext.extra_link_args += SANITIZE[:1]
            else:
                ext.extra_compile_args = ["/O2"] + openmp
        super().build_extensions()


ext = Extension(
    "pagedkv._core",
    ["pagedkv/_core.pyx"],
    include_dirs=["include", np.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=sorted(glob.glob(os.path.join("include", "pagedkv", "*.h")))  # every C header
    + sorted(glob.glob(os.path.join("pagedkv", "_*.pxi"))) + [os.path.join("pagedkv", "_core.pxd")],
)

setup(
    ext_modules=cythonize(
        [ext],
        compiler_directives={
            "language_level": 3,
            "boundscheck": DEBUG,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
    cmdclass={"build_ext": BuildExt},
)
