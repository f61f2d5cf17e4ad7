"""``ingest`` with worker processes: the serial ingest's two passes over the same
:class:`~lmdbstore.ingestion.plan.IngestPlan`, the rows cut into chunks that workers read and validate, written in
the sources' order with the same ledger entries (a run interrupted with or without workers resumes either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmdbstore.errors import LmdbStoreError
from lmdbstore.ingestion.parallel import TaskResults, as_error, carry_error, commit_in_order
from lmdbstore.ingestion.plan import IngestPlan
from lmdbstore.ingestion.reports import IngestReport, SourceReport
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.util.pool import OrderedPool, TaskFailure
from lmdbstore.util.procs import worker_processes
from lmdbstore.util.progress import Bar, ProgressFactory, bar_from
from lmdbstore.util.workers import WorkerDied

__all__ = ["ingest_parallel"]

Chunk = tuple[int, int, int]  # (source index, first row, end row)
#: Chunks each worker may have read and not yet had committed: a chunk is ``plan.batch`` rows (16,384 of 25x25
#: float32 by default: 40 MB), so two per worker already cover the writer's commits.
CHUNKS_IN_FLIGHT = 2


@dataclass(frozen=True)
class _Scan:
    """Worker side of the validation pass: the plan's validation of one chunk; returns its rows."""

    plan: IngestPlan

    def __call__(self, chunk: Chunk) -> int:
        i, lo, hi = chunk
        try:
            self.plan.validate(self.plan.sources[i], start=lo, batch=hi - lo, stop=hi)
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


def ingest_parallel(plan: IngestPlan, *, workers: int, progress: ProgressFactory | None) -> IngestReport:
    """The validation and writing passes of :func:`lmdbstore.ingestion.pipeline.ingest` in ``workers`` processes,
    in chunks of ``plan.batch`` rows (a compressed ``.npz`` member is decompressed from its start for each).

    Raises:
        ValidationError / SourceError: as the serial ingest (the file and row named); nothing written.
        TaskError: a worker died; chunks before it stay committed (rerun to resume).
    """
    srcs, batch = plan.sources, plan.batch
    workers = worker_processes(workers)  # no more processes than the cores and the memory hold (warned)
    chunks = [
        (i, lo, min(lo + batch, len(src))) for i, src in enumerate(srcs) for lo in range(plan.done[i], len(src), batch)
    ]
    rows = sum(hi - lo for _, lo, hi in chunks)
    _validate(plan, chunks, workers, bar_from(progress, f"validate {len(srcs)} sources", rows))
    with plan.writing() as (w, run):
        producer = TaskResults(
            _Read(srcs), plan.shape, plan.dtype, plan.classes, plan.config.allow_nonfinite, plan.cast
        )
        bar = bar_from(progress, f"ingest {len(srcs)} sources", rows)
        keys = [src.fingerprint() for src in srcs]

        def ledger_of(k: int) -> tuple[str, int, int | None]:
            i, _, hi = chunks[k]
            return keys[i], hi, len(srcs[i])

        try:
            pool = OrderedPool(producer, workers, workers * CHUNKS_IN_FLIGHT)
            commit_in_order(w, pool, chunks, 0, ledger_of, report=bar.update)
        finally:
            bar.close()
    reports = [
        SourceReport(src.name, len(src), len(src) - done, done) for src, done in zip(srcs, plan.done, strict=True)
    ]
    return plan.report(run, reports)


def _validate(plan: IngestPlan, chunks: list[Chunk], workers: int, bar: Bar) -> None:
    """The validation pass over ``chunks`` in ``workers`` processes, counted on ``bar`` (closed at the end).

    Raises:
        ValidationError / SourceError: the first bad chunk's error, as raised in its worker.
        TaskError: a worker died.
    """
    try:
        for _, rows in OrderedPool(_Scan(plan), workers, workers * CHUNKS_IN_FLIGHT).results(chunks):
            bar.update(rows)
    except (TaskFailure, WorkerDied) as exc:
        raise as_error(exc, chunks, plan.path) from exc
    finally:
        bar.close()
