"""A reader's hold on one store in one process: :class:`PinnedReader`, the base of
:class:`~lmdbstore.store.reader.StoreReader` (private).

It keeps the current snapshot (a :class:`~lmdbstore.store.handle.Handle`), runs every read under the snapshot rule
(:mod:`lmdbstore.store.snapshot`; a lost snapshot is replaced and the read done again), and pins the store (its
identity, no fewer samples, no older commit, at one commit one record) and data file it reads: a new snapshot that
contradicts the pin is :class:`~lmdbstore.errors.StoreReplacedError`, except on ``refresh()``.  Threads may share it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from lmdbstore.errors import (
    LmdbStoreError,
    NotAStoreError,
    StoreNotFoundError,
    StoreReplacedError,
    translate_read_errors,
)
from lmdbstore.store.handle import Handle
from lmdbstore.store.locks import lock_table_writable
from lmdbstore.store.positions import PositionTable

__all__ = ["MAX_RESNAPSHOTS", "PinnedReader", "ReaderPin"]

T = TypeVar("T")
#: Snapshots a reader takes in a row for one call before it gives up (only a lock-free reader beside a fast writer
#: gets there).
MAX_RESNAPSHOTS = 8
#: What a reader pins: store identity, samples seen, (machine, st_dev, st_ino) of the data file, the commit's
#: transaction id and record fingerprint (see the module docstring).
ReaderPin = tuple[tuple[Any, ...] | None, int, tuple[str, int, int] | None, int, bytes | None]


class PinnedReader:
    """The snapshot machinery of a reader (see the module docstring); subclasses read through :meth:`_guarded`."""

    path: Path
    lock: bool | None
    io_threads: int | None

    def _init_pin(self) -> None:
        self._h: Handle | None = None
        self._table: PositionTable | None = None
        self._labels: np.ndarray | None = None
        self._pinned: ReaderPin = (None, 0, None, 0, None)
        self._mutex = threading.RLock()
        self._mutex_pid = os.getpid()

    def _locked(self) -> threading.RLock:
        """This process's lock of the reader (a forked child makes its own: a parent's thread may hold it)."""
        if self._mutex_pid != os.getpid():
            self._mutex, self._mutex_pid = threading.RLock(), os.getpid()
        return self._mutex

    # ------------------------------------------------------------------ handles
    def _handle(self) -> Handle:
        """The current snapshot, opened (or re-opened) as needed."""
        with self._locked():
            h = self._h
            if h is None or h.pid != os.getpid() or h.lease is None or not h.lease.valid or h.poisoned:
                # a parent's handle, or an environment re-opened for a writer or retired for another data file
                self._let_go()  # before the re-open, or py-lmdb refuses it
                h = self._h = self._open(self.lock)
            return h

    def _let_go(self) -> None:
        """Let go of the current handle: retired (closed by the last read on it), or forgotten after a fork."""
        h, self._h = self._h, None
        if h is not None and h.pid != os.getpid():
            h.forget_after_fork()
        elif h is not None:
            h.retire()

    @contextmanager
    def held(self) -> Iterator[Handle]:
        """The current snapshot, kept open (a newer one does not close it) until the block ends."""
        with self._locked():
            h = self._handle()
            h.users += 1
        try:
            yield h
        finally:
            with self._locked():
                h.users -= 1
                if h.retired and h.users == 0:
                    h.close()

    def _registered(self) -> bool | None:
        """The ``lock`` of a snapshot taken because the last one was lost: registered where possible (an
        explicit ``lock=False`` stays lock-free)."""
        return False if self.lock is False else lock_table_writable(self.path)

    def _open(self, lock: bool | None) -> Handle:
        """A new snapshot whose metadata was read while it was protected, of the store this reader pinned."""
        for _ in range(MAX_RESNAPSHOTS):
            try:
                h = Handle(self.path, lock, self.io_threads)
            except (StoreNotFoundError, NotAStoreError) as exc:
                if self._pinned[0] is None:
                    raise
                raise StoreReplacedError(
                    f"the store this reader opened is no longer at the path ({exc.message})",
                    path=self.path,
                    hint="open a new reader (or call refresh()) once a store is there again",
                ) from exc
            try:
                with translate_read_errors(self.path, "open"):
                    if _attempt(h, Handle.load)[0]:
                        self._pin(h)
                        h.inherit(self._table)
                        return h
            except BaseException:
                h.close()
                raise
            h.close()
            lock = self._registered()
        raise self._lost("open")

    def _pin(self, h: Handle) -> None:
        """Remember the store and file this reader reads; refuse a snapshot of another one (``StoreReplacedError``:
        the store or its data file at the path was replaced while this reader had it open)."""
        meta, snap = h.meta, h.snapshot
        ident = meta.identity()
        here = (os.uname().nodename, *h.file_id)
        record = snap.record[1] if snap.record is not None else None
        known, count, file, txnid, fp = self._pinned
        why = None
        if known is not None:
            if ident != known:
                why = "another store: its id, creation time or layout differ"
            elif file is not None and file[0] == here[0] and file != here:
                why = "another data file"
            elif meta.count < count or snap.txnid < txnid:
                why = "an older state of the store: fewer samples or an earlier commit"
            elif snap.txnid == txnid and record is not None and fp is not None and record != fp:
                why = "another data file at the same commit"
        if why is not None:
            raise StoreReplacedError(
                f"the store was replaced while this reader had it open ({why})",
                path=self.path,
                hint="open a new reader (or call refresh()) to read the store that is there now",
            )
        self._pinned = (ident, max(count, meta.count), here, max(txnid, snap.txnid), record)
        if self._labels is not None and len(self._labels) != meta.count:
            self._labels = None  # a newer snapshot of the store: its label table has more labels

    def _lost(self, action: str) -> LmdbStoreError:
        return LmdbStoreError(
            f"{action}: a writer overwrote this reader's snapshot {MAX_RESNAPSHOTS} times in a row",
            path=self.path,
            hint="lock=False reads only a store nobody writes; use lock=None or lock=True beside a writer",
        )

    def _guarded(self, action: str, fn: Callable[[Handle], T]) -> T:
        """``fn(handle)`` on a snapshot protected before and after it ran; a lost snapshot is replaced and ``fn`` run
        again (errors of ``fn`` count only on a protected snapshot).  Raises ``LmdbStoreError``:
        :data:`MAX_RESNAPSHOTS` snapshots in a row were lost; or as ``fn``, translated."""
        for _ in range(MAX_RESNAPSHOTS):
            with self.held() as h:
                try:
                    done, result = _attempt(h, fn)
                except BaseException:
                    with translate_read_errors(self.path, action):  # only on the way out: no cost per batch
                        raise
                if done:
                    return cast(T, result)
            self._resnapshot(h)
        raise self._lost(action)

    def _resnapshot(self, lost: Handle) -> None:
        """Replace the snapshot ``lost`` (no longer protected) by a new one, registered where possible, unless
        another thread replaced it already."""
        with self._locked():
            if self._h is lost:
                self._let_go()
                self._h = self._open(self._registered())

    def _positions(self, h: Handle) -> PositionTable | None:
        """The handle's position table, kept on the reader too: a re-opened handle of the same snapshot
        (after :meth:`close`, in a forked DataLoader worker) need not rebuild it."""
        self._table = h.positions()
        return self._table

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the environment in this process (call in the parent before starting workers); reads in
        progress on other threads finish first."""
        with self._locked():
            self._let_go()

    def refresh(self) -> None:
        """Start a new read snapshot: see samples committed since, or the store now at the path."""
        with self._locked():
            self.close()
            self._labels = None
            self._pinned = (None, 0, None, 0, None)

    def _restore_pin(self, pinned: Any) -> None:
        """Take a pin that travelled with a pickled reader (on another machine: the store's, not the file's)."""
        if not isinstance(pinned, tuple) or len(pinned) != 5:
            return
        known, count, file, txnid, fp = pinned
        if file is not None and file[0] != os.uname().nodename:
            file = None
        self._pinned = (known, count, file, txnid, fp)


def _attempt(h: Handle, fn: Callable[[Handle], T]) -> tuple[bool, T | None]:
    """``(True, fn(h))`` if ``h`` was protected before and after ``fn`` ran, else ``(False, None)``; an error of
    ``fn`` is raised only on a protected snapshot."""
    if h.protected():
        try:
            result = fn(h)
        except Exception:
            if h.protected():
                raise
        else:
            if h.protected():
                return True, result
    return False, None
