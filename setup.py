"""The one compiled part of lmdbstore, optional: ``lmdbstore.store.batchread`` reads a batch in C (the GIL released,
reads in flight on threads of its own, SIGBUS caught: ``lmdbstore/store/batchread.c``).  Where it does not build
(no C compiler), the install goes on without it and lmdbstore reads with ``os.preadv`` instead, slower
(:mod:`lmdbstore.store.fileread`).  Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmdbstore.store.batchread",
            sources=["lmdbstore/store/batchread.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
