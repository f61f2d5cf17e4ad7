"""The writer-lock protocol of a store: the ``flock`` of ``writer.lock`` says who may change it.  A writer holds it
exclusive while open (a second is refused at once); ``verify``'s page walk holds it shared (no writer starts
meanwhile); a reader probes it (:func:`writer_active`) to read lock-free while nobody writes and as a registered
snapshot while a writer is active (:func:`resolve_lock`).  LMDB's reader table, ``lock.mdb``, is another file.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from lmdbstore.errors import LmdbStoreError, StoreLockedError

__all__ = [
    "LOCK_FILE",
    "WRITER_LOCK_FILE",
    "acquire_writer_lock",
    "hold_off_writers",
    "lock_table_writable",
    "release_lock",
    "resolve_lock",
    "writer_active",
]

#: The store's writer lock (see the module docstring).
WRITER_LOCK_FILE = "writer.lock"
#: LMDB's reader table, created beside ``data.mdb`` by an environment opened with ``lock=True``.
LOCK_FILE = "lock.mdb"


def acquire_writer_lock(path: Path) -> int:
    """Take the writer's exclusive lock on ``path/writer.lock`` (created if missing) without blocking: its file
    descriptor, held until :func:`release_lock`.

    Raises:
        LmdbStoreError: the lock file cannot be opened or created (a directory of that name, no write
            permission, a read-only file system).
        StoreLockedError: another writer holds the store (or ``verify`` is walking its file structure).
    """
    try:
        fd = os.open(path / WRITER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a directory named writer.lock, no write permission, a read-only file system
        raise LmdbStoreError(
            f"cannot open the writer lock {WRITER_LOCK_FILE} ({exc.strerror or exc})",
            path=path,
            hint="a writer needs to create and write this file in the store directory",
        ) from exc
    if not _exclusive(fd):
        os.close(fd)
        raise StoreLockedError(
            "another writer is using this store (or `lmdbstore verify` is checking its file structure)",
            path=path,
            hint="wait for it to finish",
        ) from None
    return fd


#: How long a writer tries for the lock while it is held shared (:func:`writer_active`), in seconds, and how often.
PROBE_WAIT, PROBE_RETRY = 0.25, 0.005


def _exclusive(fd: int) -> bool:
    """Whether the exclusive ``flock`` on ``fd`` was taken without blocking, trying for :data:`PROBE_WAIT` (a reader
    probing for a writer holds it shared for microseconds)."""
    deadline = time.monotonic() + PROBE_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(PROBE_RETRY)


def hold_off_writers(path: Path) -> int:
    """Take a shared lock on ``path/writer.lock`` without blocking, so that no writer can start meanwhile: its file
    descriptor, for :func:`release_lock` (``-1``: no lock file, no writer ever opened the store). Raises
    ``StoreLockedError``: a writer holds the store now; ``LmdbStoreError``: the lock file cannot be opened."""
    try:
        fd = os.open(path / WRITER_LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        raise LmdbStoreError(f"cannot open {WRITER_LOCK_FILE} ({exc.strerror})", path=path) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError("a writer is appending to the store", path=path) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_lock(fd: int) -> None:
    """Release a lock taken by :func:`acquire_writer_lock` or :func:`hold_off_writers` (``-1``: none)."""
    if fd >= 0:
        os.close(fd)


def writer_active(path: Path) -> bool:
    """Whether a writer holds the store's ``writer.lock`` now (a non-blocking shared ``flock`` probe: ``verify``'s
    shared lock does not count; no lock file, or one that cannot be opened, means no writer)."""
    try:
        fd = os.open(path / WRITER_LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the probe's shared lock
    return False


def lock_table_writable(path: Path) -> bool:
    """Whether this process can open LMDB's reader table (``lock.mdb``, created if missing) for writing,
    which a ``lock=True`` reader needs; a read-only store (or file system) can only be read lock-free."""
    lock_file = path / LOCK_FILE
    if lock_file.exists():
        return os.access(lock_file, os.W_OK)
    return os.access(path, os.W_OK)


def resolve_lock(path: Path, lock: bool | None) -> bool:
    """A reader's ``lock`` mode: as asked, or for ``None`` (automatic) ``True`` exactly while a writer is
    active, so the reader's snapshot is registered and its pages cannot be reused under it."""
    return writer_active(path) if lock is None else lock
