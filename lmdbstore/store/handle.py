"""The per-process open state of a :class:`~lmdbstore.store.reader.StoreReader` (private).

A :class:`Handle` is one snapshot: a share of the process's environment of the store, one read transaction,
the snapshot as its meta page described it when the transaction began (:mod:`lmdbstore.store.snapshot`),
the metadata and sub-databases read in it, and (built on first use) its position table.  Everything read
through a handle is trusted only while :meth:`Handle.protected` says the snapshot is still the file's; the
reader re-snapshots otherwise.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import lmdb

from lmdbstore.errors import CorruptStoreError, translate_read_errors
from lmdbstore.format.layout import DATA_DBS, DB_SAMPLES, encode_key
from lmdbstore.store.env import DATA_FILE, begin_read, check_store_dir, open_reader_env, read_meta
from lmdbstore.store.locks import resolve_lock
from lmdbstore.store.positions import PositionTable, build_table, table_key
from lmdbstore.store.preads import PreadEngine
from lmdbstore.store.registry import ENVS
from lmdbstore.store.snapshot import Snapshot, capture

__all__ = ["Handle"]

#: Times a registered transaction is begun again when a writer overwrote its meta page before it was read.
CAPTURE_TRIES = 4


class Handle:
    """The per-process open state: a share of the environment, one long-lived read transaction and its
    snapshot, the metadata and sub-databases, and (built on first use) the snapshot's position table.

    Args:
        path: the store.
        lock: the reader's ``lock`` option (``None``: registered exactly while a writer is active).
        io_threads: reads in flight for cold batches.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: as the store is opened.
    """

    def __init__(self, path: Path, lock: bool | None, io_threads: int | None):
        check_store_dir(path)
        self.pid = os.getpid()
        self.path = path
        self.lock = lock = resolve_lock(path, lock)
        self.io_threads = io_threads
        self.table: PositionTable | None = None
        self.engine: PreadEngine | None = None
        self.built = False
        #: how this handle got its table: "" (not yet), "built", "inherited" (same snapshot, e.g. after fork)
        self.table_source = ""
        self.txn: lmdb.Transaction = None  # type: ignore[assignment]  # set by _begin
        self.fd = -1
        self.lease = ENVS.acquire(path, writable=False, lock=lock, opener=lambda: open_reader_env(path, lock))
        self.env = self.lease.env
        try:
            with translate_read_errors(path, "open"):
                self.fd = os.open(path / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
                self.snapshot = self._begin(self.lease.entry.lock)
                self.needed_bytes = self.snapshot.needed_bytes or self._env_needed_bytes()
        except BaseException:
            self.close()
            raise

    def _begin(self, registered: bool) -> Snapshot:
        """Begin the read transaction and capture its snapshot (registered: again while a writer overwrote
        its meta page before it could be read, so that a table can be built for it)."""
        snap = None
        for _ in range(CAPTURE_TRIES):
            if self.txn is not None:
                self.txn.abort()
            self.txn = begin_read(self.env)
            snap = capture(self.fd, self.txn.id(), registered, self.path)
            if snap.meta is not None or not snap.known_layout or not registered:
                break
        assert snap is not None
        return snap

    def _env_needed_bytes(self) -> int:
        info = self.env.info()
        return (int(info["last_pgno"]) + 1) * int(self.env.stat()["psize"])

    def load(self) -> None:
        """Read the metadata and open the sub-databases in this snapshot (through liblmdb).

        Raises:
            NotAStoreError, CorruptStoreError, FormatVersionError: no metadata, a damaged one, a missing
                sub-database.
        """
        self.check_size()
        with translate_read_errors(self.path, "open"):
            self.meta = read_meta(self.env, self.txn, self.path)
            try:
                self.dbs = {name: self.env.open_db(name, txn=self.txn, create=False) for name in DATA_DBS}
            except lmdb.NotFoundError as exc:
                raise CorruptStoreError("a sub-database is missing", path=self.path) from exc

    def inherit(self, table: PositionTable | None) -> None:
        """Reuse ``table`` (kept by the reader across a fork, a re-open, ``close()``) if it is of exactly this
        snapshot of this store and data file (its :attr:`~PositionTable.key`); call after :meth:`load`."""
        if self.built or table is None or self.snapshot.meta is None:
            return
        if table.key == table_key(self.meta.store_id, os.fstat(self.fd), self.snapshot.meta):
            self._use(table)
            self.table_source = "inherited"

    @property
    def registered(self) -> bool:
        return self.snapshot.registered

    def protected(self) -> bool:
        """Whether this snapshot's pages may be trusted now (:meth:`~lmdbstore.store.snapshot.Snapshot.protected`)."""
        return self.snapshot.protected(self.fd, self.txn, self.env)

    def check_size(self) -> None:
        """Refuse to touch LMDB's map once the data file is shorter than this snapshot's pages (a page past
        the end of a mapped file kills the process with SIGBUS).

        Raises:
            CorruptStoreError: the file was truncated while open.
        """
        size = os.fstat(self.fd).st_size
        if size < self.needed_bytes:
            raise CorruptStoreError(
                f"data file was truncated while open: {size} bytes, the snapshot needs {self.needed_bytes}",
                path=self.path,
                hint="restore the store from a copy",
            )

    def _use(self, table: PositionTable | None) -> None:
        self.built, self.table = True, table
        if table is not None:
            self.engine = PreadEngine(self.fd, table.file_size, self.io_threads, path=self.path)

    def positions(self) -> PositionTable | None:
        """The position table of this snapshot, built on first call; ``None``: use liblmdb (a data file
        whose layout the parser does not know, or a snapshot whose meta page was gone before it was read).

        Raises:
            CorruptStoreError: the file contradicts itself, its metadata or liblmdb.
        """
        if not self.built:
            snap = self.snapshot.meta
            if snap is None:
                self._use(None)
                return None
            db, txn = self.dbs[DB_SAMPLES], self.txn
            engine = PreadEngine(self.fd, os.fstat(self.fd).st_size, self.io_threads, path=self.path)
            try:
                table = build_table(
                    self.fd,
                    self.meta,
                    snap,
                    DB_SAMPLES,
                    lambda first: txn.get(encode_key(first), db=db),
                    engine,
                    store_id=self.meta.store_id,
                    path=self.path,
                )
            finally:
                engine.close()
            self._use(table)
            self.table_source = "built"
        return self.table

    def forget_after_fork(self) -> None:
        """Let go of a handle inherited through ``fork()`` so that this process can open its own.

        The environment itself is handled by :data:`~lmdbstore.store.registry.ENVS` (see
        :class:`~lmdbstore.store.registry.EnvRegistry`); here every reference to it goes, without aborting
        the transaction.  The position table stays with the reader, for the next handle to inherit.
        """
        self.txn = self.env = self.dbs = self.lease = None  # type: ignore[assignment]
        self.engine = None
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __del__(self) -> None:
        # a reader dropped without close() gives its share back (the last share closes the environment)
        if getattr(self, "lease", None) is not None and self.pid == os.getpid():
            with contextlib.suppress(Exception):
                self.close()

    def close(self) -> None:
        if self.lease is None:
            return
        try:
            if self.txn is not None:
                with contextlib.suppress(lmdb.Error):
                    self.txn.abort()
        finally:
            self.txn = None  # type: ignore[assignment]
            if self.engine is not None:
                self.engine.close()
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = -1
            self.lease.release()
            self.lease = None  # type: ignore[assignment]
