"""Which bytes of a mapped file are in the page cache, as the kernel says: :class:`Residency`.

The reader copies cached bytes from its read-only map of ``data.mdb`` (no system call) and sends only
the missing ones to its I/O threads (:mod:`lmdbstore.store.preads`).  It decides from the kernel's own
answers, never from timings:

- ``mincore(2)`` on the map says, page by page, what is in the page cache.  The answers are written
  into a page map (one byte per 4 KiB page of the file: 0.024 % of its size, e.g. 7 MiB for a 28 GiB
  store, per reading process).  Runs whose pages are not known to be cached are checked exactly, one
  ``mincore`` call per cluster of nearby runs (:data:`CALL_PAGES`).
- A page the map says is cached (the kernel said so, or the I/O threads just read it) is copied without
  another system call.  Pages can leave the cache behind its back; the kernel then tells: the copy takes a
  *major* page fault (``getrusage(RUSAGE_THREAD).ru_majflt``), and the map forgets everything it knew (every
  page is asked about again before it is trusted).  Once the checks made since cost as much as one ``mincore``
  over the whole file (a ski-rental rule, so the checks cost at most twice the best choice), and a batch was
  found wholly cached, the whole map is refreshed by one ``mincore`` (*trusted* again: every entry is the
  kernel's answer since the last fault).
- Pages the I/O threads just read are marked cached.

Only speed depends on these answers: a page that leaves the cache between the check and the copy costs
a synchronous 4 KiB read from a fault (the map has ``MADV_RANDOM``), never a wrong byte.  Where
``mincore`` is unavailable every run counts as missing (read by ``preadv``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import resource

import numpy as np

__all__ = ["CALL_PAGES", "Residency", "major_faults"]

#: The cost of one ``mincore`` call from Python, in pages it could have checked instead (~0.9 us per call
#: against ~8 ns per page): runs closer than this are checked by one call over the pages between them.
CALL_PAGES = 112
#: Runs spanning fewer pages than this are looked up page by page (vectorised over the runs), longer ones reduced.
SHORT_SPAN = 16
#: Pages one whole-file refresh checks per call (bounded calls, the answers written in place).
REFRESH_PAGES = 1 << 18


@functools.lru_cache(maxsize=1)
def _mincore() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``mincore``, or ``None`` where there is none (not Linux/BSD)."""
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).mincore
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def major_faults() -> int:
    """Major page faults of the calling thread so far (-1 where the OS does not count them per thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return -1
    return resource.getrusage(who).ru_majflt


def _expand(p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
    """Every page of the runs ``p0[i]..p1[i]``."""
    counts = p1 - p0 + 1
    if counts.size and int(counts.max()) == 1:
        return p0
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    run = np.repeat(np.arange(len(p0)), counts)
    return p0[run] + (np.arange(int(counts.sum())) - starts[run])


class Residency:
    """The page-cache state of one read-only map of ``size`` bytes at address ``addr`` (see the module).

    Not thread-safe: one engine's calling thread uses it (the I/O threads only read the file).
    """

    def __init__(self, addr: int, size: int):
        self.addr, self.size = addr, size
        self.shift = mmap.PAGESIZE.bit_length() - 1
        self.npages = (size + mmap.PAGESIZE - 1) >> self.shift
        # mincore's answers, 1 = cached (one more entry: the end of a range may lie past the last page)
        self.pages = np.zeros(self.npages + 1, np.uint8)
        self.trusted = False
        self.spent = 0  # pages' worth of exact checks since the map was last refreshed whole
        self.available = _mincore() is not None

    def _span(self, starts: np.ndarray, lens: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        return starts >> self.shift, (starts + np.maximum(lens, 1) - 1) >> self.shift

    def _known(self, p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
        """Whether the map says every page of each run is cached."""
        span = int((p1 - p0).max())
        if span < SHORT_SPAN:  # a sample or a value: a few lookups per run beat a reduction per run
            ok = self.pages[p0]
            for k in range(1, span + 1):
                ok &= self.pages[np.minimum(p0 + k, p1)]
            return ok.astype(bool)
        # min over pages[p0:p1 + 1] of each run: reduceat reads entry 2i from bounds 2i and 2i + 1 alone
        bounds = np.empty(2 * len(p0), np.int64)
        bounds[0::2], bounds[1::2] = p0, p1 + 1
        return np.minimum.reduceat(self.pages, bounds)[0::2].astype(bool)

    def _check(self, p0: np.ndarray, p1: np.ndarray) -> None:
        """Ask the kernel about the pages of the runs ``p0..p1``: one call per cluster of nearby runs, the
        answers written straight into the map."""
        fn = _mincore()
        assert fn is not None
        order = np.argsort(p0, kind="stable")
        a, b = p0[order], np.maximum.accumulate(p1[order])
        brk = np.flatnonzero(np.r_[True, a[1:] - b[:-1] > CALL_PAGES])
        lo, hi = a[brk], b[np.r_[brk[1:] - 1, len(a) - 1]] + 1
        base, vec, shift = self.addr, self.pages.ctypes.data, self.shift
        for s, e in zip(lo.tolist(), hi.tolist(), strict=True):
            if fn(base + (s << shift), (e - s) << shift, vec + s) != 0:
                self.pages[s:e] = 0  # no answer: count the pages as missing (read by preadv)
            else:
                self.pages[s:e] &= 1  # the other bits are reserved
        self.spent += len(lo) * CALL_PAGES + int((hi - lo).sum())

    def refresh(self) -> None:
        """Ask the kernel about every page of the file and trust the map again."""
        fn = _mincore()
        if fn is None:
            return
        vec = self.pages.ctypes.data
        for s in range(0, self.npages, REFRESH_PAGES):
            e = min(s + REFRESH_PAGES, self.npages)
            if fn(self.addr + (s << self.shift), (e - s) << self.shift, vec + s) != 0:
                self.pages[s:e] = 0
        self.pages &= 1
        self.trusted, self.spent = True, 0

    def cached(self, starts: np.ndarray, lens: np.ndarray | int) -> np.ndarray:
        """Whether each byte run ``[starts[i], starts[i] + lens[i])`` (``lens``: one length for all) is wholly in
        the page cache now: the map's answer where it knows, the kernel's for the rest (written into the map)."""
        if not self.available or len(starts) == 0:
            return np.zeros(len(starts), bool)
        p0, p1 = self._span(starts, lens)
        known = self._known(p0, p1)
        if not known.all():
            unsure = ~known
            self._check(p0[unsure], p1[unsure])
            known[unsure] = self._known(p0[unsure], p1[unsure])
            if known.all() and not self.trusted and self.spent >= self.npages:
                self.refresh()
        return known

    def mark(self, starts: np.ndarray, lens: np.ndarray) -> None:
        """The runs were just read from the file (so their pages are in the page cache)."""
        if len(starts):
            self.pages[_expand(*self._span(starts, lens))] = 1

    def distrust(self) -> None:
        """A page the map said was cached was not (a major fault): forget every answer (each page is asked about
        again before a copy trusts it), until refreshed."""
        self.trusted = False
        self.pages[:] = 0
