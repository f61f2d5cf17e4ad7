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
    """
    with translate_lmdb_errors(path, "open"):
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
    try:
        check_file_size(env, path)
    except BaseException:
        env.close()
        raise
    return env


def read_meta(env: lmdb.Environment, txn: lmdb.Transaction, path: Path) -> StoreMeta:
    """Load and validate the metadata record in ``txn``.

    Raises:
        NotAStoreError: there is no metadata sub-database or record (an LMDB that is not ours).
        CorruptStoreError / FormatVersionError: the record is malformed.
    """
    with translate_lmdb_errors(path, "read metadata"):
        try:
            db = env.open_db(DB_META, txn=txn, create=False)
        except lmdb.NotFoundError:
            raise NotAStoreError("an LMDB environment, but not an lmdbstore store (no metadata)", path=path) from None
        raw = txn.get(META_KEY, db=db)
    if raw is None:
        raise NotAStoreError("an LMDB environment, but not an lmdbstore store (no metadata)", path=path)
    return StoreMeta.from_json(raw, path=str(path))
