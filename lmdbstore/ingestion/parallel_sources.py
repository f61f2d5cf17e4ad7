"""``ingest`` with worker processes: sources are cut into chunks of rows that workers read and validate, and
the calling process writes them in the sources' order through the machinery of :mod:`lmdbstore.ingestion.parallel`.

The steps are those of the serial :func:`lmdbstore.ingestion.pipeline.ingest`: every remaining row is validated before
anything is written (now in parallel), then written with the same per-source ledger entries (fingerprint
-> rows done), so a run interrupted with or without workers resumes with or without them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import LmdbStoreError
from lmdbstore.ingestion.parallel import DEFAULT_IN_FLIGHT, TaskResults, as_error, carry_error, commit_in_order
from lmdbstore.ingestion.pipeline import IngestReport, SourceReport
from lmdbstore.ingestion.pool import OrderedPool, TaskFailure, WorkerDied
from lmdbstore.ingestion.sources import Source, scan_source
from lmdbstore.store.opening import open_writer
from lmdbstore.util.progress import ProgressFactory, bar_from

__all__ = ["ingest_parallel"]

Chunk = tuple[int, int, int]  # (source index, first row, end row)


class _Rows:
    """Rows ``lo..hi`` of a source, as :func:`scan_source` reads a source (duck-typed)."""

    def __init__(self, src: Source, hi: int) -> None:
        self.src, self.hi = src, hi

    def iter_batches(self, batch: int, start: int = 0) -> Any:
        yield next(iter(self.src.iter_batches(self.hi - start, start)))

    def locate(self, index: int) -> tuple[Path, int]:
        return self.src.locate(index)


@dataclass(frozen=True)
class _Scan:
    """Worker side of the validation pass: :func:`scan_source` over one chunk; returns its rows."""

    sources: tuple[Source, ...]
    shape: tuple[int, ...]
    dtype: str
    classes: tuple[str, ...]
    allow_nonfinite: bool
    cast: bool

    def __call__(self, chunk: Chunk) -> int:
        i, lo, hi = chunk
        try:
            scan_source(
                _Rows(self.sources[i], hi),  # type: ignore[arg-type]
                shape=self.shape,
                dtype=np.dtype(self.dtype),
                classes=self.classes,
                allow_nonfinite=self.allow_nonfinite,
                cast=self.cast,
                batch=hi - lo,
                start=lo,
            )
        except LmdbStoreError as exc:
            raise carry_error(exc) from None
        return hi - lo


@dataclass(frozen=True)
class _Read:
    """Worker side of the writing pass: the rows of one chunk, as ``(x, y)``."""

    sources: tuple[Source, ...]

    def __call__(self, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
        i, lo, hi = chunk
        try:
            return next(iter(self.sources[i].iter_batches(hi - lo, lo)))
        except LmdbStoreError as exc:
            raise carry_error(exc) from None


def ingest_parallel(
    path: Path,
    sources: Sequence[Source],
    ledger: dict[str, int],
    *,
    shape: tuple[int, ...],
    dtype: str,
    classes: list[str],
    config: WriterConfig,
    cast: bool,
    batch: int,
    progress: ProgressFactory | None,
    workers: int,
    created: bool,
    t0: float,
) -> IngestReport:
    """The validation and writing passes of :func:`lmdbstore.ingestion.pipeline.ingest` in ``workers`` processes.

    Chunks are ``batch`` rows; ``ledger`` holds the rows of each source fingerprint already in the store.
    Compressed ``.npz`` members are decompressed from their start for every chunk: workers help most
    with ``.npy``, stored ``.npz``, HDF5 and directories.

    Raises:
        ValidationError / SourceError: as the serial ingest (the file and row named); nothing written.
        TaskError: a worker died; chunks before it stay committed (rerun to resume).
    """
    done = [min(ledger.get(src.fingerprint(), 0), len(src)) for src in sources]
    chunks = [
        (i, lo, min(lo + batch, len(src))) for i, src in enumerate(sources) for lo in range(done[i], len(src), batch)
    ]
    limit = workers * DEFAULT_IN_FLIGHT
    srcs = tuple(sources)
    scan = _Scan(srcs, shape, dtype, tuple(classes), config.allow_nonfinite, cast)
    bar = bar_from(progress, f"validate {len(sources)} sources", sum(hi - lo for _, lo, hi in chunks))
    try:
        for _, rows in OrderedPool(scan, workers, limit).results(chunks):
            bar.update(rows)
    except (TaskFailure, WorkerDied) as exc:
        raise as_error(exc, chunks, path) from exc
    finally:
        bar.close()
    with open_writer(path, shape=shape, dtype=dtype, classes=classes, config=config) as w:
        start_count = w.committed
        producer = TaskResults(_Read(srcs), shape, dtype, tuple(classes), config.allow_nonfinite, cast)
        bar = bar_from(progress, f"ingest {len(sources)} sources", sum(hi - lo for _, lo, hi in chunks))

        keys = [src.fingerprint() for src in srcs]

        def ledger_of(k: int) -> tuple[str, int, int | None]:
            i, _, hi = chunks[k]
            return keys[i], hi, len(srcs[i])

        try:
            commit_in_order(
                w, producer, chunks, 0, ledger_of, workers=workers, in_flight=DEFAULT_IN_FLIGHT, report=bar.update
            )
        finally:
            bar.close()
        w.commit()
        total = w.count
    reports = [SourceReport(src.name, len(src), len(src) - done[i], done[i]) for i, src in enumerate(sources)]
    return IngestReport(str(path), created, total - start_count, total, time.perf_counter() - t0, reports)
