"""Reading a store: :class:`StoreReader`, safe to hand to DataLoader workers.

The reader opens the LMDB environment lazily, in the process that first reads, and re-opens it after
a fork or when unpickled in a spawned worker (py-lmdb environments must never cross a fork, and
py-lmdb 3.x refuses to open a path twice in one process).  By default it opens with
``readonly=True, lock=False, readahead=False``: no reader-table slot (so killed readers cannot
exhaust it), no lock contention between workers, and no OS read-ahead wasted on random access.
``lock=False`` is only safe while nobody writes the store: by default (``lock=None``) the reader probes
the store's writer lock when it opens and uses ``lock=True`` (a registered snapshot, whose pages a writer
cannot reuse) while a writer is active.  Pass ``lock=True`` to always read a registered snapshot.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import ChecksumError, CorruptStoreError, translate_lmdb_errors, translate_read_errors
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.layout import DB_SAMPLES, encode_key
from lmdbstore.format.meta import StoreMeta
from lmdbstore.store.handle import Handle
from lmdbstore.store.labels import read_class_indices, read_labels
from lmdbstore.store.positions import DEFAULT_IO_THREADS, PositionTable

__all__ = ["StoreReader", "open_reader"]


class StoreReader:
    """Random and sequential access to the samples, labels and class index of a store.

    Args:
        path: the store directory.
        lock: use LMDB's reader lock table; ``None`` (default): only while a writer is active, so a store
            nobody writes is read lock-free and one being appended to is read as a consistent snapshot
            (decided in each process when it opens the store; see the module docstring).
        verify_checksums: check each value's checksum as it is read (default ``False``; ``verify``
            and ``stats --check`` turn it on).  Checked reads go through liblmdb.
        positions: read samples by their file offsets (default ``True``; see :mod:`lmdbstore.store.positions`):
            one ``pread`` per run of consecutive samples, ``io_threads`` in flight.  ``False``, or a file
            layout the position table does not recognise, reads through liblmdb lookups instead.
        io_threads: reads in flight per process for cold batches (default 16).

    The reader is picklable: only the path and options travel, the environment is re-opened in the
    receiving process on first use.

    Raises (on first use):
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lock: bool | None = None,
        verify_checksums: bool = False,
        positions: bool = True,
        io_threads: int = DEFAULT_IO_THREADS,
    ):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.path = Path(path)
        self.lock = lock
        self.verify_checksums = verify_checksums
        self.positions = positions
        self.io_threads = io_threads
        self._h: Handle | None = None
        self._table: PositionTable | None = None
        self._labels: np.ndarray | None = None

    # ------------------------------------------------------------------ lifecycle
    def _handle(self) -> Handle:
        h = self._h
        if h is None or h.pid != os.getpid() or not h.lease.valid:
            # After a fork the inherited handle belongs to the parent (see Handle.forget_after_fork);
            # every reference to it must be gone *before* the re-open, or py-lmdb refuses it.  A lease
            # turns invalid in this process when the shared environment was re-opened for a user that
            # needed more (a writer): the old transaction is dead, the snapshot may still be the same.
            self._h = None
            if h is not None:
                if h.pid != os.getpid():
                    h.forget_after_fork()
                else:
                    h.close()
            h = self._h = Handle(self.path, self.lock, self.io_threads, inherit=self._table)
        return h

    def _positions(self, h: Handle) -> PositionTable | None:
        """The handle's position table, kept on the reader too: it outlives :meth:`close` and a fork, so
        a re-opened handle of the same snapshot (e.g. in a forked DataLoader worker) need not rebuild it."""
        table = h.positions()
        self._table = table
        return table

    @property
    def read_path(self) -> str:
        """``"positions"`` (reads by file offset) or ``"lmdb"`` (liblmdb lookups) for unchecked reads."""
        h = self._handle()
        with translate_read_errors(self.path, "read"):
            return "positions" if self.positions and self._positions(h) is not None else "lmdb"

    def open(self) -> StoreReader:
        """Open now (instead of on first read), validating the store. Returns ``self``."""
        self._handle()
        return self

    def close(self) -> None:
        """Close the environment in this process (call in the parent before starting workers)."""
        if self._h is not None and self._h.pid == os.getpid():
            self._h.close()
        self._h = None

    def refresh(self) -> None:
        """Start a new read snapshot (see samples committed since the reader opened)."""
        self.close()
        self._labels = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("path", "lock", "verify_checksums", "positions", "io_threads")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        path = state.pop("path")
        self.__init__(path, **state)  # type: ignore[misc]

    def __enter__(self) -> StoreReader:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> StoreMeta:
        return self._handle().meta

    def __len__(self) -> int:
        return self.meta.count

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.np_dtype

    @property
    def classes(self) -> list[str]:
        return list(self.meta.classes)

    # ------------------------------------------------------------------ values
    def _value(self, h: Handle, first: int) -> memoryview:
        """The payload of the value starting at sample ``first`` (checked, trailer removed)."""
        m = h.meta
        with translate_lmdb_errors(self.path, "read"):
            buf = h.txn.get(encode_key(first), db=h.dbs[DB_SAMPLES])
        if buf is None:
            raise CorruptStoreError("value missing", path=self.path, key=first)
        want = m.expected_value_len(first)
        if len(buf) != want:
            raise CorruptStoreError(f"value has {len(buf)} bytes, expected {want}", path=self.path, key=first)
        payload = buf[: want - m.trailer_bytes]
        if self.verify_checksums and m.trailer_bytes:
            fn = compute_checksum(m.checksum)
            assert fn is not None
            if fn(payload) != bytes(buf[want - m.trailer_bytes :]):
                raise ChecksumError("checksum mismatch", path=self.path, key=first)
        return memoryview(payload)

    def _check_indices(self, idx: np.ndarray, count: int) -> None:
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= count):
            bad = int(idx[(idx < 0) | (idx >= count)][0])
            raise IndexError(f"sample index {bad} out of range for a store of {count} samples")

    def read(self, index: int) -> np.ndarray:
        """One sample as an array of the store's shape and dtype (a copy)."""
        return self.read_batch(np.array([index]))[0]

    def read_batch(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Samples at ``indices`` (any order, repeats allowed) as one ``(N, *shape)`` array.

        The indices are visited in sorted order (B-tree locality), each value is looked up once per
        run of indices that share it, and each sample's bytes are copied straight from LMDB's map
        into its row of ``out``: no per-sample arrays, no collate.

        Args:
            indices: integer sample indices.
            out: optional C-contiguous array of shape ``(N, *shape)`` and the store's dtype (or any
                dtype of the same item size, e.g. a shared-memory tensor's numpy view) to fill.

        Raises:
            IndexError: an index outside ``0..len-1``.
            CorruptStoreError / ChecksumError: a value is missing, short, or fails its checksum.
        """
        h = self._handle()
        m = h.meta
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._check_indices(idx, m.count)
        n, sb = len(idx), m.sample_bytes
        if out is None:
            out = np.empty((n, *m.shape), m.np_dtype)
        elif out.shape[0] != n or out.nbytes != n * sb or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous array of {n} samples of {sb} bytes")
        if n == 0:
            return out
        # everything below reads the store: whatever a damaged file makes it raise becomes our error
        with translate_read_errors(self.path, "read"):
            self._read_into(h, idx, out)
        return out

    def _read_into(self, h: Handle, idx: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out`` with the samples at ``idx`` (checked by :meth:`read_batch`)."""
        m = h.meta
        n, sb, spv = len(idx), m.sample_bytes, m.samples_per_value
        order = np.argsort(idx, kind="stable")
        sidx = idx[order]
        firsts = sidx - sidx % spv
        # Runs: consecutive samples of one value whose rows in ``out`` are consecutive too (block-mode
        # batches come sorted, so their runs are whole pieces of values); each run is one copy.  In
        # random order runs are single samples, and this is the hot path: numpy prepares every per-run
        # input up front (one 8-byte key object per run -- ``V8`` items become ``bytes``), so the loop
        # does no slicing, arithmetic or list indexing of its own.
        brk = np.flatnonzero(np.r_[True, (np.diff(sidx) != 1) | (firsts[1:] != firsts[:-1]) | (np.diff(order) != 1)])
        table = self._positions(h) if self.positions and not self.verify_checksums else None
        voffs = table.offsets[firsts[brk] // spv] if table is not None else None
        if voffs is not None and (voffs >= 0).all():
            # one read per run, straight into ``out`` (offsets and lengths were checked against the file);
            # a batch touching a damaged value (offset -1) goes through liblmdb for the precise error
            assert h.engine is not None
            foffs = (voffs + (sidx[brk] - firsts[brk]) * sb).tolist()
            d0 = order[brk] * sb
            ends0 = d0 + np.diff(np.r_[brk, n]) * sb
            ov0 = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            h.engine.read(ov0, foffs, d0.tolist(), ends0.tolist())
            return
        keys = firsts[brk].astype(">u8").view("V8").tolist()
        offs = ((sidx[brk] - firsts[brk]) * sb).tolist()
        dsts = (order[brk] * sb).tolist()
        ends = [d + ln for d, ln in zip(dsts, (np.diff(np.r_[brk, n]) * sb).tolist(), strict=True)]
        ov = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers
        verify = self.verify_checksums
        get = h.txn.get
        db = h.dbs[DB_SAMPLES]
        # unchecked fast path: still refuse a value of the wrong length (the last value is shorter)
        full_len, tail_first = spv * sb + m.trailer_bytes, m.count - m.count % spv
        tail_len = m.expected_value_len(tail_first) if tail_first < m.count else full_len
        tail_key = encode_key(tail_first)
        last: Any = None
        buf: Any = None
        try:
            for k, o, d, e in zip(keys, offs, dsts, ends, strict=True):
                if k != last:
                    last = k
                    if verify:
                        buf = self._value(h, int.from_bytes(k, "big"))
                    else:
                        buf = get(k, db=db)
                        if buf is None or len(buf) != (tail_len if k == tail_key else full_len):
                            buf = self._value(h, int.from_bytes(k, "big"))  # raises the precise error
                ov[d:e] = buf[o : o + e - d]
        except (TypeError, ValueError):
            # A None (missing key) or short value: re-read through the checked path for the exact error.
            if last is not None:
                self._value(h, int.from_bytes(last, "big"))
            raise

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Samples ``start..stop-1`` in order, reading each value once (sequential scans)."""
        m = self.meta
        if not 0 <= start <= stop <= m.count:
            raise IndexError(f"range {start}..{stop} outside a store of {m.count} samples")
        with translate_read_errors(self.path, "read"):
            fast = self.positions and not self.verify_checksums and self._positions(self._handle()) is not None
        if fast:
            return self.read_batch(np.arange(start, stop))
        out = np.empty((stop - start, *m.shape), m.np_dtype)
        ov = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers
        sb, spv, pos = m.sample_bytes, m.samples_per_value, 0
        h = self._handle()
        first = start - start % spv
        with translate_read_errors(self.path, "read"):
            while pos < out.nbytes:
                payload = self._value(h, first)
                lo = max(start - first, 0) * sb
                hi = min(stop - first, spv) * sb
                ov[pos : pos + hi - lo] = payload[lo:hi]
                pos += hi - lo
                first += spv
        return out

    def prefetch(self, lo: Any, hi: Any) -> None:
        """Ask the OS to read the samples of ranges ``lo[i]..hi[i]-1`` into the page cache, in the background.

        Each range's values are read as one large sequential read (``posix_fadvise(WILLNEED)`` on a
        pool thread), so a later random read of them is a copy from memory.  Used by the ``window``
        shuffle for the next window.  A no-op on the liblmdb read path.
        """
        h = self._handle()
        with translate_read_errors(self.path, "read"):
            table = self._positions(h) if self.positions else None
        if table is None or h.engine is None or len(table.offsets) == 0:
            return
        m = h.meta
        lo_v = np.asarray(lo, np.int64).reshape(-1) // m.samples_per_value
        hi_v = (np.asarray(hi, np.int64).reshape(-1) - 1) // m.samples_per_value
        if lo_v.size == 0:
            return
        off, vlen = table.offsets, m.samples_per_value * m.sample_bytes + m.trailer_bytes
        starts, ends = [], []
        for a, b in zip(lo_v.tolist(), hi_v.tolist(), strict=True):
            seg = off[max(a, 0) : min(b, len(off) - 1) + 1]
            if seg.size == 0:
                continue
            s0, s1 = int(seg.min()), int(seg.max()) + vlen
            if s1 - s0 <= 2 * vlen * seg.size:  # laid out together (the writer appends): one read
                starts.append(s0)
                ends.append(min(s1, table.file_size))
            else:  # scattered pages: one read per value
                starts.extend(seg.tolist())
                ends.extend(np.minimum(seg + vlen, table.file_size).tolist())
        h.engine.advise(starts, ends)

    def iter_chunks(
        self, chunk: int = 65536, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(first_index, samples, labels)`` over ``start..stop`` in chunks of about ``chunk``."""
        stop = len(self) if stop is None else stop
        labels = self.labels()
        for lo in range(start, stop, chunk):
            hi = min(lo + chunk, stop)
            yield lo, self.read_range(lo, hi), labels[lo:hi]

    # ------------------------------------------------------------------ labels and classes
    def labels(self) -> np.ndarray:
        """Every sample's class id (uint8 up to 256 classes): the table held in memory, cached."""
        if self._labels is None:
            self._labels = read_labels(self._handle())
        return self._labels

    def labels_of(self, indices: Any) -> np.ndarray:
        """Class ids of ``indices`` (from the cached label table)."""
        return self.labels()[np.asarray(indices, dtype=np.int64)]

    def class_indices(self, class_id: int) -> np.ndarray:
        """Sample indices of class ``class_id`` in ascending order, read from the class-index table."""
        return read_class_indices(self._handle(), class_id)

    # ------------------------------------------------------------------ internals for stats/verify
    def raw_value(self, first: int) -> bytes | None:
        """The stored bytes (payload and trailer) of the value keyed ``first``, unchecked."""
        h = self._handle()
        with translate_read_errors(self.path, "read"):
            buf = h.txn.get(encode_key(first), db=h.dbs[DB_SAMPLES])
            return None if buf is None else bytes(buf)

    def iter_raw(self, db_name: bytes | None) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value) of sub-database ``db_name`` in key order (values are zero-copy views);
        ``None``: the main database, whose keys name the sub-databases."""
        h = self._handle()
        with translate_read_errors(self.path, "scan"):
            db = None if db_name is None else h.env.open_db(db_name, txn=h.txn, create=False)
            cur = h.txn.cursor(db=db)
            for k, v in cur:
                yield bytes(k), memoryview(v)

    def env_stats(self) -> dict[str, Any]:
        """LMDB facts: page size, depth and pages of each sub-database, map size, last page, file bytes."""
        h = self._handle()
        with translate_lmdb_errors(self.path, "stat"):
            info = h.env.info()
            dbs = {name.decode(): h.txn.stat(db) for name, db in h.dbs.items()}
            main = h.env.stat()
        return {"psize": main["psize"], "info": dict(info), "main": dict(main), "dbs": dbs}


def open_reader(
    path: str | os.PathLike[str], *, lock: bool | None = None, verify_checksums: bool = False
) -> StoreReader:
    """Open a store for reading and validate it now (see :class:`StoreReader`)."""
    return StoreReader(path, lock=lock, verify_checksums=verify_checksums).open()
