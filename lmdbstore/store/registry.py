"""One LMDB environment per store path and process: :data:`ENVS`, the :class:`EnvRegistry`.

py-lmdb refuses to open one path twice in a process, so every reader and the writer of a store in this
process share one environment, reference-counted, through leases (:class:`EnvLease`; see :class:`EnvRegistry`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import lmdb

__all__ = ["ENVS", "EnvLease", "EnvRegistry"]


class _Entry:
    """One open environment of a path in this process, and how many users share it."""

    def __init__(self, env: lmdb.Environment, writable: bool, lock: bool):
        self.env, self.writable, self.lock = env, writable, lock
        self.refs = 0
        self.pid = os.getpid()

    def forget_after_fork(self) -> None:
        """Let go of an environment inherited through ``fork()``.

        A lock-free environment shares nothing with the parent and is closed.  One with a reader table
        must not be closed here (aborting its transactions would free the *parent's* reader slots and
        expose its snapshots to a writer); it is only dereferenced, and py-lmdb forgets it, without
        touching the slots, when the last reference goes.
        """
        if not self.lock:
            with contextlib.suppress(lmdb.Error):
                self.env.close()


class EnvLease:
    """A share of a process-wide environment: use :attr:`env` while :attr:`valid`, then :meth:`release`."""

    def __init__(self, registry: EnvRegistry, key: str, entry: _Entry):
        self._registry, self.key, self.entry = registry, key, entry
        self.released = False

    @property
    def env(self) -> lmdb.Environment:
        return self.entry.env

    @property
    def valid(self) -> bool:
        """False after a fork, or once the environment was re-opened for a user that needed more."""
        return self.entry.pid == os.getpid() and self._registry.current(self.key) is self.entry

    def release(self) -> None:
        """Give the share back; the last user of a path closes its environment.  Idempotent."""
        if not self.released:
            self.released = True
            self._registry.release(self)


class EnvRegistry:
    """Environments shared per path and process (py-lmdb refuses to open one path twice in a process).

    Any number of readers and one writer of a store share one environment, reference-counted.  The first
    user opens it in the mode it needs; a later user that needs more (a writer beside read-only readers,
    or a reader table beside lock-free readers) re-opens it in the stronger mode, which invalidates the
    earlier users' transactions: they see :attr:`EnvLease.valid` turn false and re-open theirs.  After a
    fork, every inherited entry is forgotten (see :meth:`_Entry.forget_after_fork`).  This is the one
    piece of process-wide state in the library, because LMDB's rule it enforces is process-wide.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._mutex = threading.RLock()
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            entries, self._entries = self._entries, {}
            self._pid = os.getpid()
            self._mutex = threading.RLock()
            for e in entries.values():
                e.forget_after_fork()

    def current(self, key: str) -> _Entry | None:
        return self._entries.get(key)

    def acquire(self, path: Path, *, writable: bool, lock: bool, opener: Callable[[], lmdb.Environment]) -> EnvLease:
        """A lease on ``path``'s environment, opened with ``opener()`` unless a sufficient one is open.

        ``opener`` must open with ``readonly=not writable`` and ``lock=lock`` (a writable environment
        always has a reader table).  Errors come from ``opener`` (already translated).
        """
        self.prepare(path, writable=writable, lock=lock)  # re-open in a stronger mode if needed
        key = os.path.realpath(path)
        with self._mutex:
            e = self._entries.get(key)
            if e is None:
                self.adopt(path, opener(), writable=writable, lock=lock)
                e = self._entries[key]
            else:
                e.refs += 1
            return EnvLease(self, key, e)

    def prepare(self, path: Path, *, writable: bool, lock: bool = True) -> None:
        """Make room to open ``path`` in this mode: close a shared environment of a weaker mode (its users
        see :attr:`EnvLease.valid` turn false and re-open).  Then open and :meth:`adopt` the new one."""
        self._after_fork()
        key = os.path.realpath(path)
        with self._mutex:
            e = self._entries.get(key)
            if e is not None and ((writable and not e.writable) or (lock and not e.lock)):
                del self._entries[key]
                e.env.close()

    def adopt(self, path: Path, env: lmdb.Environment, *, writable: bool, lock: bool = True) -> lmdb.Environment:
        """Share ``env`` (just opened after :meth:`prepare`) with later users; release with :meth:`release_env`."""
        with self._mutex:
            e = _Entry(env, writable, lock or writable)
            e.refs = 1
            self._entries[os.path.realpath(path)] = e
        return env

    def release(self, lease: EnvLease) -> None:
        self._after_fork()
        e = lease.entry
        if e.pid != os.getpid():
            return
        with self._mutex:
            e.refs -= 1
            if e.refs <= 0:
                if self._entries.get(lease.key) is e:
                    del self._entries[lease.key]
                e.env.close()

    def release_env(self, env: lmdb.Environment) -> None:
        """Release the lease whose environment is ``env`` (closing ``env`` if it was never shared)."""
        with self._mutex:
            for key, e in list(self._entries.items()):
                if e.env is env and e.pid == os.getpid():
                    self.release(EnvLease(self, key, e))
                    return
        env.close()


#: The environments of this process (see :class:`EnvRegistry`).
ENVS = EnvRegistry()
