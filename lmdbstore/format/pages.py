"""LMDB 0.9 data-file pages, read-only (data version 1, as py-lmdb 3's ``lmdb/verify.py`` parses them): meta pages,
bounded page reads, node offsets, overflow-page headers.  Everything read is checked before it is used (page numbers
and node offsets against the page and the file, headers against the page they claim to be) and no read leaves the
file.  Meta pages this parser does not know (magic, data version, byte order, page size) raise
:class:`UnsupportedLayout` (the caller falls back to liblmdb); anything else that contradicts itself,
:class:`~lmdbstore.errors.CorruptStoreError`.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmdbstore.errors import CorruptStoreError

__all__ = [
    "DAMAGE_HINT",
    "RESTORE_HINT",
    "META_BYTES",
    "P_BRANCH",
    "P_LEAF",
    "P_OVERFLOW",
    "PAGEHDRSZ",
    "LmdbDb",
    "LmdbMeta",
    "PageReader",
    "UnsupportedLayout",
    "bad_overflow_headers",
    "damaged",
    "overflow_pages",
    "parse_meta",
    "read_meta_page",
]

MDB_MAGIC = 0xBEEFC0DE
DATA_VERSION_09 = 1
PAGEHDRSZ = 16
NODESIZE = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
TYPE_MASK = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DB_SIZE = 48
#: ``MDB_meta``: magic, version, address, map size, the free and main ``MDB_db`` records, last page, txnid.
META_STRUCT_BYTES = 4 + 4 + 8 + 8 + 2 * MDB_DB_SIZE + 8 + 8
#: Bytes of a meta page that describe a snapshot completely: the page header and the ``MDB_meta``.
META_BYTES = PAGEHDRSZ + META_STRUCT_BYTES
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow pages, entries, root


#: What to do about a data file that contradicts itself, and about one truncated.
DAMAGE_HINT = "run `lmdbstore verify` on the store"
RESTORE_HINT = "restore the store from a copy"


def damaged(message: str, *, path: str | Path | None = None, key: object = None) -> CorruptStoreError:
    """The one-line error for a data file that contradicts itself (with :data:`DAMAGE_HINT`)."""
    return CorruptStoreError(message, path=path, key=key, hint=DAMAGE_HINT)


class UnsupportedLayout(Exception):
    """The data file is not in the LMDB 0.9 layout this parser knows; use liblmdb instead."""


@dataclass(frozen=True)
class LmdbDb:
    """An ``MDB_db`` record: a B-tree's flags, depth, entry count and root page."""

    flags: int
    depth: int
    entries: int
    root: int

    @classmethod
    def parse(cls, raw: bytes | memoryview) -> LmdbDb:
        _pad, flags, depth, _b, _l, _o, entries, root = _DB.unpack(bytes(raw[:MDB_DB_SIZE]))
        return cls(flags, depth, entries, root)


@dataclass(frozen=True)
class LmdbMeta:
    """One meta page: what a committed snapshot is (``raw`` holds its :data:`META_BYTES` bytes as read)."""

    psize: int
    free: LmdbDb
    main: LmdbDb
    last_pg: int
    txnid: int
    raw: bytes = b""

    @property
    def key(self) -> tuple[int, int, int, int]:
        """The snapshot as LMDB names it: transaction id, roots of the free and main B-trees, last page."""
        return (self.txnid, self.free.root, self.main.root, self.last_pg)


def _pread_exact(fd: int, n: int, off: int, file_size: int, what: str, path: str | Path | None) -> bytes:
    if off < 0 or off + n > file_size:
        raise damaged(f"{what} lies outside the data file ({off}+{n} > {file_size})", path=path)
    buf = os.pread(fd, n, off)
    if len(buf) != n:
        raise damaged(f"data file shorter than expected while reading {what}", path=path)
    return buf


def parse_meta(buf: bytes, which: int, psize: int | None = None) -> LmdbMeta:
    """Parse the :data:`META_BYTES` bytes of meta page ``which`` (0 or 1); ``psize`` as page 0 says
    (``UnsupportedLayout``: not little-endian LMDB 0.9: flags, magic, data version, page size)."""
    if sys.byteorder != "little":
        raise UnsupportedLayout("big-endian host")
    if len(buf) < META_BYTES:
        raise UnsupportedLayout(f"meta page {which} is short")
    flags = struct.unpack_from("<H", buf, 10)[0]
    magic, version = struct.unpack_from("<II", buf, PAGEHDRSZ)
    if not flags & P_META or magic != MDB_MAGIC or version != DATA_VERSION_09:
        raise UnsupportedLayout(f"meta page {which}: magic {magic:#x}, data version {version}, flags {flags:#x}")
    m = PAGEHDRSZ + 24
    if psize is None:
        psize = struct.unpack_from("<I", buf, m)[0]  # the free DB's md_pad holds the page size
    if psize < 1024 or psize > 0x8000 or psize & (psize - 1):
        raise UnsupportedLayout(f"page size {psize}")
    free = LmdbDb.parse(buf[m : m + MDB_DB_SIZE])
    main = LmdbDb.parse(buf[m + MDB_DB_SIZE : m + 2 * MDB_DB_SIZE])
    last_pg, txnid = struct.unpack_from("<QQ", buf, m + 2 * MDB_DB_SIZE)
    return LmdbMeta(psize, free, main, last_pg, txnid, bytes(buf[:META_BYTES]))


def read_meta_page(fd: int, file_size: int, which: int, path: str | Path | None = None) -> LmdbMeta:
    """Parse meta page ``which`` (0 or 1) of the data file ``fd`` (``UnsupportedLayout``: not little-endian LMDB 0.9;
    ``CorruptStoreError``: the file is shorter than the page)."""
    head = _pread_exact(fd, META_BYTES, 0, file_size, "meta page 0", path)
    page0 = parse_meta(head, 0)
    if which == 0:
        return page0
    return parse_meta(_pread_exact(fd, META_BYTES, page0.psize, file_size, "meta page 1", path), 1, page0.psize)


#: Fills an ``(n, psize)`` array with the pages ``pgnos`` (many reads in flight).
PageFill = Callable[[np.ndarray, Sequence[int]], None]


class PageReader:
    """Bounded page reads of one data file as of one snapshot (by ``fill`` where given, else one ``pread`` each)."""

    def __init__(self, fd: int, file_size: int, meta: LmdbMeta, path: str | Path | None, fill: PageFill | None):
        self.fd, self.file_size, self.psize, self.path = fd, file_size, meta.psize, path
        self.n_pages = min(meta.last_pg + 1, file_size // meta.psize)
        self.fill = fill

    def check_pgnos(self, pgnos: Sequence[int]) -> None:
        """Refuse (``CorruptStoreError`` naming the first) a page number outside the snapshot's pages but the meta
        pages."""
        for p in pgnos:
            if not 2 <= p < self.n_pages:
                raise damaged(f"B-tree points at page {p}, outside pages 2..{self.n_pages - 1}", path=self.path)

    def read(self, pgnos: Sequence[int], want: int) -> np.ndarray:
        """Pages ``pgnos`` as an ``(n, psize)`` uint8 array, each checked for its number and type ``want``
        (``CorruptStoreError``: a page number outside the snapshot, or a page whose header is not itself)."""
        self.check_pgnos(pgnos)
        ps = self.psize
        arr = np.empty((len(pgnos), ps), np.uint8)
        if self.fill is not None:
            self.fill(arr, pgnos)
        else:
            for i, p in enumerate(pgnos):  # straight into its row: no per-page objects left behind
                if os.preadv(self.fd, [memoryview(arr[i])], p * ps) != ps:
                    raise damaged(f"data file shorter than expected at page {p}", path=self.path)
        self.check(arr, pgnos, want)
        return arr

    def check(self, arr: np.ndarray, pgnos: Sequence[int], want: int) -> None:
        """Refuse (``CorruptStoreError`` naming the first) a page of ``arr`` (pages ``pgnos`` as read) whose header
        names another page or type than ``want``."""
        hdr_pgno = arr[:, :8].copy().view("<u8").reshape(-1)
        flags = arr[:, 10:12].copy().view("<u2").reshape(-1) & TYPE_MASK
        bad = np.flatnonzero((hdr_pgno != np.asarray(pgnos, np.uint64)) | (flags != want))
        if bad.size:
            i = int(bad[0])
            raise damaged(
                f"page {pgnos[i]} has header (page {int(hdr_pgno[i])}, flags {int(flags[i]):#x}), expected flags {want:#x}",
                path=self.path,
            )

    def read_bytes(self, offset: int, n: int, what: str) -> bytes:
        """``n`` bytes at ``offset`` of the snapshot's pages (``CorruptStoreError`` outside them or the file)."""
        return _pread_exact(self.fd, n, offset, min(self.file_size, self.n_pages * self.psize), what, self.path)

    def nodes(self, page: np.ndarray, pgno: int) -> tuple[np.ndarray, np.ndarray]:
        """Node offsets of one B-tree page and its 16-bit words, bounds-checked (:meth:`nodes_2d`)."""
        return self.nodes_2d(page[None], [pgno])[1], page.view("<u2")

    def nodes_2d(self, arr: np.ndarray, pgnos: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Node offsets of many B-tree pages at once: ``(page row, node offset)`` per node, bounds-checked (a page
        without nodes has bad bounds).  Raises ``CorruptStoreError``: naming the first page with bad bounds or a node
        outside it."""
        ps = self.psize
        words = arr.view("<u2")
        lower, upper = words[:, 6].astype(np.int64), words[:, 7].astype(np.int64)
        bad = np.flatnonzero(
            (lower < PAGEHDRSZ) | (lower > upper) | (upper > ps) | (lower % 2 == 1) | (lower == PAGEHDRSZ)
        )
        if bad.size:
            i = int(bad[0])
            raise damaged(f"page {pgnos[i]} has bad bounds lower={lower[i]} upper={upper[i]}", path=self.path)
        nkeys = (lower - PAGEHDRSZ) // 2
        row = np.repeat(np.arange(len(arr)), nkeys)
        slot = np.arange(int(nkeys.sum())) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
        ptr = words[row, PAGEHDRSZ // 2 + slot].astype(np.int64)
        bad = np.flatnonzero((ptr < upper[row]) | (ptr + NODESIZE > ps) | (ptr % 2 == 1))
        if bad.size:
            raise damaged(f"page {pgnos[int(row[bad[0]])]} has a node outside its page", path=self.path)
        return row, ptr


def overflow_pages(value_bytes: np.ndarray | int, psize: int) -> np.ndarray | int:
    """Pages of the overflow run holding a value of ``value_bytes`` (its 16-byte header included)."""
    return (PAGEHDRSZ - 1 + value_bytes) // psize + 1


def bad_overflow_headers(heads: np.ndarray, pgnos: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Which overflow-page headers ``heads`` (``(n, 16)`` uint8) contradict the node that points at them: not an
    overflow page, not page ``pgnos[i]`` (where the node points), or fewer than ``need[i]`` pages (its value's)."""
    h = np.ascontiguousarray(heads, np.uint8).reshape(-1, PAGEHDRSZ)
    own = h[:, :8].copy().view("<u8").reshape(-1)
    flags = h[:, 10:12].copy().view("<u2").reshape(-1) & TYPE_MASK
    pages = h[:, 12:16].copy().view("<u4").reshape(-1)
    return (own != np.asarray(pgnos, np.uint64)) | (flags != P_OVERFLOW) | (pages < np.asarray(need, np.int64))
