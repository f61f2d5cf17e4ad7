"""Where every packed value of a store lies in ``data.mdb``: the position table of one snapshot (8 bytes of offset
and a header-checked flag per value), filled as batches need it (docs/design.md, "Reads by file offset").

:func:`open_table` reads the ``samples`` tree's branch pages and the other owners' pages; :meth:`PositionTable.ensure`
the leaves a batch needs, and :data:`EXTRA_LEAVES` more until every leaf was read; each leaf must hold exactly the keys
``0, k, 2k, ...`` below the metadata's count that its separators send there.  A contradiction is a
:class:`~lmdbstore.errors.CorruptStoreError`, raised again by every later read of the snapshot.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.btree import SamplesTree, leaf_values, open_tree
from lmdbstore.format.layout import DB_SAMPLES
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import DAMAGE_HINT, LmdbMeta, PageReader
from lmdbstore.store.fileread import FileReader

__all__ = ["EXTRA_LEAVES", "UNKNOWN", "PositionTable", "TableKey", "open_table", "table_key"]

#: Leaf pages a batch reads beyond those it needs, until every leaf was read (and the whole tree checked).
EXTRA_LEAVES = 64
#: ``offsets[v]`` of a value whose leaf was not read yet (-1: a value of the wrong length).
UNKNOWN = -2
#: What a table is of: (store id, st_dev, st_ino of the data file, txnid, free root, main root, last page).
TableKey = tuple[str, int, int, int, int, int, int]


def table_key(store_id: str, st: os.stat_result, snap: LmdbMeta) -> TableKey:
    """The identity of a table: the store, the file and the snapshot (see :attr:`PositionTable.key`)."""
    return (store_id, st.st_dev, st.st_ino, *snap.key)


@dataclass
class PositionTable:
    """File offsets of every value's payload (value ``v`` holds samples ``v*k .. v*k+k-1``) in one snapshot.

    ``offsets[v]``: the payload's file offset, -1 for a value whose length contradicts the metadata, :data:`UNKNOWN`
    until its leaf is read; ``checked[v]``: its overflow header was checked (or it has none); ``key``: the store, data
    file and snapshot it is of (:func:`table_key`): a table is reused only for an equal key.
    """

    key: TableKey
    snap: LmdbMeta
    tree: SamplesTree
    offsets: np.ndarray  # int64, one per value
    checked: np.ndarray  # bool, one per value
    file_size: int
    #: what a read needs: (samples per value, sample bytes, page size, samples in all, a full value's stored bytes)
    layout: tuple[int, int, int, int, int]
    loaded: np.ndarray = field(init=False)  # bool, one per leaf
    error: CorruptStoreError | None = None
    #: leaves are being read into it (a process forked meanwhile must not use it: their pages are half claimed)
    busy: bool = False

    def __post_init__(self) -> None:
        self.loaded = np.zeros(len(self.tree.leaves), bool)
        self._lock, self._pid = threading.Lock(), os.getpid()

    @property
    def samples_per_value(self) -> int:
        return self.layout[0]

    @property
    def complete(self) -> bool:
        """Whether every leaf was read (every value located, the whole tree checked)."""
        return bool(self.loaded.all())

    def ensure(self, values: np.ndarray, files: FileReader) -> None:
        """Read the leaves holding ``values`` (value numbers, in range) that were not read yet, and up to
        :data:`EXTRA_LEAVES` more, by ``files`` (many reads in flight); afterwards each of ``values`` is located
        (``CorruptStoreError``: a leaf contradicts itself, the tree, the metadata or another owner of its pages, and
        every later call raises it again; or the file could not be read)."""
        if self.error is not None:
            raise self.error
        if not self.complete:
            self._load(self._leaf(values), files)

    def _leaf(self, values: np.ndarray) -> np.ndarray:
        """The leaf each of ``values`` is in (where liblmdb's search for its key goes)."""
        return (
            np.searchsorted(self.tree.lo, values.astype(np.uint64) * np.uint64(self.samples_per_value), side="right")
            - 1
        )

    def _load(self, leaf: np.ndarray, files: FileReader) -> None:
        if self._pid != os.getpid():  # forked: a thread of the parent may have held the lock
            self._lock, self._pid = threading.Lock(), os.getpid()
        with self._lock:
            want = np.zeros(len(self.loaded), bool)
            want[leaf] = True
            want &= ~self.loaded
            want[np.flatnonzero(~self.loaded & ~want)[:EXTRA_LEAVES]] = True
            which = np.flatnonzero(want)
            if which.size == 0:
                return
            ps = self.snap.psize
            arr = files.gather(self.tree.leaves[which] * ps, ps)  # a failed read is not damage: not kept
            pages = PageReader(files.fd, self.file_size, self.snap, files.path, None)
            self.busy = True
            try:
                self._fill(pages, which, arr)
                self.loaded[which] = True
                if self.complete:  # every page claimed once: a value's overflow run is its own, header or not
                    self.checked[:] = True
            except CorruptStoreError as exc:
                self.error = exc
                raise
            finally:
                self.busy = False

    def _fill(self, pages: PageReader, which: np.ndarray, arr: np.ndarray) -> None:
        """Locate the values of the leaves ``which`` (their pages ``arr``): each leaf must hold exactly the keys
        ``0, k, 2k, ...`` below the count that its separators send there."""
        (spv, sb, _, count, vlen), nv, path = self.layout, len(self.offsets), pages.path
        vals, li = leaf_values(pages, self.tree, which, arr)
        end = np.uint64(nv * spv)
        lo = np.minimum(self.tree.lo[which], end).astype(np.int64)
        hi = np.minimum(self.tree.hi[which], end).astype(np.int64)
        first, stop = -(-lo // spv), -(-hi // spv)  # the values each leaf must hold: first .. stop - 1
        held = np.bincount(li, minlength=len(which))
        want = (first[li] + np.arange(len(li)) - np.repeat(np.cumsum(held) - held, held)) * spv
        wrong = np.flatnonzero((vals.keys.astype(np.int64) != want) | (want >= stop[li] * spv))
        if wrong.size:
            i = int(wrong[0])
            where = f"where {int(want[i])} belongs" if want[i] < nv * spv else f"past the count's {nv} values"
            raise CorruptStoreError(
                f"samples B-tree key {int(vals.keys[i])} {where}", path=path, key=int(want[i]), hint=DAMAGE_HINT
            )
        short = np.flatnonzero(held < stop - first)
        if short.size:
            key = int((first[short[0]] + held[short[0]]) * spv)
            raise CorruptStoreError(
                f"the samples B-tree holds no value keyed {key}", path=path, key=key, hint=DAMAGE_HINT
            )
        v, length = want // spv, np.minimum(spv, count - want) * sb + vlen - spv * sb  # the last value holds the rest
        self.offsets[v] = np.where(vals.sizes == length, vals.pos, -1)
        self.checked[v] = ~vals.big


def open_table(
    fd: int,
    meta: StoreMeta,
    snap: LmdbMeta,
    *,
    store_id: str = "",
    path: str | Path | None = None,
    files: FileReader | None = None,
) -> PositionTable:
    """Open the position table of the snapshot ``snap``: the ``samples`` tree's branch pages and every other owner's
    pages, no leaf yet (see the module docstring).  Raises ``CorruptStoreError``: the file contradicts itself or the
    metadata (pages, the count of values)."""
    st = os.fstat(fd)
    pages = PageReader(fd, st.st_size, snap, path, None if files is None else files.gather_into)
    tree = open_tree(pages, snap, DB_SAMPLES)
    nv = meta.n_values
    if tree.db.entries != nv:
        raise CorruptStoreError(
            f"the samples B-tree holds {tree.db.entries} values; a count of {meta.count} means {nv}",
            path=path,
            hint=DAMAGE_HINT,
        )
    layout = (meta.samples_per_value, meta.sample_bytes, snap.psize, meta.count,
              meta.samples_per_value * meta.sample_bytes + meta.trailer_bytes)  # fmt: skip
    offsets = np.full(nv, UNKNOWN, np.int64)
    return PositionTable(table_key(store_id, st, snap), snap, tree, offsets, np.zeros(nv, bool), st.st_size, layout)


def prefetch_ranges(
    table: PositionTable, lo: np.ndarray, hi: np.ndarray, files: FileReader
) -> tuple[list[int], list[int]]:
    """The byte ranges of the file holding the samples of ranges ``lo[i]..hi[i]-1``: each value's own bytes,
    located first (their leaves read by ``files`` as a batch's are, many in flight; a few ms for a window of
    thousands of values), values lying next to each other merged into one range.  Leaves are not laid out beside
    their values (a commit rewrites the last leaf elsewhere), so a leaf's page says nothing of where its values
    lie.  ``CorruptStoreError``: as :meth:`PositionTable.ensure`."""
    spv, nv, vlen, ps = table.samples_per_value, len(table.offsets), table.layout[4], table.snap.psize
    if nv == 0 or len(lo) == 0:
        return [], []
    first = np.clip(np.asarray(lo, np.int64) // spv, 0, nv - 1)
    n = np.clip((np.asarray(hi, np.int64) - 1) // spv, first, nv - 1) - first + 1
    values = np.unique(np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum())))
    table.ensure(values, files)
    starts = np.sort(table.offsets[values])
    starts = starts[starts >= 0]  # -1: a value of the wrong length, which its read reports
    ends = np.minimum(starts + vlen, table.file_size)
    new = np.flatnonzero(np.r_[True, starts[1:] > ends[:-1] + ps]) if starts.size else np.zeros(0, np.int64)
    return starts[new].tolist(), (np.maximum.reduceat(ends, new).tolist() if new.size else [])
