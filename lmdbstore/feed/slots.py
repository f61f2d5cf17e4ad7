"""Batch slots in shared memory, handed to the consumer without a copy and reused only when nothing references
them any more; how many fit (docs/design.md#the-feed).  numpy only.

One anonymous segment (a ``memfd``), reserved up front, holds ``n`` slots: samples then int64 labels, on 4 KiB
boundaries (TensorFlow wraps aligned memory without a copy).  Everything handed out views a slot's one base
array, so its reference count says whether anything still uses the slot, whatever framework.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from lmdbstore.util.memory import check_allocation, clip_count, reserve
from lmdbstore.util.workers import PassedFd

__all__ = ["ALIGN", "SHM_DIR", "SharedSlots", "pool_slots", "slot_bytes"]

#: Slots start on multiples of this many bytes.
ALIGN = 4096
#: Where shared segments go first (a tmpfs on Linux); the temporary directory when it is absent or full.
SHM_DIR = "/dev/shm"


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_bytes(rows: int, item_bytes: int) -> tuple[int, int]:
    """``(offset of the labels, bytes of a slot)`` for batches of up to ``rows`` samples of ``item_bytes``."""
    x = _round_up(max(1, rows * item_bytes))
    return x, x + _round_up(8 * max(1, rows))


def pool_slots(wanted: int, least: int, stride: int) -> int:
    """How many slots of ``stride`` bytes to make: ``wanted``, or fewer down to ``least`` where half the memory
    available cannot hold them (a warning naming ``prefetch``; :mod:`lmdbstore.util.memory`).

    Raises:
        ValueError: not even ``least`` fit, naming ``batch_size``.
    """
    check_allocation(
        least * stride, what=f"{least} batch slots (one per reader and the consumer's)", parameter="batch_size"
    )
    return clip_count(wanted, stride, what="batch slots", parameter="prefetch", minimum=least, stacklevel=4)


def _create_segment(size: int) -> int:
    """A new shared segment of ``size`` reserved bytes with no name anywhere: its descriptor.

    Raises:
        ValueError: no room for it (naming ``batch_size``).
    """
    fds = []
    with contextlib.suppress(AttributeError, OSError):
        fds.append(os.memfd_create("lmdbstore-slots"))
    if not fds:  # not Linux: a file removed at once
        for d in (SHM_DIR, tempfile.gettempdir()):
            with contextlib.suppress(OSError):
                fd, path = tempfile.mkstemp(prefix="lmdbstore-slots-", dir=d)
                os.unlink(path)
                fds.append(fd)
    for other in fds[1:]:
        os.close(other)
    try:
        reserve(fds[0], size, what="the batch slots", parameter="batch_size")
    except BaseException:
        os.close(fds[0])
        raise
    return fds[0]


class SharedSlots:
    """``n`` batch slots of ``rows`` samples of ``item_bytes`` each (see the module docstring), in a shared
    segment for reader processes (``shared=False``: private memory), or in ``segment`` (a reader's
    :class:`~lmdbstore.util.workers.PassedFd`) instead of a new one.

    Raises:
        OSError: no room for the segment.
    """

    def __init__(self, n: int, rows: int, item_bytes: int, *, shared: bool = True, segment: PassedFd | None = None):
        self.n, self.rows = n, rows
        self.y_offset, self.stride = slot_bytes(rows, item_bytes)
        size = self.stride * n
        self.fd: int | None = None  # the segment, kept open for readers started later (the creator only)
        if segment is not None:
            self._map = mmap.mmap(segment.fd, size)
            os.close(segment.fd)
        elif shared:
            self.fd = _create_segment(size)
            self._map = mmap.mmap(self.fd, size)
        else:
            self._map = mmap.mmap(-1, size)
        buf = memoryview(self._map)
        # one base array per slot: every array handed out is a view of it (its reference count tells)
        self.bases = [np.frombuffer(buf[k * self.stride : (k + 1) * self.stride], np.uint8) for k in range(n)]
        self._refs = [sys.getrefcount(self.bases[k]) for k in range(len(self.bases))]  # the list and the call only
        self._closed = False

    def x(self, slot: int, rows: int, item_shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """The samples of ``slot`` as a ``(rows, *item_shape)`` array of ``dtype`` (a view, no copy)."""
        nbytes = rows * int(np.prod(item_shape, dtype=np.int64)) * dtype.itemsize
        return self.bases[slot][:nbytes].view(dtype).reshape(rows, *item_shape)

    def y(self, slot: int, rows: int) -> np.ndarray:
        """The labels of ``slot`` as an int64 array of ``rows`` (a view, no copy)."""
        return self.bases[slot][self.y_offset : self.y_offset + 8 * rows].view(np.int64)

    def unreferenced(self, slot: int) -> bool:
        """Whether nothing outside this object references ``slot``'s memory any more."""
        return sys.getrefcount(self.bases[slot]) <= self._refs[slot]

    @property
    def segment(self) -> PassedFd:
        """What a reader process maps these slots by."""
        assert self.fd is not None, "private slots have no segment"
        return PassedFd(self.fd)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def address(self) -> int:
        """Where the slots' memory starts in this process."""
        return int(self.bases[0].ctypes.data)

    @property
    def nbytes(self) -> int:
        """Bytes of all the slots."""
        return self.stride * self.n

    def close(self, before_unmap: Callable[[], None] | None = None) -> None:
        """Let go of the memory (it stays mapped while a consumer holds arrays of it); ``before_unmap`` is
        called first (what page-locked it undoes it)."""
        if self._closed:
            return
        if before_unmap is not None:
            before_unmap()
        self._closed = True
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.bases = []
        with contextlib.suppress(BufferError):  # still exported to arrays the consumer holds: unmapped with them
            self._map.close()
