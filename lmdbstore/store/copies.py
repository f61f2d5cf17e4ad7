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
from types import ModuleType

__all__ = ["COPIED", "DEST", "ENV_SWITCH", "FAST", "OTHER", "SOURCE", "UNPROTECTED", "compiled"]

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
