"""Declares the Cython extensions; everything else lives in pyproject.toml.

Every ``native/<dotted/path>.pyx`` becomes the extension ``<dotted.path>``: the folder path
spells the module name, so that Cython finds the matching ``.pxd`` next to it.
"""

import os
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
NATIVE = HERE / "native"
INCLUDES = NATIVE / "fastelastic" / "_native" / "includes"  # C/C++ headers: rebuild on change
DEBUG = os.environ.get("FASTELASTIC_DEBUG") == "1"
# Line tracing (coverage of .pyx) is opt-in on top of the debug build. With Cython 3.3 on
# Python < 3.12 a traced nogil function takes the GIL when it returns (its frame is freed:
# __Pyx_PyMonitoring_ExitScope; CYTHON_TRACE forces CYTHON_PROFILE_REUSE_FRAME off), so the
# store's nogil loop would wait for any thread holding the GIL while it waits for the store's
# reply (torch's TCPStore.list_keys does): the build would deadlock where the release cannot.
LINETRACE = DEBUG and os.environ.get("FASTELASTIC_LINETRACE") == "1"


def _extensions():
    exts = []
    for pyx in sorted(NATIVE.rglob("*.pyx")):
        rel = pyx.relative_to(NATIVE).with_suffix("")
        name = ".".join(rel.parts)
        exts.append(
            Extension(
                name,
                [str(pyx.relative_to(HERE))],
                include_dirs=[str(INCLUDES.relative_to(HERE))],
                depends=[str(h.relative_to(HERE)) for h in sorted(INCLUDES.glob("*.h"))],
                extra_compile_args=["-O2", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
                # -UNDEBUG: C assert() checks too (Python's CFLAGS carry -DNDEBUG)
                + (["-DFE_DEBUG=1", "-O0", "-g", "-UNDEBUG"] if DEBUG else []),
                define_macros=[("CYTHON_TRACE_NOGIL", "1")] if LINETRACE else [],
            )
        )
    return exts


setup(
    ext_modules=cythonize(
        _extensions(),
        include_path=[str(NATIVE)],
        compiler_directives={
            "language_level": "3",
            "embedsignature": True,
            "linetrace": LINETRACE,
            # the defaults, stated: only reviewed loops turn them off, by decorator
            "boundscheck": True,
            "initializedcheck": True,
        },
        annotate=DEBUG,
        # build_ext --force regenerates the C++ too: it is how a debug and a release build
        # replace each other, and their directives differ (Cython only compares timestamps)
        force="--force" in sys.argv,
        nthreads=0,
    ),
)
