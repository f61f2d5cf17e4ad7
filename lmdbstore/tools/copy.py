"""A consistent copy of a store: :func:`copy_store`, LMDB's own ``mdb_env_copy2``, made beside the destination
(``.DEST.copy-PID``; one a killed copy left is removed by the next copy there) and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lmdbstore.errors import (
    LmdbStoreError,
    StoreExistsError,
    StoreLockedError,
    StoreReplacedError,
    translate_lmdb_errors,
    translate_read_errors,
)
from lmdbstore.format.layout import DB_META, META_KEY
from lmdbstore.format.meta import new_store_id
from lmdbstore.store.env import DATA_FILE, check_store_dir, open_env, read_meta
from lmdbstore.store.locks import LOCK_FILE, hold_off_writers, lock_table_writable, release_lock
from lmdbstore.store.registry import ENVS, FileChanged
from lmdbstore.util.atomic import fsync_path, remove_stale_temps, temp_beside
from lmdbstore.util.paths import check_outside

__all__ = ["COPY_TAG", "CopyReport", "copy_store"]

#: Tag of the temporary directory a copy is made in (``.DEST.copy-PID``).
COPY_TAG = "copy"
#: What a copy's temporary directory holds: the copied data file and, once its metadata is rewritten, the
#: lock file LMDB creates (a directory holding anything else is never removed as a leftover).
COPY_FILES = frozenset({DATA_FILE, LOCK_FILE})
#: Room beyond the copied file for the transaction that gives the copy its store id.
COPY_MAP_SLACK = 64 << 20


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


def _check_dest(dst: Path) -> None:
    """Refuse a destination that exists or whose parent is not a writable directory (one line each)."""
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise StoreExistsError("destination exists", path=dst, hint="give a new directory")
    if not dst.parent.is_dir():
        raise LmdbStoreError("destination's parent directory does not exist", path=dst.parent)
    if not os.access(dst.parent, os.W_OK | os.X_OK):
        raise LmdbStoreError("cannot write to the destination's directory: permission denied", path=dst.parent)


def copy_store(store: str | os.PathLike[str], dest: str | os.PathLike[str], *, compact: bool = False) -> CopyReport:
    """Copy ``store`` to the new directory ``dest`` with LMDB's own consistent copy.

    The copy is of one snapshot, taken under a registered read transaction, so it is consistent while readers
    and a writer use the store.  ``compact=True`` omits free pages (a smaller file; slower).  The copy gets a new
    store id (a reader must never take one for the other), is made beside ``dest``, renamed into place and
    fsynced.  It shares this process's environment of ``store`` (py-lmdb refuses a second one).  A store whose
    reader table this process cannot write is copied lock-free, writers held off (a shared lock on
    ``writer.lock``, as ``verify`` takes); a writer that committed during the copy anyway is an error.

    Raises:
        StoreExistsError: ``dest`` exists (and is not an empty directory).
        LmdbStoreError: ``dest`` is ``store`` or lies inside it, or cannot be written (no such parent, no
            permission, a full disk...); without the reader table, a writer committed during the copy.
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        StoreLockedError: the store's reader table cannot be written and a writer is appending to it.
    """
    src, dst = Path(store), Path(dest)
    check_store_dir(src)
    check_outside(dst, [src], "destination")
    _check_dest(dst)
    t0 = time.perf_counter()
    registered = lock_table_writable(src)
    held = -1 if registered else _hold_off_writers(src)
    fd = -1
    try:
        with translate_read_errors(src, "copy"):
            fd = os.open(src / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)  # the file copied (its size is reported)
        st = os.fstat(fd)
        lease = ENVS.acquire(
            src,
            writable=False,
            lock=registered,
            opener=lambda: open_env(src, readonly=True, lock=registered),
            data_file=(st.st_dev, st.st_ino),
        )
    except BaseException as exc:
        release_lock(held)
        if fd >= 0:
            os.close(fd)
        if isinstance(exc, FileChanged):
            raise StoreReplacedError(
                "the data file was replaced as it was opened", path=src, hint="copy again"
            ) from None
        raise
    env = lease.env
    remove_stale_temps(dst, COPY_TAG, allowed=COPY_FILES)
    tmp = temp_beside(dst, COPY_TAG)
    try:
        try:
            tmp.mkdir()
        except OSError as exc:
            raise LmdbStoreError(f"cannot create the copy ({exc.strerror or exc})", path=dst) from exc
        with translate_lmdb_errors(src, "copy"):
            before = int(env.info()["last_txnid"])
            env.copy(str(tmp), compact=compact)
            after = int(env.info()["last_txnid"])
        if not registered and after > before + 1:
            raise LmdbStoreError(
                f"a writer committed {after - before} transactions during the lock-free copy (this process cannot "
                "use the store's reader table, lock.mdb, to hold its snapshot)",
                path=src,
                hint="copy again once no writer runs, or from an account that can write the store directory",
            )
        release_lock(held)
        held = -1
        lease.release()
        count = _give_own_id(tmp)
        fsync_path(tmp / DATA_FILE)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
        fsync_path(dst.parent)
        source_bytes = os.fstat(fd).st_size
    finally:
        release_lock(held)
        lease.release()
        os.close(fd)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return CopyReport(
        str(src), str(dst), compact, count, source_bytes, os.path.getsize(dst / DATA_FILE), time.perf_counter() - t0
    )


def _hold_off_writers(src: Path) -> int:
    """For a copy without the reader table: keep writers from starting (a shared ``flock`` on ``writer.lock``, as
    ``verify`` takes; ``-1`` where the store has none); the lock to release.

    Raises:
        StoreLockedError: a writer is appending now (one line, with what to do).
    """
    try:
        return hold_off_writers(src)
    except StoreLockedError:
        raise StoreLockedError(
            "a writer is appending to the store, and this process cannot use its reader table (lock.mdb: no "
            "write permission, or a read-only file system) to copy a consistent snapshot beside it",
            path=src,
            hint="copy once the writer is done, or from an account that can write the store directory",
        ) from None


def _give_own_id(path: Path) -> int:
    """Give the fresh copy at ``path`` (nobody else has it open) a store id of its own, in one durable
    transaction; returns the sample count of the snapshot the copy took."""
    size = os.path.getsize(path / DATA_FILE)
    env = ENVS.open_making_room(  # a stale environment's lock file may have had the copy's inode number
        path,
        lambda: open_env(path, readonly=False, lock=True, map_size=size + COPY_MAP_SLACK, sync=True, metasync=True),
    )
    try:
        with translate_lmdb_errors(path, "give the copy its store id"), env.begin(write=True) as w:
            meta = read_meta(env, w, path)[0]
            db = env.open_db(DB_META, txn=w, create=False)
            w.put(META_KEY, meta.with_(store_id=new_store_id()).to_json(), db=db)
        return meta.count
    finally:
        env.close()
