"""One LMDB environment per store path and process (py-lmdb refuses a second): :data:`ENVS`, the
:class:`EnvRegistry`, shared by the readers and the writer through leases (docs/design.md, "Readers and snapshots").

An entry is tied to the data file it opened: a path now naming another file gets a new environment, and the old
entry is *retired* (its leases turn invalid, its last user closes it).  Right after a fork the child makes every
inherited reader table private (:func:`lmdbstore.util.forking.privatize`), so closing an inherited environment
cannot touch the parent's reader slots.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb

from lmdbstore.errors import LmdbStoreError
from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.locks import LOCK_FILE
from lmdbstore.util.forking import file_ranges, privatize, supported

__all__ = ["ENVS", "EnvLease", "EnvRegistry", "FileChanged", "FileId", "file_id"]

#: A file's identity: ``(st_dev, st_ino)``.
FileId = tuple[int, int]
T = TypeVar("T")


class FileChanged(Exception):
    """The store's data file changed between the caller opening it and the environment being opened: retry."""


def file_id(path: Path, name: str = DATA_FILE) -> FileId | None:
    """``(st_dev, st_ino)`` of the store's file ``name`` (``data.mdb``, ``lock.mdb``) now, or ``None`` when it cannot
    be found."""
    try:
        st = os.stat(Path(path) / name)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class _Entry:
    """One open environment of a path in this process, and how many users share it.

    ``lock_file``, ``data_file``: the ``(st_dev, st_ino)`` of ``lock.mdb`` and ``data.mdb`` when it opened (py-lmdb
    keys both, lock-free or not); ``writing``: a write transaction is open on it (the writer's commit); ``private``:
    in a forked child, its reader table was made private to the child.
    """

    def __init__(self, env: lmdb.Environment, key: str, writable: bool, lock: bool, path: Path):
        self.env, self.key, self.writable, self.lock = env, key, writable, lock
        self.lock_file, self.data_file = file_id(path, LOCK_FILE), file_id(path)
        self.refs = 1
        self.pid = os.getpid()
        self.writing = 0
        self.private = False
        self._use = threading.Condition()
        self._using = 0  # liblmdb calls in progress on it (see using())

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Hold for a liblmdb call on this environment: :meth:`close` waits until no call is in progress (a
        call on another thread must never run on a closed environment)."""
        with self._use:
            self._using += 1
        try:
            yield
        finally:
            with self._use:
                self._using -= 1
                if not self._using:
                    self._use.notify_all()

    def close(self) -> None:
        """Close the environment once no liblmdb call is in progress on it; its transactions end."""
        with self._use:
            while self._using:
                self._use.wait()
            with contextlib.suppress(lmdb.Error):
                self.env.close()

    def privatize_after_fork(self) -> None:
        """In a forked child, right after the fork: make the inherited reader table private to the child
        (not while a write transaction was open: closing that would wait for the parent's thread)."""
        if self.lock and self.lock_file is not None and not self.writing and supported():
            with contextlib.suppress(OSError, ValueError):
                for start, end in file_ranges(*self.lock_file):
                    privatize(start, end)
                self.private = True

    def forget_after_fork(self) -> None:
        """Let go of an environment inherited through ``fork()``: closed where it shares nothing with the parent
        (lock-free, or its reader table made private), else only dereferenced (closing it would free the parent's
        reader slots; py-lmdb then keeps refusing a second open of its path in this process)."""
        if not self.lock or self.private:
            with contextlib.suppress(lmdb.Error):
                self.env.close()


class EnvLease:
    """A share of a process-wide environment: use :attr:`env` while :attr:`valid`, then :meth:`release`."""

    def __init__(self, registry: EnvRegistry, entry: _Entry):
        self._registry, self.entry, self.released = registry, entry, False

    @property
    def env(self) -> lmdb.Environment:
        return self.entry.env

    @property
    def valid(self) -> bool:
        """False after a fork, or once the environment was re-opened for a user that needed more."""
        return self.entry.pid == os.getpid() and self._registry.current(self.entry.key) is self.entry

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Mark the environment as holding an open write transaction for the block (a fork meanwhile does not make
        its reader table private: :meth:`_Entry.privatize_after_fork`)."""
        self.entry.writing += 1
        try:
            yield
        finally:
            self.entry.writing -= 1

    def release(self) -> None:
        """Give the share back; the last user of a path closes its environment.  Idempotent."""
        if not self.released:
            self.released = True
            self._registry.release(self)


class EnvRegistry:
    """Environments shared per path and process (see the module docstring).  The first user opens one in the mode it
    needs; a later user that needs more (a writer beside read-only readers, a reader table beside lock-free readers)
    re-opens it in the stronger mode: the earlier users see :attr:`EnvLease.valid` turn false and re-open theirs.
    After a fork, every inherited entry is forgotten (:meth:`_Entry.forget_after_fork`)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._retired: list[_Entry] = []  # replaced by an entry of another data file; closed by their last user
        self._mutex = threading.RLock()
        self._pid = os.getpid()

    def _all(self) -> list[_Entry]:
        return [*self._entries.values(), *self._retired]

    def privatize_after_fork(self) -> None:
        """``os.register_at_fork(after_in_child=...)``: make every inherited reader table private to the child before
        anything in it could close or drop an inherited environment (single-threaded: no lock, a parent's thread may
        have held it)."""
        for e in self._all():
            e.privatize_after_fork()

    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            entries = self._all()
            self._entries, self._retired = {}, []
            self._pid = os.getpid()
            self._mutex = threading.RLock()
            for e in entries:
                e.forget_after_fork()

    def current(self, key: str) -> _Entry | None:
        return self._entries.get(key)

    def acquire(
        self,
        path: Path,
        *,
        writable: bool,
        lock: bool,
        opener: Callable[[], lmdb.Environment],
        data_file: FileId | None = None,
        own: bool = False,
        setup: Callable[[lmdb.Environment], None] | None = None,
    ) -> EnvLease:
        """A lease on ``path``'s environment, opened with ``opener()`` (``readonly=not writable``, ``lock=lock``)
        unless a sufficient one of the same data file is open; ``data_file``: the data file the caller opened itself
        (an open entry of another one is retired). ``own``, ``setup``: the writer's (:meth:`prepare`), which runs
        ``setup(env)`` (its sub-databases) before anyone shares the new environment (liblmdb forbids opening
        sub-databases in two transactions at once).  Errors come from ``opener`` and ``setup``; ``FileChanged``: the
        environment opened is not of ``data_file`` (the path changed meanwhile)."""
        self._after_fork()  # before taking the lock: a forked child's copy of it may be held by a parent thread
        key = os.path.realpath(path)
        with self._mutex:  # prepare, open and adopt at once: no other thread opens the path in between
            self.prepare(path, writable=writable, lock=lock, data_file=data_file, own=own)
            e = self._entries.get(key)
            if e is None:
                env = self.open_making_room(path, opener)
                try:
                    if setup is not None:
                        setup(env)
                except BaseException:
                    env.close()
                    raise
                e = self._adopt(path, env, writable=writable, lock=lock)
                if data_file is not None and e.data_file != data_file:
                    self.release(EnvLease(self, e))
                    raise FileChanged(str(path))
            else:
                e.refs += 1
            return EnvLease(self, e)

    def open_making_room(self, path: Path, opener: Callable[[], T]) -> T:
        """``opener()``, an open of the LMDB environment at ``path``; where py-lmdb refuses it as "already open",
        :meth:`make_room` for it and ``opener()`` once more (``LmdbStoreError``: as ``opener``, py-lmdb's refusal
        when no stale environment was in the way)."""
        try:
            return opener()
        except LmdbStoreError as exc:
            if "already open" not in str(exc) or not self.make_room(path):
                raise
        return opener()

    def make_room(self, path: Path) -> bool:
        """Close the stale environments (their path no longer holds the data file they opened) whose files py-lmdb
        takes for those of ``path``: it keys an environment by the ``(st_dev, st_ino)`` of ``data.mdb`` and
        ``lock.mdb`` when it opened, and a new file may get a deleted one's inode number (``lmdb/_envid.py``).  Their
        leases turn invalid.  Returns whether any was closed."""
        wanted = {file_id(path), file_id(path, LOCK_FILE)} - {None}
        with self._mutex:
            stale = [
                e
                for e in self._all()
                if e.pid == os.getpid() and wanted & {e.data_file, e.lock_file} and file_id(Path(e.key)) != e.data_file
            ]
            for e in stale:
                self._drop(e)
        return bool(stale)

    def _drop(self, e: _Entry) -> None:
        """Forget the entry ``e`` and close its environment."""
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        if e in self._retired:
            self._retired.remove(e)
        e.close()

    def prepare(
        self, path: Path, *, writable: bool, lock: bool = True, data_file: FileId | None = None, own: bool = False
    ) -> None:
        """Make room to open ``path`` in this mode: retire a shared environment of another data file than
        ``data_file`` (default: the one at the path now), close one of a weaker mode (its leases turn invalid);
        ``own`` (a writer, with its own options, holding the writer lock): close any, an earlier writer's that readers
        kept among them."""
        key = os.path.realpath(path)
        now = data_file if data_file is not None else file_id(path)
        with self._mutex:
            e = self._entries.get(key)
            if e is not None and now is not None and e.data_file is not None and e.data_file != now:
                del self._entries[key]
                self._retired.append(e)
            elif e is not None and (own or (writable and not e.writable) or (lock and not e.lock)):
                del self._entries[key]
                e.close()

    def _adopt(self, path: Path, env: lmdb.Environment, *, writable: bool, lock: bool = True) -> _Entry:
        """Share ``env`` (just opened after :meth:`prepare`, under the lock) with later users."""
        key = os.path.realpath(path)
        e = self._entries[key] = _Entry(env, key, writable, lock or writable, path)
        return e

    def release(self, lease: EnvLease) -> None:
        self._after_fork()
        e = lease.entry
        if e.pid != os.getpid():
            return
        with self._mutex:
            e.refs -= 1
            if e.refs <= 0:
                self._drop(e)


#: The environments of this process: process-wide, as LMDB's rule (one environment per file and process) and what
#: ``fork()`` shares are.
ENVS = EnvRegistry()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=ENVS.privatize_after_fork)
