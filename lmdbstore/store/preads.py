"""Reading runs of bytes of one data file by offset: :class:`PreadEngine`.

The reader copies exactly the bytes a batch needs from ``data.mdb`` at offsets the position table gives
(:mod:`lmdbstore.store.positions`): plain slice copies from a read-only map when the file is in the page
cache, ``os.preadv`` on a small thread pool (``pread`` releases the GIL) when it is not.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError

__all__ = ["CACHED_BYTE_S", "CACHED_READ_S", "DEFAULT_IO_THREADS", "PROBE_RUNS", "PreadEngine"]

#: Reads kept in flight by one reader (threads of its pool); 16 saturates typical NVMe and network disks.
DEFAULT_IO_THREADS = 16
#: Runs read on the calling thread before deciding whether the batch is served from the page cache.
PROBE_RUNS = 32
#: Probe reads faster than this (seconds per read plus seconds per byte) came from the page cache: a cold
#: read from a fast NVMe disk takes ~80 us for 4 KiB, a page-cache copy ~2 us plus ~0.2 ns per byte.
CACHED_READ_S = 20e-6
CACHED_BYTE_S = 1e-9


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

    def pmap(self, fn: Callable[[Any], Any], items: Any) -> list[Any]:
        """``[fn(i) for i in items]``, where ``fn`` reads the file: the first :data:`PROBE_RUNS` on this
        thread, the rest too when those came from the page cache, else on the pool (many in flight)."""
        items = list(items)
        k = min(PROBE_RUNS, len(items))
        t0 = time.perf_counter()
        out = [fn(i) for i in items[:k]]
        if k < len(items):
            if time.perf_counter() - t0 < k * CACHED_READ_S:
                out += [fn(i) for i in items[k:]]
            else:
                out += list(self.pool().map(fn, items[k:]))
        return out

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

    def gather(self, offs: list[int], width: int) -> np.ndarray:
        """``width`` bytes at each offset of ``offs``, as an ``(n, width)`` uint8 array (cached or not, as
        :meth:`read`).

        Raises:
            CorruptStoreError: the file is shorter than some ``off + width``.
        """
        buf = np.empty((len(offs), width), np.uint8)
        dsts = list(range(0, len(offs) * width, width))
        self.read(memoryview(buf.reshape(-1)), offs, dsts, [d + width for d in dsts])  # type: ignore[arg-type]
        return buf

    def read_headed(
        self, view: memoryview, offs: list[int], skips: list[int], dsts: list[int], ends: list[int], head: int
    ) -> np.ndarray:
        """For each run: the ``head`` bytes at ``o``, then ``s`` bytes skipped, then ``view[d:e]``, in one
        ``preadv`` (one read from the disk instead of two: a value's header page and the sample in it).

        Returns the ``(n, head)`` heads.  Many runs go to the pool (many in flight), a few are read here.

        Raises:
            CorruptStoreError: a short read (the file shorter than the table says).
        """
        n = len(offs)
        heads = np.empty((n, head), np.uint8)
        hv = memoryview(heads.reshape(-1))  # type: ignore[arg-type]
        junk = memoryview(bytearray(max(skips, default=0) or 1))  # what lies between: read and thrown away

        def part(a: int, b: int) -> None:
            fd, preadv = self.fd, os.preadv
            for j in range(a, b):
                bufs = [hv[j * head : (j + 1) * head], junk[: skips[j]], view[dsts[j] : ends[j]]]
                if preadv(fd, bufs, offs[j]) != head + skips[j] + ends[j] - dsts[j]:
                    raise CorruptStoreError("data file is shorter than its B-tree says (truncated?)", path=self.path)

        if n <= PROBE_RUNS or self.threads == 1:
            part(0, n)
            return heads
        bounds = np.linspace(0, n, min(self.threads, n) + 1).astype(int).tolist()
        for f in [self.pool().submit(part, a, b) for a, b in itertools.pairwise(bounds) if b > a]:
            f.result()
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
            if self._mv is not None:
                self._mv.release()
            if self._map is not None:
                self._map.close()
        self._pool, self._map, self._mv = None, None, None
