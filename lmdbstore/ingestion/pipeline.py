"""Ingesting sources into a store: validate everything first, then write with resume support.

A bad source must leave the store exactly as it was, so :func:`ingest` streams every source once
through validation (shape, dtype, finite values, known labels) before a single sample is written.
The writing pass records each source's position in the store's resume ledger, keyed by the source's
fingerprint (path, size, modification time, options), in the same transaction as the samples: after
an interruption, running the same command again skips what was committed and continues.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import ValidationError, preview
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.layout import DB_PROGRESS
from lmdbstore.format.ledger import parse_entry, synthetic_key
from lmdbstore.format.meta import check_classes
from lmdbstore.ingestion.sources import Source, infer_classes, scan_source
from lmdbstore.ingestion.sources.store import restrict_store_sources
from lmdbstore.ingestion.synth import SYNTH_CLASSES, SYNTH_SHAPE, synth_batches
from lmdbstore.store.env import to_be_created
from lmdbstore.store.opening import open_writer
from lmdbstore.store.reader import StoreReader
from lmdbstore.util.progress import ProgressFactory, bar_from

__all__ = ["IngestReport", "SourceReport", "ingest", "ingest_synthetic", "store_layout"]

#: Rows read per batch from a source while validating and writing.
DEFAULT_READ_BATCH = 16384


@dataclass
class SourceReport:
    name: str
    samples: int
    written: int
    skipped: int  # already in the store from an earlier (interrupted) run


@dataclass
class IngestReport:
    store: str
    created: bool
    added: int
    total: int
    seconds: float
    sources: list[SourceReport] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.added / self.seconds if self.seconds > 0 else 0.0


def store_layout(path: Path) -> tuple[tuple[int, ...], str, list[str]] | None:
    """(shape, dtype, classes) of an existing store, or None when it does not exist yet (or its creation
    was interrupted before the first commit: the writer creates it afresh)."""
    if to_be_created(path):
        return None
    with StoreReader(path) as r:  # closed again before the writer opens the same path
        m = r.meta
        return m.shape, m.dtype, list(m.classes)


def _classes_from(sources: Sequence[Source]) -> list[str]:
    """Classes of a new store: the sources' own ordered list when they all carry the same one
    (e.g. an npz ``class_names``, so the file's ids keep their meaning), else :func:`infer_classes`."""
    lists = [src.class_names() for src in sources]
    if all(lst is not None for lst in lists) and len({tuple(lst) for lst in lists if lst is not None}) == 1:
        return list(lists[0] or [])
    return infer_classes(sources)


def _ledger(path: Path) -> dict[str, int]:
    """Committed position of every producer in the store's resume ledger (validated like the writer does)."""
    out: dict[str, int] = {}
    with StoreReader(path) as r:
        for k, v in r.iter_raw(DB_PROGRESS):
            name = k.decode("utf-8", "replace")
            out[name] = int(parse_entry(bytes(v), path, name)["done"])
    return out


def ingest(
    store: str | os.PathLike[str],
    sources: Sequence[Source],
    *,
    classes: Sequence[str] | None = None,
    dtype: Any = None,
    config: WriterConfig | None = None,
    cast: bool = False,
    batch: int = DEFAULT_READ_BATCH,
    progress: ProgressFactory | None = None,
    workers: int = 0,
) -> IngestReport:
    """Validate ``sources`` and append them to ``store`` (created if needed).

    Args:
        store: the store directory.
        sources: from :func:`lmdbstore.ingestion.sources.open_sources`.
        classes: class names for a new store (default: inferred from the sources); for an existing
            store they must match if given.
        dtype: sample dtype of a new store (default: the first source's); other dtypes need ``cast``.
        config: writer settings (checksum, packing and non-finite policy apply to a new store).
        cast: convert samples of another dtype of the same kind (e.g. float64 -> float32).
        batch: rows per read.
        progress: factory of progress bars (``(description, total) -> bar``); ``None`` for none.
        workers: read and validate in this many processes (``lmdbstore.ingestion.parallel_sources``); 0: in this one.

    Raises:
        ValidationError / SourceError: a source is unusable; nothing has been written.
        StoreExistsError, NotAStoreError, StoreLockedError, StoreFullError, CorruptStoreError.
    """
    if not sources:
        raise ValueError("sources must not be empty")
    config = config or WriterConfig()
    path = Path(store)
    if classes is not None:
        classes = check_classes(classes)  # before any source is read: a bad list fails at once
    sources = restrict_store_sources(sources, path, classes)  # stores as sources: no self-ingest, --classes subsets
    layout = store_layout(path)
    first = sources[0]
    if layout is None:
        shape = tuple(first.shape)
        dtype = normalize_dtype(dtype if dtype is not None else first.dtype)
        names = list(classes) if classes is not None else check_classes(_classes_from(sources))
    else:
        if dtype is not None and normalize_dtype(dtype) != layout[1]:
            raise ValidationError(f"store holds dtype {layout[1]}, --dtype gave {np.dtype(dtype)}", path=path)
        shape, dtype, names = layout
        if classes is not None and list(classes) != names:
            raise ValidationError(f"store has classes {preview(names)}, --classes gave {preview(classes)}", path=path)
    t0 = time.perf_counter()
    ledger = _ledger(path) if layout is not None else {}
    if workers:  # the same two passes, in worker processes
        from lmdbstore.ingestion.parallel_sources import ingest_parallel

        return ingest_parallel(
            path,
            sources,
            ledger,
            shape=tuple(shape),
            dtype=dtype,
            classes=names,
            config=config,
            cast=cast,
            batch=batch,
            progress=progress,
            workers=workers,
            created=layout is None,
            t0=t0,
        )
    for src in sources:
        done = min(ledger.get(src.fingerprint(), 0), len(src))  # what an earlier run already committed
        if done == len(src):
            continue
        bar = bar_from(progress, f"validate {src.name}", len(src) - done)
        try:
            scan_source(
                src,
                shape=shape,
                dtype=np.dtype(dtype),
                classes=names,
                start=done,
                allow_nonfinite=config.allow_nonfinite,
                cast=cast,
                batch=batch,
                progress=bar.update,
            )
        finally:
            bar.close()
    reports: list[SourceReport] = []
    with open_writer(path, shape=shape, dtype=dtype, classes=names, config=config) as w:
        start_count = w.committed
        for src in sources:
            reports.append(_write_source(w, src, batch, cast, progress))
        w.commit()
        total = w.count
    seconds = time.perf_counter() - t0
    return IngestReport(str(path), layout is None, total - start_count, total, seconds, reports)


def _write_source(w: Any, src: Source, batch: int, cast: bool, progress: ProgressFactory | None) -> SourceReport:
    key = src.fingerprint()
    done = w.progress(key)
    n = len(src)
    if done >= n:
        return SourceReport(src.name, n, 0, n)
    bar = bar_from(progress, f"ingest {src.name}", n - done)
    pos = done
    try:
        for x, y in src.iter_batches(batch, start=done):
            pos += len(x)
            w.append(x, y, progress=(key, pos), progress_total=n, cast=cast)
            bar.update(len(x))
    finally:
        bar.close()
    return SourceReport(src.name, n, pos - done, done)


def ingest_synthetic(
    store: str | os.PathLike[str],
    n: int,
    *,
    seed: int = 0,
    config: WriterConfig | None = None,
    batch: int = DEFAULT_READ_BATCH,
    progress: ProgressFactory | None = None,
    exclusive: bool = False,
) -> IngestReport:
    """Generate ``n`` samples of the built-in 5-class dataset straight into ``store`` (resumable).

    The resume ledger key depends only on ``n`` and ``seed``, so running the same call again adds
    nothing.  With ``exclusive`` a store holding anything else (other synthetic sets, ingested files)
    is refused before anything is written.  This is also the pattern for a user's own generator:
    append batches with a progress marker.

    Raises:
        ValidationError: ``exclusive`` and the store holds other data.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    path = Path(store)
    key = synthetic_key(n, seed)
    if exclusive and store_layout(path) is not None:
        other = sorted(k for k in _ledger(path) if k != key)
        with StoreReader(path) as r:
            count = r.meta.count
        if other or count > n:
            raise ValidationError(
                f"the store holds other data than the {n} synthetic samples of seed {seed} "
                f"({count} samples{', from ' + other[0] if other else ''})",
                path=path,
                hint="use another store directory, or delete this one",
            )
    t0 = time.perf_counter()
    with open_writer(path, shape=SYNTH_SHAPE, dtype="float32", classes=SYNTH_CLASSES, config=config) as w:
        start_count, done = w.committed, w.progress(key)
        created = start_count == 0 and done == 0
        bar = bar_from(progress, "synthesize+ingest", n - done)
        pos = 0
        try:
            for x, y in synth_batches(n, seed=seed, batch=batch):
                pos += len(x)
                if pos <= done:
                    continue  # regenerate deterministically, skip what was committed
                keep = min(len(x), pos - done)
                w.append(x[-keep:], y[-keep:], progress=(key, pos), progress_total=n)
                bar.update(keep)
        finally:
            bar.close()
        w.commit()
        total = w.count
    report = SourceReport(key, n, n - done, done)
    return IngestReport(str(path), created, total - start_count, total, time.perf_counter() - t0, [report])
