"""Where every packed value of a store lies in ``data.mdb``, and reads of exactly the bytes a batch needs.

py-lmdb's value-returning calls touch every page of the value before returning, so out of core one random
2.5 KB sample of a 45 KB value costs 11 page-fault reads, one at a time.  Instead, the reader resolves
each value's file offset once per snapshot (:func:`build_table`, parsing the ``samples`` B-tree with
:mod:`lmdbstore.format.pages`), then reads a batch with one ``os.preadv`` per run of consecutive samples straight
into the output array (:class:`PreadEngine`), many in flight on a small thread pool (``pread`` releases the
GIL).  The table costs 8 bytes per value.

LMDB's rules are kept: the offsets come from the committed snapshot of the reader's own read transaction
(the meta page whose transaction id is that transaction's), LMDB never moves a value's pages unless the
value is rewritten or deleted, and a ``lock=True`` reader's transaction keeps its snapshot's pages from
reuse.  The table is checked against liblmdb lookups (and the stored checksums) of a sample of values
before use; any mismatch or unrecognised layout makes the reader use liblmdb for that snapshot.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import UnsupportedLayout, read_meta_page, samples_positions

__all__ = ["DEFAULT_IO_THREADS", "PositionTable", "PreadEngine", "build_table"]

#: Reads kept in flight by one reader (threads of its pool); 16 saturates typical NVMe and network disks.
DEFAULT_IO_THREADS = 16
#: Values checked against liblmdb (and their checksums) when a table is built.
VERIFY_SAMPLE = 16
#: Runs read on the calling thread before deciding whether the batch is served from the page cache.
PROBE_RUNS = 32
#: Probe reads faster than this (seconds per read plus seconds per byte) came from the page cache: a cold
#: read from a fast NVMe disk takes ~80 us for 4 KiB, a page-cache copy ~2 us plus ~0.2 ns per byte.
CACHED_READ_S = 20e-6
CACHED_BYTE_S = 1e-9


@dataclass(frozen=True)
class PositionTable:
    """File offsets of every value's payload (value ``v`` holds samples ``v*k .. v*k+k-1``) in one snapshot."""

    txnid: int
    offsets: np.ndarray  # int64, one per value
    file_size: int
    file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the data file it was built from


def build_table(
    fd: int,
    meta: StoreMeta,
    txnid: int,
    db_name: bytes,
    lookup: Callable[[int], Any],
    *,
    path: str | Path | None = None,
    pmap: Callable[..., list[bytes]] | None = None,
) -> PositionTable | None:
    """Build and check the position table of snapshot ``txnid``, or return ``None`` to use liblmdb.

    ``lookup(first)`` returns the value keyed ``first`` through liblmdb (checked against the table on a
    sample of values).

    Returns ``None`` when the layout is not recognised or the snapshot's meta page was already reused.

    Raises:
        CorruptStoreError: the file contradicts itself (pages, keys, lengths outside their bounds).
        ChecksumError: a sampled value fails its stored checksum.
    """
    file_size = os.fstat(fd).st_size
    try:
        metas = [read_meta_page(fd, file_size, i, path) for i in (0, 1)]
        snap = [m for m in metas if m.txnid == txnid]
        if not snap:
            return None  # a writer committed twice since our transaction began: its meta page is gone
        vals = samples_positions(fd, file_size, snap[0], db_name, path=path, pmap=pmap)
    except UnsupportedLayout:
        return None
    spv, n_values = meta.samples_per_value, meta.n_values
    want_len = np.full(n_values, spv * meta.sample_bytes + meta.trailer_bytes, np.int64)
    if n_values:
        want_len[-1] = meta.expected_value_len((n_values - 1) * spv)
    # Slot of each key; keys that are no value's (not a multiple of k, past the end) are never read.
    keys = vals.keys.astype(np.int64)
    slot = keys // spv
    ok = (keys >= 0) & (keys % spv == 0) & (slot < n_values)
    offsets = np.full(n_values, -1, np.int64)
    good = ok.copy()
    good[ok] = vals.sizes[ok] == want_len[slot[ok]]
    # A missing or wrong-length value keeps offset -1: batches touching it go through liblmdb, which
    # raises the precise CorruptStoreError for it, and every other value still reads by offset.
    offsets[slot[good]] = vals.pos[good]
    present = offsets >= 0
    if present.any() and int((offsets[present] + want_len[present]).max()) > file_size:
        raise CorruptStoreError("a value extends past the end of the data file", path=path)
    st = os.fstat(fd)
    table = PositionTable(txnid, offsets, file_size, (st.st_dev, st.st_ino))
    del vals, keys, slot, ok, good, present
    ok_ = _agrees(fd, table, meta, lookup, want_len, path)
    _give_back_free_memory()
    return table if ok_ else None


def _give_back_free_memory() -> None:
    """Return the parse's freed temporaries to the OS (glibc keeps freed heap memory in the process
    otherwise, and the reader's resident memory would look like it grew with the store)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _agrees(
    fd: int,
    table: PositionTable,
    meta: StoreMeta,
    lookup: Callable[[int], Any],
    lens: np.ndarray,
    path: str | Path | None,
) -> bool:
    """Check a sample of values (first, last, evenly spread) read by offset.

    A value whose stored checksum matches is where the table says; otherwise (no checksums, or a damaged
    value) its bytes must equal liblmdb's.  Damage itself is left to ``verify_checksums`` readers.
    """
    present = np.flatnonzero(table.offsets >= 0)
    if present.size == 0:
        return True
    check = compute_checksum(meta.checksum)
    t = meta.trailer_bytes
    for v in sorted(set(present[np.linspace(0, present.size - 1, VERIFY_SAMPLE).astype(int)].tolist())):
        first = v * meta.samples_per_value
        mine = os.pread(fd, int(lens[v]), int(table.offsets[v]))
        if check is not None and len(mine) > t and check(mine[:-t]) == mine[-t:]:
            continue
        theirs = lookup(first)
        if theirs is None or bytes(theirs) != mine:
            return False
    return True


class PreadEngine:
    """Copies runs of bytes of one file into memory: plain copies when cached, ``os.preadv`` when not.

    A batch starts with a few ``pread``s on the calling thread.  When they come back at page-cache speed,
    the rest is copied from a read-only memory map of the file (a slice assignment per run: no system
    call); when they are slower, the rest is spread over a thread pool of ``threads`` running ``preadv``
    (it releases the GIL, so the reads overlap in the kernel and on the disk).  The map and the pool are
    created on first need in each process, and never cross a fork.  Only offsets below ``file_size``
    (checked when the table was built) are ever read.
    """

    def __init__(self, fd: int, file_size: int, threads: int = DEFAULT_IO_THREADS, path: str | Path | None = None):
        self.fd, self.file_size, self.threads, self.path = fd, file_size, max(1, threads), path
        self._pool: ThreadPoolExecutor | None = None
        self._map: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _own(self) -> None:
        if self._pid != os.getpid():  # inherited through fork: start afresh in this process
            self._pool, self._map, self._mv, self._pid = None, None, None, os.getpid()
            self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        self._own()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmdbstore-io")
            return self._pool

    def mapped(self) -> memoryview:
        self._own()
        if self._mv is None:
            self._map = mmap.mmap(self.fd, self.file_size, prot=mmap.PROT_READ)
            with contextlib.suppress(AttributeError, OSError):
                self._map.madvise(mmap.MADV_RANDOM)  # no read-ahead when a cold page slips through
            self._mv = memoryview(self._map)
        return self._mv

    def pmap(self, fn: Callable[[Any], bytes], items: Any) -> list[bytes]:
        return list(self.pool().map(fn, items))

    def _pread(self, view: memoryview, offs: list[int], dsts: list[int], ends: list[int]) -> None:
        fd, preadv = self.fd, os.preadv
        for o, d, e in zip(offs, dsts, ends, strict=True):
            if preadv(fd, [view[d:e]], o) != e - d:
                raise CorruptStoreError("data file is shorter than its B-tree says (truncated?)", path=self.path)

    def _copy(self, view: memoryview, offs: list[int], dsts: list[int], ends: list[int]) -> None:
        src = self.mapped()
        if os.fstat(self.fd).st_size < self.file_size:
            raise CorruptStoreError("data file was truncated while open", path=self.path)
        for o, d, e in zip(offs, dsts, ends, strict=True):
            view[d:e] = src[o : o + e - d]

    def read(self, view: memoryview, offs: list[int], dsts: list[int], ends: list[int]) -> None:
        """Fill ``view[d:e]`` with the file's bytes at ``o`` for every ``(o, d, e)``.

        Raises:
            CorruptStoreError: the file is shorter than when the table was built (truncated under us).
        """
        n = len(offs)
        k = min(PROBE_RUNS, n)
        t0 = time.perf_counter()
        self._pread(view, offs[:k], dsts[:k], ends[:k])
        if k == n:
            return
        probed = sum(ends[:k]) - sum(dsts[:k])
        if time.perf_counter() - t0 < k * CACHED_READ_S + probed * CACHED_BYTE_S:
            self._copy(view, offs[k:], dsts[k:], ends[k:])
            return
        if self.threads == 1:
            self._pread(view, offs[k:], dsts[k:], ends[k:])
            return
        parts = min(self.threads, n - k)
        bounds = np.linspace(k, n, parts + 1).astype(int).tolist()
        futs = [
            self.pool().submit(self._pread, view, offs[a:b], dsts[a:b], ends[a:b])
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        for f in futs:
            f.result()

    def advise(self, starts: list[int], ends: list[int]) -> None:
        """Start reading byte ranges ``[s, e)`` into the page cache on the pool, without waiting."""

        def run() -> None:
            for s, e in zip(starts, ends, strict=True):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self.fd, s, e - s, os.POSIX_FADV_WILLNEED)

        self.pool().submit(run)

    def close(self) -> None:
        if self._pid == os.getpid():
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._mv is not None:
                self._mv.release()
            if self._map is not None:
                self._map.close()
        self._pool, self._map, self._mv = None, None, None
