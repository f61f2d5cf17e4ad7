"""What an ingest will write, settled before a sample is read: the store's layout and the sources' resume points.

:func:`plan_ingest` checks the options against the store (or decides a new store's shape, dtype and classes
from the sources) and reads the resume ledger once, so the serial and the parallel ingest
(:mod:`lmdbstore.ingestion.pipeline`, :mod:`lmdbstore.ingestion.parallel_sources`) start from the same
:class:`IngestPlan` and differ only in where the rows are read and validated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import ValidationError, preview
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.layout import DB_PROGRESS
from lmdbstore.format.ledger import parse_entry
from lmdbstore.format.meta import check_classes
from lmdbstore.ingestion.reports import IngestReport, SourceReport, WriteRun, writing
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.sources.scan import infer_classes, scan_source
from lmdbstore.ingestion.sources.store import restrict_store_sources
from lmdbstore.store.env import to_be_created
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.writer import StoreWriter
from lmdbstore.util.paths import check_outside

__all__ = ["IngestPlan", "plan_ingest", "read_ledger", "store_layout"]

Layout = tuple[tuple[int, ...], str, list[str]]  # (shape, dtype, classes) of a store


def store_layout(path: Path) -> Layout | None:
    """(shape, dtype, classes) of an existing store, or None when it does not exist yet (or its creation
    was interrupted before the first commit).  Raises as :class:`~lmdbstore.store.reader.StoreReader` does
    (``NotAStoreError``, ``CorruptStoreError``...) for a path holding something else."""
    if to_be_created(path):
        return None
    with StoreReader(path) as r:  # closed again before the writer opens the same path
        m = r.meta
        return m.shape, m.dtype, list(m.classes)


def read_ledger(path: Path) -> dict[str, int]:
    """Committed position of every producer in the store's resume ledger (validated like the writer does).

    Raises:
        CorruptStoreError: an entry the writer would refuse.
    """
    out: dict[str, int] = {}
    with StoreReader(path) as r:
        for k, v in r.iter_raw(DB_PROGRESS):
            name = k.decode("utf-8", "replace")
            out[name] = int(parse_entry(bytes(v), path, name)["done"])
    return out


@dataclass(frozen=True)
class IngestPlan:
    """Everything an ingest settled before reading a sample (picklable: the parallel ingest's workers get it): the
    sources in order (store sources restricted to the destination's classes), the store's layout (a new store's
    as decided from the sources), whether the ingest ``created`` it, the rows of each source an earlier run
    committed (``done``), the options, and ``t0`` (``time.perf_counter()``), where the report's seconds start."""

    path: Path
    sources: tuple[Source, ...]
    shape: tuple[int, ...]
    dtype: str
    classes: tuple[str, ...]
    created: bool
    done: tuple[int, ...]
    config: WriterConfig
    cast: bool
    batch: int
    t0: float

    def validate(
        self,
        src: Source,
        *,
        start: int,
        batch: int,
        progress: Callable[[int], None] | None = None,
        stop: int | None = None,
    ) -> None:
        """:func:`~lmdbstore.ingestion.sources.scan.scan_source` of ``src``'s rows ``start..stop`` (default: to the
        end) against the store's layout and the ingest's options.

        Raises:
            ValidationError / SourceError: as ``scan_source``.
        """
        scan_source(
            src,
            shape=self.shape,
            dtype=np.dtype(self.dtype),
            classes=self.classes,
            start=start,
            allow_nonfinite=self.config.allow_nonfinite,
            cast=self.cast,
            batch=batch,
            progress=progress,
            stop=stop,
        )

    def writing(self) -> AbstractContextManager[tuple[StoreWriter, WriteRun]]:
        """The store's writer for the writing pass (:func:`~lmdbstore.ingestion.reports.writing`)."""
        return writing(
            self.path, self.t0, shape=self.shape, dtype=self.dtype, classes=list(self.classes), config=self.config
        )

    def report(self, run: WriteRun, sources: list[SourceReport]) -> IngestReport:
        """The ingest's report, once the writing pass ``run`` has ended."""
        return IngestReport(str(self.path), self.created, run.added, run.total, run.seconds, sources)


def plan_ingest(
    store: str | os.PathLike[str],
    sources: Sequence[Source],
    *,
    classes: Sequence[str] | None,
    dtype: Any,
    config: WriterConfig,
    cast: bool,
    batch: int,
) -> IngestPlan:
    """Settle an ingest of ``sources`` into ``store`` (arguments as :func:`~lmdbstore.ingestion.pipeline.ingest`).

    Raises:
        ValueError: no sources, or a bad ``classes`` list (before any source is read).
        ValidationError: ``dtype`` or ``classes`` disagree with the existing store; inferred classes unusable.
        SourceError: a store source is the destination itself.
        LmdbStoreError: the store is a source or lies inside one.
    """
    if not sources:
        raise ValueError("sources must not be empty")
    path = Path(store)
    if classes is not None:
        classes = check_classes(classes)  # before any source is read: a bad list fails at once
    else:
        for src in sources:
            src.class_names()  # names a file has but that cannot be read: an error unless classes= settles them
    sources = restrict_store_sources(sources, path, classes)  # stores as sources: no self-ingest, --classes subsets
    check_outside(path, [src.path for src in sources], "store")  # never written into what it reads
    layout = store_layout(path)
    if layout is None:
        shape, dtype, names = _new_layout(sources, classes, dtype)
    else:
        shape, dtype, names = _check_layout(path, layout, classes, dtype)
    t0 = time.perf_counter()
    ledger = read_ledger(path) if layout is not None else {}
    done = tuple(min(ledger.get(src.fingerprint(), 0), len(src)) for src in sources)
    return IngestPlan(
        path, tuple(sources), tuple(shape), dtype, tuple(names), layout is None, done, config, cast, batch, t0
    )


def _new_layout(sources: Sequence[Source], classes: Sequence[str] | None, dtype: Any) -> Layout:
    """A new store's layout: the first source's shape, ``dtype`` (default: the first source's) and ``classes``
    (default: from the sources)."""
    first = sources[0]
    dtype = normalize_dtype(dtype if dtype is not None else first.dtype)  # a bad dtype fails before a label is read
    names = list(classes) if classes is not None else check_classes(_classes_from(sources))
    return tuple(first.shape), dtype, names


def _check_layout(path: Path, layout: Layout, classes: Sequence[str] | None, dtype: Any) -> Layout:
    """An existing store's layout, refusing a ``dtype`` or ``classes`` option that disagrees with it."""
    if dtype is not None and normalize_dtype(dtype) != layout[1]:
        raise ValidationError(f"store holds dtype {layout[1]}, dtype= gave {np.dtype(dtype)}", path=path)
    names = layout[2]
    if classes is not None and list(classes) != names:
        raise ValidationError(f"store has classes {preview(names)}, classes= gave {preview(classes)}", path=path)
    return layout


def _classes_from(sources: Sequence[Source]) -> list[str]:
    """Classes of a new store: the sources' own ordered list when they all carry the same one
    (e.g. an npz ``class_names``, so the file's ids keep their meaning), else :func:`infer_classes`."""
    lists = [src.class_names() for src in sources]
    if all(lst is not None for lst in lists) and len({tuple(lst) for lst in lists if lst is not None}) == 1:
        return list(lists[0] or [])
    return infer_classes(sources)
