"""The compiled copier of the offset read path, where it was built: :data:`FAST` (private to the store package).

``lmdbstore.store.fastcopy`` (``lmdbstore/store/fastcopy.c``, built by ``pip install`` when a C compiler is
there; the install goes on without it otherwise) copies a batch's runs of bytes out of the read-only map of
``data.mdb`` in one call: every run checked against the map's size and the destination first, the GIL released,
the first and last cache lines of a run a few runs ahead prefetched (a random gather waits on memory more than it
copies), and SIGBUS caught (a page past the end of a file another process shrank ends the copy with ``False``
instead of killing the process).  It writes straight into the output: no temporary, whatever the order.

Without it the engine copies as before (:mod:`lmdbstore.store.preads`): numpy gathers and slice copies under the
file's read lease, ``process_vm_readv`` where no lease can be had.  ``LMDBSTORE_FASTCOPY=0`` in the environment
(read once, at import) makes a process use that fallback even where the compiled copier exists: the benchmarks
and tests compare the two that way.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import numpy as np

from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.store.mapguard import truncated, vm_readable

__all__ = [
    "COPIED",
    "DEST",
    "ENV_SWITCH",
    "FAST",
    "OTHER",
    "SOURCE",
    "UNPROTECTED",
    "compiled",
    "copy_failed",
    "destination_fault",
    "fast_copy",
]

#: The environment variable that turns the compiled copier off (``0``) in a process.
ENV_SWITCH = "LMDBSTORE_FASTCOPY"
#: What ``FAST.copy`` answers: every byte copied; a SIGBUS on a page of the source map, of the destination, of
#: neither; nothing copied (another SIGBUS handler was installed over the copier's during a copy): the numbers of
#: ``fastcopy.c``.
COPIED, SOURCE, DEST, OTHER, UNPROTECTED = 0, 1, 2, 3, 4


def _load() -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    try:
        from lmdbstore.store import fastcopy  # type: ignore[attr-defined]
    except ImportError:
        return None
    if not hasattr(fastcopy, "UNPROTECTED"):  # an older build (a bool answer): not used
        return None
    return fastcopy  # type: ignore[no-any-return]


#: ``lmdbstore.store.fastcopy`` where it was built and is not turned off, else ``None`` (see the module docstring).
FAST: ModuleType | None = _load()


def compiled() -> bool:
    """Whether this process copies with the compiled copier."""
    return FAST is not None


def destination_fault() -> LmdbStoreError:
    """The one-line error for a copy whose *destination* could not be written (a bus error on its pages: an
    ``out=`` that maps a file which was truncated, a shared-memory segment on a full tmpfs): the store is fine."""
    return LmdbStoreError(
        "the batch's destination memory could not be written (a bus error on out=: it maps a file that was "
        "truncated, or a tmpfs or /dev/shm that is full); the store was not the cause",
        hint="read into ordinary memory, or make room where the destination lives",
    )


def copy_failed(fd: int, file_size: int, path: str | Path | None, dst: np.ndarray | None = None) -> LmdbStoreError:
    """The error for a copy out of the map of the data file ``fd`` that stopped short (the kernel's, or the compiled
    copier's SIGBUS on the map): the file shrank below ``file_size``, or its pages could not be read -- unless it was
    the destination ``dst`` that could not be written (probed: :func:`destination_fault`)."""
    if dst is not None and not vm_readable(dst.ctypes.data, dst.nbytes):
        return destination_fault()
    size = os.fstat(fd).st_size
    if size < file_size:
        return truncated(size, file_size, path)
    return CorruptStoreError("the data file's pages could not be copied", path=path, hint="check the disk")


def fast_copy(
    fast: ModuleType,
    dst: np.ndarray,
    at: np.ndarray,
    base: int,
    offs: np.ndarray,
    lens: np.ndarray | int,
    fd: int,
    file_size: int,
    path: str | Path | None,
) -> bool:
    """``fast.copy`` of the runs ``offs``/``lens`` of the map at ``base`` (the data file ``fd``'s, ``file_size``
    bytes) to ``dst[at:]``; ``False``: nothing copied (another SIGBUS handler was installed over the copier's during
    a copy: copy without it).

    Raises:
        LmdbStoreError: the copy met a page that could not be touched, told by its address: the data file's
            (CorruptStoreError, as :func:`copy_failed`) or the destination's (:func:`destination_fault`).
    """
    status = fast.copy(dst, at, base, file_size, offs, lens)
    if status == COPIED:
        return True
    if status == UNPROTECTED:
        return False
    if status == DEST:
        raise destination_fault()
    raise copy_failed(fd, file_size, path, None if status == SOURCE else dst)
