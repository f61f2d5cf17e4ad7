"""The per-process open state of a :class:`~lmdbstore.store.reader.StoreReader` (private)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import lmdb

from lmdbstore.errors import CorruptStoreError, translate_read_errors
from lmdbstore.format.layout import DATA_DBS, DB_SAMPLES, encode_key
from lmdbstore.store.env import DATA_FILE, begin_read, check_store_dir, open_env, read_meta
from lmdbstore.store.locks import resolve_lock
from lmdbstore.store.positions import PositionTable, PreadEngine, build_table
from lmdbstore.store.registry import ENVS


class Handle:
    """The per-process open state: a share of the environment, one long-lived read transaction,
    the sub-databases, and (built on first use) the position table of that transaction's snapshot."""

    def __init__(self, path: Path, lock: bool | None, io_threads: int, inherit: PositionTable | None = None):
        check_store_dir(path)
        self.pid = os.getpid()
        self.path = path
        self.lock = lock = resolve_lock(path, lock)
        self.lease = ENVS.acquire(
            path, writable=False, lock=lock, opener=lambda: open_env(path, readonly=True, lock=lock)
        )
        self.env = self.lease.env
        try:
            with translate_read_errors(path, "open"):
                self.txn = begin_read(self.env)
                self.meta = read_meta(self.env, self.txn, path)
                self.dbs = {name: self.env.open_db(name, txn=self.txn, create=False) for name in DATA_DBS}
                self.txnid = self.txn.id()
                self.fd = os.open(path / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except lmdb.NotFoundError as exc:
            self.lease.release()
            self.lease = None  # type: ignore[assignment]
            raise CorruptStoreError("a sub-database is missing", path=path) from exc
        except BaseException:
            self.lease.release()
            self.lease = None  # type: ignore[assignment]
            raise
        self.io_threads = io_threads
        self.table: PositionTable | None = None
        self.engine: PreadEngine | None = None
        self.built = False
        #: how this handle got its table: "" (not yet), "built", "inherited" (same snapshot, e.g. after fork)
        self.table_source = ""
        st = os.fstat(self.fd)
        same_file = (
            inherit is not None and inherit.file_id == (st.st_dev, st.st_ino) and inherit.file_size <= st.st_size
        )
        if inherit is not None and same_file and inherit.txnid == self.txnid:
            # same snapshot (e.g. inherited through fork, or re-opened): its offsets hold here too
            self._use(inherit)
            self.table_source = "inherited"

    def _use(self, table: PositionTable | None) -> None:
        self.built, self.table = True, table
        if table is not None:
            self.engine = PreadEngine(self.fd, table.file_size, self.io_threads, path=self.path)

    def positions(self) -> PositionTable | None:
        """The position table of this snapshot, built on first call; ``None``: use liblmdb."""
        if not self.built:
            db = self.dbs[DB_SAMPLES]
            pool = PreadEngine(self.fd, 0, self.io_threads, path=self.path)
            try:
                table = build_table(
                    self.fd,
                    self.meta,
                    self.txnid,
                    DB_SAMPLES,
                    lambda first: self.txn.get(encode_key(first), db=db),
                    path=self.path,
                    pmap=pool.pmap,
                )
            finally:
                pool.close()
            self._use(table)
            self.table_source = "built"
        return self.table

    def forget_after_fork(self) -> None:
        """Let go of a handle inherited through ``fork()`` so that this process can open its own.

        The environment itself is forgotten by :data:`~lmdbstore.store.registry.ENVS` (see
        :meth:`~lmdbstore.store.registry.EnvRegistry._after_fork`); here every reference to it goes, without
        aborting the transaction (with a reader lock, that would free the *parent's* reader slot).  The
        position table stays, for :meth:`__init__` to inherit.
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
            with contextlib.suppress(lmdb.Error):
                self.txn.abort()
        finally:
            self.txn = None  # type: ignore[assignment]
            if self.engine is not None:
                self.engine.close()
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.lease.release()
            self.lease = None  # type: ignore[assignment]
