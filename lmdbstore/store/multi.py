"""Many stores read as one, in place: :class:`StoreSet` (docs/api.md, "Many stores as one", states its rules): a
reader's interface over one index space, classes mapped by name, one shape and dtype, one layout taken when it opens
(a store that grows adds nothing until ``refresh()``); each store's reader pins its own store and data file.  A batch
grouped by store is read straight into its rows, every store's part in one compiled call.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmdbstore.errors import ValidationError, preview
from lmdbstore.format.dtypes import label_dtype_for
from lmdbstore.format.meta import StoreMeta, check_classes
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.store.batch import read_parts, read_samples
from lmdbstore.store.handle import Handle
from lmdbstore.store.metaview import MetaView, check_in_range, check_out, range_bounds, sample_indices
from lmdbstore.store.reader import StoreReader

__all__ = ["StoreSet"]

StorePath = str | os.PathLike[str]


class StoreSet(MetaView):
    """Several stores read as one (see the module docstring).

    Args:
        stores: store paths or :class:`StoreReader` objects, in index order (at least one; a reader keeps its own
            options, paths take the ones below).
        classes: the set's class names in order (default: the union of the stores', first seen first).
        lock, verify_checksums, positions, io_threads: as :class:`StoreReader`, for every store given by path.

    Raises:
        ValueError: no store, a store given twice, or ``classes`` with a repeated, blank or non-string name or one
            holding a control character.
        ValidationError (on first use): stores of different shapes or dtypes, a store's class missing from
            ``classes``, or one store (its ``store_id``) given twice.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError (on first use): a store.
    """

    noun = "set"

    def __init__(
        self,
        stores: Sequence[StorePath | StoreReader],
        *,
        classes: Sequence[str] | None = None,
        lock: bool | None = None,
        verify_checksums: bool = False,
        positions: bool = True,
        io_threads: int | None = None,
    ) -> None:
        if isinstance(stores, (str, bytes, os.PathLike)) or not len(stores):
            raise ValueError(f"stores must be a non-empty list of store paths, got {stores!r}")
        self.readers = [
            s
            if isinstance(s, StoreReader)
            else StoreReader(
                s, lock=lock, verify_checksums=verify_checksums, positions=positions, io_threads=io_threads
            )
            for s in stores
        ]
        self.paths = [r.path for r in self.readers]
        resolved = [p.resolve() for p in self.paths]
        twice = [str(p) for i, p in enumerate(self.paths) if resolved[i] in resolved[:i]]
        if twice:
            raise ValueError(f"stores: {preview(twice)} given twice (a store's samples would count twice)")
        self.path = self.paths[0]  #: the first store (messages about the set as a whole name it)
        if classes is not None and (isinstance(classes, (str, bytes)) or not all(isinstance(c, str) for c in classes)):
            raise ValueError(f"classes must be a list of class names (strings), got {preview(classes, quote=True)}")
        self.wanted_classes = None if classes is None else check_classes(classes)
        self._mutex, self._mutex_pid = threading.Lock(), os.getpid()
        self._meta: StoreMeta | None = None
        self._offsets: np.ndarray | None = None
        self._remaps: list[np.ndarray] = []
        self._labels: np.ndarray | None = None

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> StoreSet:
        """Open every store and check that they make one set.  Returns ``self``."""
        self._layout()
        return self

    def close(self) -> None:
        """Close every store in this process (call in the parent before starting workers)."""
        for r in self.readers:
            r.close()

    def refresh(self) -> None:
        """New read snapshots of every store (see samples committed since), and the set's layout again."""
        for r in self.readers:
            r.refresh()
        self._meta, self._offsets, self._remaps, self._labels = None, None, [], None

    def __enter__(self) -> StoreSet:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_labels"] = None  # rebuilt from the stores' tables on first use
        del state["_mutex"], state["_mutex_pid"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mutex, self._mutex_pid = threading.Lock(), os.getpid()

    def _locked(self) -> threading.Lock:
        """This process's lock of the set (a forked child makes its own)."""
        if self._mutex_pid != os.getpid():
            self._mutex, self._mutex_pid = threading.Lock(), os.getpid()
        return self._mutex

    def __repr__(self) -> str:
        return f"StoreSet({[str(p) for p in self.paths]!r})"

    # ------------------------------------------------------------------ layout
    def _layout(self) -> StoreMeta:
        """The set's metadata, offsets and class maps, computed once (from the stores' metadata only)."""
        if self._meta is not None:
            return self._meta
        with self._locked():
            if self._meta is None:
                self._lay_out()
        assert self._meta is not None
        return self._meta

    def _lay_out(self) -> None:
        metas = [r.meta for r in self.readers]
        first = metas[0]
        seen: dict[str, int] = {}
        for i, m in enumerate(metas):
            if m.store_id and seen.setdefault(m.store_id, i) != i:
                raise ValidationError(
                    f"this store is the set's store {seen[m.store_id]} ({self.paths[seen[m.store_id]]}) again: "
                    "the same store id (a second path to it, or a copy made with cp)",
                    path=self.paths[i],
                    hint="give each store once; `lmdbstore copy` gives a copy an id of its own",
                )
        for r, m in zip(self.readers, metas, strict=True):
            if m.shape != first.shape or m.dtype != first.dtype:
                raise ValidationError(
                    f"samples of shape {m.shape} {m.np_dtype.name} differ from the set's first store "
                    f"({first.shape} {first.np_dtype.name}, {self.paths[0]})",
                    path=r.path,
                    hint="a set reads stores of one sample shape and dtype",
                )
        names = self._class_names(metas)
        index = {c: i for i, c in enumerate(names)}
        self._remaps = [np.array([index[c] for c in m.classes], label_dtype_for(len(names))) for m in metas]
        self._offsets = np.cumsum([0, *(m.count for m in metas)]).astype(np.int64)
        counts = np.zeros(len(names), np.int64)
        stats = ValueStats()
        for m, remap in zip(metas, self._remaps, strict=True):
            np.add.at(counts, remap.astype(np.int64), m.class_counts)
            stats.merge(m.value_stats)
        self._meta = first.with_(
            classes=names, count=int(self._offsets[-1]), class_counts=counts.tolist(), value_stats=stats
        )

    def _class_names(self, metas: list[StoreMeta]) -> list[str]:
        """The union of the stores' class names, first seen first, or ``classes=`` checked to cover them."""
        if self.wanted_classes is None:
            return list(dict.fromkeys(c for m in metas for c in m.classes))
        for r, m in zip(self.readers, metas, strict=True):
            missing = [c for c in m.classes if c not in self.wanted_classes]
            if missing:
                raise ValidationError(
                    f"classes {preview(missing, quote=True)} of this store are not in the set's classes "
                    f"{preview(self.wanted_classes, quote=True)}",
                    path=r.path,
                    hint="name every class of every store in classes=",
                )
        return list(self.wanted_classes)

    @property
    def offsets(self) -> np.ndarray:
        """``offsets[i]``: the set index of store ``i``'s first sample; ``offsets[-1]`` is the set's length."""
        self._layout()
        assert self._offsets is not None
        return self._offsets

    @property
    def counts(self) -> list[int]:
        """Samples of each store, in order."""
        return np.diff(self.offsets).tolist()

    def store_of(self, indices: Any) -> np.ndarray:
        """The store (its position in the set) holding each of the set indices ``indices``."""
        return np.searchsorted(self.offsets, np.asarray(indices, np.int64), side="right") - 1

    def class_map(self, i: int) -> np.ndarray:
        """Store ``i``'s class ids -> the set's class ids."""
        self._layout()
        return self._remaps[i]

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> StoreMeta:
        """The set as one store's metadata: total ``count``, the set's ``classes`` and ``class_counts``, the
        merged ``value_stats``; shape, dtype and packing fields are the first store's."""
        return self._layout()

    @property
    def read_path(self) -> str:
        """``"positions"`` when every store is read by file offset, else ``"lmdb"``."""
        return "positions" if all(r.read_path == "positions" for r in self.readers) else "lmdb"

    # ------------------------------------------------------------------ samples
    def read_batch(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Samples at ``indices`` as :meth:`StoreReader.read_batch` (and its errors); indices grouped by store (each
        store's together, stores in order) are read straight into ``out``, others through one gather copy."""
        m = self.meta
        idx = sample_indices(indices)
        check_in_range(idx, m.count, "set")
        store = self.store_of(idx)
        n = len(idx)
        out = check_out(out, n, m)
        if out is None:
            out = np.empty((n, *m.shape), m.np_dtype)
        if n == 0:
            return out
        if (store[1:] >= store[:-1]).all():  # grouped: each store's part is a slice of out
            self._read_groups(idx, store, out)
            return out
        order = np.argsort(store, kind="stable")
        out[order] = self.read_batch(idx[order])
        return out

    def _read_groups(self, idx: np.ndarray, store: np.ndarray, out: np.ndarray) -> None:
        """Each store's part of a grouped batch straight into its rows: in one compiled read under each store's
        snapshot rule, or (through liblmdb) one by one."""
        b, starts = np.searchsorted(store, np.arange(len(self.readers) + 1)).tolist(), self.offsets.tolist()
        parts = [(r, idx[b[i] : b[i + 1]] - starts[i], out[b[i] : b[i + 1]]) for i, r in enumerate(self.readers)]
        parts = [p for p in parts if len(p[1])]
        together = [p for p in parts if p[0].positions and not p[0].verify_checksums]
        if together:
            _read_together(together, [])
        for r, local, rows in parts:
            if not (r.positions and not r.verify_checksums):
                r.read_batch(local, out=rows)

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Per store, the part ``lo..hi`` of ``start..stop`` it holds (set indices; empty where none)."""
        off = self.offsets
        return [(max(start, int(a)), min(stop, int(b))) for a, b in itertools.pairwise(off.tolist())]

    def prefetch(self, lo: Any, hi: Any) -> None:
        """:meth:`StoreReader.prefetch` of set ranges ``lo[i]..hi[i]-1`` (each store its own part)."""
        lo_a, hi_a = range_bounds(lo, hi)
        off = self.offsets
        for i, r in enumerate(self.readers):
            a, b = np.maximum(lo_a, off[i]), np.minimum(hi_a, off[i + 1])
            keep = b > a
            if keep.any():
                r.prefetch(a[keep] - off[i], b[keep] - off[i])

    # ------------------------------------------------------------------ labels and classes
    def labels(self) -> np.ndarray:
        """Every sample's class id in the set's classes (uint8 up to 256 classes), cached: each store's labels
        of the samples the layout counted (a store that grew since adds none)."""
        if self._labels is None:
            self._layout()
            parts = [remap[r.labels()[:n]] for r, remap, n in zip(self.readers, self._remaps, self.counts, strict=True)]
            if any(len(p) != n for p, n in zip(parts, self.counts, strict=True)):  # a reader pins no fewer
                raise ValidationError("a store of the set has fewer labels than when it was laid out", path=self.path)
            self._labels = np.concatenate(parts) if parts else np.zeros(0, label_dtype_for(len(self.classes)))
        return self._labels

    def class_indices(self, class_id: int) -> np.ndarray:
        """Set indices of class ``class_id`` in ascending order, from each store's class-index table (of the
        samples the layout counted); ``ValueError``: ``class_id`` not an integer in ``0..len(classes)-1``."""
        name = self.classes[self._class_id(class_id)]
        parts = []
        for r, off, n in zip(self.readers, self.offsets[:-1].tolist(), self.counts, strict=True):
            if name in r.classes:
                own = r.class_indices(r.classes.index(name)).astype(np.int64)
                parts.append(own[: np.searchsorted(own, n)] + off)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _read_together(parts: list[tuple[StoreReader, np.ndarray, np.ndarray]], handles: list[Handle]) -> None:
    """Read each part ``(reader, local indices, rows)`` on a snapshot of its reader that was protected before and after
    (each reader's rule, one inside the other), the parts with a position table in one compiled call."""
    if len(handles) < len(parts):
        reader = parts[len(handles)][0]
        reader._guarded("read", lambda h: _read_together(parts, [*handles, h]))
        return
    offset = []
    for (r, local, rows), h in zip(parts, handles, strict=True):
        table = r._positions(h)
        if table is None:  # a layout the position table does not know: liblmdb
            read_samples(h, None, local, rows, True, False, False)
        else:
            offset.append((h, table, local, rows, r.check_whole_values))
    if offset:
        read_parts(offset)
