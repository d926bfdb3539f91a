"""Build script for the two compiled parts: the fs tier's GIL-free per-batch
file calls (``kvstore_tiers/backends/fs/_fsio.c``: read_files, exists_files,
publish_file, publish_files) and the admission sketch's per-key counter
updates (``kvstore_tiers/_sketch.c``: offer, increment, estimate).

Everything else is declared in pyproject.toml. The extensions are optional:
where they cannot be compiled (no C compiler, a platform without ``readv``)
the install still succeeds and the pure-Python twins are used
(``kvstore_tiers/backends/fs/fileio.py``, ``kvstore_tiers/admission.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore_tiers.backends.fs._fsio",
            sources=["kvstore_tiers/backends/fs/_fsio.c"],
            # read_files starts helper threads (libc has them from glibc 2.34).
            extra_compile_args=["-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "kvstore_tiers._sketch",
            sources=["kvstore_tiers/_sketch.c"],
            optional=True,
        ),
    ]
)
