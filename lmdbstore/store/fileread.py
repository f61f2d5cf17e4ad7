"""Reading a batch by file offset, and guarding liblmdb's reads of its map (private; docs/design.md, "Reads by file
offset" and "No SIGBUS"): :class:`FileReader` reads a batch in one call of the compiled reader (``batchread.c``), or
without it by ``os.preadv`` calls in turn (the same bytes and checks, slower); :func:`lmdb_guard` refuses a liblmdb
call that met a page of a file shrunk under it (:class:`MapPatched`) instead of letting SIGBUS kill the process.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.format.pages import DAMAGE_HINT, PAGEHDRSZ, RESTORE_HINT, bad_overflow_headers, overflow_pages

__all__ = [
    "COMPILED",
    "EXTEND_RUN_SAMPLES",
    "IO_THREADS",
    "FileReader",
    "MapPatched",
    "lmdb_guard",
    "map_spans",
    "read_together",
]


def _load() -> ModuleType | None:
    try:
        from lmdbstore.store import batchread  # type: ignore[attr-defined]
    except ImportError:
        return None
    return batchread  # type: ignore[no-any-return]


#: The compiled reader, or ``None`` where it was not built (then the reads are ``os.preadv`` calls in turn).
COMPILED: ModuleType | None = _load()
#: What a read answers (``batchread.c``'s numbers), and its detail: done; a value not located yet (the row); a value
#: of the wrong length, a wrong overflow header (the value); a short read (the offset); a fault on a page of the map,
#: of the destination; an I/O error (errno).
OK, NEED, WRONG_LENGTH, BAD_HEADER, SHORT, SOURCE, DEST, IO_ERROR = range(8)
#: Reads in flight for a cold batch: 64 read 1.15-1.3x more than 16 or 32 on a virtio disk over NVMe, for 2.5 KB
#: reads and whole values alike; a slower disk only queues them.
IO_THREADS = 64
#: A run of at least this many samples of one value (block order) that is not cached is read with the rest of the
#: value: its other pieces, in the next batches, are then copies.
EXTEND_RUN_SAMPLES = 4
#: ``FileReader.state``: whether the page map is trusted, the pages' worth of probes since, runs the page cache
#: held, runs read from the disk.
STATE = ("trusted", "spent", "copied", "read")


def truncated(size: int, needed: int, path: str | Path | None) -> CorruptStoreError:
    """The one-line error for a data file shorter than what is read from it."""
    msg = f"data file was truncated while open: {size} bytes, the reader needs {needed}"
    return CorruptStoreError(msg, path=path, hint=RESTORE_HINT)


def shrunk(fd: int, needed: int, path: str | Path | None) -> CorruptStoreError:
    """The one-line error for a read the file ``fd`` shrank under (it may have grown back since)."""
    size = os.fstat(fd).st_size
    if size < needed:
        return truncated(size, needed, path)
    return CorruptStoreError("the data file shrank while it was read", path=path, hint=RESTORE_HINT)


class FileReader:
    """Reads of the data file ``fd`` (``size`` bytes when its positions were read) in one process, ``threads`` in
    flight (default :data:`IO_THREADS`), by threads that share the map (made on first need) and the page map."""

    def __init__(self, fd: int, size: int, path: str | Path | None = None, threads: int | None = None):
        self.fd, self.size, self.path = fd, size, path
        self.threads = IO_THREADS if threads is None else threads
        self._map: mmap.mmap | None = None
        self._addr = 0
        self.pages = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE + 1, np.uint8)
        self.state = np.zeros(len(STATE), np.int64)
        self._lock = threading.Lock()
        # Whole values are read through a file description without read-ahead (many reads of neighbouring values
        # look sequential to the kernel, which reads on in vain); single samples keep it (it completes a window).
        try:
            self.rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(self.rfd, 0, 0, os.POSIX_FADV_RANDOM)
        except (OSError, AttributeError):
            self.rfd = fd

    @property
    def stats(self) -> dict[str, int]:
        return dict(zip(STATE, self.state.tolist(), strict=True))

    def _address(self) -> int:
        if self._map is None and self.size:
            with self._lock:
                if self._map is None:
                    m = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
                    with contextlib.suppress(AttributeError, OSError):
                        m.madvise(mmap.MADV_RANDOM)  # a fault reads one page, no read-ahead
                    buf = np.frombuffer(m, np.uint8)
                    self._addr = buf.ctypes.data
                    del buf
                    self._map = m
        return self._addr

    def read(
        self,
        dst: np.ndarray,
        idx: np.ndarray,
        offsets: np.ndarray,
        checked: np.ndarray,
        layout: tuple[int, int, int, int, int],
        extend: int = 0,
    ) -> tuple[int, int]:
        """Read sample ``idx[i]`` into ``dst[i * sb:]`` (C-contiguous bytes) for every ``i``; value ``v``'s payload lies
        at ``offsets[v]``; ``layout``: (samples per value, sample bytes, page size (0: no overflow headers), samples
        in all, a full value's stored bytes); cold runs of ``extend`` samples or more read their whole value; a value
        not ``checked`` has its overflow header checked, then is marked.  Returns ``(status, detail)`` (:data:`OK`
        and the others; :meth:`fail` makes the error)."""
        return read_together([(self, (dst, idx, offsets, checked, layout, extend))])[0]

    def _read_by_preadv(
        self, dst: np.ndarray, idx: np.ndarray, offsets: np.ndarray, checked: np.ndarray, layout: tuple[int, ...]
    ) -> tuple[int, int]:
        """:meth:`read` without the compiled reader: one ``os.preadv`` per sample (and per new header), in turn."""
        spv, sb, psize, count, vlen = layout
        values = idx // spv
        offs = offsets[values]
        if (offs < -1).any():
            return NEED, int(np.flatnonzero(offs < -1)[0])
        if (offs == -1).any():
            return WRONG_LENGTH, int(values[offs == -1][0])
        new = np.unique(values[~checked[values]]) if psize else values[:0]
        if new.size:
            heads = np.empty((len(new), PAGEHDRSZ), np.uint8)
            for i, o in enumerate((offsets[new] - PAGEHDRSZ).tolist()):
                if os.preadv(self.fd, [memoryview(heads[i])], o) != PAGEHDRSZ:
                    return SHORT, o
            lens = np.minimum(spv, count - new * spv) * sb + (vlen - spv * sb)
            need = np.asarray(overflow_pages(lens, psize))
            bad = bad_overflow_headers(heads, (offsets[new] - PAGEHDRSZ) // psize, need)
            if bad.any():
                return BAD_HEADER, int(new[bad][0])
            checked[new] = True
        view = memoryview(dst)  # type: ignore[arg-type]
        for i, o in enumerate((offs + (idx - values * spv) * sb).tolist()):
            if os.preadv(self.fd, [view[i * sb : (i + 1) * sb]], o) != sb:
                return SHORT, o
        self.state[3] += len(idx)  # (not told apart from runs the page cache held)
        return OK, 0

    def fail(self, status: int, detail: int, key: int | None = None) -> LmdbStoreError:
        """The one-line error for a read that answered ``status`` (not NEED); ``key``: the value's key, where the
        detail is a value."""
        if status == WRONG_LENGTH:
            return CorruptStoreError("value has the wrong length", path=self.path, key=key, hint=DAMAGE_HINT)
        if status == BAD_HEADER:
            return CorruptStoreError(
                "the overflow page of a value has a wrong header", path=self.path, key=key, hint=DAMAGE_HINT
            )
        if status == DEST:  # the batch's destination could not be written: the store is fine
            return LmdbStoreError(
                "the batch's destination memory could not be written (a bus error on out=: it maps a file that was "
                "truncated, or a tmpfs or /dev/shm that is full); the store was not the cause",
                hint="read into ordinary memory, or make room where the destination lives",
            )
        size = os.fstat(self.fd).st_size
        if size < self.size:
            return truncated(size, self.size, self.path)
        if status == IO_ERROR:
            return CorruptStoreError(
                f"I/O error reading the store ({os.strerror(detail)})", path=self.path, hint="check the disk"
            )
        if status == SHORT:
            return CorruptStoreError("data file is shorter than its B-tree says (truncated?)", path=self.path)
        return CorruptStoreError("the data file's pages could not be copied", path=self.path, hint="check the disk")

    def gather(self, offs: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
        """``width`` bytes at each offset of ``offs``, as the rows of an ``(n, width)`` uint8 array (``out``, or a
        new one), many reads in flight (``CorruptStoreError``: the file is shorter than some ``off + width``)."""
        offs = np.ascontiguousarray(offs, np.int64)
        out = np.empty((len(offs), width), np.uint8) if out is None else out
        n = len(offs)
        status, detail = self.read(out.reshape(-1), np.arange(n), offs, np.ones(n, bool), (1, width, 0, n, width))
        if status != OK:
            raise self.fail(status, detail)
        return out

    def gather_into(self, arr: np.ndarray, pgnos: Sequence[int]) -> None:
        """Pages ``pgnos`` into the rows of ``arr`` (a page reader's fill)."""
        self.gather(np.asarray(pgnos, np.int64) * arr.shape[1], arr.shape[1], arr)

    def advise(self, starts: list[int], ends: list[int]) -> None:
        """Start reading byte ranges ``[s, e)`` into the page cache on a thread of its own (advice, never waited for)."""
        fd = self.fd

        def run() -> None:
            for s, e in zip(starts, ends, strict=True):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, s, e - s, os.POSIX_FADV_WILLNEED)

        threading.Thread(target=run, name="lmdbstore-advise", daemon=True).start()

    def close(self) -> None:
        """Let go of the map and the second file description (the first is the caller's)."""
        with self._lock:
            m, self._map, self._addr = self._map, None, 0
            if self.rfd != self.fd:
                with contextlib.suppress(OSError):
                    os.close(self.rfd)
            self.rfd = self.fd
        if m is not None:
            with contextlib.suppress(BufferError):
                m.close()


def read_together(parts: list[tuple[FileReader, tuple[Any, ...]]]) -> list[tuple[int, int]]:
    """:meth:`FileReader.read` of each ``(reader, arguments)`` part -- the stores of a set -- in one compiled call
    (one job: every part's reads in flight together, the warm copies shared); its ``(status, detail)`` each."""
    if COMPILED is None:
        return [f._read_by_preadv(*args[:5]) for f, args in parts]
    specs = []  # batchread.c's read(): one tuple per file
    for f, (dst, idx, offsets, checked, layout, extend) in parts:
        idx = np.ascontiguousarray(idx, np.int64)
        specs.append((f.fd, f.rfd, f._address(), f.size, f.pages, f.state, dst, idx, offsets, checked, *layout, extend))
    return COMPILED.read(max(f.threads for f, _ in parts), specs)  # type: ignore[no-any-return]


class MapPatched(Exception):
    """A page of liblmdb's map lay past the end of the file during a guarded call: it read zeros there."""


def map_spans(data: Path, ino: int) -> np.ndarray | None:
    """``[start, end)`` of every map of this process of the file ``data`` (inode ``ino``) from its first byte (liblmdb's
    map among them; the kernel may list one map in pieces), as int64 pairs for :func:`lmdb_guard`; ``None`` where
    ``/proc/self/maps`` cannot tell."""
    real, spans = os.path.realpath(data), list[list[int]]()
    with contextlib.suppress(OSError, ValueError), open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and (int(fields[4]) == ino or fields[5].strip() == real):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                off = int(fields[2], 16)
                if spans and spans[-1][1] == lo and spans[-1][2] + lo - spans[-1][0] == off:
                    spans[-1][1] = hi  # the next piece of the same map
                else:
                    spans.append([lo, hi, off])
        whole = [x for s in spans if s[2] == 0 for x in s[:2]]
        return np.asarray(whole[:8], np.uint64) if whole else None
    return None


@contextlib.contextmanager
def lmdb_guard(spans: np.ndarray | None, fd: int) -> Iterator[None]:
    """Guard liblmdb's reads of its map (one of ``spans``, :func:`map_spans`) during the block, on this thread: a page
    past the end of a file shrunk meanwhile reads as zeros (mapped over it) instead of raising SIGBUS, and the block
    raises :class:`MapPatched` (what liblmdb returned is not the file's); the file's pages are then mapped there again
    from ``fd``.  A no-op without the compiled reader or spans, and where another SIGBUS handler was installed over
    the reader's (a shrunk file then kills the process, as any access to a truncated map does)."""
    on = COMPILED is not None and spans is not None and bool(COMPILED.lmdb_begin(spans))
    try:
        yield
    finally:
        if on and COMPILED.lmdb_end(fd):  # type: ignore[union-attr]
            raise MapPatched
