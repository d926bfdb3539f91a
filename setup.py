"""Build script for the one compiled part: the fs tier's GIL-free per-batch
file calls (``kvstore_tiers/backends/fs/_fsio.c``: read_files, exists_files,
publish_file, publish_files).

Everything else is declared in pyproject.toml. The extension is optional: where
it cannot be compiled (no C compiler, a platform without ``readv``) the
install still succeeds and the fs tier uses the pure-Python twins in
``kvstore_tiers/backends/fs/fileio.py``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore_tiers.backends.fs._fsio",
            sources=["kvstore_tiers/backends/fs/_fsio.c"],
            optional=True,
        )
    ]
)
