"""Ingesting sources into a store: every source validated first (a bad source leaves the store as it was), then
written, each source's position in the resume ledger (keyed by its fingerprint) committed with its samples, so
running the same command again after an interruption continues where the last commit ended.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_CAST, DEFAULT_INGEST_WORKERS, DEFAULT_SYNTH_SEED, WriterConfig
from lmdbstore.errors import ValidationError
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.ledger import synthetic_key
from lmdbstore.ingestion.parallel_sources import ingest_parallel
from lmdbstore.ingestion.plan import IngestPlan, plan_ingest, read_ledger, store_layout
from lmdbstore.ingestion.reports import IngestReport, SourceReport, writing
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.synth import SYNTH_CLASSES, SYNTH_SHAPE, synth_batches
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.writer import StoreWriter
from lmdbstore.util.progress import ProgressFactory, bar_from

__all__ = ["ingest", "ingest_synthetic"]

#: Rows read per batch from a source while validating and writing.
DEFAULT_READ_BATCH = 16384


def ingest(
    store: str | os.PathLike[str],
    sources: Sequence[Source],
    *,
    classes: Sequence[str] | None = None,
    dtype: Any = None,
    config: WriterConfig | None = None,
    cast: bool = DEFAULT_CAST,
    batch: int = DEFAULT_READ_BATCH,
    progress: ProgressFactory | None = None,
    workers: int = DEFAULT_INGEST_WORKERS,
) -> IngestReport:
    """Validate ``sources`` and append them to ``store`` (created if needed).

    Args:
        sources: from :func:`lmdbstore.ingestion.sources.open_sources`.
        classes: class names for a new store (default: inferred from the sources); for an existing
            store they must match if given.
        dtype: sample dtype of a new store (default: the first source's); other dtypes need ``cast``.
        config: writer settings (checksum, packing and non-finite policy apply to a new store).
        cast: convert samples of another dtype of the same kind (e.g. float64 -> float32).
        progress: factory of progress bars (``(description, total) -> bar``); ``None`` for none.
        workers: read and validate in this many processes; 0: in this one.

    Raises:
        ValueError: no sources, or a bad ``classes`` list.
        ValidationError / SourceError: a source is unusable; nothing has been written.
        StoreExistsError, NotAStoreError, StoreLockedError, StoreFullError, CorruptStoreError.
    """
    plan = plan_ingest(
        store, sources, classes=classes, dtype=dtype, config=config or WriterConfig(), cast=cast, batch=batch
    )
    if workers:  # the same two passes, in worker processes
        return ingest_parallel(plan, workers=workers, progress=progress)
    _validate(plan, progress)
    with plan.writing() as (w, run):
        reports = [_write_source(w, src, plan.batch, plan.cast, progress) for src in plan.sources]
    return plan.report(run, reports)


def _validate(plan: IngestPlan, progress: ProgressFactory | None) -> None:
    """The validation pass: every row of every source not yet in the store, through the writer's checks."""
    for src, done in zip(plan.sources, plan.done, strict=True):
        if done == len(src):
            continue
        bar = bar_from(progress, f"validate {src.name}", len(src) - done)
        try:
            plan.validate(src, start=done, batch=plan.batch, progress=bar.update)
        finally:
            bar.close()


def _write_source(
    w: StoreWriter, src: Source, batch: int, cast: bool, progress: ProgressFactory | None
) -> SourceReport:
    """Append the rows of ``src`` the store does not hold yet, each batch with its ledger entry."""
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
    seed: int = DEFAULT_SYNTH_SEED,
    config: WriterConfig | None = None,
    batch: int = DEFAULT_READ_BATCH,
    progress: ProgressFactory | None = None,
    exclusive: bool = False,
    dtype: Any = None,
) -> IngestReport:
    """Generate ``n`` samples of the built-in 5-class dataset straight into ``store`` (resumable: the ledger key
    depends only on ``n`` and ``seed``, so the same call again adds nothing), in the float ``dtype`` (default
    ``None``: float32, as generated); an existing store must hold the same.  With ``exclusive`` a store holding
    anything else is refused before anything is written.

    Raises:
        ValidationError: ``exclusive`` and the store holds other data.
        ValueError: ``dtype`` is not a float dtype.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    want = np.dtype(normalize_dtype(dtype if dtype is not None else "float32"))
    if want.kind != "f":
        raise ValueError(
            f"dtype of the synthetic dataset must be a float dtype (float16, float32, float64), got {want}"
        )
    path = Path(store)
    key = synthetic_key(n, seed)
    if exclusive and store_layout(path) is not None:
        _refuse_other_data(path, n, seed, key)
    t0 = time.perf_counter()
    with writing(path, t0, shape=SYNTH_SHAPE, dtype=want.str, classes=SYNTH_CLASSES, config=config) as (w, run):
        done = w.progress(key)
        created = run.start == 0 and done == 0
        bar = bar_from(progress, "synthesize+ingest", n - done)
        try:
            _append_synthetic(w, key, n, seed, batch, done, bar.update, want)
        finally:
            bar.close()
    return IngestReport(str(path), created, run.added, run.total, run.seconds, [SourceReport(key, n, n - done, done)])


def _refuse_other_data(path: Path, n: int, seed: int, key: str) -> None:
    """Refuse a store holding anything but (part of) the ``n`` synthetic samples of ``seed`` (ledger ``key``)."""
    other = sorted(k for k in read_ledger(path) if k != key)
    with StoreReader(path) as r:
        count = r.meta.count
    if other or count > n:
        raise ValidationError(
            f"the store holds other data than the {n} synthetic samples of seed {seed} "
            f"({count} samples{', from ' + other[0] if other else ''})",
            path=path,
            hint="use another store directory, or delete this one",
        )


def _append_synthetic(
    w: StoreWriter,
    key: str,
    n: int,
    seed: int,
    batch: int,
    done: int,
    report: Callable[[int], Any],
    dtype: np.dtype[Any],
) -> None:
    """Append the synthetic samples after the first ``done`` (regenerated deterministically and skipped), in
    ``dtype``."""
    pos = 0
    for x, y in synth_batches(n, seed=seed, batch=batch):
        pos += len(x)
        if pos <= done:
            continue  # regenerate deterministically, skip what was committed
        keep = min(len(x), pos - done)
        xs = x[-keep:] if dtype == x.dtype else x[-keep:].astype(dtype)
        w.append(xs, y[-keep:], progress=(key, pos), progress_total=n)
        report(keep)
