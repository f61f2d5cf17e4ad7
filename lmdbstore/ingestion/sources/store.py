"""A store as an ingest source: merge stores, subset them by class, with class names mapped by name.

``lmdbstore ingest NEW OLD [OLD2 ...] [--classes a,c]``: a :class:`StoreSource` yields its samples in index order
with their labels as class *names*, so the destination maps them onto its own class list by name.  The source
opens its reader only while a batch iterator runs, so it never holds an environment the writer or another source
needs; ingesting a store into itself is refused (:func:`restrict_store_sources`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import LmdbStoreError, SourceError, clip, preview
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.sources.checks import Label, check_range
from lmdbstore.store.reader import StoreReader

__all__ = ["StoreSource", "restrict_store_sources"]


class StoreSource(Source):
    """The samples of the store at ``path``, labelled by class name (``label``: a class name or id for every
    sample instead), only those of the class names ``classes`` where given (default: all).

    Raises:
        SourceError: the store cannot be opened, or a class in ``classes`` is not in it.
    """

    kind = "store"

    def __init__(self, path: Path, *, label: Label | None = None, classes: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        self.label = label
        try:
            with StoreReader(self.path) as r:
                m = r.meta
                self._store_classes = list(m.classes)
                self.shape, self.dtype = tuple(m.shape), np.dtype(m.np_dtype)
                self._count = m.count
                self._stamp = {"count": m.count, "created_at": m.created_at, "updated_at": m.updated_at}
                if classes is None:
                    self._classes = list(m.classes)
                    self._n = m.count
                else:
                    missing = [c for c in classes if c not in m.classes]
                    if missing:
                        raise SourceError(
                            f"the store has no class {clip(missing[0])!r} (it has {preview(m.classes)})", path=self.path
                        )
                    self._classes = [c for c in m.classes if c in set(classes)]
                    self._n = sum(m.class_counts[m.classes.index(c)] for c in self._classes)
        except SourceError:
            raise
        except LmdbStoreError as exc:  # a store that cannot be opened is an unusable source
            raise SourceError(f"cannot read the store ({exc.message})", path=self.path, hint=exc.hint) from exc
        self._filtered = len(self._classes) < len(self._store_classes)
        self.name = f"{self.path}[{','.join(self._classes)}]" if self._filtered else str(self.path)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            **self._stamp,
            "classes": self._classes if self._filtered else None,
            "label": self.label,
        }

    def class_names(self) -> list[str] | None:
        if self.label is not None:
            return [self.label] if isinstance(self.label, str) else None
        return list(self._classes)

    def _selected(self, r: StoreReader) -> np.ndarray | None:
        """Ascending indices of the kept classes, or None for every sample."""
        if not self._filtered:
            return None
        ids = [self._store_classes.index(c) for c in self._classes]
        parts = [r.class_indices(c) for c in ids]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        check_range(batch, start, self._n)
        names = np.asarray(self._store_classes)
        r = StoreReader(self.path)
        try:
            r.open()
            if r.meta.count < self._count or list(r.classes) != self._store_classes:
                raise SourceError("the store changed since it was opened as a source", path=self.path)
            sel = self._selected(r)
            for lo in range(start, self._n, batch):
                hi = min(lo + batch, self._n)
                if sel is None:
                    x, ids = r.read_range(lo, hi), r.labels()[lo:hi]
                else:
                    x, ids = r.read_batch(sel[lo:hi]), r.labels_of(sel[lo:hi])
                y = np.full(len(x), self.label) if self.label is not None else names[ids]
                yield x, y
        finally:
            r.close()

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        check_range(batch, start, self._n)
        if self.label is not None:
            for lo in range(start, self._n, batch):
                yield np.full(min(batch, self._n - lo), self.label)
            return
        names = np.asarray(self._store_classes)
        with StoreReader(self.path) as r:
            labels = r.labels()
            sel = self._selected(r)
            for lo in range(start, self._n, batch):
                hi = min(lo + batch, self._n)
                yield names[labels[lo:hi] if sel is None else labels[sel[lo:hi]]]


def restrict_store_sources(
    sources: Sequence[Source], store: str | os.PathLike[str], classes: Sequence[str] | None
) -> list[Source]:
    """Prepare store sources for ingesting into ``store``: refuse the store itself as a source, and with
    explicit destination ``classes`` keep only those classes of each store source.  Other sources pass as is.

    Raises:
        SourceError: a source is the destination store.
    """
    dest = Path(store).resolve()
    out: list[Source] = []
    for src in sources:
        if isinstance(src, StoreSource):
            if src.path.resolve() == dest:
                raise SourceError("a store cannot be ingested into itself", path=src.path)
            if classes is not None:  # only those of the destination's classes it has
                src = StoreSource(src.path, label=src.label, classes=[c for c in src._classes if c in set(classes)])
        out.append(src)
    return out
