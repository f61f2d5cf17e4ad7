"""Batch slots in shared memory for the reader processes of a feed, handed to the consumer without a copy
and reused only when nothing references them any more.  numpy only, no torch.

One memory-mapped segment holds ``n`` slots; a slot holds one batch: the samples (``x``), then the labels
(``y``, int64).  Slots start on 4 KiB boundaries (TensorFlow makes tensors of 64-byte-aligned numpy memory
without copying it).  The segment is a file in ``/dev/shm`` (else the temporary directory), its space
reserved with ``posix_fallocate`` so that a full ``/dev/shm`` is an error here rather than a ``SIGBUS``
in a reader later; the file's name is removed as soon as the readers have mapped it
(:meth:`SharedSlots.unlink`), so nothing is left behind even if the process is killed.  Without reader
processes the slots are private memory.

Knowing when a slot is free again: each slot has one base array here (``uint8``, the slot's bytes), and
the consumer gets views of it.  numpy collapses every view of a view onto that base array (it stops at the
first base that is not an ndarray, and the base's base is a memoryview), ``torch.from_numpy`` tensors and
zero-copy TensorFlow tensors hold the array they were made from, so the base array's reference count says
whether anything still uses the slot (:meth:`SharedSlots.unreferenced`), whichever framework consumes it.
(A memoryview's own reference count would not: ``np.frombuffer`` references the buffer behind it, not the
memoryview object.)  A consumer that copies lets the slot go at once.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
from typing import Any

import numpy as np

__all__ = ["ALIGN", "SHM_DIR", "SharedSlots", "slot_bytes"]

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


def _create_file(size: int) -> tuple[str, int]:
    """A new file of ``size`` reserved bytes in :data:`SHM_DIR` (else the temporary directory): its path and
    an open descriptor.

    Raises:
        OSError: no room for it in either place.
    """
    dirs = [d for d in (SHM_DIR, tempfile.gettempdir()) if os.path.isdir(d)]
    error: OSError | None = None
    for d in dirs:
        fd, path = tempfile.mkstemp(prefix="lmdbstore-slots-", dir=d)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - not Linux
                os.ftruncate(fd, size)
            return path, fd
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            error = exc
    raise OSError(f"no room for {size / 2**20:.0f} MiB of batch slots in {' or '.join(dirs)}: {error}")


class SharedSlots:
    """``n`` batch slots of ``rows`` samples of ``item_bytes`` each (see the module docstring).

    Args:
        n, rows, item_bytes: slots, samples per slot, bytes per sample.
        shared: in a shared segment, for reader processes (default ``True``); ``False``: private memory.
        name: map the existing segment of this name (a reader process) instead of creating one.

    Raises:
        OSError: no room for the segment.
    """

    def __init__(self, n: int, rows: int, item_bytes: int, *, shared: bool = True, name: str | None = None):
        self.n, self.rows = n, rows
        self.y_offset, self.stride = slot_bytes(rows, item_bytes)
        size = self.stride * n
        self.name: str | None = None
        if name is None and not shared:
            self._map = mmap.mmap(-1, size)
        else:
            if name is None:
                self.name, fd = _create_file(size)
            else:
                fd = os.open(name, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        buf = memoryview(self._map)
        # one base array per slot: every array handed out is a view of it (its reference count tells)
        self.bases = [np.frombuffer(buf[k * self.stride : (k + 1) * self.stride], np.uint8) for k in range(n)]
        self._refs = [sys.getrefcount(b) for b in self.bases]

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

    def unlink(self) -> None:
        """Remove the shared segment's name (the memory stays while mapped); once every reader has mapped it."""
        if self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name)

    def close(self) -> None:
        """Remove the name and let go of the memory (it stays mapped while a consumer holds arrays of it)."""
        self.unlink()
        self.bases = []
        with contextlib.suppress(BufferError):  # still exported to arrays the consumer holds: unmapped with them
            self._map.close()
