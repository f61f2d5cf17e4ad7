"""Writing samples into a store: :func:`open_writer` and :class:`StoreWriter`.

The writer buffers appended samples and commits them in bounded transactions.  Each commit writes,
in one LMDB transaction: the packed sample values, the label chunks, the per-class index chunks, the
metadata (count, class counts, value statistics) and the resume ledger.  A crash therefore leaves the
store exactly as of the last commit, and a rerun can continue from the ledger.
"""

from __future__ import annotations

import fcntl
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import (
    CorruptStoreError,
    LmdbStoreError,
    StoreExistsError,
    StoreFullError,
    StoreLockedError,
    preview,
    translate_lmdb_errors,
)
from lmdbstore.format.checksums import checksum_size, compute_checksum
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.layout import (
    DB_CLASSIDX,
    DB_LABELS,
    DB_META,
    DB_PROGRESS,
    DB_SAMPLES,
    INDEX_DTYPE,
    MAX_DBS,
    META_KEY,
    classidx_key,
    encode_key,
)
from lmdbstore.format.ledger import encode_entry, parse_entry
from lmdbstore.format.limits import LMDB_PAGE_SIZE
from lmdbstore.format.meta import StoreMeta, check_classes
from lmdbstore.format.packing import choose_samples_per_value
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.store.env import (
    DATA_FILE,
    ENVS,
    WRITER_LOCK_FILE,
    check_store_dir,
    open_env,
    raise_if_unborn,
    read_meta,
    to_be_created,
)
from lmdbstore.store.validation import check_samples, label_ids
from lmdbstore.version import __version__

__all__ = ["StoreWriter", "open_writer"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class _Tail:
    """In-memory copy of what the next commit must rewrite: the last, partly filled chunks."""

    samples: bytes = b""  # payload of the last value if it holds fewer than samples_per_value
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    class_tails: dict[int, np.ndarray] = field(default_factory=dict)


class StoreWriter:
    """Appends samples and labels to a store; use :func:`open_writer` to get one.

    Only one writer may hold a store at a time (an exclusive ``flock`` on ``writer.lock``); a second
    one gets :class:`~lmdbstore.errors.StoreLockedError` at once rather than blocking.

    Appended samples are buffered and committed when ``config.commit_bytes`` are pending, on
    :meth:`commit`, and when the writer is closed without an exception.  Leaving the ``with`` block
    with an exception discards what was not yet committed (like a rolled-back transaction).
    """

    def __init__(self, path: Path, meta: StoreMeta, env: lmdb.Environment, lock_fd: int, config: WriterConfig):
        self.path = path
        self.config = config
        self._meta = meta
        self._env = env
        self._lock_fd = lock_fd
        self._dbs = {name: env.open_db(name) for name in (DB_SAMPLES, DB_LABELS, DB_CLASSIDX, DB_META, DB_PROGRESS)}
        self._checksum = compute_checksum(meta.checksum)
        self._trailer = checksum_size(meta.checksum)
        self._pending_x: list[np.ndarray] = []
        self._pending_y: list[np.ndarray] = []
        self._pending_stats_of: list[ValueStats | None] = []  # precomputed statistics per pending batch
        self._pending_bytes = 0
        self._pending_progress: dict[str, dict[str, Any]] = {}
        self._pending_stats = ValueStats()
        self._tail = self._load_tail()
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def meta(self) -> StoreMeta:
        """Metadata as of the last commit."""
        return self._meta

    @property
    def committed(self) -> int:
        """Samples committed so far (what a crash now would keep)."""
        return self._meta.count

    @property
    def count(self) -> int:
        """Samples committed plus samples appended and not yet committed."""
        return self._meta.count + sum(len(y) for y in self._pending_y)

    @property
    def classes(self) -> list[str]:
        return list(self._meta.classes)

    # ------------------------------------------------------------------ tail state
    def _load_tail(self) -> _Tail:
        """Read the partly filled last value / label chunk / class-index chunks from disk."""
        m = self._meta
        tail = _Tail(labels=np.zeros(0, m.label_dtype))
        with self._env.begin(buffers=False) as txn:
            n_tail = m.count % m.samples_per_value
            if n_tail:
                first = m.count - n_tail
                raw = txn.get(encode_key(first), db=self._dbs[DB_SAMPLES])
                if raw is None or len(raw) != m.expected_value_len(first):
                    raise CorruptStoreError("last value is missing or has the wrong length", path=self.path, key=first)
                tail.samples = raw[: n_tail * m.sample_bytes]
            n_lab = m.count % m.label_chunk
            if n_lab:
                first = m.count - n_lab
                raw = txn.get(encode_key(first), db=self._dbs[DB_LABELS])
                if raw is None or len(raw) != n_lab * m.label_dtype.itemsize:
                    raise CorruptStoreError(
                        "last label chunk is missing or has the wrong length", path=self.path, key=first
                    )
                tail.labels = np.frombuffer(raw, m.label_dtype).copy()
            for c, n_c in enumerate(m.class_counts):
                n_part = n_c % m.label_chunk
                if n_part:
                    raw = txn.get(classidx_key(c, n_c - n_part), db=self._dbs[DB_CLASSIDX])
                    if raw is None or len(raw) != n_part * INDEX_DTYPE.itemsize:
                        raise CorruptStoreError(
                            f"last index chunk of class {m.classes[c]!r} is missing or has the wrong length",
                            path=self.path,
                        )
                    tail.class_tails[c] = np.frombuffer(raw, INDEX_DTYPE).copy()
        return tail

    # ------------------------------------------------------------------ resume ledger
    def progress(self, name: str) -> int:
        """Committed position recorded for ``name`` by ``append(..., progress=...)`` (0 if none).

        A producer that records its position with every append can resume after a crash by
        skipping what this returns: the ledger is committed atomically with the samples.
        """
        with self._env.begin() as txn:
            raw = txn.get(name.encode(), db=self._dbs[DB_PROGRESS])
        if raw is None:
            return 0
        return int(parse_entry(raw, self.path, name)["done"])

    def progress_entries(self) -> dict[str, dict[str, Any]]:
        """The whole committed resume ledger: name -> {"done": int, "total": int | None}."""
        out: dict[str, dict[str, Any]] = {}
        with self._env.begin() as txn:
            for k, v in txn.cursor(db=self._dbs[DB_PROGRESS]):
                name = bytes(k).decode("utf-8", "replace")
                out[name] = parse_entry(bytes(v), self.path, name)
        return out

    # ------------------------------------------------------------------ appending
    def check_samples(self, x: Any, *, cast: bool = False) -> np.ndarray:
        """Validate a batch against this store (see :func:`check_samples`)."""
        m = self._meta
        return check_samples(
            x, m.shape, m.np_dtype, allow_nonfinite=self.config.allow_nonfinite, cast=cast, path=self.path
        )

    def append(
        self,
        x: Any,
        y: Any,
        *,
        progress: tuple[str, int] | None = None,
        progress_total: int | None = None,
        cast: bool = False,
        stats: ValueStats | None = None,
    ) -> int:
        """Append a batch of samples ``x`` (shape ``(N, *shape)`` or one sample) with labels ``y``.

        Args:
            x: samples; validated against the store's shape and dtype.
            y: labels: class ids, class names, or one id/name for the whole batch.
            progress: ``(name, position)`` to record in the resume ledger with these samples.
            progress_total: total size of that producer, kept beside the position (optional).
            cast: convert ``x`` to the store's dtype when the kinds agree (e.g. float64 -> float32).
            stats: ``ValueStats`` of ``x`` computed elsewhere (a worker process), folded into the
                metadata instead of recomputing them here; trusted as given.

        Returns:
            The index the first sample of the batch receives.

        Raises:
            ValidationError: bad shape/dtype/values/labels; nothing of the batch is kept.
        """
        self._check_open()
        arr = self.check_samples(x, cast=cast)
        if np.may_share_memory(arr, np.asarray(x)):
            arr = arr.copy()  # buffered until the commit: the caller may reuse its array meanwhile
        ids = label_ids(y, len(arr), self._meta.classes, path=self.path)
        first = self.count
        if len(arr):
            self._pending_x.append(arr)
            self._pending_y.append(ids)
            self._pending_stats_of.append(stats)
            self._pending_bytes += arr.nbytes
        if progress is not None:
            name, pos = progress
            self._pending_progress[name] = {"done": int(pos), "total": progress_total}
        if self._pending_bytes >= self.config.commit_bytes:
            self.commit()
        return first

    # ------------------------------------------------------------------ committing
    def commit(self) -> None:
        """Write everything pending in one transaction (growing the map if needed) and fsync it."""
        self._check_open()
        if not self._pending_x and not self._pending_progress:
            return
        if len(self._pending_x) == 1:
            x = self._pending_x[0]  # already the writer's own copy
        elif self._pending_x:
            x = np.concatenate(self._pending_x)
        else:
            x = np.zeros((0, *self._meta.shape), self._meta.np_dtype)
        y = np.concatenate(self._pending_y) if self._pending_y else np.zeros(0, self._meta.label_dtype)
        stats = ValueStats(**vars(self._meta.value_stats))
        if all(s is None for s in self._pending_stats_of):
            stats.update(x)
        else:  # some batches came with statistics computed elsewhere
            for a, s in zip(self._pending_x, self._pending_stats_of, strict=True):
                if s is None:
                    stats.update(a)
                else:
                    stats.merge(s)
        with translate_lmdb_errors(self.path, "clear stale readers"):
            # Slots of killed lock=True readers pin old pages, which would make the file grow.
            self._env.reader_check()
        while True:
            try:
                with translate_lmdb_errors(self.path, "commit"):
                    new_meta, new_tail = self._write(x, y, stats)
                break
            except StoreFullError as exc:
                if not isinstance(exc.__cause__, lmdb.MapFullError) or not self._grow_map():
                    raise
        self._meta, self._tail = new_meta, new_tail
        self._pending_x, self._pending_y, self._pending_bytes = [], [], 0
        self._pending_stats_of = []
        self._pending_progress = {}

    def _grow_map(self) -> bool:
        """Double the map size; False if that would pass ``config.max_map_size``."""
        current = self._env.info()["map_size"]
        new = current * 2
        if self.config.max_map_size is not None:
            if current >= self.config.max_map_size:
                return False
            new = min(new, self.config.max_map_size)
        self._env.set_mapsize(new)
        return True

    def _write(self, x: np.ndarray, y: np.ndarray, stats: ValueStats) -> tuple[StoreMeta, _Tail]:
        m = self._meta
        spv, sb, chunk = m.samples_per_value, m.sample_bytes, m.label_chunk
        n_new = len(x)
        count = m.count + n_new
        with self._env.begin(write=True) as txn:
            # samples: rewrite the partial last value, then append full values
            n_tail = len(self._tail.samples) // sb
            start = m.count - n_tail
            tail = self._tail.samples
            xb = memoryview(x.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers

            def payload(lo: int, hi: int) -> bytes | memoryview:
                """Bytes lo..hi of (old partial value + new samples), copying only across the seam."""
                if hi <= len(tail):
                    return tail[lo:hi]
                if lo >= len(tail):
                    return xb[lo - len(tail) : hi - len(tail)]
                return tail[lo:] + bytes(xb[: hi - len(tail)])

            db = self._dbs[DB_SAMPLES]
            pos = 0
            for first in range(start, count, spv):
                n = min(spv, count - first)
                value: bytes | memoryview = payload(pos * sb, (pos + n) * sb)
                if self._checksum is not None:
                    value = b"".join((value, self._checksum(value)))
                if first == start and n_tail:
                    txn.put(encode_key(first), value, db=db)
                elif not txn.put(encode_key(first), value, db=db, append=True):
                    raise CorruptStoreError("append out of key order", path=self.path, key=first)
                pos += n
            total = (count - start) * sb
            new_tail_samples = bytes(payload(total - count % spv * sb, total)) if count % spv else b""
            # labels
            labels = np.concatenate([self._tail.labels, y])
            lab_start = m.count - len(self._tail.labels)
            self._put_chunks(txn, self._dbs[DB_LABELS], lab_start, labels, chunk, lambda p: encode_key(p))
            new_labels_tail = labels[len(labels) - count % chunk :] if count % chunk else labels[:0]
            # per-class index lists
            class_counts = list(m.class_counts)
            class_tails = dict(self._tail.class_tails)
            if n_new:
                new_idx = np.arange(m.count, count, dtype=INDEX_DTYPE)
                order = np.argsort(y, kind="stable")
                bounds = np.searchsorted(y[order], np.arange(len(m.classes) + 1))
                for c in range(len(m.classes)):
                    lo, hi = bounds[c], bounds[c + 1]
                    if lo == hi:
                        continue
                    prev = class_tails.get(c, np.zeros(0, INDEX_DTYPE))
                    idx = np.concatenate([prev, new_idx[order[lo:hi]]])
                    c_start = class_counts[c] - len(prev)
                    self._put_chunks(
                        txn, self._dbs[DB_CLASSIDX], c_start, idx, chunk, lambda p, c=c: classidx_key(c, p)
                    )
                    class_counts[c] += int(hi - lo)
                    n_part = class_counts[c] % chunk
                    class_tails[c] = idx[len(idx) - n_part :] if n_part else idx[:0]
            # ledger and metadata
            for name, entry in self._pending_progress.items():
                txn.put(name.encode(), encode_entry(**entry), db=self._dbs[DB_PROGRESS])
            new_meta = m.with_(count=count, class_counts=class_counts, value_stats=stats, updated_at=_now())
            txn.put(META_KEY, new_meta.to_json(), db=self._dbs[DB_META])
        return new_meta, _Tail(new_tail_samples, new_labels_tail.copy(), {c: t.copy() for c, t in class_tails.items()})

    @staticmethod
    def _put_chunks(txn: lmdb.Transaction, db: Any, start: int, arr: np.ndarray, chunk: int, key: Any) -> None:
        """Write ``arr`` (whose first entry sits at list position ``start``) in ``chunk``-aligned pieces."""
        assert start % chunk == 0, "chunk writes start at a chunk boundary"
        for off in range(0, len(arr), chunk):
            txn.put(key(start + off), arr[off : off + chunk].tobytes(), db=db)

    # ------------------------------------------------------------------ closing
    def abort(self) -> None:
        """Discard everything appended since the last commit."""
        self._pending_x, self._pending_y, self._pending_bytes = [], [], 0
        self._pending_stats_of = []
        self._pending_progress = {}

    def close(self, commit: bool = True) -> None:
        """Commit what is pending (unless ``commit=False``), close the environment, release the lock."""
        if self._closed:
            return
        try:
            if commit:
                self.commit()
        finally:
            self._closed = True
            ENVS.release_env(self._env)  # shared with this process's readers of the store
            os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise LmdbStoreError("writer is closed", path=self.path)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        self.close(commit=exc_type is None)


def _acquire_lock(path: Path) -> int:
    try:
        fd = os.open(path / WRITER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a directory named writer.lock, no write permission, a read-only file system
        raise LmdbStoreError(
            f"cannot open the writer lock {WRITER_LOCK_FILE} ({exc.strerror or exc})",
            path=path,
            hint="a writer needs to create and write this file in the store directory",
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(
            "another writer is using this store (or `lmdbstore verify` is checking its file structure)",
            path=path,
            hint="wait for it to finish",
        ) from None
    return fd


def _check_same(meta: StoreMeta, path: Path, shape: Any, dtype: Any, classes: Sequence[str] | None) -> None:
    if shape is not None and tuple(int(s) for s in shape) != meta.shape:
        raise StoreExistsError(f"store holds shape {meta.shape}, asked for {tuple(shape)}", path=path)
    if dtype is not None and normalize_dtype(dtype) != meta.dtype:
        raise StoreExistsError(f"store holds dtype {meta.dtype}, asked for {np.dtype(dtype)}", path=path)
    if classes is not None and list(classes) != meta.classes:
        raise StoreExistsError(f"store has classes {preview(meta.classes)}, asked for {preview(classes)}", path=path)


def _new_meta(shape: Any, dtype: Any, classes: Sequence[str] | None, config: WriterConfig, page_size: int) -> StoreMeta:
    if shape is None or dtype is None or classes is None:
        raise ValueError("shape, dtype and classes are required to create a store")
    shape_t = tuple(int(s) for s in shape)
    if not 1 <= len(shape_t) <= 4 or any(s < 1 for s in shape_t):
        raise ValueError(f"shape must have 1..4 positive dimensions, got {tuple(shape)}")
    classes_l = check_classes(classes)
    dt = normalize_dtype(dtype)
    sample_bytes = math.prod(shape_t) * np.dtype(dt).itemsize
    spv = config.samples_per_value or choose_samples_per_value(sample_bytes, checksum_size(config.checksum), page_size)
    now = _now()
    return StoreMeta(
        shape=shape_t,
        dtype=dt,
        classes=classes_l,
        samples_per_value=spv,
        checksum=config.checksum,
        created_by=f"lmdbstore {__version__}",
        created_at=now,
        updated_at=now,
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
        probe = _new_meta(shape, dtype, classes, config, LMDB_PAGE_SIZE)  # validate before touching the disk
        del probe
        p.mkdir(parents=True, exist_ok=True)
        lock_fd = _acquire_lock(p)  # a creation still running elsewhere holds it: StoreLockedError
        try:
            if to_be_created(p):  # still, now that no other writer can change it
                return _create(p, lock_fd, shape, dtype, classes, config)
            check_store_dir(p)  # another writer created the store meanwhile: open it like any existing store
        except BaseException:
            os.close(lock_fd)
            raise
    else:
        check_store_dir(p)
        lock_fd = _acquire_lock(p)
    try:
        size = os.path.getsize(p / DATA_FILE)
        map_size = max(config.initial_map_size, 2 * size)
        if config.max_map_size is not None:  # the ceiling holds on reopen too (never below the file)
            map_size = max(min(map_size, config.max_map_size), size)
        ENVS.prepare(p, writable=True)
        env = open_env(
            p,
            readonly=False,
            map_size=map_size,
            sync=config.sync,
            metasync=config.sync,
            meminit=False,
        )
        ENVS.adopt(p, env, writable=True)
        try:
            with env.begin() as txn:
                meta = read_meta(env, txn, p)
            _check_same(meta, p, shape, dtype, classes)
            return StoreWriter(p, meta, env, lock_fd, config)
        except BaseException:
            ENVS.release_env(env)
            raise
    except BaseException:
        os.close(lock_fd)
        raise


def _create(
    p: Path, lock_fd: int, shape: Any, dtype: Any, classes: Sequence[str] | None, config: WriterConfig
) -> StoreWriter:
    """Create the store in ``p`` (absent, empty or an interrupted creation), holding the writer lock.

    An interrupted creation's ``data.mdb`` has nothing committed (see :func:`unborn_reason`): LMDB
    initialises an empty one and keeps one with empty meta pages, and this first transaction makes it a
    store either way.  Until it commits, the directory stays one that a rerun creates afresh.
    """
    ENVS.prepare(p, writable=True)
    with translate_lmdb_errors(p, "create"):
        env = lmdb.open(
            str(p),
            subdir=True,
            map_size=config.initial_map_size,
            max_dbs=MAX_DBS,
            sync=config.sync,
            metasync=config.sync,
            readahead=False,
            meminit=False,
        )
    ENVS.adopt(p, env, writable=True)
    try:
        meta = _new_meta(shape, dtype, classes, config, env.stat()["psize"])
        with translate_lmdb_errors(p, "create"), env.begin(write=True) as txn:
            for name in (DB_SAMPLES, DB_LABELS, DB_CLASSIDX, DB_PROGRESS):
                env.open_db(name, txn=txn)
            txn.put(META_KEY, meta.to_json(), db=env.open_db(DB_META, txn=txn))
    except BaseException:
        ENVS.release_env(env)
        raise
    return StoreWriter(p, meta, env, lock_fd, config)
