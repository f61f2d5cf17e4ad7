"""What a writing run did (the reports the runs return), and :func:`writing`, the one ending every writing run
(ingest, synthetic, parallel) shares: commit what is pending, count the store, time the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lmdbstore.config import WriterConfig
from lmdbstore.store.opening import open_writer
from lmdbstore.store.writer import StoreWriter

__all__ = ["IngestReport", "ParallelReport", "SourceReport", "WriteRun", "writing"]


class _Throughput:
    """``samples_per_s`` of a report, from its ``added`` samples and ``seconds``."""

    added: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        """Samples added per second of the run (0 when no time was measured)."""
        return self.added / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SourceReport:
    """One source of an ingest: its samples, those written now, and those skipped (already in the store
    from an earlier, interrupted run)."""

    name: str
    samples: int
    written: int
    skipped: int


@dataclass
class IngestReport(_Throughput):
    """What an ingest did: the store, whether it created it, samples added, the store's total after it,
    the seconds it took and a :class:`SourceReport` per source."""

    store: str
    created: bool
    added: int
    total: int
    seconds: float
    sources: list[SourceReport] = field(default_factory=list)


@dataclass
class ParallelReport(_Throughput):
    """What :func:`~lmdbstore.ingestion.parallel.write_parallel` did: tasks in the call, tasks skipped
    (already in the store), samples added, the store's total after it and the seconds it took."""

    store: str
    tasks: int
    skipped: int
    added: int
    total: int
    seconds: float


@dataclass
class WriteRun:
    """The counts :func:`writing` keeps for a run's report: samples committed when the writer opened (``start``);
    set when the run ends, samples after its final commit (``total``) and seconds since ``t0`` (``seconds``)."""

    start: int
    total: int = 0
    seconds: float = 0.0

    @property
    def added(self) -> int:
        """Samples the run added."""
        return self.total - self.start


@contextmanager
def writing(
    path: str | os.PathLike[str],
    t0: float,
    *,
    shape: Sequence[int] | None,
    dtype: Any,
    classes: Sequence[str] | None,
    config: WriterConfig | None,
) -> Iterator[tuple[StoreWriter, WriteRun]]:
    """Open the store's writer (:func:`~lmdbstore.store.opening.open_writer`, creating the store if needed) for a
    run; when the run's body ends, commit what it appended and fill in the :class:`WriteRun`.

    ``t0`` is the run's ``time.perf_counter()`` start.  An exception in the body skips the final commit: the
    writer discards what is pending and keeps what was committed before, as a writer's ``with`` block does.

    Raises:
        StoreExistsError, NotAStoreError, StoreLockedError, StoreFullError...: as ``open_writer`` and ``commit``.
    """
    with open_writer(path, shape=shape, dtype=dtype, classes=classes, config=config) as w:
        run = WriteRun(w.committed)
        yield w, run
        w.commit()
        run.total = w.count
    run.seconds = time.perf_counter() - t0
