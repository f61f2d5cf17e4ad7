"""What memory the machine can give an allocation, and the one rule for allocations sized by an argument.

Overcommit never says no: a buffer that does not fit is allocated and the process OOM-killed when its pages are
touched (a full ``/dev/shm`` raises SIGBUS).  So every allocation sized by an argument is compared, before anything
is touched, with what the data needs (the caller clips to that first) and what the machine can give now: refused
in one line naming the parameter (:func:`check_allocation`), or clipped with a :class:`MemoryBoundWarning` naming
it (:func:`clip_count`, :func:`clip_bytes`); a shared-memory file gets its pages up front (:func:`reserve`).  Each
takes ``available=`` (bytes; default: read now) and ``share=`` (default :data:`DEFAULT_SHARE`).
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_SHARE",
    "MemoryBoundWarning",
    "ResultBudget",
    "available_memory",
    "check_allocation",
    "clip_bytes",
    "clip_count",
    "describe_bytes",
    "reserve",
    "result_bytes",
    "shm_available",
]

#: The share of the available memory one allocation sized by an argument may take: the rest is left to the
#: page cache (the reads need it), the other buffers and the program around the library.
DEFAULT_SHARE = 0.5
#: cgroup files holding a memory limit and the usage under it (v2, then v1), relative to the cgroup's directory.
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes"))


class MemoryBoundWarning(UserWarning):
    """An argument asked for more memory than the machine can give; it was clipped (the message names it)."""


def describe_bytes(n: int | float) -> str:
    """``n`` bytes for a message: ``"1.5 GiB"``, ``"300.0 MiB"``, ``"512 B"``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (``None``: no limit, or none readable)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    room: int | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or (parts[1] and "memory" not in parts[1].split(",")):
            continue
        for root in (
            Path("/sys/fs/cgroup") / parts[2].lstrip("/"),
            Path("/sys/fs/cgroup/memory") / parts[2].lstrip("/"),
        ):
            for limit_name, usage_name in _CGROUP_FILES:
                try:
                    limit_text = (root / limit_name).read_text().strip()
                    usage = int((root / usage_name).read_text().strip())
                except (OSError, ValueError):
                    continue
                if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
                    continue  # no limit (v1 says so with a huge number)
                left = max(0, int(limit_text) - usage)
                room = left if room is None else min(room, left)
    return room


def available_memory() -> int:
    """Bytes of memory this process can allocate now without swapping: ``MemAvailable``, lowered to the room
    under its cgroup's memory limit if it has one (see the module docstring); physical memory if unknown."""
    avail = _meminfo_available()
    if avail is None:
        try:
            avail = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (OSError, ValueError):
            avail = 1 << 30
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def shm_available(path: str | os.PathLike[str] = "/dev/shm") -> int:
    """Bytes the tmpfs at ``path`` can still take (``statvfs``), never more than :func:`available_memory`; the
    available memory alone where ``path`` cannot be examined (a ``memfd``'s tmpfs has no size of its own)."""
    avail = available_memory()
    try:
        st = os.statvfs(path)
    except OSError:
        return avail
    return min(avail, st.f_bavail * st.f_frsize)


def check_allocation(
    nbytes: int, *, what: str, parameter: str, available: int | None = None, share: float = DEFAULT_SHARE
) -> None:
    """Refuse an allocation of ``nbytes`` (``what``, sized by ``parameter``) that exceeds ``share`` of the
    ``available`` bytes (default: what :func:`available_memory` says now), before anything is allocated.

    Raises:
        ValueError: one line naming ``parameter``, the bytes asked for and the bytes available.
    """
    avail = available_memory() if available is None else available
    limit = int(avail * share)
    if nbytes > limit:
        raise ValueError(
            f"{parameter}: {what} would take {describe_bytes(nbytes)}, more than this machine can give "
            f"({describe_bytes(limit)}: {share:.0%} of the {describe_bytes(avail)} available); lower {parameter}"
        )


def clip_count(
    count: int,
    item_bytes: int,
    *,
    what: str,
    parameter: str,
    available: int | None = None,
    share: float = DEFAULT_SHARE,
    minimum: int = 1,
    stacklevel: int = 2,
) -> int:
    """The largest count ``<= count`` of items of ``item_bytes`` that fits ``share`` of the ``available`` bytes
    (default: :func:`available_memory` now), at least ``minimum``; when that is less than ``count``, a
    :class:`MemoryBoundWarning` names ``parameter``, what was asked and what is used.

    Clip to what the data needs before calling (``min(batch_size, len(store))``): that costs nothing and needs
    no notice.  Returns ``count`` unchanged when it fits (or ``item_bytes`` is 0)."""
    if item_bytes <= 0 or count <= minimum:
        return count
    avail = available_memory() if available is None else available
    fits = max(minimum, int(avail * share) // item_bytes)
    if fits >= count:
        return count
    warnings.warn(
        f"{parameter}: {count:,} {what} of {describe_bytes(item_bytes)} would take {describe_bytes(count * item_bytes)}, "
        f"more than this machine can give ({describe_bytes(int(avail * share))}: {share:.0%} of the "
        f"{describe_bytes(avail)} available); using {fits:,}",
        MemoryBoundWarning,
        stacklevel=stacklevel,
    )
    return fits


def clip_bytes(
    nbytes: int,
    *,
    what: str,
    parameter: str,
    available: int | None = None,
    share: float = DEFAULT_SHARE,
    stacklevel: int = 2,
) -> int:
    """``nbytes`` (a size asked for, clipped to what the data needs first), at most ``share`` of the ``available``
    bytes (default: :func:`available_memory` now); when it had to clip, a :class:`MemoryBoundWarning` names
    ``parameter``, what was asked and what is used."""
    avail = available_memory() if available is None else available
    limit = max(1, int(avail * share))
    if nbytes <= limit:
        return nbytes
    warnings.warn(
        f"{parameter}: {what} of {describe_bytes(nbytes)} is more than this machine can give ({describe_bytes(limit)}: "
        f"{share:.0%} of the {describe_bytes(avail)} available); using {describe_bytes(limit)}",
        MemoryBoundWarning,
        stacklevel=stacklevel,
    )
    return limit


def reserve(fd: int, nbytes: int, *, what: str, parameter: str) -> None:
    """Give the shared-memory file ``fd`` its ``nbytes`` now (``posix_fallocate``): a tmpfs that cannot hold them
    answers ENOSPC here, instead of a SIGBUS when a page is first written.

    Raises:
        ValueError: one line naming ``parameter`` when the tmpfs (or the memory behind it) cannot hold them.
        OSError: any other error of ``posix_fallocate``.
    """
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        raise ValueError(
            f"{parameter}: {what} of {describe_bytes(nbytes)} do not fit in shared memory ({exc.strerror}; "
            f"{describe_bytes(shm_available())} free in /dev/shm); lower {parameter}"
        ) from None


def result_bytes(result: Any) -> int:
    """The bytes of a task's result held in memory: its numpy arrays (and those of a tuple or list of them)."""
    if isinstance(result, np.ndarray):
        return int(result.nbytes)
    if isinstance(result, (tuple, list)):
        return sum(result_bytes(r) for r in result)
    return 0


class ResultBudget:
    """How many task results (held in this process until consumed) a run of ``workers`` tasks at once may hold:
    ``share`` of the ``available`` memory (default: read now) over the largest result seen so far (with a
    :class:`MemoryBoundWarning` naming ``in_flight``), two per worker before the first, at least one each.
    """

    def __init__(self, workers: int, available: int | None = None, share: float = DEFAULT_SHARE) -> None:
        self.workers = max(1, workers)
        self.budget = int((available_memory() if available is None else available) * share)
        self.largest = 0
        self._warned = False

    def observe(self, result: Any) -> None:
        """Note a result received (its size bounds the window from now on)."""
        self.largest = max(self.largest, result_bytes(result))

    def window(self, limit: int) -> int:
        """The tasks that may be submitted and not yet consumed now, of the ``limit`` asked for."""
        if self.largest == 0:
            return min(limit, 2 * self.workers)
        fits = max(1, self.budget // self.largest)
        if fits < limit and not self._warned:
            self._warned = True
            warnings.warn(
                f"in_flight: {limit:,} task results of up to {describe_bytes(self.largest)} in flight would take "
                f"{describe_bytes(limit * self.largest)}, more than this machine can give ({describe_bytes(self.budget)}); "
                f"keeping {fits:,} in flight",
                MemoryBoundWarning,
                stacklevel=4,
            )
        return min(limit, fits)
