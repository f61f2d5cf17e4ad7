"""Which pages of a snapshot belong to whom: every page but one sub-database's, as runs (issue 34 #1).

A value's overflow page number that names the first page of *another* sub-database's overflow run (a class-index
chunk: a valid overflow header, enough pages) passes every check of the value itself -- its header names its own
page, has the overflow flag and enough pages -- and liblmdb follows it too.  What gives it away is that the page
is reachable twice.  So the walk of the ``samples`` B-tree (:func:`lmdbstore.format.btree.samples_positions`) is
checked against every page the snapshot reaches otherwise: the two meta pages, the main B-tree, every other
sub-database's tree and overflow runs, and the free list (its tree, its overflow runs and the free pages it lists).
A page claimed twice -- by any two owners -- is a :class:`~lmdbstore.errors.CorruptStoreError`, before any sample
is read, on every read path (the offset reader and, where lmdbstore calls it, liblmdb: the reader walks a snapshot
before its first sample read either way; labels and class indices read before it are refused with it).  What it costs: the other trees are small next to ``samples`` (a label chunk and a class-index chunk
hold 65,536 entries each: one leaf page covers a store of tens of millions of samples), so the walk reads a few
more pages once per snapshot, and nothing per batch.

Only page numbers are read: no key is interpreted (their order is liblmdb's business and ``verify``'s), so any
sub-database of an LMDB 0.9 file can be walked.  Everything read is bounds-checked as in :mod:`~lmdbstore.format.pages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmdbstore.format.pages import (
    F_BIGDATA,
    F_DUPDATA,
    F_SUBDATA,
    MDB_DB_SIZE,
    NODESIZE,
    P_BRANCH,
    P_LEAF,
    P_OVERFLOW,
    PAGEHDRSZ,
    LmdbDb,
    LmdbMeta,
    PageReader,
    damaged,
    overflow_pages,
)

__all__ = ["MAX_DEPTH", "Runs", "foreign_runs", "walk_tree"]

#: Deepest B-tree accepted (LMDB's cursor stack holds 32 levels).
MAX_DEPTH = 32
#: The meta pages: 0 and 1.
META_PAGES = 2


@dataclass(frozen=True)
class Runs:
    """Runs of pages: ``count[i]`` pages from page ``start[i]``, with what owns each (for messages)."""

    start: np.ndarray  # int64
    count: np.ndarray  # int64
    owner: list[str]  # one per run

    @staticmethod
    def join(parts: list[Runs]) -> Runs:
        if not parts:
            return Runs(np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        return Runs(
            np.concatenate([p.start for p in parts]),
            np.concatenate([p.count for p in parts]),
            [o for p in parts for o in p.owner],
        )


@dataclass(frozen=True)
class _Leaves:
    """What a walk found in its leaves: overflow runs, sub-database records (main B-tree), values (free list)."""

    runs: Runs
    subdbs: dict[bytes, LmdbDb]
    values: list[bytes]


def _pgno(words: np.ndarray, w: int) -> int:
    return int(words[w]) | int(words[w + 1]) << 16 | int(words[w + 2]) << 32


def walk_tree(pages: PageReader, db: LmdbDb, what: str, *, values: bool = False) -> tuple[Runs, _Leaves]:
    """The pages of the B-tree ``db`` (its branch and leaf pages, one run each) and what its leaves hold: the
    overflow runs of its values, its sub-database records (by key), and with ``values`` every value's bytes.

    Raises:
        CorruptStoreError: a page number outside the snapshot, a page that is not what its parent says, a node
            outside its page, a tree deeper than :data:`MAX_DEPTH` or reaching more pages than the file holds.
    """
    if db.depth == 0:
        empty = Runs(np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        return empty, _Leaves(empty, {}, [])
    if not 1 <= db.depth <= MAX_DEPTH:
        raise damaged(f"{what} B-tree has depth {db.depth}", path=pages.path)
    level, tree, seen = [db.root], [db.root], 1
    for _ in range(db.depth - 1):
        nxt: list[int] = []
        for pgno, page in zip(level, pages.read(level, P_BRANCH), strict=True):
            ptr, words = pages.nodes(page, pgno)
            nxt += [_pgno(words, o // 2) for o in ptr.tolist()]
        seen += len(nxt)
        if seen > pages.n_pages:
            raise damaged(f"{what} B-tree reaches more pages than the file holds", path=pages.path)
        tree += nxt
        level = nxt
    ov_start: list[int] = []
    ov_count: list[int] = []
    subdbs: dict[bytes, LmdbDb] = {}
    found: list[bytes] = []
    ps = pages.psize
    for pgno, page in zip(level, pages.read(level, P_LEAF), strict=True):
        ptr, words = pages.nodes(page, pgno)
        for o in ptr.tolist():
            w = o // 2
            dsize, flags, ksize = int(words[w]) | int(words[w + 1]) << 16, int(words[w + 2]), int(words[w + 3])
            data = o + NODESIZE + ksize
            if flags & F_DUPDATA or data + (8 if flags & F_BIGDATA else dsize) > ps:
                raise damaged(f"{what} B-tree page {pgno} has a node outside its page", path=pages.path)
            if flags & F_BIGDATA:
                ov = int(np.frombuffer(page[data : data + 8].tobytes(), "<u8")[0])
                n = int(overflow_pages(dsize, ps))
                if ov < META_PAGES or ov + n > pages.n_pages:
                    raise damaged(
                        f"a value of the {what} B-tree points at overflow pages outside the file", path=pages.path
                    )
                ov_start.append(ov)
                ov_count.append(n)
                if values:
                    found.append(_overflow_value(pages, ov, dsize, what))
            elif flags & F_SUBDATA:
                if dsize != MDB_DB_SIZE:
                    raise damaged(
                        f"{what} B-tree page {pgno} has a sub-database record of {dsize} bytes", path=pages.path
                    )
                subdbs[page[o + NODESIZE : data].tobytes()] = LmdbDb.parse(page[data : data + MDB_DB_SIZE].tobytes())
            elif values:
                found.append(page[data : data + dsize].tobytes())
    own = Runs(np.asarray(tree, np.int64), np.ones(len(tree), np.int64), [f"{what} B-tree"] * len(tree))
    ov_runs = Runs(np.asarray(ov_start, np.int64), np.asarray(ov_count, np.int64), [f"{what} value"] * len(ov_start))
    return own, _Leaves(ov_runs, subdbs, found)


def _overflow_value(pages: PageReader, pgno: int, size: int, what: str) -> bytes:
    """The ``size`` bytes of the value in the overflow run at ``pgno`` (its header checked)."""
    head = pages.read([pgno], P_OVERFLOW)[0]
    if int(head[12:16].view("<u4")[0]) < int(overflow_pages(size, pages.psize)):
        raise damaged(f"an overflow run of the {what} B-tree is shorter than its value", path=pages.path)
    raw = pages.read_bytes(pgno * pages.psize + PAGEHDRSZ, size, f"a {what} value")
    return raw


def _free_pages(values: list[bytes], n_pages: int, path: object) -> Runs:
    """The pages the free list's values (``MDB_IDL``: a count, then that many page numbers) list, within the file
    (a free page past its end is never read)."""
    lists = []
    for raw in values:
        if len(raw) < 8 or len(raw) % 8:
            raise damaged("a free-list record is not a list of page numbers", path=path)  # type: ignore[arg-type]
        ids = np.frombuffer(raw, "<u8")
        if int(ids[0]) != len(ids) - 1:
            raise damaged("a free-list record's count contradicts its length", path=path)  # type: ignore[arg-type]
        lists.append(ids[1:].astype(np.int64))
    free = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    free = free[(free >= 0) & (free < n_pages)]
    return Runs(free, np.ones(len(free), np.int64), ["free page"] * len(free))


def foreign_runs(pages: PageReader, meta: LmdbMeta, mine: bytes) -> tuple[LmdbDb, Runs]:
    """The record of the sub-database ``mine``, and every page of the snapshot that is *not* its own: the meta
    pages, the main B-tree, the other sub-databases (trees and overflow runs), the free list (tree, overflow runs
    and the free pages it lists).  With ``mine``'s own, no two of them may share a page.

    Raises:
        CorruptStoreError: any tree contradicts itself or the file (see :func:`walk_tree`), or ``mine`` is missing.
    """
    parts = [Runs(np.arange(META_PAGES, dtype=np.int64), np.ones(META_PAGES, np.int64), ["meta page"] * META_PAGES)]
    main_tree, main = walk_tree(pages, meta.main, "main")
    parts += [main_tree, main.runs]
    if mine not in main.subdbs:
        raise damaged(f"no sub-database {mine.decode(errors='replace')!r}", path=pages.path)
    for name, db in main.subdbs.items():
        if name != mine:
            tree, leaves = walk_tree(pages, db, name.decode(errors="replace"))
            parts += [tree, leaves.runs]
    free_tree, free = walk_tree(pages, meta.free, "free-list", values=True)
    parts += [free_tree, free.runs, _free_pages(free.values, pages.n_pages, pages.path)]
    return main.subdbs[mine], Runs.join(parts)
