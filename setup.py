"""The one compiled part of lmdbstore, optional: ``lmdbstore.store.fastcopy`` copies out of the file map in C (the
GIL released, SIGBUS caught).  Where it does not build (no C compiler), the install goes on without it and
lmdbstore copies with numpy or ``process_vm_readv`` instead (:mod:`lmdbstore.store.copies`).  Everything else is
in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmdbstore.store.fastcopy",
            sources=["lmdbstore/store/fastcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
