"""Appending to a store: :class:`StoreWriter` (get one with :func:`lmdbstore.store.opening.open_writer`).  Each
commit writes the packed values, label chunks, class-index chunks, metadata and resume ledger in one transaction:
a crash leaves the store exactly as of the last commit, and a rerun continues from the ledger.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import CorruptStoreError, LmdbStoreError, StoreFullError, translate_lmdb_errors
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.layout import (
    ALL_DBS,
    DB_CLASSIDX,
    DB_LABELS,
    DB_META,
    DB_PROGRESS,
    DB_SAMPLES,
    INDEX_DTYPE,
    META_KEY,
    classidx_key,
    encode_key,
)
from lmdbstore.format.ledger import check_entry, encode_entry, parse_entry
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.store.locks import release_lock
from lmdbstore.store.registry import EnvLease
from lmdbstore.store.tail import Tail, load_tail
from lmdbstore.store.validation import check_samples, label_ids
from lmdbstore.util.memory import clip_bytes

__all__ = ["StoreWriter", "utc_now"]


class _Pieces:
    """Consecutive byte ranges of buffers laid end to end (a value's payload may span two batches): a view
    where a range lies in one buffer, copied only across a seam."""

    def __init__(self, buffers: list[bytes | memoryview]) -> None:
        self._buffers, self._i, self._pos = [b for b in buffers if len(b)], 0, 0

    def take(self, n: int) -> bytes | memoryview:
        """The next ``n`` bytes."""
        parts = []
        while n:
            buf = self._buffers[self._i]
            k = min(n, len(buf) - self._pos)
            parts.append(buf[self._pos : self._pos + k])
            self._pos, n = self._pos + k, n - k
            if self._pos == len(buf):
                self._i, self._pos = self._i + 1, 0
        return parts[0] if len(parts) == 1 else b"".join(parts)


def utc_now() -> str:
    """The current time as the metadata records it (``created_at``, ``updated_at``): UTC, ISO 8601, seconds."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class StoreWriter:
    """Appends samples and labels to a store (one writer at a time: a second gets
    :class:`~lmdbstore.errors.StoreLockedError` at once); use :func:`~lmdbstore.store.opening.open_writer`.

    Appended samples are committed when ``config.commit_bytes`` are pending (at most half the memory available when
    the writer opens: a larger value is clipped, with a warning), on :meth:`commit`, and on closing without an
    exception; leaving the ``with`` block with one discards what was not committed.
    """

    def __init__(self, path: Path, meta: StoreMeta, lease: EnvLease, lock_fd: int, config: WriterConfig):
        self.path = path
        self.config = config
        self._meta = meta
        self._lease, self._env = lease, lease.env
        self._lock_fd = lock_fd
        self._dbs = {name: self._env.open_db(name) for name in ALL_DBS}
        self._checksum = compute_checksum(meta.checksum)
        self._pending_x: list[np.ndarray] = []
        self._pending_y: list[np.ndarray] = []
        self._pending_stats_of: list[ValueStats | None] = []  # precomputed statistics per pending batch
        self._pending_bytes = 0
        self._pending_progress: dict[str, dict[str, Any]] = {}
        self._tail = load_tail(self._env, self._dbs, meta, path)
        self._closed = False
        #: what is buffered before a commit: the configured bytes, bounded by the machine (warned)
        self._commit_bytes = clip_bytes(
            config.commit_bytes, what="samples buffered before a commit", parameter="commit_bytes", stacklevel=4
        )

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

    # ------------------------------------------------------------------ resume ledger
    def progress(self, name: str) -> int:
        """Committed position recorded for ``name`` by ``append(..., progress=...)`` (0 if none).

        A producer that records its position with every append can resume after a crash by
        skipping what this returns: the ledger is committed atomically with the samples.

        Raises:
            ValueError: ``name`` is not a non-empty string of at most 511 UTF-8 bytes (as ``append`` records).
        """
        name = check_entry(name, 0, None)[0]
        self._check_open()
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
        copy: bool = True,
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
            copy: keep a copy of ``x`` until the commit (default), so the caller may reuse its array; ``False``
                hands ``x`` over: the writer keeps the array as given until the commit, and it must not change
                meanwhile (one copy of every sample less: ``write_parallel``'s results, which nobody else holds).

        Returns:
            The index the first sample of the batch receives.

        Raises:
            ValidationError: bad shape/dtype/values/labels; nothing of the batch is kept.
            ValueError: ``progress`` not ``(name, position)`` with a non-empty name and an integer position in
                ``0..2**63-1``, or ``progress_total`` not ``None`` or such an integer; nothing is kept.
        """
        self._check_open()
        entry = None
        if progress is not None:
            if not isinstance(progress, tuple) or len(progress) != 2:
                raise ValueError(f"progress must be a (name, position) tuple, got {str(progress)[:60]!r}")
            entry = check_entry(progress[0], progress[1], progress_total)
        elif progress_total is not None:
            raise ValueError("progress_total needs progress=(name, position)")
        arr = self.check_samples(x, cast=cast)
        if copy and np.may_share_memory(arr, np.asarray(x)):
            arr = arr.copy()  # buffered until the commit: the caller may reuse its array meanwhile
        ids = label_ids(y, len(arr), self._meta.classes, path=self.path)
        first = self.count
        if len(arr):
            self._pending_x.append(arr)
            self._pending_y.append(ids)
            self._pending_stats_of.append(stats)
            self._pending_bytes += arr.nbytes
        if entry is not None:
            name, pos, total = entry
            self._pending_progress[name] = {"done": pos, "total": total}
        if self._pending_bytes >= self._commit_bytes:
            self.commit()
        return first

    # ------------------------------------------------------------------ committing
    def commit(self) -> None:
        """Write everything pending in one transaction (growing the map if needed) and fsync it."""
        self._check_open()
        if not self._pending_x and not self._pending_progress:
            return
        xs = self._pending_x  # written from the batches as they are: no concatenated copy of a commit's samples
        y = np.concatenate(self._pending_y) if self._pending_y else np.zeros(0, self._meta.label_dtype)
        stats = ValueStats(**vars(self._meta.value_stats))
        if all(s is None for s in self._pending_stats_of):
            stats.update_all(xs)  # the same floats as over their concatenation
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
                with self._lease.writing(), translate_lmdb_errors(self.path, "commit"):
                    new_meta, new_tail = self._write(xs, y, stats)
                break
            except StoreFullError as exc:
                if not isinstance(exc.__cause__, lmdb.MapFullError) or not self._grow_map():
                    raise
        self._meta, self._tail = new_meta, new_tail
        self.abort()  # all of it is committed now

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

    def _write(self, xs: list[np.ndarray], y: np.ndarray, stats: ValueStats) -> tuple[StoreMeta, Tail]:
        """Commit the samples of the batches ``xs`` (in order), their labels ``y`` and the pending ledger entries in
        one transaction; the new metadata and tail.

        The samples, label chunks and class-index chunks each continue their partly filled last piece (the
        tail kept in memory), and the metadata is rewritten with the new counts and statistics.
        """
        m = self._meta
        count = m.count + sum(len(x) for x in xs)
        with self._env.begin(write=True) as txn:
            samples_tail = self._put_samples(txn, xs, count)
            labels_tail = self._put_labels(txn, y, count)
            class_counts, class_tails = self._put_class_index(txn, y, count)
            for name, entry in self._pending_progress.items():
                txn.put(name.encode(), encode_entry(**entry), db=self._dbs[DB_PROGRESS])
            new_meta = m.with_(count=count, class_counts=class_counts, value_stats=stats, updated_at=utc_now())
            txn.put(META_KEY, new_meta.to_json(), db=self._dbs[DB_META])
        return new_meta, Tail(samples_tail, labels_tail.copy(), {c: t.copy() for c, t in class_tails.items()})

    def _put_samples(self, txn: lmdb.Transaction, xs: list[np.ndarray], count: int) -> bytes:
        """Rewrite the partial last value, then append full values of the batches ``xs``; returns the new partial
        value's payload."""
        m = self._meta
        spv, sb = m.samples_per_value, m.sample_bytes
        n_tail = len(self._tail.samples) // sb
        start = m.count - n_tail
        pieces = _Pieces([self._tail.samples, *(memoryview(x.reshape(-1).view(np.uint8)) for x in xs)])  # type: ignore[arg-type]  # numpy arrays are buffers
        db = self._dbs[DB_SAMPLES]
        payload: bytes | memoryview = b""
        for first in range(start, count, spv):
            payload = pieces.take(min(spv, count - first) * sb)
            value = payload if self._checksum is None else b"".join((payload, self._checksum(payload)))
            if first == start and n_tail:
                txn.put(encode_key(first), value, db=db)
            elif not txn.put(encode_key(first), value, db=db, append=True):
                raise CorruptStoreError("append out of key order", path=self.path, key=first)
        return bytes(payload) if count % spv else b""

    def _put_labels(self, txn: lmdb.Transaction, y: np.ndarray, count: int) -> np.ndarray:
        """Write the label chunks from the partial last one on; returns the new partial chunk's labels."""
        m = self._meta
        chunk = m.label_chunk
        labels = np.concatenate([self._tail.labels, y])
        lab_start = m.count - len(self._tail.labels)
        self._put_chunks(txn, self._dbs[DB_LABELS], lab_start, labels, chunk, encode_key)
        return labels[len(labels) - count % chunk :] if count % chunk else labels[:0]

    def _put_class_index(
        self, txn: lmdb.Transaction, y: np.ndarray, count: int
    ) -> tuple[list[int], dict[int, np.ndarray]]:
        """Extend each class's index list by the new samples of that class; returns the new class counts
        and each class's partial last chunk."""
        m = self._meta
        chunk = m.label_chunk
        class_counts = list(m.class_counts)
        class_tails = dict(self._tail.class_tails)
        if count == m.count:
            return class_counts, class_tails
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
            self._put_chunks(txn, self._dbs[DB_CLASSIDX], c_start, idx, chunk, lambda p, c=c: classidx_key(c, p))
            class_counts[c] += int(hi - lo)
            n_part = class_counts[c] % chunk
            class_tails[c] = idx[len(idx) - n_part :] if n_part else idx[:0]
        return class_counts, class_tails

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
            self._lease.release()  # the environment is shared with this process's readers of the store
            release_lock(self._lock_fd)

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
