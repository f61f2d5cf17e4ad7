"""glibc's allocator in producer processes that inherited ``MALLOC_TRIM_THRESHOLD_``.

Dask's Nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also pins glibc's mmap threshold
at 128 KiB: every large numpy temporary of a producer is mapped afresh and faulted in on every use (a quarter
more CPU time or worse).  :func:`keep_large_blocks` sets, once per process and only where the variable is set,
the thresholds glibc's dynamic rule would grow to: blocks up to 32 MiB from the heap, up to 64 MiB kept at its
top.  ``LMDBSTORE_KEEP_MALLOC=0`` leaves the allocator as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_large_blocks"]

#: mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's dynamic threshold stops at 32 MiB on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Freed memory at the top of the heap kept for reuse (glibc's dynamic rule: twice the mmap threshold).
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: The environment variable that pins the thresholds (Dask sets it in its workers).
PINNING_VARIABLE = "MALLOC_TRIM_THRESHOLD_"
#: Set to ``0`` to leave the allocator alone.
OPT_OUT_VARIABLE = "LMDBSTORE_KEEP_MALLOC"


@functools.cache
def keep_large_blocks() -> bool:
    """In a process whose environment pins glibc's thresholds (``MALLOC_TRIM_THRESHOLD_`` set), let large
    blocks come from the heap and be reused (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`); once per process.

    Returns whether the thresholds were set: ``False`` without the variable, with ``LMDBSTORE_KEEP_MALLOC=0``,
    or where the C library has no ``mallopt`` (not glibc).  Never raises.
    """
    if PINNING_VARIABLE not in os.environ or os.environ.get(OPT_OUT_VARIABLE) == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
