"""Batch slots in shared memory for the reader processes of a feed, handed to the consumer without a copy
and reused only when nothing references them any more; how many fit.  numpy only, no torch.

One memory-mapped segment holds ``n`` slots; a slot holds one batch: the samples (``x``), then the labels
(``y``, int64).  Slots start on 4 KiB boundaries (TensorFlow makes tensors of 64-byte-aligned numpy memory
without copying it).  Nothing of it can be left behind, whatever kills the processes: on Linux the segment
is an anonymous ``memfd`` (no name anywhere; the readers get its descriptor, by inheritance or passed by
``multiprocessing``), freed by the kernel when the last process mapping it ends.  Elsewhere it is a file in
:data:`SHM_DIR` (else the temporary directory) named with the owner's pid and start time, removed once the
readers have mapped it (:meth:`SharedSlots.unlink`); one whose owner is gone (killed before that) is
removed by the next process that makes a segment (:func:`reclaim`).  The space is reserved with
``posix_fallocate``, so that no room is an error here rather than a ``SIGBUS`` in a reader later.  Without
reader processes the slots are private memory.

Knowing when a slot is free again: each slot has one base array here (``uint8``, the slot's bytes), and
the consumer gets views of it.  numpy collapses every view of a view onto that base array (it stops at the
first base that is not an ndarray, and the base's base is a memoryview), ``torch.from_numpy`` tensors and
zero-copy TensorFlow tensors hold the array they were made from, so the base array's reference count says
whether anything still uses the slot (:meth:`SharedSlots.unreferenced`), whichever framework consumes it.
(A memoryview's own reference count would not: ``np.frombuffer`` references the buffer behind it, not the
memoryview object.)  A consumer that copies lets the slot go at once.

How many: a slot holds the largest batch the sampler can yield (never more rows than the store or set has,
unless the sampler draws with replacement), and the pool is checked against what the machine can give before
anything is touched (:func:`pool_slots`: the memory available, :func:`available_bytes`): fewer slots than
asked for, said once, or a one-line ``ValueError`` naming ``batch_size``, ``workers`` and ``prefetch`` when not
even one batch per reader fits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.util.lifeline import process_alive, process_start_time

__all__ = [
    "ALIGN",
    "PREFIX",
    "SHM_DIR",
    "SLOT_MEMORY_SHARE",
    "SegmentFd",
    "SharedSlots",
    "available_bytes",
    "pool_slots",
    "reclaim",
    "slot_bytes",
]

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


#: Share of the memory the machine has available that one feed's slots may take.
SLOT_MEMORY_SHARE = 0.5


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) still allows, where it sets a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    return None if limit == "max" else max(0, int(limit) - int(used))


def available_bytes() -> int | None:
    """Memory this process can still get: the kernel's ``MemAvailable``, less where its cgroup allows less
    (``None`` where neither is known)."""
    known = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    return min(known) if known else None


def pool_slots(wanted: int, least: int, stride: int, *, workers: int, rows: int) -> int:
    """How many slots of ``stride`` bytes to make: ``wanted``, or fewer down to ``least`` where
    :data:`SLOT_MEMORY_SHARE` of the available memory cannot hold them (said in a warning).

    Raises:
        ValueError: not even ``least`` fit, naming ``batch_size``, ``workers`` and ``prefetch``.
    """
    room = available_bytes()
    if room is None or wanted * stride <= SLOT_MEMORY_SHARE * room:
        return wanted
    fit = int(SLOT_MEMORY_SHARE * room // stride)
    if fit < least:
        raise ValueError(
            f"the batch slots need {least * stride / 2**30:.1f} GiB at least ({least} slots of {rows} samples: "
            f"workers={workers} readers with one batch each and the consumer's), more than half of the "
            f"{room / 2**30:.1f} GiB this machine has available: lower batch_size or workers"
        )
    warnings.warn(
        f"lmdbstore: {fit} batch slots of {stride / 2**20:.1f} MiB instead of {wanted} fit in memory "
        f"({room / 2**30:.1f} GiB available): fewer batches read ahead (lower batch_size or prefetch to silence)",
        RuntimeWarning,
        stacklevel=4,
    )
    return fit


#: Name prefix of the named segments (platforms without ``memfd_create``).
PREFIX = "lmdbstore-slots-"


def _reserve(fd: int, size: int) -> None:
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # pragma: no cover - not Linux
        os.ftruncate(fd, size)


def reclaim(directory: str) -> int:
    """Remove the named segments in ``directory`` whose owner process is gone; how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            parts = name[len(PREFIX) :].split("-") if name.startswith(PREFIX) else []
            if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
                continue
            if process_alive(int(parts[0]), int(parts[1]) or None):
                continue  # its owner still runs
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed


def _create_named(size: int) -> tuple[str, int]:
    """A new named segment of ``size`` reserved bytes in :data:`SHM_DIR` (else the temporary directory),
    named with this process's pid and start time: its path and an open descriptor.

    Raises:
        OSError: no room for it in either place.
    """
    dirs = [d for d in (SHM_DIR, tempfile.gettempdir()) if os.path.isdir(d)]
    error: OSError | None = None
    pid = os.getpid()
    for d in dirs:
        reclaim(d)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{pid}-{process_start_time(pid) or 0}-", dir=d)
        try:
            _reserve(fd, size)
            return path, fd
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            error = exc
    raise OSError(f"no room for {size / 2**20:.0f} MiB of batch slots in {' or '.join(dirs)}: {error}")


def _create_memfd(size: int) -> int | None:
    """A new anonymous shared segment of ``size`` reserved bytes (Linux), or ``None`` where there is none.

    Raises:
        OSError: no room for it.
    """
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("lmdbstore-slots")
    except OSError:
        return None
    try:
        _reserve(fd, size)
    except OSError as exc:
        os.close(fd)
        raise OSError(f"no room for {size / 2**20:.0f} MiB of batch slots in shared memory: {exc}") from None
    return fd


class SegmentFd:
    """A segment's descriptor on its way to a reader: inherited as it is by a forked one, duplicated into a
    spawned or forkserver one by ``multiprocessing`` (as it passes connections)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> SegmentFd:
    return SegmentFd(dup.detach())


class SharedSlots:
    """``n`` batch slots of ``rows`` samples of ``item_bytes`` each (see the module docstring).

    Args:
        n, rows, item_bytes: slots, samples per slot, bytes per sample.
        shared: in a shared segment, for reader processes (default ``True``); ``False``: private memory.
        segment: map this existing segment (a reader process: its :class:`SegmentFd`, or its name where
            segments are named) instead of creating one.

    Raises:
        OSError: no room for the segment.
    """

    def __init__(
        self, n: int, rows: int, item_bytes: int, *, shared: bool = True, segment: SegmentFd | str | None = None
    ):
        self.n, self.rows = n, rows
        self.y_offset, self.stride = slot_bytes(rows, item_bytes)
        size = self.stride * n
        self.name: str | None = None
        self.fd: int | None = None  # the memfd, kept open for readers started later (the creator only)
        if segment is None and not shared:
            self._map = mmap.mmap(-1, size)
        else:
            if isinstance(segment, SegmentFd):
                fd, keep = segment.fd, False
            elif isinstance(segment, str):
                fd, keep = os.open(segment, os.O_RDWR), False
            else:
                memfd = _create_memfd(size)
                if memfd is not None:
                    fd, keep = memfd, True
                else:
                    self.name, fd = _create_named(size)
                    keep = False
            try:
                self._map = mmap.mmap(fd, size)
            finally:
                if keep:
                    self.fd = fd
                else:
                    os.close(fd)
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
    def segment(self) -> SegmentFd | str:
        """What a reader process maps these slots by (:class:`SegmentFd`, or the name of a named segment)."""
        if self.fd is not None:
            return SegmentFd(self.fd)
        assert self.name is not None, "private slots have no segment"
        return self.name

    def unlink(self) -> None:
        """Remove the shared segment's name, if it has one (the memory stays while mapped); once every
        reader has mapped it."""
        if self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name)

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
        """Remove the name and let go of the memory (it stays mapped while a consumer holds arrays of it);
        ``before_unmap`` is called first (what page-locked it undoes it)."""
        if self._closed:
            return
        if before_unmap is not None:
            before_unmap()
        self._closed = True
        self.unlink()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.bases = []
        with contextlib.suppress(BufferError):  # still exported to arrays the consumer holds: unmapped with them
            self._map.close()
