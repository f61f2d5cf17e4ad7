"""Which pages of a snapshot belong to whom: every page but one sub-database's (:func:`foreign_runs`), and
:class:`Claims`, where a page claimed twice is damage.

An overflow page number naming another owner's run (a class-index chunk: a valid header, enough pages) passes every
check of the value itself, and liblmdb follows it too: only a page reachable twice gives it away.  Only page numbers
are read (no key is interpreted), bounds-checked as in :mod:`~lmdbstore.format.pages`.
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

__all__ = ["MAX_DEPTH", "Claims", "Runs", "foreign_runs", "walk_tree"]

#: Deepest B-tree accepted (LMDB's cursor stack holds 32 levels).
MAX_DEPTH = 32
#: The meta pages: 0 and 1.
META_PAGES = 2


@dataclass(frozen=True)
class Runs:
    """Runs of pages: ``count[i]`` pages from page ``start[i]``, all of one owner (for messages)."""

    start: np.ndarray  # int64
    count: np.ndarray  # int64
    owner: str

    @staticmethod
    def of(owner: str, start: object = (), count: object = None) -> Runs:
        s = np.asarray(start, np.int64).reshape(-1)
        return Runs(s, np.ones(len(s), np.int64) if count is None else np.asarray(count, np.int64), owner)


class Claims:
    """The pages of a snapshot claimed so far, as disjoint runs sorted by first page, with their owners: a page
    claimed twice (by two owners, or twice by one) is damage."""

    def __init__(self, path: object = None):
        self.start = np.zeros(0, np.int64)
        self.end = np.zeros(0, np.int64)
        self.owner = np.zeros(0, np.int16)
        self.names: list[str] = []
        self.path = path

    def add(self, runs: Runs) -> None:
        """Claim the pages of ``runs`` (``CorruptStoreError``: a page of ``runs`` is claimed twice by them, or was
        claimed before)."""
        if not len(runs.start):
            return
        s, e = runs.start, runs.start + runs.count
        if (s[1:] < s[:-1]).any():  # an appended tree's runs come in order
            order = np.argsort(s, kind="stable")
            s, e = s[order], e[order]
        reach = np.maximum.accumulate(e)
        inside = np.flatnonzero(s[1:] < reach[:-1])
        if inside.size:
            self._twice(int(s[inside[0] + 1]), runs.owner, runs.owner)
        k = np.searchsorted(self.start, s, side="right")  # the first earlier claim starting after each run's start
        if len(self.start):
            prev, nxt = np.maximum(k - 1, 0), np.minimum(k, len(self.start) - 1)
            before = (k > 0) & (self.end[prev] > s)  # an earlier claim from before the run reaches into it
            hit = np.flatnonzero(before | ((k < len(self.start)) & (self.start[nxt] < e)))
            if hit.size:
                i = int(hit[0])
                j = int(prev[i] if before[i] else nxt[i])
                self._twice(max(int(s[i]), int(self.start[j])), self.names[int(self.owner[j])], runs.owner)
        if runs.owner not in self.names:
            self.names.append(runs.owner)
        new = k + np.arange(len(k))  # where each run goes among the claims (np.insert would sort k again)
        old = np.ones(len(self.start) + len(k), bool)
        old[new] = False
        for name, add in (("start", s), ("end", e), ("owner", self.names.index(runs.owner))):
            merged = np.empty(len(old), getattr(self, name).dtype)
            merged[new], merged[old] = add, getattr(self, name)
            setattr(self, name, merged)

    def _twice(self, page: int, a: str, b: str) -> None:
        if a == b == "samples value":
            raise damaged(f"two values of the samples B-tree share overflow pages (page {page})", path=self.path)  # type: ignore[arg-type]
        raise damaged(f"page {page} is reachable twice (from the {a} and the {b})", path=self.path)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Leaves:
    """What a walk found in its leaves: overflow runs, sub-database records (main B-tree), and with ``values`` each
    value's key, file offset and length."""

    runs: Runs
    subdbs: dict[bytes, LmdbDb]
    values: list[tuple[bytes, int, int]]


def _pgno(words: np.ndarray, w: int) -> int:
    return int(words[w]) | int(words[w + 1]) << 16 | int(words[w + 2]) << 32


def walk_tree(pages: PageReader, db: LmdbDb, what: str, *, values: bool = False) -> tuple[Runs, _Leaves]:
    """The pages of the B-tree ``db`` (its branch and leaf pages, one run each) and what its leaves hold: the
    overflow runs of its values, its sub-database records (by key), and with ``values`` where every value lies
    (``CorruptStoreError``: a page number outside the snapshot, a page that is not what its parent says, a node
    outside its page, an overflow run that is not one or is shorter than its value, a tree deeper than
    :data:`MAX_DEPTH` or reaching more pages than the file holds)."""
    if db.depth == 0:
        return Runs.of(f"{what} B-tree"), _Leaves(Runs.of(f"{what} value"), {}, [])
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
    found: list[tuple[bytes, int, int]] = []
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
                if values and int(pages.read([ov], P_OVERFLOW)[0][12:16].view("<u4")[0]) < n:
                    raise damaged(f"an overflow run of the {what} B-tree is shorter than its value", path=pages.path)
                if values:
                    found.append((page[o + NODESIZE : data].tobytes(), ov * ps + PAGEHDRSZ, dsize))
            elif flags & F_SUBDATA:
                if dsize != MDB_DB_SIZE:
                    raise damaged(
                        f"{what} B-tree page {pgno} has a sub-database record of {dsize} bytes", path=pages.path
                    )
                subdbs[page[o + NODESIZE : data].tobytes()] = LmdbDb.parse(page[data : data + MDB_DB_SIZE].tobytes())
            elif values:
                found.append((page[o + NODESIZE : data].tobytes(), pgno * ps + data, dsize))
    return Runs.of(f"{what} B-tree", tree), _Leaves(Runs.of(f"{what} value", ov_start, ov_count), subdbs, found)


def _free_pages(pages: PageReader, values: list[tuple[bytes, int, int]]) -> Runs:
    """The pages the free list's values (``MDB_IDL``: a count, then that many page numbers) list, within the file
    (a free page past its end is never read)."""
    lists, path = [], pages.path
    for _, off, n in values:
        raw = pages.read_bytes(off, n, "a free-list value")
        if len(raw) < 8 or len(raw) % 8:
            raise damaged("a free-list record is not a list of page numbers", path=path)  # type: ignore[arg-type]
        ids = np.frombuffer(raw, "<u8")
        if int(ids[0]) != len(ids) - 1:
            raise damaged("a free-list record's count contradicts its length", path=path)  # type: ignore[arg-type]
        lists.append(ids[1:].astype(np.int64))
    free = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    return Runs.of("free page", free[(free >= 0) & (free < pages.n_pages)])


def foreign_runs(pages: PageReader, meta: LmdbMeta, mine: bytes) -> tuple[LmdbDb, Claims]:
    """The record of the sub-database ``mine``, and every page of the snapshot that is *not* its own, claimed: the
    meta pages, the main B-tree, the other sub-databases (trees and overflow runs), the free list (tree, overflow
    runs and the free pages it lists). No two of them may share a page, nor any with ``mine``'s pages claimed later
    (``CorruptStoreError``: any tree contradicts itself or the file, as :func:`walk_tree` checks, a page is claimed
    twice, or ``mine`` is missing)."""
    claims = Claims(pages.path)
    claims.add(Runs.of("meta page", range(META_PAGES)))
    main_tree, main = walk_tree(pages, meta.main, "main")
    claims.add(main_tree)
    claims.add(main.runs)
    if mine not in main.subdbs:
        raise damaged(f"no sub-database {mine.decode(errors='replace')!r}", path=pages.path)
    for name, db in main.subdbs.items():
        if name != mine:
            tree, leaves = walk_tree(pages, db, name.decode(errors="replace"))
            claims.add(tree)
            claims.add(leaves.runs)
    free_tree, free = walk_tree(pages, meta.free, "free-list", values=True)
    for runs in (free_tree, free.runs, _free_pages(pages, free.values)):
        claims.add(runs)
    return main.subdbs[mine], claims
