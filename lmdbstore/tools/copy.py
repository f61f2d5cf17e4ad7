"""A consistent copy of a store: :func:`copy_store`, LMDB's own ``mdb_env_copy2``, optionally compacting.

The copy reads one snapshot under a registered read transaction, so it is safe while readers and a
writer run; it is made in a temporary directory beside the destination and renamed into place.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from lmdbstore.errors import LmdbStoreError, StoreExistsError, translate_lmdb_errors
from lmdbstore.store.env import DATA_FILE, begin_read, check_store_dir, open_env, read_meta
from lmdbstore.util.atomic import fsync_path, temp_beside

__all__ = ["CopyReport", "copy_store"]


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_store` did: source and copy sizes (bytes of ``data.mdb``), samples, time."""

    source: str
    dest: str
    compact: bool
    samples: int
    source_bytes: int
    dest_bytes: int
    seconds: float


def copy_store(store: str | os.PathLike[str], dest: str | os.PathLike[str], *, compact: bool = False) -> CopyReport:
    """Copy ``store`` to the new directory ``dest`` with LMDB's own consistent copy.

    The copy is of one snapshot, taken under a registered read transaction (``lock=True``), so it is
    consistent while readers and a writer use the store; a writer's later commits are not in it.
    ``compact=True`` omits free pages and renumbers the rest (a smaller file; slower).  The copy is
    made in a temporary directory beside ``dest`` and renamed into place, then fsynced.

    py-lmdb refuses a second environment of one path in a process: close this process's readers of
    ``store`` first (DataLoader workers and other processes are fine).

    Raises:
        StoreExistsError: ``dest`` exists (and is not an empty directory).
        StoreNotFoundError, NotAStoreError, CorruptStoreError, LmdbStoreError: the store cannot be read.
    """
    src, dst = Path(store), Path(dest)
    check_store_dir(src)
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise StoreExistsError("destination exists", path=dst, hint="give a new directory")
    if not dst.parent.is_dir():
        raise LmdbStoreError("destination's parent directory does not exist", path=dst.parent)
    t0 = time.perf_counter()
    try:
        env = open_env(src, readonly=True, lock=True)
    except LmdbStoreError as exc:
        if "already open" in str(exc):
            raise LmdbStoreError(
                str(exc.message), path=src, hint="close this process's readers of the store first"
            ) from exc
        raise
    tmp = temp_beside(dst, "copy")
    try:
        with translate_lmdb_errors(src, "copy"):
            tmp.mkdir()
            env.copy(str(tmp), compact=compact)
        count = _sample_count(tmp)  # of the snapshot the copy took (a writer may have committed since)
        fsync_path(tmp / DATA_FILE)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
        fsync_path(dst.parent)
    finally:
        env.close()
        if tmp.exists():
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()
    return CopyReport(
        str(src),
        str(dst),
        compact,
        count,
        os.path.getsize(src / DATA_FILE),
        os.path.getsize(dst / DATA_FILE),
        time.perf_counter() - t0,
    )


def _sample_count(path: Path) -> int:
    """The sample count a freshly copied store's metadata holds (nobody else has it open yet)."""
    env = open_env(path, readonly=True, lock=False)
    try:
        with translate_lmdb_errors(path, "read the copy"):
            txn = begin_read(env)
            try:
                return read_meta(env, txn, path).count
            finally:
                txn.abort()
    finally:
        env.close()
