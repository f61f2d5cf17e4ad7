"""The per-process open state of a :class:`~lmdbstore.store.reader.StoreReader` (private): a :class:`Handle` is one
snapshot (a share of the environment, one read transaction, its meta page as captured, the metadata, and on first use
its position table and file reader) of one data file (its own descriptor, an environment of the same ``st_dev``,
``st_ino``), trusted only while :meth:`Handle.protected`.  liblmdb calls go through :meth:`Handle.lmdb`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np

from lmdbstore.errors import CorruptStoreError, StoreReplacedError, translate_read_errors
from lmdbstore.format.btree import record_position
from lmdbstore.format.layout import DATA_DBS, DB_META, META_KEY
from lmdbstore.format.limits import MIN_DATA_FILE_BYTES
from lmdbstore.format.pages import PageReader
from lmdbstore.store.env import DATA_FILE, begin_read, check_store_dir, open_reader_env, read_meta
from lmdbstore.store.fileread import FileReader, MapPatched, lmdb_guard, map_spans, shrunk
from lmdbstore.store.locks import resolve_lock
from lmdbstore.store.positions import PositionTable, open_table, table_key
from lmdbstore.store.registry import ENVS, EnvLease, FileChanged, FileId
from lmdbstore.store.snapshot import Snapshot, capture, fingerprint

__all__ = ["Handle"]

#: Times a registered transaction is begun again when a writer overwrote its meta page before it was read.
CAPTURE_TRIES = 4
#: Times the data file and an environment of it are opened again (the path named another file by then, or another
#: thread re-opened the environment meanwhile).
OPEN_TRIES = 8


class Handle:
    """One snapshot of the store ``path`` in this process (see the module docstring); ``lock``, ``io_threads``: the
    reader's options (``lock=None``: registered exactly while a writer is active).

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: as the store is opened.
    """

    def __init__(self, path: Path, lock: bool | None, io_threads: int | None = None):
        check_store_dir(path)
        self.io_threads = io_threads
        self.pid = os.getpid()
        self.path = path
        self.lock = lock = resolve_lock(path, lock)
        self.table: PositionTable | None = None
        self.files: FileReader | None = None
        self.built = False
        self.table_source = ""  # how this handle got its table: "built", "inherited" (same snapshot, e.g. after fork)
        self.spans: np.ndarray | None = None  # where liblmdb maps the file (map_spans)
        self.txn: lmdb.Transaction = None  # type: ignore[assignment]  # set by _begin
        self.fd = -1
        self.lease: EnvLease = None  # type: ignore[assignment]  # set by _open_file
        self.users = 0  # reads in progress (the reader counts them under its lock)
        self.poisoned = False  # a liblmdb call read zeros for a page of a shrunk file: use it no more
        self.retired = False
        self._mutex = threading.RLock()  # liblmdb calls and the table's opening: one thread at a time
        try:
            with translate_read_errors(path, "open"):
                self.file_id = self._open_file(lock)
        except BaseException:
            self.close()
            raise

    def _open_file(self, lock: bool) -> FileId:
        """Open the data file, a share of an environment of the same file (see the module docstring) and the read
        transaction; again while the path named another file by the time the environment opened, or another thread
        closed that environment meanwhile (to re-open it in a stronger mode).  Raises ``StoreReplacedError``: the path
        kept naming another file, or the environment kept being re-opened."""
        for _ in range(OPEN_TRIES):
            self.fd = os.open(self.path / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
            st = os.fstat(self.fd)
            try:
                self.lease = ENVS.acquire(
                    self.path,
                    writable=False,
                    lock=lock,
                    opener=lambda: open_reader_env(self.path, lock),
                    data_file=(st.st_dev, st.st_ino),
                )
            except FileChanged:
                pass  # the path named another file by the time the environment opened: again
            else:
                with self.lease.entry.using():
                    if self.lease.valid:
                        self.env = self.lease.env
                        self.snapshot = self._begin(self.lease.entry.lock)
                        return (st.st_dev, st.st_ino)
                self.lease.release()
                self.lease = None  # type: ignore[assignment]
            os.close(self.fd)
            self.fd = -1
        raise StoreReplacedError(
            "the data file was replaced, or its environment re-opened, again and again while it was opened",
            path=self.path,
        )

    @contextlib.contextmanager
    def lmdb(self) -> Iterator[None]:
        """Hold for a liblmdb call on this snapshot: one thread at a time, liblmdb's reads of its map guarded
        (``CorruptStoreError``: the data file shrank under the call)."""
        with self._mutex, self.lease.entry.using():
            try:
                with lmdb_guard(self.spans, self.fd):
                    yield
            except MapPatched:  # liblmdb read zeros: its transaction may be in error now, the next read re-opens
                self.poisoned = True
                raise shrunk(self.fd, self.snapshot.needed_bytes, self.path) from None

    def _begin(self, registered: bool) -> Snapshot:
        """Begin the read transaction and capture its snapshot (registered: again while a writer overwrote
        its meta page before it could be read, so that a table can be built for it)."""
        snap = None
        for _ in range(CAPTURE_TRIES):
            if self.txn is not None:
                self.txn.abort()
            self.spans = map_spans(self.path / DATA_FILE, os.fstat(self.fd).st_ino)
            try:
                with lmdb_guard(self.spans, self.fd):
                    self.txn = begin_read(self.env)  # may map the file anew (a writer grew it): found again below
            except MapPatched:
                raise shrunk(self.fd, MIN_DATA_FILE_BYTES, self.path) from None
            snap = capture(self.fd, self.txn.id(), registered, self.path)
            if snap.meta is not None or not snap.known_layout or not registered:
                break
        assert snap is not None
        self.spans = map_spans(self.path / DATA_FILE, os.fstat(self.fd).st_ino)
        return snap

    def load(self) -> None:
        """Read the metadata and open the sub-databases in this snapshot, and note the record's fingerprint
        (``NotAStoreError`` / ``CorruptStoreError`` / ``FormatVersionError``: no metadata, a damaged one, a missing
        sub-database)."""
        with translate_read_errors(self.path, "open"), self.lmdb():
            self.meta, raw = read_meta(self.env, self.txn, self.path)
            try:
                self.dbs = {name: self.env.open_db(name, txn=self.txn, create=False) for name in DATA_DBS}
            except lmdb.NotFoundError as exc:
                raise CorruptStoreError("a sub-database is missing", path=self.path) from exc
        self.snapshot = dataclasses.replace(self.snapshot, record=self._fingerprint(raw))

    def _fingerprint(self, raw: bytes) -> tuple[int, bytes] | None:
        """The fingerprint of this snapshot's metadata record ``raw`` (as liblmdb read it) where it lies in the file;
        ``None`` where the layout is unknown or the file does not show liblmdb's bytes there."""
        snap = self.snapshot.meta
        if snap is None:
            return None
        size = os.fstat(self.fd).st_size
        with contextlib.suppress(CorruptStoreError, OSError):
            off, n = record_position(PageReader(self.fd, size, snap, self.path, None), snap.main, DB_META, META_KEY)
            if n == len(raw) and os.pread(self.fd, n, off) == raw:
                return fingerprint(raw, off)
        return None

    def inherit(self, table: PositionTable | None) -> None:
        """Reuse ``table`` (kept by the reader across a fork, a re-open, ``close()``) if it is of exactly this
        snapshot of this store and data file (its :attr:`~PositionTable.key`); call after :meth:`load`."""
        if self.built or table is None or table.busy or self.snapshot.meta is None:
            return
        if table.key == table_key(self.meta.store_id, os.fstat(self.fd), self.snapshot.meta):
            self._use(table, "inherited")

    def protected(self) -> bool:
        """Whether this snapshot's pages may be trusted now (:meth:`~lmdbstore.store.snapshot.Snapshot.protected`)
        and its environment is still open (re-opened for a writer, retired for another file: re-snapshot)."""
        lease = self.lease
        return lease is not None and lease.valid and self.snapshot.protected(self.fd, self.txn, self.env)

    def _use(self, table: PositionTable | None, source: str, files: FileReader | None = None) -> None:
        self.table, self.table_source = table, source
        if table is not None:
            self.files = files or FileReader(self.fd, table.file_size, self.path, self.io_threads)
        self.built = True  # last: positions() reads the table without the lock once this is set

    def positions(self) -> PositionTable | None:
        """The position table of this snapshot, opened on first call; ``None``: use liblmdb (a data file whose layout
        the parser does not know, or a snapshot whose meta page was gone before it was read). Raises
        ``CorruptStoreError``: the file contradicts itself, its metadata or liblmdb."""
        if self.built:
            return self.table
        with self._mutex:
            if not self.built:
                self._build()
            return self.table

    def _build(self) -> None:
        snap = self.snapshot.meta
        if snap is None:
            self._use(None, "")
            return
        files = FileReader(self.fd, os.fstat(self.fd).st_size, self.path, self.io_threads)
        table = open_table(self.fd, self.meta, snap, store_id=self.meta.store_id, path=self.path, files=files)
        self._use(table, "built", files)

    def forget_after_fork(self) -> None:
        """Let go of a handle inherited through ``fork()`` so this process opens its own: every reference to the
        environment (:data:`~lmdbstore.store.registry.ENVS` handles it), the transaction not aborted."""
        self.txn = self.env = self.dbs = self.lease = None  # type: ignore[assignment]
        if self.files is not None:
            self.files.close()
            self.files = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1

    def retire(self) -> None:
        """No new reads start on this handle: close it now, or when the last read in progress ends (the caller
        holds the reader's lock, which guards :attr:`users`)."""
        self.retired = True
        if self.users == 0:
            self.close()

    def __del__(self) -> None:
        # a reader dropped without close() gives its share back (the last share closes the environment)
        if getattr(self, "lease", None) is not None and self.pid == os.getpid():
            with contextlib.suppress(Exception):
                self.close()

    def close(self) -> None:
        """End the transaction, and let go of the file reader, the descriptor and the share of the environment."""
        try:
            if self.txn is not None:
                with contextlib.suppress(lmdb.Error):
                    self.txn.abort()
        finally:
            self.txn = None  # type: ignore[assignment]
            if self.files is not None:
                self.files.close()
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = -1
            if self.lease is not None:
                self.lease.release()
            self.lease = None  # type: ignore[assignment]
