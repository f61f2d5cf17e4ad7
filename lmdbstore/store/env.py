"""Opening LMDB environments of a store, with the checks that turn hostile paths into clear errors.

Private: the writer and the reader share these helpers so both see the same store layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from lmdbstore.errors import (
    CorruptStoreError,
    LmdbStoreError,
    NotAStoreError,
    StoreNotFoundError,
    translate_lmdb_errors,
)
from lmdbstore.format.layout import DB_META, MAX_DBS, META_KEY
from lmdbstore.format.limits import MIN_DATA_FILE_BYTES
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import UnsupportedLayout, read_meta_page

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
WRITER_LOCK_FILE = "writer.lock"
#: All that creating a store leaves in its directory before the first commit (see :func:`unborn_reason`).
CREATION_FILES = frozenset({WRITER_LOCK_FILE, DATA_FILE, LOCK_FILE})


def unborn_reason(path: Path) -> str | None:
    """Why ``path`` is a store whose creation was interrupted before its first commit; ``None`` if it is not.

    Creating a store takes the writer lock (``writer.lock``), lets LMDB create ``lock.mdb`` and
    ``data.mdb`` (empty, then its two meta pages), and commits one transaction with the sub-databases and
    the metadata.  A directory killed before that commit holds regular files among those three only, and
    ``data.mdb`` is missing, empty, or an LMDB file whose two meta pages both record an empty main
    database (no sub-database, no key: nothing was ever committed).  Such a directory holds no data, so a
    writer may create the store in it.  Anything else (another file, a data file with any committed
    entry, one LMDB's layout we do not recognise or one shorter than its two meta pages) is not unborn.
    Reads only the directory listing and the two meta pages; writes nothing.
    """
    try:
        entries = {e.name: e for e in os.scandir(path)}
        if not entries or not set(entries) <= CREATION_FILES:
            return None
        if not all(stat.S_ISREG(e.stat(follow_symlinks=False).st_mode) for e in entries.values()):
            return None
        if DATA_FILE not in entries:
            return f"no {DATA_FILE} yet"
        fd = os.open(path / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return f"{DATA_FILE} is empty; a truncated data file looks the same"
            metas = [read_meta_page(fd, size, which, path) for which in (0, 1)]
        finally:
            os.close(fd)
    except (OSError, UnsupportedLayout, CorruptStoreError):
        return None
    if size < 2 * metas[0].psize or any(m.main.entries for m in metas):
        return None
    return f"{DATA_FILE} holds no committed transaction"


def raise_if_unborn(path: Path) -> None:
    """Raise :class:`NotAStoreError` (one line, with a hint) if ``path`` is a store whose creation was
    interrupted (see :func:`unborn_reason`)."""
    why = unborn_reason(path)
    if why is not None:
        raise NotAStoreError(
            f"the store's creation was interrupted before its first commit ({why})",
            path=path,
            hint="rerun the ingest that creates it, or open a writer with shape, dtype and classes, to complete it",
        )


def to_be_created(path: Path) -> bool:
    """Whether a writer given shape, dtype and classes creates the store at ``path``: nothing is there, an
    empty directory, or a store whose creation was interrupted (:func:`unborn_reason`)."""
    if not path.exists():
        return True
    return path.is_dir() and (not any(path.iterdir()) or unborn_reason(path) is not None)


def writer_active(path: Path) -> bool:
    """Whether a writer holds the store's ``writer.lock`` now: a non-blocking shared ``flock`` probe.

    A writer holds an exclusive lock for as long as it is open; ``verify``'s shared lock does not count.
    ``False`` when there is no lock file or it cannot be opened (no writer could have taken it either).
    """
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


def check_store_dir(path: Path) -> None:
    """Raise unless ``path`` is a directory holding an LMDB data file.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        NotAStoreError: ``path`` is a file, a directory without ``data.mdb``, or a store whose creation was
            interrupted before its first commit (see :func:`unborn_reason`).
    """
    try:
        if not path.exists():
            raise StoreNotFoundError("no such store", path=path, hint="create it with `lmdbstore ingest`")
        if not path.is_dir():
            raise NotAStoreError("not a store (a store is a directory)", path=path)
        raise_if_unborn(path)
        if not (path / DATA_FILE).is_file():
            raise NotAStoreError(f"not a store (no {DATA_FILE} inside)", path=path)
        size = os.path.getsize(path / DATA_FILE)
    except PermissionError as exc:
        raise LmdbStoreError(
            f"permission denied ({exc.filename or path})", path=path, hint="check the store's permissions"
        ) from exc
    if size < MIN_DATA_FILE_BYTES:
        # LMDB would misreport this (EBADF for an empty file), and a writer would re-initialise it.
        raise CorruptStoreError(
            f"data file is truncated: {size} bytes, shorter than LMDB's two meta pages",
            path=path,
            hint="restore the store from a copy",
        )


def check_file_size(env: lmdb.Environment, path: Path) -> None:
    """Refuse a data file shorter than the pages LMDB believes it has.

    Reading a page past the end of a memory-mapped file kills the process with SIGBUS, so a
    truncated file must be caught before any lookup.
    """
    info = env.info()
    psize = env.stat()["psize"]
    needed = (info["last_pgno"] + 1) * psize
    actual = os.path.getsize(path / DATA_FILE)
    if actual < needed:
        raise CorruptStoreError(
            f"data file is truncated: {actual} bytes, LMDB needs {needed}",
            path=path,
            hint="restore the store from a copy",
        )


def open_env(path: Path, *, readonly: bool, lock: bool = True, **kwargs: Any) -> lmdb.Environment:
    """Open the store's LMDB environment (a directory) with our sub-database count.

    Extra keyword arguments go to ``lmdb.open``.  Errors are translated into ``LmdbStoreError``s.
    Opening retries a few times on MDB_MAP_RESIZED: py-lmdb begins a transaction while opening, and
    a writer in another process may have grown the map and committed in between (see
    :func:`begin_read`).
    """
    with translate_lmdb_errors(path, "open"):
        for attempt in range(8):
            try:
                env = lmdb.open(
                    str(path),
                    subdir=True,
                    readonly=readonly,
                    lock=lock,
                    max_dbs=MAX_DBS,
                    readahead=False,
                    create=False,
                    **kwargs,
                )
                break
            except lmdb.MapResizedError:
                if attempt == 7:
                    raise
    try:
        check_file_size(env, path)
        if lock:
            # Free the reader-table slots of processes that died holding a read transaction (e.g.
            # SIGKILLed DataLoader workers).  LMDB only resets the table when no process has the
            # environment open, so without this, stale slots pile up while any process keeps it
            # open, until MDB_READERS_FULL (126 slots), and they pin old pages the writer cannot reuse.
            with translate_lmdb_errors(path, "clear stale readers"):
                env.reader_check()
    except BaseException:
        env.close()
        raise
    return env


def begin_read(env: lmdb.Environment) -> lmdb.Transaction:
    """Begin a zero-copy read transaction, adopting a map that a writer has grown meanwhile.

    A writer in another process may grow the map between our open and our first transaction; LMDB
    then answers MDB_MAP_RESIZED until this environment adopts the new size (``set_mapsize(0)``
    takes it from the meta page).  The writer can grow it again in between, hence the few retries.
    """
    for _ in range(8):
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    return env.begin(buffers=True)


def read_meta(env: lmdb.Environment, txn: lmdb.Transaction, path: Path) -> StoreMeta:
    """Load and validate the metadata record in ``txn``.

    Raises:
        NotAStoreError: there is no metadata sub-database or record (an LMDB that is not ours).
        CorruptStoreError / FormatVersionError: the record is malformed.
    """
    with translate_lmdb_errors(path, "read metadata"):
        try:
            db = env.open_db(DB_META, txn=txn, create=False)
        except (lmdb.NotFoundError, lmdb.IncompatibleError):
            # IncompatibleError: the main database has a plain key "meta", not a sub-database.
            raise NotAStoreError("an LMDB environment, but not an lmdbstore store (no metadata)", path=path) from None
        raw = txn.get(META_KEY, db=db)
    if raw is None:
        raise NotAStoreError("an LMDB environment, but not an lmdbstore store (no metadata)", path=path)
    meta = StoreMeta.from_json(raw, path=str(path))
    check_count_fits(meta, path)
    return meta


def check_count_fits(meta: StoreMeta, path: Path) -> None:
    """Refuse metadata claiming more sample bytes than the data file holds.

    Values are stored uncompressed, so ``count * sample_bytes`` can never exceed the file size; a
    larger count is damaged or forged metadata, and trusting it would make ``labels()`` (or verify)
    allocate a table of ``count`` entries.
    """
    size = os.path.getsize(path / DATA_FILE)
    if meta.count * meta.sample_bytes > size:
        raise CorruptStoreError(
            f"metadata claims {meta.count} samples ({meta.count * meta.sample_bytes} bytes) "
            f"but the data file holds only {size} bytes",
            path=path,
        )


# ---------------------------------------------------------------------- one environment per path and process
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
