"""What a store directory is (and one whose creation was interrupted), opening its LMDB environment, beginning a read
transaction and reading its metadata, with the checks that turn hostile paths into one-line errors: shared by the
writer, the reader, ``verify`` and ``copy_store``.
"""

from __future__ import annotations

import os
import stat
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
from lmdbstore.format.pages import RESTORE_HINT, UnsupportedLayout, read_meta_page
from lmdbstore.store.locks import LOCK_FILE, WRITER_LOCK_FILE

__all__ = [
    "CREATION_FILES",
    "DATA_FILE",
    "begin_read",
    "check_count_fits",
    "check_store_dir",
    "open_env",
    "open_reader_env",
    "raise_if_unborn",
    "read_meta",
    "to_be_created",
    "unborn_reason",
]

#: The LMDB data file of a store (its one environment is the store directory).
DATA_FILE = "data.mdb"
#: All that creating a store leaves in its directory before the first commit (see :func:`unborn_reason`).
CREATION_FILES = frozenset({WRITER_LOCK_FILE, DATA_FILE, LOCK_FILE})


def unborn_reason(path: Path) -> str | None:
    """Why ``path`` is a store whose creation was interrupted before its first commit; ``None`` if it is not.

    Such a directory holds regular files among ``writer.lock``, ``lock.mdb`` and ``data.mdb`` only, and ``data.mdb``
    is missing, empty, or an LMDB file whose two meta pages both record an empty main database: it holds no data,
    and a writer may create the store in it.  Reads only the directory listing and the two meta pages.
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
    """Raise :class:`NotAStoreError` if ``path`` is a store whose creation was interrupted (:func:`unborn_reason`)."""
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
            hint=RESTORE_HINT,
        )


#: What every environment of a store is opened with: a directory holding ``data.mdb``, room for the
#: sub-databases, and no OS read-ahead (reads are random or planned; read-ahead would only waste the cache).
ENV_OPTIONS: dict[str, Any] = {"subdir": True, "max_dbs": MAX_DBS, "readahead": False}


def open_env(path: Path, *, readonly: bool, lock: bool = True, **kwargs: Any) -> lmdb.Environment:
    """Open the store's LMDB environment (extra keyword arguments go to ``lmdb.open``; errors are translated), again
    on MDB_MAP_RESIZED (py-lmdb begins a transaction while opening: see :func:`begin_read`).

    Raises:
        CorruptStoreError: the data file is shorter than the pages LMDB believes it has (a lookup there would
            kill the process with SIGBUS).
    """
    with translate_lmdb_errors(path, "open"):
        for attempt in range(8):
            try:
                env = lmdb.open(str(path), **ENV_OPTIONS, readonly=readonly, lock=lock, create=False, **kwargs)
                break
            except lmdb.MapResizedError:
                if attempt == 7:
                    raise
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        actual = os.path.getsize(path / DATA_FILE)
        if actual < needed:
            raise CorruptStoreError(
                f"data file is truncated: {actual} bytes, LMDB needs {needed}", path=path, hint=RESTORE_HINT
            )
        if lock:
            # Free the slots of processes that died holding a read transaction (killed DataLoader workers): they
            # would pile up while any process keeps the environment open, and pin pages the writer cannot reuse.
            with translate_lmdb_errors(path, "clear stale readers"):
                env.reader_check()
    except BaseException:
        env.close()
        raise
    return env


#: A reader maps at least this much address space (virtual memory only), and :data:`READER_MAP_FACTOR` times the file,
#: so that a writer growing the store rarely obliges it to ``set_mapsize`` (which ends every transaction).
READER_MAP_MIN = 64 << 30
READER_MAP_FACTOR = 4


def open_reader_env(path: Path, lock: bool) -> lmdb.Environment:
    """Open the store's environment read-only for readers, with room to grow (:data:`READER_MAP_MIN`; LMDB's own
    size where the address space is limited, ``ulimit -v``).  Errors as :func:`open_env`."""
    try:
        size = os.path.getsize(path / DATA_FILE)
    except OSError:
        size = 0
    try:
        return open_env(path, readonly=True, lock=lock, map_size=max(READER_MAP_MIN, READER_MAP_FACTOR * size))
    except LmdbStoreError as exc:
        if not isinstance(exc.__cause__, lmdb.MemoryError):
            raise
    return open_env(path, readonly=True, lock=lock)


def begin_read(env: lmdb.Environment) -> lmdb.Transaction:
    """Begin a zero-copy read transaction, adopting (``set_mapsize(0)``, a few times) a map that a writer in another
    process has grown meanwhile: LMDB answers MDB_MAP_RESIZED until then."""
    for _ in range(8):
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    return env.begin(buffers=True)


def read_meta(env: lmdb.Environment, txn: lmdb.Transaction, path: Path) -> tuple[StoreMeta, bytes]:
    """Load and validate the metadata record in ``txn``: the metadata, and the record's bytes as liblmdb returned them.

    Raises:
        NotAStoreError: there is no metadata sub-database or record (an LMDB that is not ours).
        CorruptStoreError / FormatVersionError: the record is malformed.
    """
    with translate_lmdb_errors(path, "read metadata"):
        try:
            buf = txn.get(META_KEY, db=env.open_db(DB_META, txn=txn, create=False))
        except (lmdb.NotFoundError, lmdb.IncompatibleError):  # Incompatible: a plain key "meta", no sub-database
            buf = None
        if buf is None:
            raise NotAStoreError("an LMDB environment, but not an lmdbstore store (no metadata)", path=path)
        raw = bytes(buf)
    meta = StoreMeta.from_json(raw, path=str(path))
    check_count_fits(meta, path)
    return meta, raw


def check_count_fits(meta: StoreMeta, path: Path) -> None:
    """Refuse (``CorruptStoreError``) metadata claiming more sample bytes than the data file holds: values are stored
    uncompressed, and trusting such a count would size ``labels()``'s (or verify's) tables by it."""
    size = os.path.getsize(path / DATA_FILE)
    if meta.count * meta.sample_bytes > size:
        raise CorruptStoreError(
            f"metadata claims {meta.count} samples ({meta.count * meta.sample_bytes} bytes) "
            f"but the data file holds only {size} bytes",
            path=path,
        )
