"""Declares the Cython extensions; everything else lives in pyproject.toml.

Every ``native/<dotted/path>.pyx`` becomes the extension ``<dotted.path>``: the folder path
spells the module name, so that Cython finds the matching ``.pxd`` next to it.
"""

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
NATIVE = HERE / "native"
INCLUDES = NATIVE / "fastelastic" / "_native" / "includes"  # C/C++ headers: rebuild on change
DEBUG = os.environ.get("FASTELASTIC_DEBUG") == "1"


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
                + (["-DFE_DEBUG=1", "-O0", "-g"] if DEBUG else []),
                define_macros=[("CYTHON_TRACE_NOGIL", "1")] if DEBUG else [],
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
            "linetrace": DEBUG,
        },
        annotate=DEBUG,
        nthreads=0,
    ),
)
