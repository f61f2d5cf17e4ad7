"""Walking an LMDB 0.9 B-tree read-only: where each value of the ``samples`` sub-database lies in the file.

The reader uses this once per snapshot (see :mod:`lmdbstore.store.positions`) to turn the ``samples``
B-tree into a table of file offsets, one per value, so that a sample can be fetched with one ``pread`` of
exactly its bytes instead of a B-tree lookup that faults in every page of its value.

It checks at least what liblmdb relies on when it looks a key up, so that every value it locates is the one
liblmdb would return for that key: page numbers inside the snapshot, page headers naming their own page and
type, node offsets and sizes inside their page, no page reached twice, levels no larger than the file,
keys strictly increasing in tree order, every branch separator between the keys of the subtrees it
separates (so liblmdb's binary search descends to the leaf this walk found), node flags a plain sub-database
can have, overflow runs inside the file and disjoint from each other and from the tree's pages, and no page of the
snapshot reachable twice (the samples tree and overflow runs, the other sub-databases', the main tree's, the free
list's: :mod:`lmdbstore.format.owners`).  Any
contradiction is a :class:`~lmdbstore.errors.CorruptStoreError`; what the headers of the overflow pages say
is checked before a value is first read (:func:`lmdbstore.format.pages.bad_overflow_headers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmdbstore.format.owners import Runs, foreign_runs
from lmdbstore.format.pages import (
    F_BIGDATA,
    F_SUBDATA,
    MDB_DB_SIZE,
    NODESIZE,
    P_BRANCH,
    P_LEAF,
    LmdbDb,
    LmdbMeta,
    PageReader,
    damaged,
    overflow_pages,
)

__all__ = ["LEAF_GROUP", "MAX_DEPTH", "BTreeValues", "main_db_entry", "record_position", "samples_positions"]

#: Deepest B-tree accepted (LMDB's cursor stack holds 32 levels).
MAX_DEPTH = 32
#: Leaf pages parsed per group (bounded memory however large the store).
LEAF_GROUP = 1024
#: Width of the keys this walker reads (the ``samples`` keys: 8-byte big-endian sample indices).
KEY_BYTES = 8


@dataclass(frozen=True)
class BTreeValues:
    """Every leaf node of a B-tree whose keys are 8 bytes: the key, value length and value position.

    ``pos`` is the file offset of the value's first byte: inside the leaf page for a small value, past the
    16-byte header of its first overflow page for a large one (``big``).
    """

    keys: np.ndarray  # uint64, B-tree order (strictly increasing: checked)
    sizes: np.ndarray  # int64
    pos: np.ndarray  # int64
    big: np.ndarray  # bool: the value lives in overflow pages


@dataclass
class _Level:
    """One branch level of a walk: its pages, and per node (in order) the child page and separator key."""

    pgnos: list[int]
    per_page: np.ndarray  # nodes of each page
    child: np.ndarray  # int64 page numbers
    sep: np.ndarray  # uint64 separator keys (node 0 of a page has none; its entry is unused)


def _branch_level(pages: PageReader, level: Sequence[int], what: str) -> _Level:
    """Read one level of branch pages: children and 8-byte separators, bounds-checked."""
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
    return _Level(list(level), np.bincount(row, minlength=len(level)), child, sep)


def _walk(pages: PageReader, db: LmdbDb, what: str) -> tuple[list[int], list[_Level]]:
    """The leaf page numbers of ``db`` in key order and its branch levels, read level by level (each level's
    reads in flight together); no page twice, no level larger than the file."""
    if not 1 <= db.depth <= MAX_DEPTH:
        raise damaged(f"{what} B-tree has depth {db.depth}", path=pages.path)
    level, levels, seen = [db.root], [], 1
    for _ in range(db.depth - 1):
        lv = _branch_level(pages, level, what)
        levels.append(lv)
        level = lv.child.tolist()
        seen += len(level)
        if seen > pages.n_pages:
            raise damaged(f"{what} B-tree reaches more pages than the file holds", path=pages.path)
    every = np.concatenate([np.asarray(lv.pgnos, np.int64) for lv in levels] + [np.asarray(level, np.int64)])
    if np.unique(every).size != every.size:
        raise damaged(f"{what} B-tree reaches a page twice", path=pages.path)
    return level, levels


def main_db_entry(pages: PageReader, main: LmdbDb, name: bytes) -> LmdbDb:
    """The ``MDB_db`` record of the named sub-database ``name`` in the main B-tree.

    Raises:
        CorruptStoreError: the main B-tree is damaged, or holds no sub-database ``name``.
    """
    leaves, _ = _walk(pages, main, "main")
    for pgno, page in zip(leaves, pages.read(leaves, P_LEAF), strict=True):
        ptr, words = pages.nodes(page, pgno)
        for o in ptr.tolist():
            w = o // 2
            dsize = int(words[w]) | int(words[w + 1]) << 16
            flags, ksize = int(words[w + 2]), int(words[w + 3])
            if o + NODESIZE + ksize + dsize > pages.psize:
                raise damaged(f"page {pgno} has a node outside its page", path=pages.path)
            key = page[o + NODESIZE : o + NODESIZE + ksize].tobytes()
            if key == name:
                if flags != F_SUBDATA or dsize != MDB_DB_SIZE:
                    raise damaged(f"main-database node {name!r} has flags {flags:#x}", path=pages.path)
                start = o + NODESIZE + ksize
                return LmdbDb.parse(page[start : start + MDB_DB_SIZE].tobytes())
    raise damaged(f"no sub-database {name.decode()!r}", path=pages.path)


def _node_key(page: np.ndarray, words: np.ndarray, o: int, pgno: int, pages: PageReader) -> tuple[bytes, int]:
    """The key of the node at offset ``o`` of ``page`` and the offset just past it (bounds-checked)."""
    ksize = int(words[o // 2 + 3])
    if o + NODESIZE + ksize > pages.psize:
        raise damaged(f"page {pgno} has a node outside its page", path=pages.path)
    return page[o + NODESIZE : o + NODESIZE + ksize].tobytes(), o + NODESIZE + ksize


def record_position(pages: PageReader, main: LmdbDb, name: bytes, key: bytes) -> tuple[int, int]:
    """File offset and length of the value of ``key`` in the small sub-database ``name`` (e.g. the metadata
    record), found the way liblmdb's search finds it (keys compared as bytes, shorter first).

    Raises:
        CorruptStoreError: the tree is damaged, or holds no such key.
    """
    db = main_db_entry(pages, main, name)
    if not 1 <= db.depth <= MAX_DEPTH:
        raise damaged(f"{name.decode()} B-tree has depth {db.depth}", path=pages.path)
    pgno = db.root
    for _ in range(db.depth - 1):
        page = pages.read([pgno], P_BRANCH)[0]
        ptr, words = pages.nodes(page, pgno)
        child = None
        for i, o in enumerate(ptr.tolist()):
            if i == 0 or _node_key(page, words, o, pgno, pages)[0] <= key:
                w = o // 2
                child = int(words[w]) | int(words[w + 1]) << 16 | int(words[w + 2]) << 32
        assert child is not None  # a branch page has nodes (checked by nodes())
        pgno = child
    page = pages.read([pgno], P_LEAF)[0]
    ptr, words = pages.nodes(page, pgno)
    for o in ptr.tolist():
        k, data = _node_key(page, words, o, pgno, pages)
        if k != key:
            continue
        w, ps = o // 2, pages.psize
        dsize, flags = int(words[w]) | int(words[w + 1]) << 16, int(words[w + 2])
        if flags & F_BIGDATA:
            ov = int(np.frombuffer(page[data : data + 8].tobytes(), "<u8")[0]) if data + 8 <= ps else -1
            if not 2 <= ov < pages.n_pages or ov + overflow_pages(dsize, ps) > pages.n_pages:
                raise damaged(f"the {name.decode()} record points at overflow pages outside the file", path=pages.path)
            return ov * ps + 16, dsize
        if flags or data + dsize > ps:
            raise damaged(f"page {pgno} has a {name.decode()} record outside its page", path=pages.path)
        return pgno * ps + data, dsize
    raise damaged(f"no {key!r} record in the {name.decode()} sub-database", path=pages.path)


def _check_separators(
    levels: list[_Level], leaf_first: np.ndarray, leaf_last: np.ndarray, what: str, path: object
) -> None:
    """Every branch separator (but each page's first, which LMDB ignores) lies above the last key of the
    subtree before it and at or below the first key of its own: liblmdb's search then reaches the same leaf.

    ``leaf_first``/``leaf_last``: each leaf's first and last key, in leaf order.
    """
    lo = np.arange(len(leaf_first))  # per node of the level below: its first and last leaf
    hi = lo
    for lv in reversed(levels):
        first_in_page = np.zeros(len(lv.child), bool)
        starts = np.cumsum(lv.per_page) - lv.per_page
        first_in_page[starts[lv.per_page > 0]] = True
        sub_min, sub_max = leaf_first[lo], leaf_last[hi]
        j = np.flatnonzero(~first_in_page)
        bad = (lv.sep[j] <= sub_max[j - 1]) | (lv.sep[j] > sub_min[j])
        if bad.any():
            raise damaged(
                f"{what} B-tree: a separator key ({int(lv.sep[j[bad][0]])}) does not separate its subtrees",
                path=path,  # type: ignore[arg-type]
            )
        ends = starts + lv.per_page
        lo, hi = lo[starts], hi[ends - 1]


def _check_overflow_runs(pos: np.ndarray, sizes: np.ndarray, tree: np.ndarray, ps: int, path: object) -> None:
    """Overflow runs must not overlap each other nor any page of the tree (a damaged page number would
    otherwise serve another value's bytes)."""
    first = (pos - 16) // ps
    order = np.argsort(first, kind="stable")
    f, n = first[order], np.asarray(overflow_pages(sizes[order], ps), np.int64)
    if (f[1:] < f[:-1] + n[:-1]).any():
        raise damaged("two values of the samples B-tree share overflow pages", path=path)  # type: ignore[arg-type]
    k = np.searchsorted(f, tree, side="right") - 1
    inside = (k >= 0) & (tree < f[np.maximum(k, 0)] + n[np.maximum(k, 0)])
    if inside.any():
        raise damaged(
            f"an overflow run covers B-tree page {int(tree[inside][0])}",
            path=path,  # type: ignore[arg-type]
        )


def _check_reached_once(mine: Runs, foreign: Runs, path: object) -> None:
    """No page of the snapshot may be reached twice: the ``samples`` sub-database's tree pages and overflow runs
    (``mine``) and every other page the snapshot reaches (``foreign``: :func:`~lmdbstore.format.owners.foreign_runs`:
    the other sub-databases', the main tree's, the free list's) together claim each page once.  A page claimed twice
    would serve one owner's bytes as another's (a samples value pointed at a class-index chunk read it as samples;
    a label chunk pointed at one would read it as labels)."""
    runs = Runs.join([mine, foreign])
    if not len(runs.start):
        return
    order = np.argsort(runs.start, kind="stable")
    start, end = runs.start[order], runs.start[order] + runs.count[order]
    reach = np.maximum.accumulate(end)  # the furthest page the runs up to each one cover
    bad = np.flatnonzero(start[1:] < reach[:-1])
    if bad.size:
        i = int(bad[0]) + 1
        j = int(np.flatnonzero(end[:i] > start[i])[0])  # an earlier run that covers run i's first page
        a, b = runs.owner[int(order[j])], runs.owner[int(order[i])]
        raise damaged(
            f"page {int(start[i])} is reachable twice (from the {a} and the {b})",
            path=path,  # type: ignore[arg-type]
        )


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
        CorruptStoreError: anything in the tree that contradicts itself or the file (see the module docstring).
    """
    pages = PageReader(fd, file_size, meta, path, pmap)
    db, foreign = foreign_runs(pages, meta, name)  # every page that is not this sub-database's
    what = name.decode()
    if db.flags & 0x7FFF:
        raise damaged(f"{what} sub-database has flags {db.flags:#x} (lmdbstore sets none)", path=path)
    if db.entries == 0:
        z = np.zeros(0, np.int64)
        return BTreeValues(z.astype(np.uint64), z, z, z.astype(bool))
    ps = meta.psize
    if db.entries > pages.n_pages * (ps // (NODESIZE + KEY_BYTES + 2)):
        raise damaged(f"{what} B-tree claims {db.entries} entries, more than the file holds", path=path)
    keys = np.empty(db.entries, np.uint64)
    sizes = np.empty(db.entries, np.int64)
    pos = np.empty(db.entries, np.int64)
    big_all = np.empty(db.entries, bool)
    leaves, levels = _walk(pages, db, what)
    per_leaf = np.zeros(len(leaves), np.int64)
    done = 0
    for g in range(0, len(leaves), LEAF_GROUP):
        pgnos = leaves[g : g + LEAF_GROUP]
        arr = pages.read(pgnos, P_LEAF)
        row, ptr = pages.nodes_2d(arr, pgnos)
        per_leaf[g : g + len(pgnos)] = np.bincount(row, minlength=len(pgnos))
        flat = arr.reshape(-1)
        base = row * ps + ptr  # node offsets in ``flat``
        w = base // 2
        words = flat.view("<u2")
        dsize = words[w].astype(np.int64) | words[w + 1].astype(np.int64) << 16
        flags, ksize = words[w + 2], words[w + 3]
        if (ksize != KEY_BYTES).any() or (flags & ~np.uint16(F_BIGDATA)).any():
            raise damaged(f"{what} B-tree holds a node that is not an 8-byte key with a value", path=path)
        big = (flags & F_BIGDATA).astype(bool)
        data = ptr + NODESIZE + KEY_BYTES
        bad = np.flatnonzero(data + np.where(big, 8, dsize) > ps)
        if bad.size:
            raise damaged(f"page {pgnos[int(row[bad[0]])]} has a value outside its page", path=path)
        n = len(ptr)
        if done + n > db.entries:
            raise damaged(f"more values in the {what} B-tree than its header's {db.entries}", path=path)
        keys[done : done + n] = flat[(base + NODESIZE)[:, None] + np.arange(KEY_BYTES)].copy().view(">u8").reshape(-1)
        sizes[done : done + n] = dsize
        p = np.asarray(pgnos, np.int64)[row] * ps + data
        if big.any():
            ov = flat[(base[big] + NODESIZE + KEY_BYTES)[:, None] + np.arange(8)].copy().view("<u8").reshape(-1)
            ov = ov.astype(np.int64)
            need = np.asarray(overflow_pages(dsize[big], ps), np.int64)
            if (ov < 2).any() or (ov > pages.n_pages).any() or ((ov + need) > pages.n_pages).any():
                raise damaged("a value points at overflow pages outside the file", path=path)
            p[big] = ov * ps + 16
        pos[done : done + n] = p
        big_all[done : done + n] = big
        done += n
    if done != db.entries:
        raise damaged(f"{done} values in the {what} B-tree, its header says {db.entries}", path=path)
    if (keys[1:] <= keys[:-1]).any():
        i = int(np.flatnonzero(keys[1:] <= keys[:-1])[0])
        raise damaged(f"{what} B-tree keys out of order ({int(keys[i])} then {int(keys[i + 1])})", path=path)
    ends = np.cumsum(per_leaf)
    if levels:
        _check_separators(levels, keys[ends - per_leaf], keys[ends - 1], what, path)
    tree = np.concatenate([np.asarray(lv.pgnos, np.int64) for lv in levels] + [np.asarray(leaves, np.int64)])
    first = (pos[big_all] - 16) // ps
    counts = np.asarray(overflow_pages(sizes[big_all], ps), np.int64)
    if big_all.any():
        _check_overflow_runs(pos[big_all], sizes[big_all], np.sort(tree), ps, path)
    mine = Runs(
        np.concatenate([tree, first]),
        np.concatenate([np.ones(len(tree), np.int64), counts]),
        [f"{what} B-tree"] * len(tree) + [f"{what} value"] * len(first),
    )
    _check_reached_once(mine, foreign, path)
    return BTreeValues(keys, sizes, pos, big_all)
