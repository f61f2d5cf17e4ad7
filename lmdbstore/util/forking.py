"""Making shared memory a forked child inherited private to that child (Linux).

``fork()`` hands a child the parent's ``MAP_SHARED`` mappings shared.  Two must not be: LMDB's reader table
(closing an inherited environment in the child aborts the parent's read transactions in it, so a writer may
overwrite the parent's snapshot) and a loader's reusable batch buffers (a later batch would overwrite one the
child still reads).  :func:`privatize` replaces such a range, in the child only, by a private anonymous mapping
of the same bytes; call it only where no other thread can use the range (right after a fork).  Elsewhere than
Linux :func:`supported` is false and nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import sys

__all__ = ["file_ranges", "privatize", "supported"]

#: ``MAP_FIXED`` on the Linux architectures this is enabled for (the mmap module does not export it).
MAP_FIXED = 0x10
_ARCHES = ("x86_64", "aarch64", "arm64", "i686", "armv7l", "riscv64", "ppc64le", "s390x")


def supported() -> bool:
    """Whether :func:`privatize` can work here (Linux, a known architecture, /proc mounted)."""
    return sys.platform == "linux" and platform.machine() in _ARCHES and os.path.exists("/proc/self/maps")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


def file_ranges(dev: int, ino: int) -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` of this process's shared, writable mappings of the file
    ``(dev, ino)`` (from ``/proc/self/maps``)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 5 or parts[4] == "0" or int(parts[4]) != ino or not parts[1].startswith("rw"):
                continue
            major, minor = (int(v, 16) for v in parts[3].split(":"))
            if os.makedev(major, minor) == dev and parts[1][3] == "s":
                start, end = (int(v, 16) for v in parts[0].split("-"))
                out.append((start, end))
    return out


def privatize(start: int, end: int) -> None:
    """Replace the mapping ``[start, end)`` (page-aligned outward) of this process by private anonymous
    memory holding the same bytes.

    Raises:
        OSError: the kernel refused the new mapping.
    """
    page = mmap.PAGESIZE
    start -= start % page
    end += -end % page
    n = end - start
    saved = ctypes.create_string_buffer(n)
    ctypes.memmove(saved, start, n)
    libc = _libc()
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
    if libc.mmap(start, n, prot, flags, -1, 0) != start:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED) of {n} bytes failed: {os.strerror(err)}")
    ctypes.memmove(start, saved, n)
