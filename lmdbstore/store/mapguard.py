"""Reading a memory map of ``data.mdb`` without dying of SIGBUS when another process shrinks the file.

A page of a shared file map that lies past the end of the file faults with SIGBUS, which kills a Python
process; a size check *before* a copy from the map leaves the copy itself exposed (another process may
truncate the file in between).  Two things close that window:

* **A read lease** (``fcntl(F_SETLEASE, F_RDLCK)``, :class:`MapGuard`) held around every access to the map, by
  our copies and by liblmdb alike: while it is held the kernel holds back anyone who opens the file for writing
  or truncates it (until the lease is released, for at most ``/proc/sys/fs/lease-break-time`` seconds, 45 by
  default), so the size checked after taking it holds until it is released.  Taking and releasing one costs
  about 3 us; it is taken once per batch (by the first of the threads reading through one file descriptor)
  and released at once.  When someone waits for a lease the kernel signals its holder, this process: the signal
  is set to SIGURG, whose default action is to ignore it, before every lease (the default SIGIO would kill the
  process, and Linux resets the file's signal to it whenever a lease is released).  That signal must never reach
  a handler of the program's (asyncio's ``add_signal_handler``, out-of-band socket data, runtimes that use
  SIGURG): a lease is taken only while SIGURG's disposition is the default or ignore (one ``sigaction`` query,
  ~1 us, per lease), and where the program handles SIGURG the reads take the no-lease path below.  Not a
  real-time signal nobody handles: their default action ends the process, so one would need a handler of
  ours, which the program could notice.
* **A copy by the kernel** where no lease can be had (a writer holds the file open for writing, the file
  belongs to another user and the process lacks CAP_LEASE, a file system without leases):
  ``process_vm_readv(2)`` on this process (:func:`vm_copy`) copies from the map and answers EFAULT for a page
  past the end of the file instead of raising SIGBUS.  It costs about twice a numpy gather of warm data.
  Where even that is refused (seccomp), the runs are read with ``preadv`` (the caller's choice).

What remains is liblmdb's own access to the map while no lease can be had (the metadata, labels and class
index read at open, ``positions=False`` reads, verify's scans): the file size is checked before them, and a
file shrunk during one of them still raises SIGBUS; and a copy that takes longer than the lease-break time.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import signal
import threading
from pathlib import Path

import numpy as np

from lmdbstore.errors import CorruptStoreError

__all__ = [
    "IOV_MAX",
    "LEASE_SIGNAL",
    "MapGuard",
    "lease_signal_free",
    "truncated",
    "vm_available",
    "vm_copy",
    "vm_readable",
]

#: The signal the kernel sends a lease holder when someone waits for the lease (ignored by default).
LEASE_SIGNAL = signal.SIGURG
F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
F_SETSIG = getattr(fcntl, "F_SETSIG", 10)
#: Entries of one ``process_vm_readv`` call (the kernel's ``UIO_MAXIOV``).
IOV_MAX = 1024
_IOV = np.dtype([("base", np.uintp), ("len", np.uintp)])


def truncated(size: int, needed: int, path: str | Path | None) -> CorruptStoreError:
    """The one-line error for a data file shorter than what is read from it."""
    return CorruptStoreError(
        f"data file was truncated while open: {size} bytes, the reader needs {needed}",
        path=path,
        hint="restore the store from a copy",
    )


class MapGuard:
    """Keeps the file ``fd`` (opened read-only) from shrinking while its map is read: see the module docstring.

    ``with guard.hold(needed) as leased:`` takes the lease (shared by the threads inside), checks that the file
    holds at least ``needed`` bytes, and says whether the lease is held: ``True``, the map may be read;
    ``False``, copy with :func:`vm_copy` or ``preadv`` instead.

    Raises (from :meth:`hold`):
        CorruptStoreError: the file is shorter than ``needed``.
    """

    def __init__(self, fd: int, path: str | Path | None = None):
        self.fd, self.path = fd, path
        self._lock = threading.Lock()
        self._holders = 0
        self._leased = False
        self._size = 0  # the file's size checked under the lease now held (it cannot shrink meanwhile)
        self.leases = _leases_possible()  # False once the kernel refuses leases on this file for good

    def _take(self) -> bool:
        if not self.leases or not lease_signal_free():
            return False
        try:
            # Every release resets the file's signal to SIGIO (Linux's lease_modify): set it again each time.
            fcntl.fcntl(self.fd, F_SETSIG, LEASE_SIGNAL)
            fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EBUSY):  # EACCES, EINVAL: never on this file
                self.leases = False
            return False
        return True

    def _release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_UNLCK)

    def hold(self, needed: int) -> contextlib.AbstractContextManager[bool]:
        """``with guard.hold(needed) as leased:`` see the class docstring (a plain object, not a generator: it is
        taken twice per batch)."""
        return _Hold(self, needed)

    def _enter(self, needed: int) -> bool:
        with self._lock:
            if self._holders == 0:
                self._leased, self._size = self._take(), 0
            self._holders += 1
            leased, known = self._leased, self._size
        if leased and known >= needed:  # checked under this very lease: the file cannot have shrunk since
            return True
        try:
            size = os.fstat(self.fd).st_size
            if size < needed:
                raise truncated(size, needed, self.path)
        except BaseException:
            self._exit()
            raise
        if leased:
            with self._lock:
                self._size = max(self._size, size) if self._leased else 0
        return leased

    def _exit(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._leased:
                self._release()
                self._leased = False


class _Hold:
    """One ``with guard.hold(needed)`` (see :meth:`MapGuard.hold`)."""

    __slots__ = ("guard", "needed")

    def __init__(self, guard: MapGuard, needed: int):
        self.guard, self.needed = guard, needed

    def __enter__(self) -> bool:
        return self.guard._enter(self.needed)

    def __exit__(self, *exc: object) -> None:
        self.guard._exit()


class _SigactionBuffer(ctypes.Structure):
    """Room for libc's ``struct sigaction`` (152 bytes on x86-64 and aarch64 glibc), whose first member is the
    handler (``SIG_DFL`` 0, ``SIG_IGN`` 1) on the Linux ABIs lmdbstore runs on."""

    _fields_ = [("handler", ctypes.c_void_p), ("rest", ctypes.c_char * 504)]


@functools.lru_cache(maxsize=1)
def _sigaction() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``sigaction``, where it can be called (``None`` elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sigaction
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def lease_signal_free() -> bool:
    """Whether the lease's signal (:data:`LEASE_SIGNAL`) is the program's to nobody: its disposition in this
    process is the default or ignore (not a handler of the program's, Python's or C's).  ``False`` where it
    cannot be told: then no lease is taken."""
    fn = _sigaction()
    if fn is None:
        return False
    buf = _SigactionBuffer()
    if fn(int(LEASE_SIGNAL), None, ctypes.byref(buf)) != 0:
        return False
    return (buf.handler or 0) in (0, 1)  # SIG_DFL, SIG_IGN


def _leases_possible() -> bool:
    """Whether read leases may be tried here (Linux: ``F_SETLEASE`` and ``F_SETSIG``)."""
    return hasattr(fcntl, "F_RDLCK") and os.uname().sysname == "Linux"


@functools.lru_cache(maxsize=1)
def _vm_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``process_vm_readv`` if it works on this process here (not refused by seccomp), else ``None``."""
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).process_vm_readv
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
        iov = np.array([(dst.ctypes.data, 16), (src.ctypes.data, 16)], _IOV)
        if fn(os.getpid(), iov[:1].ctypes.data, 1, iov[1:].ctypes.data, 1, 0) == 16 and (dst == src).all():
            return fn
    return None


def vm_available() -> bool:
    """Whether :func:`vm_copy` works in this process."""
    return _vm_readv() is not None


def vm_copy(dst: np.ndarray, at: np.ndarray, src: np.ndarray, lens: np.ndarray) -> bool:
    """Copy ``lens[i]`` bytes from address ``src[i]`` of this process to ``dst[at[i]:]`` (a C-contiguous uint8
    array) with ``process_vm_readv``: a page that cannot be read (past the end of its file) makes the call
    fail instead of raising SIGBUS.  Returns whether every byte was copied (``False``: unavailable, or a
    source page could not be read).  The GIL is released during each call."""
    fn = _vm_readv()
    n = len(lens)
    if fn is None:
        return False
    if n == 0:
        return True
    remote = np.empty(n, _IOV)
    remote["base"], remote["len"] = src, lens
    contiguous = bool((at[1:] == at[:-1] + lens[:-1]).all())
    local = np.empty(1 if contiguous else n, _IOV)
    if not contiguous:
        local["base"], local["len"] = dst.ctypes.data + at, lens
    pid, step = os.getpid(), remote.itemsize
    for a in range(0, n, IOV_MAX):
        b = min(a + IOV_MAX, n)
        want = int(lens[a:b].sum())
        if contiguous:
            local[0] = (dst.ctypes.data + int(at[a]), want)
            got = fn(pid, local.ctypes.data, 1, remote.ctypes.data + a * step, b - a, 0)
        else:
            got = fn(pid, local.ctypes.data + a * step, b - a, remote.ctypes.data + a * step, b - a, 0)
        if got != want:
            return False
    return True


#: Bytes :func:`vm_readable` reads at a time.
PROBE_BYTES = 1 << 20


def vm_readable(address: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` of this process's memory at ``address`` can be read (``process_vm_readv``: a page
    of a map past the end of its file, or of a tmpfs that could not give it, is ``False``, never SIGBUS); ``True``
    where it cannot be told.  Only for telling whose page a failed copy met: it reads every page."""
    fn = _vm_readv()
    if fn is None or nbytes <= 0:
        return True
    scratch = np.empty(min(nbytes, PROBE_BYTES), np.uint8)
    iov = np.zeros(2, _IOV)
    pid = os.getpid()
    for a in range(0, nbytes, PROBE_BYTES):
        k = min(PROBE_BYTES, nbytes - a)
        iov[0], iov[1] = (scratch.ctypes.data, k), (address + a, k)
        if fn(pid, iov[:1].ctypes.data, 1, iov[1:].ctypes.data, 1, 0) != k:
            return False
    return True
