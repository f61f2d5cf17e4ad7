"""Reading runs of bytes of one data file by offset: :class:`PreadEngine`.

The reader copies exactly the bytes a batch needs from ``data.mdb`` at offsets the position table gives
(:mod:`lmdbstore.store.positions`).  What is in the page cache is copied from a read-only map of the file
(numpy copies: one gather for a batch of single samples, one slice copy per longer run; no system call);
what is not goes to a small thread pool running ``os.preadv`` (it releases the GIL, so the reads overlap in
the kernel and on the disk), in the same batch.  Which is which, the kernel says
(:class:`~lmdbstore.store.residency.Residency`), not a timer.  Every copy from the map is made under the
file's :class:`~lmdbstore.store.mapguard.MapGuard`: with its read lease held by numpy, without one by the kernel
(``process_vm_readv``) or ``preadv``, so a file shrunk under the reader is an error, never SIGBUS.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from lmdbstore.errors import CorruptStoreError
from lmdbstore.store import copies
from lmdbstore.store.inflight import MAX_IO_THREADS, InFlight
from lmdbstore.store.mapguard import MapGuard, vm_available, vm_copy
from lmdbstore.store.residency import Residency, major_faults

__all__ = ["DEFAULT_IO_THREADS", "GATHER_MAX_BYTES", "PreadEngine"]

#: Reads kept in flight by one reader (threads of its pool); 16 saturates typical NVMe and network disks.
DEFAULT_IO_THREADS = 16
#: Cached runs of one length up to this many bytes are copied by one numpy gather (a batch of single samples);
#: longer ones by one slice copy each (a gather would copy them twice: through a temporary).
GATHER_MAX_BYTES = 16384
#: Bytes one gather into a given output copies at a time (its temporary stays in the CPU cache).
GATHER_CHUNK_BYTES = 320 << 10


def _shifted(bufs_of: Callable[[int], list[memoryview]], a: int, j: int) -> list[memoryview]:
    return bufs_of(a + j)


def _arr(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


class PreadEngine:
    """Copies runs of bytes of one file into memory: from the map when cached, by ``os.preadv`` when not.

    The map, the page-cache state and the pool are created on first need in each process, and never cross
    a fork.  Only offsets below ``file_size`` (checked when the table was built) are ever read; the map is read
    only under ``guard`` (the file's :class:`~lmdbstore.store.mapguard.MapGuard`; default: one of its own).
    """

    def __init__(
        self,
        fd: int,
        file_size: int,
        threads: int | None = None,
        path: str | Path | None = None,
        guard: MapGuard | None = None,
    ):
        self.fd, self.file_size, self.path = fd, file_size, path
        self.guard = guard if guard is not None else MapGuard(fd, path)
        self.threads = MAX_IO_THREADS if threads is None else max(1, threads)  # the pool's size
        self.inflight = InFlight(DEFAULT_IO_THREADS if threads is None else self.threads, fixed=threads is not None)
        self._pool: ThreadPoolExecutor | None = None
        self._map: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._bytes: np.ndarray | None = None
        self._base = 0  # the map's address
        self._res: Residency | None = None
        self._views: dict[int, np.ndarray] = {}  # strided views of the map by row width (numpy gathers)
        self._rows_at, self._rows_width = np.zeros(0, np.int64), 0  # k * width for k < n: a batch's rows
        #: the compiled copier (:mod:`lmdbstore.store.copies`), or ``None``: numpy and process_vm_readv
        self.fast = copies.FAST
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: Runs sent to the I/O threads / copied from the map in this process (what the benchmarks count).
        self.stats = {"pread_runs": 0, "copied_runs": 0, "pread_batches": 0, "batches": 0}

    def _own(self) -> None:
        if self._pid != os.getpid():  # inherited through fork: start afresh in this process
            self._pool, self._map, self._mv, self._bytes, self._res = None, None, None, None, None
            self._pid, self._lock, self._views = os.getpid(), threading.Lock(), {}
            self.stats = dict.fromkeys(self.stats, 0)

    def pool(self) -> ThreadPoolExecutor:
        self._own()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmdbstore-io")
            return self._pool

    def mapped(self) -> np.ndarray:
        """The file's bytes as a read-only uint8 array over the map (read it only under :attr:`guard`)."""
        self._own()
        with self._lock:
            if self._bytes is None:
                self._map = mmap.mmap(self.fd, self.file_size, prot=mmap.PROT_READ)
                with contextlib.suppress(AttributeError, OSError):
                    self._map.madvise(mmap.MADV_RANDOM)  # a fault reads one page, no read-ahead
                self._mv = memoryview(self._map)
                self._bytes = np.frombuffer(self._mv, np.uint8)
                self._base = self._bytes.ctypes.data
                self._res = Residency(self._base, self.file_size)
            return self._bytes

    def residency(self) -> Residency:
        res = self._res
        if res is None or self._pid != os.getpid():  # not mapped yet in this process
            self.mapped()
            res = self._res
            assert res is not None
        return res

    def pmap(self, fn: Callable[[Any], Any], items: Any) -> list[Any]:
        """``[fn(i) for i in items]`` on the pool (many reads in flight: the pages of one B-tree level)."""
        return list(self.pool().map(fn, list(items)))

    # ------------------------------------------------------------------ reads
    def _fast_copy(self, dst: np.ndarray, at: np.ndarray, offs: np.ndarray, lens: np.ndarray | int) -> bool:
        """The compiled copier's copy (:func:`~lmdbstore.store.copies.fast_copy`); ``False``: copy without it."""
        assert self.fast is not None
        return copies.fast_copy(self.fast, dst, at, self._base, offs, lens, self.fd, self.file_size, self.path)

    def _pread(self, bufs_of: Callable[[int], list[memoryview]], offs: list[int], want: list[int]) -> None:
        fd, preadv = self.fd, os.preadv
        for j, o in enumerate(offs):
            if preadv(fd, bufs_of(j), o) != want[j]:
                raise CorruptStoreError("data file is shorter than its B-tree says (truncated?)", path=self.path)

    def _submit(self, bufs_of: Callable[[int], list[memoryview]], offs: list[int], want: list[int]) -> list[Future]:
        """Start the missing runs' reads: on the pool in up to ``threads`` parts (one run: on this thread)."""
        n = len(offs)
        if n == 0:
            return []
        if n == 1 or self.inflight.count == 1:
            self._pread(bufs_of, offs, want)
            return []
        bounds = np.linspace(0, n, min(self.inflight.count, self.threads, n) + 1).astype(int).tolist()
        pool = self.pool()
        return [
            pool.submit(self._pread, functools.partial(_shifted, bufs_of, a), offs[a:b], want[a:b])
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]

    def _copy(self, dst: np.ndarray, offs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, leased: bool) -> None:
        """Copy cached runs from the map into the uint8 array ``dst``: by the compiled copier where there is one;
        else, with the file's lease held, runs of one short length by a gather and the others by one slice copy
        each; without, by the kernel (or ``preadv``)."""
        self.mapped()
        if self.fast is not None and self._fast_copy(dst, dsts, offs, lens):
            return
        if not leased:
            if vm_copy(dst, dsts, self._base + offs, lens):
                return
            if vm_available():
                raise copies.copy_failed(self.fd, self.file_size, self.path, dst)
            out = memoryview(dst)  # type: ignore[arg-type]
            dl, nl = dsts.tolist(), lens.tolist()
            self._pread(lambda j: [out[dl[j] : dl[j] + nl[j]]], offs.tolist(), nl)
            return
        if len(offs) >= 16:
            width = int(lens[0])
            if width <= min(GATHER_MAX_BYTES, self.file_size) and dst.size % width == 0:
                same = (lens == width) & (dsts % width == 0)
                if same.all() or same.sum() >= 16:
                    self._gather(dst.reshape(-1, width), offs[same], dsts[same] // width, width)
                    offs, dsts, lens = offs[~same], dsts[~same], lens[~same]
        src, out = self._mv, memoryview(dst)  # type: ignore[arg-type]
        assert src is not None
        for o, d, n in zip(offs.tolist(), dsts.tolist(), lens.tolist(), strict=True):
            out[d : d + n] = src[o : o + n]

    def _strided(self, width: int) -> np.ndarray:
        """The map as overlapping rows of ``width`` bytes, one starting at every byte (``view[o]``: the bytes
        ``o..o+width-1``), for numpy gathers; made once per width (``as_strided`` costs microseconds)."""
        view = self._views.get(width)
        if view is None:
            src = self.mapped()
            view = as_strided(src, (self.file_size - width + 1, width), (1, 1), writeable=False)
            self._views[width] = view
        return view

    def _row_offsets(self, n: int, width: int) -> np.ndarray:
        """``k * width`` for ``k < n`` (where each row of a batch starts in its output), kept between batches."""
        if len(self._rows_at) < n or self._rows_width != width:
            self._rows_at, self._rows_width = np.arange(n, dtype=np.int64) * width, width
        return self._rows_at[:n]

    def _gather(self, rows: np.ndarray, offs: np.ndarray, at: np.ndarray, width: int) -> None:
        view = self._strided(width)
        k = max(1, GATHER_CHUNK_BYTES // width)
        for a in range(0, len(offs), k):
            rows[at[a : a + k]] = view[offs[a : a + k]]

    def read_rows(self, offs: np.ndarray, width: int, rows: np.ndarray | None) -> np.ndarray | None:
        """The ``width`` bytes at each of ``offs`` as the rows of ``rows`` (a C-contiguous ``(n, width)`` uint8
        array) or of a new array, when all of them are in the page cache; else ``None``, and nothing is read.
        One call of the compiled copier straight into place; without it, numpy gathers (under the lease) or
        kernel copies.

        Raises:
            CorruptStoreError: the file is shorter than when the table was built.
        """
        n = len(offs)
        if width > self.file_size or not self._all_cached(offs, width):
            return None
        with self.guard.hold(self.file_size) as leased:
            if self.fast is None and not leased and not vm_available():
                return None
            before = major_faults()
            rows = self._copy_rows(offs, width, rows, leased)
            if before >= 0 and major_faults() > before:
                self.residency().distrust()
        self.stats["batches"] += 1
        self.stats["copied_runs"] += n
        return rows

    def _all_cached(self, offs: np.ndarray, width: int) -> bool:
        """Whether every run of ``width`` bytes at ``offs`` is in the page cache (the page map's answer in one
        compiled pass where it knows them all, else the residency's)."""
        res = self.residency()
        if self.fast is not None and res.available and self.fast.known(res.pages, offs, width, res.shift):
            return True
        return bool(res.cached(offs, width).all())

    def _copy_rows(self, offs: np.ndarray, width: int, rows: np.ndarray | None, leased: bool) -> np.ndarray:
        """The copy of :meth:`read_rows` (the map guarded, every byte cached)."""
        n = len(offs)
        if self.fast is not None:
            out = np.empty((n, width), np.uint8) if rows is None else rows
            if self._fast_copy(out, self._row_offsets(n, width), offs, width):
                return out
        if leased:
            view = self._strided(width)
            if rows is None:
                return view[offs]  # one gather into a new array
            k = max(1, GATHER_CHUNK_BYTES // width)  # into a given one: through a temporary kept in the CPU cache
            for a in range(0, n, k):
                rows[a : a + k] = view[offs[a : a + k]]
            return rows
        rows = np.empty((n, width), np.uint8) if rows is None else rows
        flat = rows.reshape(-1)
        if vm_copy(flat, self._row_offsets(n, width), self._base + offs, np.full(n, width, np.int64)):
            return rows
        if vm_available():
            raise copies.copy_failed(self.fd, self.file_size, self.path, rows)
        mv = memoryview(flat)  # type: ignore[arg-type]  # no lease and no kernel copy: read the rows
        self._pread(lambda j: [mv[j * width : (j + 1) * width]], offs.tolist(), [width] * n)
        return rows

    def _run(
        self, missing: np.ndarray, start: Callable[[np.ndarray], list[Future]], copy: Callable[[bool], None]
    ) -> None:
        """Start the missing runs' reads, copy the cached ones meanwhile (``copy(leased)``, under the guard), then
        wait for the reads; a major page fault in the copy (a page left the cache after it was checked) tells
        the page-cache state."""
        self.stats["batches"] += 1
        if missing.any():
            self.stats["pread_batches"] += 1
            self.stats["pread_runs"] += int(missing.sum())
        t0 = time.perf_counter()
        futs = start(missing)
        try:
            with self.guard.hold(self.file_size) as leased:
                before = major_faults()
                copy(leased)
                if before >= 0 and major_faults() > before:
                    self.residency().distrust()
        finally:
            for f in futs:
                f.result()
        if futs:  # the disk's rate at this count of reads in flight (only the count depends on it)
            self.inflight.observe(int(missing.sum()), time.perf_counter() - t0)

    def read(
        self, view: memoryview, offs: Any, dsts: Any, ends: Any, *, only_cached: bool = False, around: Any = (0, 0)
    ) -> bool:
        """Fill ``view[d:e]`` with the file's bytes at ``o`` for every ``(o, d, e)``; with ``only_cached``, only
        if the page cache holds them all (else nothing is read).  Returns whether it read.  A run that is not
        cached is read together with the ``around[0][i]`` bytes before it and the ``around[1][i]`` after it
        (thrown away, but in the page cache then: the rest of a value whose other samples a later batch reads).

        Raises:
            CorruptStoreError: the file is shorter than when the table was built (truncated under us).
        """
        o, d = _arr(offs), _arr(dsts)
        n = _arr(ends) - d
        if len(o) == 0:
            return True
        pre, post = (np.broadcast_to(_arr(a), len(o)) for a in around)
        dst = np.frombuffer(view, np.uint8)
        hit = self.residency().cached(o, n)
        miss = ~hit
        if only_cached and miss.any():
            return False
        self.stats["copied_runs"] += int(hit.sum())

        def start(missing: np.ndarray) -> list[Future]:
            mb, md, mn, ma = pre[missing].tolist(), d[missing].tolist(), n[missing].tolist(), post[missing].tolist()
            junk = memoryview(bytearray(max([*mb, *ma, 1])))  # read along and thrown away

            def bufs(j: int) -> list[memoryview]:
                return [junk[: mb[j]], view[md[j] : md[j] + mn[j]], junk[: ma[j]]]

            return self._submit(bufs, (o[missing] - pre[missing]).tolist(), (pre + n + post)[missing].tolist())

        self._run(miss, start, lambda leased: self._copy(dst, o[hit], d[hit], n[hit], leased))
        self.residency().mark(o[miss] - pre[miss], (pre + n + post)[miss])
        return True

    def gather(self, offs: Any, width: int) -> np.ndarray:
        """``width`` bytes at each offset of ``offs``, as an ``(n, width)`` uint8 array (cached or not, as
        :meth:`read`).

        Raises:
            CorruptStoreError: the file is shorter than some ``off + width``.
        """
        o = _arr(offs)
        buf = np.empty((len(o), width), np.uint8)
        d = np.arange(len(o), dtype=np.int64) * width
        self.read(memoryview(buf.reshape(-1)), o, d, d + width)  # type: ignore[arg-type]
        return buf

    def read_headed(
        self, view: memoryview, offs: Any, skips: Any, dsts: Any, ends: Any, head: int, tails: Any
    ) -> np.ndarray:
        """For each run: the ``head`` bytes at ``o``, then ``s`` bytes skipped, then ``view[d:e]`` (a value's
        overflow header and the samples read from it: one disk read, not two, when not cached), and when not
        cached the ``tails[i]`` bytes after it too (thrown away, but in the page cache then).  Returns the
        ``(n, head)`` heads.

        Raises:
            CorruptStoreError: a short read (the file shorter than the table says).
        """
        o, s, d, t = _arr(offs), _arr(skips), _arr(dsts), _arr(tails)
        n = _arr(ends) - d
        heads = np.empty((len(o), head), np.uint8)
        if len(o) == 0:
            return heads
        hit = self.residency().cached(o, head + s + n)
        miss = ~hit
        self.stats["copied_runs"] += int(hit.sum())
        hv = memoryview(heads.reshape(-1))  # type: ignore[arg-type]
        dst = np.frombuffer(view, np.uint8)

        def start(missing: np.ndarray) -> list[Future]:
            idx = np.flatnonzero(missing).tolist()
            ms, md, mn, mt = s[missing].tolist(), d[missing].tolist(), n[missing].tolist(), t[missing].tolist()
            junk = memoryview(bytearray(max([*ms, *mt, 1])))  # what lies between and after: read and thrown away

            def bufs(j: int) -> list[memoryview]:
                i = idx[j]
                return [hv[i * head : (i + 1) * head], junk[: ms[j]], view[md[j] : md[j] + mn[j]], junk[: mt[j]]]

            return self._submit(bufs, o[missing].tolist(), (head + s + n + t)[missing].tolist())

        def copy(leased: bool) -> None:
            if hit.any():
                at = np.flatnonzero(hit).astype(np.int64) * head
                self._copy(heads.reshape(-1), o[hit], at, np.full(len(at), head, np.int64), leased)
                self._copy(dst, o[hit] + head + s[hit], d[hit], n[hit], leased)

        self._run(miss, start, copy)
        self.residency().mark(o[miss], (head + s + n + t)[miss])
        return heads

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
            self._bytes, self._res, self._views = None, None, {}
            # a view of the map still alive (a traceback's frame holding one) keeps it open until collected
            with contextlib.suppress(BufferError):
                if self._mv is not None:
                    self._mv.release()
                if self._map is not None:
                    self._map.close()
        self._pool, self._map, self._mv, self._bytes, self._res = None, None, None, None, None
