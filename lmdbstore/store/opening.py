"""Opening a store for writing: :func:`open_writer`, which creates the store when it is not there yet.  The writer
lock comes first (two writers never create or append to one store at once); creating writes the sub-databases and
the metadata in one first transaction (a creation killed before it leaves a directory the next writer creates).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import StoreExistsError, preview, translate_lmdb_errors
from lmdbstore.format.checksums import checksum_size
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.layout import ALL_DBS, DB_META, META_KEY
from lmdbstore.format.limits import LMDB_PAGE_SIZE
from lmdbstore.format.meta import StoreMeta, check_classes, new_store_id
from lmdbstore.format.packing import choose_samples_per_value
from lmdbstore.store.env import (
    DATA_FILE,
    ENV_OPTIONS,
    check_store_dir,
    open_env,
    raise_if_unborn,
    read_meta,
    to_be_created,
)
from lmdbstore.store.locks import acquire_writer_lock, release_lock
from lmdbstore.store.registry import ENVS
from lmdbstore.store.writer import StoreWriter, utc_now
from lmdbstore.version import __version__

__all__ = ["open_writer"]


def _check_same(meta: StoreMeta, path: Path, shape: Any, dtype: Any, classes: Sequence[str] | None) -> None:
    """Refuse (``StoreExistsError``) to append to a store whose shape, dtype or classes differ from those given
    (``None``: any)."""
    if shape is not None and tuple(int(s) for s in shape) != meta.shape:
        raise StoreExistsError(f"store holds shape {meta.shape}, asked for {tuple(shape)}", path=path)
    if dtype is not None and normalize_dtype(dtype) != meta.dtype:
        raise StoreExistsError(f"store holds dtype {meta.dtype}, asked for {np.dtype(dtype)}", path=path)
    if classes is not None and list(classes) != meta.classes:
        raise StoreExistsError(f"store has classes {preview(meta.classes)}, asked for {preview(classes)}", path=path)


def _options(config: WriterConfig) -> dict[str, Any]:
    """The writer's environment options besides the map size."""
    return {"sync": config.sync, "metasync": config.sync, "meminit": False}


def _new_meta(shape: Any, dtype: Any, classes: Sequence[str] | None, config: WriterConfig, page_size: int) -> StoreMeta:
    """The metadata of a new, empty store; ``samples_per_value`` is chosen for ``page_size`` unless configured
    (``ValueError``: missing ``shape``/``dtype``/``classes``, a shape of other than 1..4 positive dimensions, bad
    class names, or an unsupported dtype)."""
    if shape is None or dtype is None or classes is None:
        raise ValueError("shape, dtype and classes are required to create a store")
    shape_t = tuple(int(s) for s in shape)
    if not 1 <= len(shape_t) <= 4 or any(s < 1 for s in shape_t):
        raise ValueError(f"shape must have 1..4 positive dimensions, got {tuple(shape)}")
    classes_l = check_classes(classes)
    dt = normalize_dtype(dtype)
    sample_bytes = math.prod(shape_t) * np.dtype(dt).itemsize
    spv = config.samples_per_value or choose_samples_per_value(sample_bytes, checksum_size(config.checksum), page_size)
    now = utc_now()
    return StoreMeta(
        shape=shape_t,
        dtype=dt,
        classes=classes_l,
        samples_per_value=spv,
        checksum=config.checksum,
        created_by=f"lmdbstore {__version__}",
        created_at=now,
        updated_at=now,
        store_id=new_store_id(),
    )


def open_writer(
    path: str | os.PathLike[str],
    *,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    classes: Sequence[str] | None = None,
    config: WriterConfig | None = None,
) -> StoreWriter:
    """Open a store for appending, creating it if it does not exist.

    Creating needs ``shape``, ``dtype`` and ``classes``; for an existing store they may be omitted,
    and when given they must match (appending continues the indices).  A store whose creation was
    interrupted before its first commit (killed process; nothing stored) is created afresh.

    Example::

        with lmdbstore.open_writer("train.lmdb", shape=(25, 25), dtype="float32",
                                   classes=["a", "b", "c", "d", "e"]) as w:
            for x, y in generator():
                w.append(x, y)

    Raises:
        ValueError: missing or bad ``shape``/``dtype``/``classes`` when creating.
        StoreExistsError: the store exists with a different shape, dtype or classes.
        NotAStoreError: ``path`` holds something that is not a store, or a store whose creation was
            interrupted and no ``shape``/``dtype``/``classes`` to complete it.
        StoreLockedError: another writer has the store open (or is still creating it).
    """
    config = config or WriterConfig()
    p = Path(path)
    if to_be_created(p):
        if shape is None or dtype is None or classes is None:
            raise_if_unborn(p)  # an interrupted creation says so, and how to complete it
            raise ValueError("shape, dtype and classes are required to create a store")
        _new_meta(shape, dtype, classes, config, LMDB_PAGE_SIZE)  # validate before touching the disk
        p.mkdir(parents=True, exist_ok=True)
        lock_fd = acquire_writer_lock(p)  # a creation still running elsewhere holds it: StoreLockedError
        try:
            if to_be_created(p):  # still, now that no other writer can change it
                return _create(p, lock_fd, shape, dtype, classes, config)
            check_store_dir(p)  # another writer created the store meanwhile: open it like any existing store
        except BaseException:
            release_lock(lock_fd)
            raise
    else:
        check_store_dir(p)
        lock_fd = acquire_writer_lock(p)
    try:
        return _open_existing(p, lock_fd, shape, dtype, classes, config)
    except BaseException:
        release_lock(lock_fd)
        raise


def _open_existing(
    p: Path, lock_fd: int, shape: Any, dtype: Any, classes: Sequence[str] | None, config: WriterConfig
) -> StoreWriter:
    """Open the existing store ``p`` for appending, holding the writer lock (the caller releases it on error); the
    map starts at twice the data file (at least ``config.initial_map_size``, at most ``config.max_map_size`` but
    never below the file)."""
    size = os.path.getsize(p / DATA_FILE)
    map_size = max(config.initial_map_size, 2 * size)
    if config.max_map_size is not None:  # the ceiling holds on reopen too (never below the file)
        map_size = max(min(map_size, config.max_map_size), size)
    metas: list[StoreMeta] = []

    def check_and_open_dbs(env: lmdb.Environment) -> None:
        """The store's metadata checked, then its sub-databases opened, before any reader shares the environment."""
        with env.begin() as txn:
            metas.append(read_meta(env, txn, p)[0])
        _check_same(metas[0], p, shape, dtype, classes)
        with translate_lmdb_errors(p, "open"):
            for name in ALL_DBS:
                env.open_db(name)

    opener = functools.partial(open_env, p, readonly=False, map_size=map_size, **_options(config))
    lease = ENVS.acquire(p, writable=True, lock=True, own=True, opener=opener, setup=check_and_open_dbs)
    try:
        return StoreWriter(p, metas[0], lease, lock_fd, config)
    except BaseException:
        lease.release()
        raise


def _create(
    p: Path, lock_fd: int, shape: Any, dtype: Any, classes: Sequence[str] | None, config: WriterConfig
) -> StoreWriter:
    """Create the store in ``p`` (absent, empty or an interrupted creation: nothing committed, which LMDB initialises
    or keeps), holding the writer lock; until its first transaction commits, a rerun creates it afresh."""

    def create() -> lmdb.Environment:
        with translate_lmdb_errors(p, "create"):
            return lmdb.open(str(p), **ENV_OPTIONS, map_size=config.initial_map_size, **_options(config))

    made: list[StoreMeta] = []

    def first_commit(env: lmdb.Environment) -> None:  # the sub-databases and metadata, before anyone shares it
        meta = _new_meta(shape, dtype, classes, config, env.stat()["psize"])
        with translate_lmdb_errors(p, "create"), env.begin(write=True) as txn:
            dbs = {name: env.open_db(name, txn=txn) for name in ALL_DBS}
            txn.put(META_KEY, meta.to_json(), db=dbs[DB_META])
        made.append(meta)

    lease = ENVS.acquire(p, writable=True, lock=True, own=True, opener=create, setup=first_commit)
    return StoreWriter(p, made[0], lease, lock_fd, config)
