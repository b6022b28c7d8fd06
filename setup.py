"""Build of the Cython extensions; the metadata lives in pyproject.toml."""
import sys

from setuptools import Extension, setup

if not sys.platform.startswith("linux"):
    raise RuntimeError(
        "unienv_mp needs Linux (memfd_create, futex); this platform is " + sys.platform)

from Cython.Build import cythonize  # noqa: E402
import numpy  # noqa: E402

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"]

extensions = [
    Extension(
        "unienv_mp._transport.ring",
        sources=["unienv_mp/_transport/ring.pyx", "csrc/umr_ring.c", "csrc/umr_shm.c"],
        include_dirs=["csrc"],
        extra_compile_args=CFLAGS,
    ),
    Extension(
        "unienv_mp._transport.codec",
        sources=["unienv_mp/_transport/codec.pyx", "csrc/umr_rows.c"],
        include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=CFLAGS,
    ),
    Extension(
        "unienv_mp._direct.rows",
        sources=["unienv_mp/_direct/rows.pyx", "csrc/umr_rows.c", "csrc/umr_window.c",
                 "csrc/umr_pread.c"],
        include_dirs=["csrc"],
        extra_compile_args=CFLAGS,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3"},
    ),
)
