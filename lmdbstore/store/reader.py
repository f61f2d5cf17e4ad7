"""Reading a store: :class:`StoreReader`, safe to hand to DataLoader workers, and its label table and per-class
index lists (read whole, checked against the metadata).  The reader opens in the process that first reads (an
environment never crosses a fork), and every read follows the snapshot rule (:mod:`lmdbstore.store.snapshot`) on a
snapshot of the store and data file it pinned (:mod:`lmdbstore.store.pinned`; docs/design.md, "Readers and
snapshots").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_CHECK_WHOLE_VALUES
from lmdbstore.errors import CorruptStoreError, LmdbStoreError, translate_lmdb_errors, translate_read_errors
from lmdbstore.format.layout import ALL_DBS, DB_CLASSIDX, DB_LABELS, INDEX_DTYPE, classidx_key, encode_key
from lmdbstore.format.meta import StoreMeta
from lmdbstore.store.batch import read_samples
from lmdbstore.store.handle import Handle
from lmdbstore.store.metaview import MetaView, check_in_range, check_out, range_bounds, sample_indices, whole_number
from lmdbstore.store.pinned import PinnedReader
from lmdbstore.store.positions import prefetch_ranges

__all__ = ["StoreReader", "read_class_indices", "read_labels"]

#: The most reads in flight a reader takes (``io_threads``): each is a thread of the process.
MAX_READ_THREADS = 1024
#: Values and bytes (besides one larger value) a scan (:meth:`StoreReader.iter_raw`) copies out of the map at a time.
SCAN_VALUES, SCAN_BYTES = 64, 4 << 20


class StoreReader(PinnedReader, MetaView):
    """Random and sequential access to the samples, labels and class index of a store.

    Args:
        path: the store directory.
        lock: use LMDB's reader table; ``None`` (default): only while a writer is active (decided in each process
            when it opens the store).  With ``False`` a snapshot a writer overwrites is replaced by another lock-free
            one (after :data:`~lmdbstore.store.pinned.MAX_RESNAPSHOTS` in a row, an error), else by a registered one.
        verify_checksums: check each value's checksum as it is read, through liblmdb (default ``False``).
        positions: read samples by file offset (default ``True``): a batch in one compiled call; ``False``, or a
            layout the position table does not know, reads through liblmdb lookups.
        io_threads: reads in flight for cold batches (1..1024, threads of a pool the process shares; ``None``:
            :data:`~lmdbstore.store.fileread.IO_THREADS`).
        check_whole_values: check the stored checksum of every value a batch reads whole by file offset (block and
            window orders; default ``DEFAULT_CHECK_WHOLE_VALUES``).

    Picklable: the path, the options and the pin of its store travel; it opens again in the receiving process.

    Raises (on first use):
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError.
        StoreReplacedError (on any read): the store or data file at the path is no longer the one it opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lock: bool | None = None,
        verify_checksums: bool = False,
        positions: bool = True,
        io_threads: int | None = None,
        check_whole_values: bool = DEFAULT_CHECK_WHOLE_VALUES,
    ):
        if io_threads is not None:  # each one a thread of this process: a number of threads, not a wish
            io_threads = whole_number(io_threads, "io_threads", 1, MAX_READ_THREADS)
        self.path = Path(path)
        self.lock = lock
        self.verify_checksums = verify_checksums
        self.positions = positions
        self.io_threads = io_threads
        self.check_whole_values = check_whole_values
        self._init_pin()

    @property
    def read_path(self) -> str:
        """``"positions"`` (reads by file offset) or ``"lmdb"`` (liblmdb lookups) for unchecked reads."""
        if not self.positions:
            self._handle()
            return "lmdb"
        return "positions" if self._guarded("read", self._positions) is not None else "lmdb"

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> StoreReader:
        """Open now (instead of on first read), validating the store. Returns ``self``."""
        self._handle()
        return self

    def __getstate__(self) -> dict[str, Any]:
        keys = ("path", "lock", "verify_checksums", "positions", "io_threads", "check_whole_values")
        return {**{k: getattr(self, k) for k in keys}, "pinned": self._pinned}

    def __setstate__(self, state: dict[str, Any]) -> None:
        path = state.pop("path")
        pinned = state.pop("pinned", None)
        self.__init__(path, **state)  # type: ignore[misc]
        self._restore_pin(pinned)

    def __enter__(self) -> StoreReader:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> StoreMeta:
        return self._handle().meta

    # ------------------------------------------------------------------ values
    def read_batch(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Samples at ``indices`` (any order, repeats allowed) as one ``(N, *shape)`` array, each sample's bytes read
        straight into its row: no per-sample arrays, no collate.

        Args:
            indices: integer sample indices in ``0..len-1`` (no wrap-around; not floats, not a boolean mask).
            out: optional array to fill: C-contiguous, writable, of shape ``(N, *shape)`` and the store's dtype
                (a shared-memory tensor's numpy view is one).

        Raises:
            IndexError: an index outside ``0..len-1``.
            ValueError: indices that are not integers, or an ``out`` that is not as above.
            CorruptStoreError / ChecksumError: a value is missing, short, or fails its checksum.
        """
        m = self._handle().meta
        idx = sample_indices(indices)
        check_in_range(idx, m.count)
        out = check_out(out, len(idx), m)
        if len(idx) == 0:
            return np.empty((0, *m.shape), m.np_dtype) if out is None else out
        lmdb, verify, whole = (
            not self.positions or self.verify_checksums,
            self.verify_checksums,
            self.check_whole_values,
        )
        return self._guarded("read", lambda h: read_samples(h, self._positions(h), idx, out, lmdb, verify, whole))

    def prefetch(self, lo: Any, hi: Any) -> None:
        """Ask the OS to read the samples of ranges ``lo[i]..hi[i]-1`` into the page cache, in the background.

        The values' leaves are read first (many in flight, a few ms for a window), then the values' bytes, merged
        where they lie together, are advised (``posix_fadvise(WILLNEED)`` on a thread of its own; the ``window``
        order's next window).  A no-op on the liblmdb read path.  Only advice: never a wrong sample.
        ``CorruptStoreError``: a leaf read contradicts the store (as a read of those samples would say).
        """
        lo_a, hi_a = range_bounds(lo, hi)
        if not self.positions or lo_a.size == 0:
            return

        def advise(h: Handle) -> None:
            table = self._positions(h)
            if table is not None and h.files is not None:
                h.files.advise(*prefetch_ranges(table, lo_a, hi_a, h.files))

        self._guarded("read", advise)

    # ------------------------------------------------------------------ labels and classes
    def labels(self) -> np.ndarray:
        """Every sample's class id (uint8 up to 256 classes): the table held in memory, cached."""
        if self._labels is None:
            self._labels = self._guarded("read labels", read_labels)
        return self._labels

    def class_indices(self, class_id: int) -> np.ndarray:
        """Sample indices of class ``class_id`` in ascending order, read from the class-index table.

        Raises:
            ValueError: ``class_id`` not an integer in ``0..len(classes)-1``.
        """
        c = self._class_id(class_id)
        return self._guarded("read class index", lambda h: read_class_indices(h, c))

    # ------------------------------------------------------------------ internals for stats/verify
    def iter_raw(self, db_name: bytes | None) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value) of sub-database ``db_name`` (``None``: the main database) in key order, copied out of
        the map in groups (:data:`SCAN_VALUES` values or :data:`SCAN_BYTES`), each checked protected before it is
        yielded (a scan cannot be redone).

        Raises:
            ValueError: ``db_name`` is not ``None`` or the name of one of the store's sub-databases.
            LmdbStoreError: a writer overwrote the snapshot during the scan (a lock-free reader): scan again.
            CorruptStoreError: the data file was truncated or is damaged.
        """
        if db_name is not None and db_name not in ALL_DBS:
            raise ValueError(
                f"db_name must be None or one of {', '.join(d.decode() for d in ALL_DBS)}, got {db_name!r}"
            )
        with self.held() as h:
            with translate_read_errors(self.path, "scan"), h.lmdb():
                db = None if db_name is None else h.env.open_db(db_name, txn=h.txn, create=False)
                cursor = h.txn.cursor(db=db)
                more = cursor.first()
            while more:
                group: list[tuple[bytes, memoryview]] = []
                with translate_read_errors(self.path, "scan"), h.lmdb():
                    size = 0
                    while more and len(group) < SCAN_VALUES and size < SCAN_BYTES:
                        value = bytes(cursor.value())
                        group.append((bytes(cursor.key()), memoryview(value)))
                        size += len(value)
                        more = cursor.next()
                    if not h.protected():
                        raise LmdbStoreError(
                            "scan: a writer overwrote this snapshot while it was scanned",
                            path=self.path,
                            hint="scan again (with lock=True, beside a writer)",
                        )
                yield from group

    def env_stats(self) -> dict[str, Any]:
        """LMDB facts: page size, depth and pages of each sub-database, map size, last page, file bytes."""
        with self.held() as h, translate_lmdb_errors(self.path, "stat"), h.lmdb():
            info = h.env.info()
            dbs = {name.decode(): h.txn.stat(db) for name, db in h.dbs.items()}
            main = h.env.stat()
        return {"psize": main["psize"], "info": dict(info), "main": dict(main), "dbs": dbs}


def read_labels(h: Handle) -> np.ndarray:
    """Every sample's class id, in sample order (the label dtype: uint8 up to 256 classes). Raises
    ``CorruptStoreError``: a label chunk is missing or of the wrong length, or a label is not a class id."""
    m = h.meta
    out = _read_chunks(h, DB_LABELS, encode_key, np.empty(m.count, m.label_dtype), "labels")
    if m.count and int(out.max()) >= len(m.classes):
        raise CorruptStoreError("a label is outside the class list", path=h.path)
    return out


def read_class_indices(h: Handle, class_id: int) -> np.ndarray:
    """The sample indices of class ``class_id`` in ascending order (int64), from the class-index table
    (``CorruptStoreError``: a chunk of the class's list is missing or of the wrong length, or the list is not
    ascending sample indices of the store)."""
    m, name = h.meta, h.meta.classes[class_id]
    out = np.empty(m.class_counts[class_id], np.int64)
    _read_chunks(h, DB_CLASSIDX, lambda pos: classidx_key(class_id, pos), out, f"class index of class {name!r}")
    if len(out) and (int(out[0]) < 0 or int(out[-1]) >= m.count or not (out[1:] > out[:-1]).all()):
        raise CorruptStoreError(  # one pass: the list is ascending sample indices of the store
            f"the class index of class {name!r} is not ascending sample indices below {m.count}",
            path=h.path,
            hint="run `lmdbstore verify` on the store",
        )
    return out


def _read_chunks(h: Handle, db: bytes, key: Callable[[int], bytes], out: np.ndarray, what: str) -> np.ndarray:
    """Fill ``out`` from the ``label_chunk``-entry chunks of sub-database ``db`` keyed ``key(position)`` (labels: the
    label dtype; class indices: :data:`~lmdbstore.format.layout.INDEX_DTYPE`); returns ``out``
    (``CorruptStoreError``: a chunk is missing or of the wrong length)."""
    chunk, dtype = h.meta.label_chunk, h.meta.label_dtype if db == DB_LABELS else INDEX_DTYPE
    with translate_read_errors(h.path, f"read {what}"), h.lmdb():
        for pos in range(0, len(out), chunk):
            raw = h.txn.get(key(pos), db=h.dbs[db])
            n = min(chunk, len(out) - pos)
            if raw is None or len(raw) != n * dtype.itemsize:
                raise CorruptStoreError(
                    f"a chunk of the {what} is missing or of the wrong length", path=h.path, key=pos
                )
            out[pos : pos + n] = np.frombuffer(raw, dtype)
    return out
