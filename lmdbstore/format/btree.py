"""Reading an LMDB 0.9 B-tree read-only: where each value of the ``samples`` sub-database lies in the file.

The reader opens the ``samples`` tree with :func:`open_tree` and reads its leaves as batches need them
(:func:`leaf_values`); ``verify`` reads them all (:func:`samples_positions`).  What is checked -- at least what
liblmdb's search relies on, and no page reachable twice -- is listed in docs/design.md, "Reads by file offset".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

from lmdbstore.format.layout import KEY_BYTES
from lmdbstore.format.owners import MAX_DEPTH, Claims, Runs, foreign_runs, walk_tree
from lmdbstore.format.pages import (
    F_BIGDATA,
    NODESIZE,
    P_BRANCH,
    P_LEAF,
    PAGEHDRSZ,
    LmdbDb,
    LmdbMeta,
    PageReader,
    damaged,
)

__all__ = [
    "BTreeValues",
    "SamplesTree",
    "leaf_values",
    "main_db_entry",
    "open_tree",
    "record_position",
    "samples_positions",
]

#: Leaf pages parsed per group (bounded memory however large the store).
LEAF_GROUP = 1024
#: Above every key: the upper end of the last leaf's range.
NO_KEY = np.uint64(2**64 - 1)


@dataclass(frozen=True)
class BTreeValues:
    """Leaf nodes of a B-tree whose keys are 8 bytes: the key, value length and value position.

    ``pos`` is the file offset of the value's first byte: inside the leaf page for a small value, past the
    16-byte header of its first overflow page for a large one (``big``).
    """

    keys: np.ndarray  # uint64, B-tree order (strictly increasing: checked)
    sizes: np.ndarray  # int64
    pos: np.ndarray  # int64
    big: np.ndarray  # bool: the value lives in overflow pages


def _branch_level(pages: PageReader, level: Sequence[int], what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read one level of branch pages: per node (in order) its page (a row of ``level``), child page (int64) and 8-byte
    separator key (uint64; node 0 of a page has none, its entry is unused), bounds-checked."""
    arr = pages.read(level, P_BRANCH)
    row, ptr = pages.nodes_2d(arr, level)
    flat, ps = arr.reshape(-1), pages.psize
    base = row * ps + ptr
    words = flat.view("<u2")
    w = base // 2
    ksize = words[w + 3].astype(np.int64)
    if int((ptr + NODESIZE + ksize).max()) > ps:
        raise damaged(f"{what} branch page {level[int(row[0])]} has a key outside its page", path=pages.path)
    first = np.r_[True, row[1:] != row[:-1]]
    if ((ksize != KEY_BYTES) & ~first).any():
        i = int(np.flatnonzero((ksize != KEY_BYTES) & ~first)[0])
        raise damaged(f"{what} branch page {level[int(row[i])]} holds a key that is not 8 bytes", path=pages.path)
    child = words[w].astype(np.int64) | words[w + 1].astype(np.int64) << 16 | words[w + 2].astype(np.int64) << 32
    idx = (base + NODESIZE)[:, None] + np.arange(KEY_BYTES)
    sep = flat[np.minimum(idx, flat.size - 1)].copy().view(">u8").reshape(-1).astype(np.uint64)
    return row, child, sep


@dataclass(frozen=True)
class SamplesTree:
    """A sub-database's B-tree opened down to its leaves: leaf ``i`` is page ``leaves[i]``, and liblmdb's search sends
    exactly the keys ``lo[i] <= key < hi[i]`` there.  ``claims``: every page of the snapshot claimed so far."""

    name: str
    db: LmdbDb
    leaves: np.ndarray  # int64 page numbers, in key order
    lo: np.ndarray  # uint64, non-decreasing
    hi: np.ndarray  # uint64
    claims: Claims


def open_tree(pages: PageReader, meta: LmdbMeta, name: bytes) -> SamplesTree:
    """Open the sub-database ``name`` of the snapshot ``meta``: claim every page the snapshot reaches otherwise
    (:func:`~lmdbstore.format.owners.foreign_runs`), read its branch levels and claim its tree pages
    (``CorruptStoreError``: anything read contradicts itself or the file)."""
    db, claims = foreign_runs(pages, meta, name)
    what = name.decode()
    if db.flags & 0x7FFF:
        raise damaged(f"{what} sub-database has flags {db.flags:#x} (lmdbstore sets none)", path=pages.path)
    if db.entries == 0:
        none = np.zeros(0, np.int64)
        return SamplesTree(what, db, none, none.astype(np.uint64), none.astype(np.uint64), claims)
    if db.entries > pages.n_pages * (pages.psize // (NODESIZE + KEY_BYTES + 2)):
        raise damaged(f"{what} B-tree claims {db.entries} entries, more than the file holds", path=pages.path)
    if not 1 <= db.depth <= MAX_DEPTH:
        raise damaged(f"{what} B-tree has depth {db.depth}", path=pages.path)
    level, lo, hi = np.array([db.root], np.int64), np.zeros(1, np.uint64), np.array([NO_KEY])
    for _ in range(db.depth - 1):
        row, child, sep = _branch_level(pages, level.tolist(), what)
        claims.add(Runs.of(f"{what} B-tree", level))
        first = np.r_[True, row[1:] != row[:-1]]
        last = np.r_[row[1:] != row[:-1], True]
        if ((sep[1:] <= sep[:-1]) & ~first[1:] & ~first[:-1]).any():  # node 0's key is none
            raise damaged(f"{what} B-tree: the separator keys of a branch page are out of order", path=pages.path)
        # liblmdb's search takes the last node whose separator is at most the key (node 0: any key)
        lo_n = np.where(first, lo[row], np.maximum(lo[row], sep))
        hi_n = np.where(last, hi[row], np.minimum(hi[row], np.r_[sep[1:], NO_KEY]))
        level, lo, hi = child, lo_n, np.maximum(hi_n, lo_n)
        if len(level) > pages.n_pages:
            raise damaged(f"{what} B-tree reaches more pages than the file holds", path=pages.path)
    pages.check_pgnos(level.tolist())
    claims.add(Runs.of(f"{what} B-tree", level))
    return SamplesTree(what, db, level, lo, hi, claims)


def leaf_values(
    pages: PageReader, tree: SamplesTree, which: np.ndarray, arr: np.ndarray
) -> tuple[BTreeValues, np.ndarray]:
    """The values of the leaves ``which`` (indices into ``tree.leaves``), whose pages ``arr`` holds (as read), and
    the row of ``arr`` each value is in; their overflow runs are claimed (``CorruptStoreError``: a page is not a leaf
    or contradicts itself, a key lies outside what its leaf's separators send there or out of order, a value outside
    its page or the file, a page reachable twice)."""
    pgnos = tree.leaves[which].tolist()
    ps, path, what = pages.psize, pages.path, tree.name
    pages.check(arr, pgnos, P_LEAF)
    row, ptr = pages.nodes_2d(arr, pgnos)
    # each node's header, key and (overflow values) page number: 24 bytes from the node, one row each
    padded = np.concatenate([arr.reshape(-1), np.zeros(NODESIZE + 2 * KEY_BYTES, np.uint8)])
    nodes = as_strided(padded, (arr.size, NODESIZE + 2 * KEY_BYTES), (1, 1))[row * ps + ptr]
    words = nodes[:, :NODESIZE].copy().view("<u2")
    dsize = words[:, 0].astype(np.int64) | words[:, 1].astype(np.int64) << 16
    flags, ksize = words[:, 2], words[:, 3]
    if (ksize != KEY_BYTES).any() or (flags & ~np.uint16(F_BIGDATA)).any():
        raise damaged(f"{what} B-tree holds a node that is not an 8-byte key with a value", path=path)
    big = (flags & F_BIGDATA).astype(bool)
    data = ptr + NODESIZE + KEY_BYTES
    bad = np.flatnonzero(data + np.where(big, 8, dsize) > ps)
    if bad.size:
        raise damaged(f"page {pgnos[int(row[bad[0]])]} has a value outside its page", path=path)
    keys = nodes[:, NODESIZE : NODESIZE + KEY_BYTES].copy().view(">u8").reshape(-1).astype(np.uint64)
    same = row[1:] == row[:-1]
    if (keys[1:] <= keys[:-1])[same].any():
        i = int(np.flatnonzero((keys[1:] <= keys[:-1]) & same)[0])
        raise damaged(f"{what} B-tree keys out of order ({int(keys[i])} then {int(keys[i + 1])})", path=path)
    lo, hi = tree.lo[which], tree.hi[which]
    outside = np.flatnonzero((keys < lo[row]) | (keys >= hi[row]))
    if outside.size:
        raise damaged(
            f"{what} B-tree: key {int(keys[outside[0]])} lies outside what the separator keys send to its page "
            "(liblmdb's search would not find it there)",
            path=path,
        )
    pos = np.asarray(pgnos, np.int64)[row] * ps + data
    if big.any():
        ov = nodes[big, NODESIZE + KEY_BYTES :].copy().view("<u8").reshape(-1).astype(np.int64)
        need = (PAGEHDRSZ - 1 + dsize[big]) // ps + 1
        if (ov < 2).any() or ((ov + need) > pages.n_pages).any():
            raise damaged("a value points at overflow pages outside the file", path=path)
        tree.claims.add(Runs.of(f"{what} value", ov, need))
        pos[big] = ov * ps + PAGEHDRSZ
    return BTreeValues(keys, dsize, pos, big), row


def samples_positions(
    fd: int, file_size: int, meta: LmdbMeta, name: bytes, *, path: str | Path | None = None
) -> BTreeValues:
    """Keys, sizes and file positions of every value of sub-database ``name`` in the snapshot ``meta``: the tree
    opened (:func:`open_tree`) and every leaf read (``verify``'s value table).  Raises ``CorruptStoreError``: anything
    in the tree that contradicts itself or the file."""
    pages = PageReader(fd, file_size, meta, path, None)
    tree = open_tree(pages, meta, name)
    parts = []
    for g in range(0, len(tree.leaves), LEAF_GROUP):
        which = np.arange(g, min(g + LEAF_GROUP, len(tree.leaves)))
        parts.append(leaf_values(pages, tree, which, pages.read(tree.leaves[which].tolist(), P_LEAF))[0])
    if not parts:
        z = np.zeros(0, np.int64)
        return BTreeValues(z.astype(np.uint64), z, z, z.astype(bool))
    vals = BTreeValues(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("keys", "sizes", "pos", "big")))
    if len(vals.keys) != tree.db.entries:
        raise damaged(
            f"{len(vals.keys)} values in the {tree.name} B-tree, its header says {tree.db.entries}", path=path
        )
    return vals


def main_db_entry(pages: PageReader, main: LmdbDb, name: bytes) -> LmdbDb:
    """The ``MDB_db`` record of the named sub-database ``name`` in the main B-tree (``CorruptStoreError``: the main
    B-tree is damaged, or holds no sub-database ``name``)."""
    subdbs = walk_tree(pages, main, "main")[1].subdbs
    if name not in subdbs:
        raise damaged(f"no sub-database {name.decode()!r}", path=pages.path)
    return subdbs[name]


def record_position(pages: PageReader, main: LmdbDb, name: bytes, key: bytes) -> tuple[int, int]:
    """File offset and length of the value of ``key`` in the small sub-database ``name`` (e.g. the metadata record).
    Raises ``CorruptStoreError``: the tree is damaged, or holds no such key."""
    for k, offset, size in walk_tree(pages, main_db_entry(pages, main, name), name.decode(), values=True)[1].values:
        if k == key:
            return offset, size
    raise damaged(f"no {key!r} record in the {name.decode()} sub-database", path=pages.path)
