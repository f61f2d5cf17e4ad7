"""A read-only parser of LMDB 0.9 data files: where each packed value of the ``samples`` B-tree lies.

LMDB's on-disk page format is fixed for the 0.9 series (data version 1; py-lmdb 3's offline verifier,
``lmdb/verify.py``, parses the same layout in pure Python).  The reader uses this module once per snapshot
to turn the ``samples`` sub-database into a table of file offsets, one per value, so that a sample can be
fetched with one ``pread`` of exactly its bytes instead of a B-tree lookup that faults in every page of its
value (see :mod:`lmdbstore.store.positions`).

Everything read from the file is checked before it is used: page numbers and node offsets against the page
and the file size, page headers against the page they claim to be, keys against the store's key sequence,
value lengths against the metadata.  A file this parser does not recognise (another magic, data version,
byte order, page size, or database flags) raises :class:`UnsupportedLayout`, and the caller falls back to
liblmdb; a recognised file that contradicts itself raises :class:`~lmdbstore.errors.CorruptStoreError`.
Nothing here ever reads outside the file: every read is a bounded ``os.pread``.
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

__all__ = ["BTreeValues", "LmdbMeta", "UnsupportedLayout", "read_meta_page", "samples_positions"]

MDB_MAGIC = 0xBEEFC0DE
DATA_VERSION_09 = 1
PAGEHDRSZ = 16
NODESIZE = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_TYPE_MASK = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DB_SIZE = 48
MAX_DEPTH = 32
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow pages, entries, root


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
    """The fields of one meta page this parser needs."""

    psize: int
    main: LmdbDb
    last_pg: int
    txnid: int


def _pread_exact(fd: int, n: int, off: int, file_size: int, what: str, path: str | Path | None) -> bytes:
    if off < 0 or off + n > file_size:
        raise CorruptStoreError(f"{what} lies outside the data file ({off}+{n} > {file_size})", path=path)
    buf = os.pread(fd, n, off)
    if len(buf) != n:
        raise CorruptStoreError(f"data file shorter than expected while reading {what}", path=path)
    return buf


def read_meta_page(fd: int, file_size: int, which: int, path: str | Path | None = None) -> LmdbMeta:
    """Parse meta page ``which`` (0 or 1).

    Raises:
        UnsupportedLayout: not little-endian LMDB 0.9 (magic, data version, page size).
    """
    if sys.byteorder != "little":
        raise UnsupportedLayout("big-endian host")
    head = _pread_exact(fd, PAGEHDRSZ + 136, 0, file_size, "meta page 0", path)
    magic, version = struct.unpack_from("<II", head, PAGEHDRSZ)
    if magic != MDB_MAGIC or version != DATA_VERSION_09:
        raise UnsupportedLayout(f"magic {magic:#x}, data version {version}")
    psize = struct.unpack_from("<I", head, PAGEHDRSZ + 24)[0]
    if psize < 1024 or psize > 0x8000 or psize & (psize - 1):
        raise UnsupportedLayout(f"page size {psize}")
    buf = head if which == 0 else _pread_exact(fd, PAGEHDRSZ + 136, psize, file_size, "meta page 1", path)
    flags = struct.unpack_from("<H", buf, 10)[0]
    magic, version = struct.unpack_from("<II", buf, PAGEHDRSZ)
    if not flags & P_META or magic != MDB_MAGIC or version != DATA_VERSION_09:
        raise UnsupportedLayout(f"meta page {which} not recognised")
    m = PAGEHDRSZ + 24
    main = LmdbDb.parse(buf[m + MDB_DB_SIZE : m + 2 * MDB_DB_SIZE])
    last_pg, txnid = struct.unpack_from("<QQ", buf, m + 2 * MDB_DB_SIZE)
    return LmdbMeta(psize, main, last_pg, txnid)


class _Pages:
    """Bounded page reads of one data file, many in flight when a ``pmap`` is given."""

    def __init__(
        self, fd: int, file_size: int, meta: LmdbMeta, path: str | Path | None, pmap: Callable[..., list[bytes]] | None
    ):
        self.fd, self.file_size, self.psize, self.path = fd, file_size, meta.psize, path
        self.n_pages = min(meta.last_pg + 1, file_size // meta.psize)
        self.pmap = pmap

    def read(self, pgnos: Sequence[int], want: int) -> np.ndarray:
        """Pages ``pgnos`` as an ``(n, psize)`` uint8 array, each checked for its number and type."""
        for p in pgnos:
            if not 2 <= p < self.n_pages:
                raise CorruptStoreError(
                    f"B-tree points at page {p}, outside pages 2..{self.n_pages - 1}", path=self.path
                )
        ps = self.psize
        arr = np.empty((len(pgnos), ps), np.uint8)

        def one(i: int) -> None:  # straight into its row: no per-page objects left behind
            if os.preadv(self.fd, [memoryview(arr[i])], pgnos[i] * ps) != ps:
                raise CorruptStoreError(f"data file shorter than expected at page {pgnos[i]}", path=self.path)

        if self.pmap is not None and len(pgnos) > 8:
            self.pmap(one, range(len(pgnos)))
        else:
            for i in range(len(pgnos)):
                one(i)
        hdr_pgno = arr[:, :8].copy().view("<u8").reshape(-1)
        flags = arr[:, 10:12].copy().view("<u2").reshape(-1) & _TYPE_MASK
        bad = np.flatnonzero((hdr_pgno != np.asarray(pgnos, np.uint64)) | (flags != want))
        if bad.size:
            i = int(bad[0])
            if flags[i] == P_LEAF2 or flags[i] & P_SUBP:
                raise UnsupportedLayout(f"page type {int(flags[i]):#x}")
            raise CorruptStoreError(
                f"page {pgnos[i]} has header (page {int(hdr_pgno[i])}, flags {int(flags[i]):#x}), expected flags {want:#x}",
                path=self.path,
            )
        return arr

    def nodes(self, page: np.ndarray, pgno: int) -> tuple[np.ndarray, np.ndarray]:
        """Node offsets of one B-tree page and its 16-bit words, bounds-checked."""
        ps = self.psize
        words = page.view("<u2")
        lower, upper = int(words[6]), int(words[7])
        if not PAGEHDRSZ <= lower <= upper <= ps or lower % 2:
            raise CorruptStoreError(f"page {pgno} has bad bounds lower={lower} upper={upper}", path=self.path)
        ptr = words[PAGEHDRSZ // 2 : lower // 2].astype(np.int64)
        if ptr.size == 0:
            raise CorruptStoreError(f"page {pgno} is an empty B-tree page", path=self.path)
        if int(ptr.min()) < upper or int(ptr.max()) + NODESIZE > ps or (ptr % 2).any():
            raise CorruptStoreError(f"page {pgno} has a node outside its page", path=self.path)
        return ptr, words


def _nodes_2d(pages: _Pages, arr: np.ndarray, pgnos: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Node offsets of many B-tree pages at once: ``(page row, node offset)`` per node, bounds-checked."""
    ps = pages.psize
    words = arr.view("<u2")
    lower, upper = words[:, 6].astype(np.int64), words[:, 7].astype(np.int64)
    bad = np.flatnonzero((lower < PAGEHDRSZ) | (lower > upper) | (upper > ps) | (lower % 2 == 1) | (lower == PAGEHDRSZ))
    if bad.size:
        i = int(bad[0])
        raise CorruptStoreError(f"page {pgnos[i]} has bad bounds lower={lower[i]} upper={upper[i]}", path=pages.path)
    nkeys = (lower - PAGEHDRSZ) // 2
    row = np.repeat(np.arange(len(arr)), nkeys)
    slot = np.arange(int(nkeys.sum())) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
    ptr = words[row, PAGEHDRSZ // 2 + slot].astype(np.int64)
    bad = np.flatnonzero((ptr < upper[row]) | (ptr + NODESIZE > ps) | (ptr % 2 == 1))
    if bad.size:
        raise CorruptStoreError(f"page {pgnos[int(row[bad[0]])]} has a node outside its page", path=pages.path)
    return row, ptr


#: Leaf pages parsed per group (bounded memory however large the store).
LEAF_GROUP = 1024


def _gather_u64(page: np.ndarray, offs: np.ndarray, dtype: str) -> np.ndarray:
    return page[offs[:, None] + np.arange(8)].copy().view(dtype).reshape(-1)


@dataclass(frozen=True)
class BTreeValues:
    """Every leaf node of a B-tree whose keys are 8 bytes: the key, value length and value position.

    ``pos`` is the file offset of the value's first byte: inside the leaf page for a small value, past the
    16-byte header of its first overflow page for a large one (``F_BIGDATA``).
    """

    keys: np.ndarray  # uint64, B-tree order
    sizes: np.ndarray  # int64
    pos: np.ndarray  # int64


def _walk(pages: _Pages, db: LmdbDb, what: str) -> list[int]:
    """The leaf page numbers of ``db`` in key order, read level by level (each level's reads in flight together)."""
    if not 1 <= db.depth <= MAX_DEPTH:
        raise CorruptStoreError(f"{what} B-tree has depth {db.depth}", path=pages.path)
    level = [db.root]
    for _ in range(db.depth - 1):
        arr = pages.read(level, P_BRANCH)
        nxt: list[int] = []
        for pgno, page in zip(level, arr, strict=True):
            ptr, words = pages.nodes(page, pgno)
            w = ptr // 2
            ksize = words[w + 3].astype(np.int64)
            if int((ptr + NODESIZE + ksize).max()) > pages.psize:
                raise CorruptStoreError(f"page {pgno} has a key outside its page", path=pages.path)
            child = (
                words[w].astype(np.int64) | words[w + 1].astype(np.int64) << 16 | words[w + 2].astype(np.int64) << 32
            )
            nxt.extend(child.tolist())
        level = nxt
    return level


def _main_db_entry(pages: _Pages, main: LmdbDb, name: bytes) -> LmdbDb:
    """The ``MDB_db`` record of the named sub-database ``name`` in the main B-tree."""
    leaves = _walk(pages, main, "main")
    for pgno, page in zip(leaves, pages.read(leaves, P_LEAF), strict=True):
        ptr, words = pages.nodes(page, pgno)
        for o in ptr.tolist():
            w = o // 2
            dsize = int(words[w]) | int(words[w + 1]) << 16
            flags, ksize = int(words[w + 2]), int(words[w + 3])
            if o + NODESIZE + ksize + dsize > pages.psize:
                raise CorruptStoreError(f"page {pgno} has a node outside its page", path=pages.path)
            key = page[o + NODESIZE : o + NODESIZE + ksize].tobytes()
            if key == name:
                if flags != F_SUBDATA or dsize != MDB_DB_SIZE:
                    raise UnsupportedLayout(f"main-database node {name!r} has flags {flags:#x}")
                start = o + NODESIZE + ksize
                return LmdbDb.parse(page[start : start + MDB_DB_SIZE].tobytes())
    raise CorruptStoreError(f"no sub-database {name.decode()!r}", path=pages.path)


def samples_positions(
    fd: int,
    file_size: int,
    meta: LmdbMeta,
    name: bytes,
    *,
    path: str | Path | None = None,
    pmap: Callable[..., list[bytes]] | None = None,
) -> BTreeValues:
    """Keys, sizes and file positions of every value of sub-database ``name`` in the snapshot ``meta``.

    ``pmap(fn, items)`` (e.g. a thread pool's ``map``) reads the pages of one tree level in parallel.

    Raises:
        UnsupportedLayout: database flags, key widths or page types this parser does not handle.
        CorruptStoreError: a page, node or overflow extent outside the file or inconsistent with itself.
    """
    pages = _Pages(fd, file_size, meta, path, pmap)
    db = _main_db_entry(pages, meta.main, name)
    if db.flags & 0x7FFF:
        raise UnsupportedLayout(f"sub-database flags {db.flags:#x}")
    if db.entries == 0:
        z = np.zeros(0, np.int64)
        return BTreeValues(z.astype(np.uint64), z, z)
    ps = meta.psize
    if db.entries > pages.n_pages * (ps // (NODESIZE + 8 + 2)):
        raise CorruptStoreError(
            f"{name.decode()} B-tree claims {db.entries} entries, more than the file holds", path=path
        )
    keys = np.empty(db.entries, np.uint64)
    sizes = np.empty(db.entries, np.int64)
    pos = np.empty(db.entries, np.int64)
    done = 0
    leaves = _walk(pages, db, name.decode())
    for g in range(0, len(leaves), LEAF_GROUP):
        pgnos = leaves[g : g + LEAF_GROUP]
        arr = pages.read(pgnos, P_LEAF)
        row, ptr = _nodes_2d(pages, arr, pgnos)
        flat = arr.reshape(-1)
        base = row * ps + ptr  # node offsets in ``flat``
        w = base // 2
        words = flat.view("<u2")
        dsize = words[w].astype(np.int64) | words[w + 1].astype(np.int64) << 16
        flags, ksize = words[w + 2], words[w + 3]
        if (ksize != 8).any():
            raise UnsupportedLayout("keys that are not 8 bytes")
        if (flags & ~np.uint16(F_BIGDATA)).any():
            raise UnsupportedLayout("sub-database or duplicate nodes")
        big = (flags & F_BIGDATA).astype(bool)
        data = ptr + NODESIZE + 8
        bad = np.flatnonzero(data + np.where(big, 8, dsize) > ps)
        if bad.size:
            raise CorruptStoreError(f"page {pgnos[int(row[bad[0]])]} has a value outside its page", path=path)
        n = len(ptr)
        if done + n > db.entries:
            raise CorruptStoreError(f"more values in the B-tree than its header's {db.entries}", path=path)
        keys[done : done + n] = _gather_u64(flat, base + NODESIZE, ">u8")
        sizes[done : done + n] = dsize
        p = np.asarray(pgnos, np.int64)[row] * ps + data
        if big.any():
            ov = _gather_u64(flat, base[big] + NODESIZE + 8, "<u8").astype(np.int64)
            need = (PAGEHDRSZ - 1 + dsize[big]) // ps + 1
            if (ov < 2).any() or ((ov + need) > pages.n_pages).any():
                raise CorruptStoreError("a value points at overflow pages outside the file", path=path)
            p[big] = ov * ps + PAGEHDRSZ
        pos[done : done + n] = p
        done += n
    if done != db.entries:
        raise CorruptStoreError(f"{done} values in the B-tree, its header says {db.entries}", path=path)
    out = BTreeValues(keys, sizes, pos)
    return out
