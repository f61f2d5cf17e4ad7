"""Opening LMDB environments of a store, with the checks that turn hostile paths into clear errors.

Private: the writer and the reader share these helpers so both see the same store layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lmdb

from .errors import CorruptStoreError, NotAStoreError, StoreNotFoundError, translate_lmdb_errors
from .format import DB_META, MAX_DBS, META_KEY, StoreMeta

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
WRITER_LOCK_FILE = "writer.lock"
#: Every LMDB data file starts with two meta pages (at least 4 KiB each).
MIN_DATA_FILE_BYTES = 2 * 4096


def check_store_dir(path: Path) -> None:
    """Raise unless ``path`` is a directory holding an LMDB data file.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        NotAStoreError: ``path`` is a file, or a directory without ``data.mdb``.
    """
    if not path.exists():
        raise StoreNotFoundError("no such store", path=path, hint="create it with `lmdbstore ingest`")
    if not path.is_dir():
        raise NotAStoreError("not a store (a store is a directory)", path=path)
    if not (path / DATA_FILE).is_file():
        raise NotAStoreError(f"not a store (no {DATA_FILE} inside)", path=path)
    size = os.path.getsize(path / DATA_FILE)
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
