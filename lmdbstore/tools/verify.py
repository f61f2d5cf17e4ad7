"""Check that a store's contents agree with its metadata (``lmdbstore verify``).

:func:`verify_store` streams through every sub-database once and reports what it finds as a list
of :class:`Problem`\\ s (kind, sample index, one-line message), stopping after ``max_problems``:

* ``structure``: the LMDB file itself (B-tree pages, overflow extents, free list) as checked by
  py-lmdb's offline verifier ``lmdb.verify``, which reads the file with plain ``read()`` calls and
  never hands it to liblmdb, so a damaged file cannot crash the process.  It runs first, and only
  when no writer holds the store; if it finds damage, the content checks are skipped (liblmdb may
  crash on a damaged B-tree).  Skipped, with a note, where py-lmdb has no ``lmdb.verify``.
* ``samples``: the keys are exactly ``0, spv, 2*spv, ... < count`` (no gaps, no extras), every value
  has exactly the length the metadata implies (the last one may be short), and every value's
  checksum trailer matches its bytes (when the store has checksums and ``checksums=True``).
* ``labels``: one chunk per ``label_chunk`` samples, each of the right length, every label a valid
  class id, and the number of labels of each class equal to ``meta.class_counts``.
* ``classidx``: each class's index list is stored in the right chunks, is strictly increasing and
  is exactly ``np.flatnonzero(labels == c)``; compared chunk by chunk, so memory stays bounded by
  the label table (one byte per sample for up to 256 classes).
* ``meta``/``progress``/main database: no unknown sub-databases or keys, every resume-ledger entry
  is well-formed JSON, and the value statistics cover exactly ``count`` samples.

Errors that make a store *unverifiable* (missing path, not a store, malformed metadata, unknown
format version, truncated data file) are not reported as problems: they propagate as the usual
:class:`~lmdbstore.errors.LmdbStoreError` subclasses, so callers (and the CLI's exit codes) can tell
"damaged contents" from "cannot be read at all".

The content checks run in one read transaction with ``lock=True`` (lock-free on a store whose reader table
is read-only, unless a writer is active), so verifying while a writer
appends checks one consistent snapshot.  The ``samples`` check does not walk liblmdb's cursor: ``workers``
processes read the values in large sequential runs and compare their checksums, and the structure walk runs
beside them on a large store (:mod:`lmdbstore.tools.verify_values`, :mod:`lmdbstore.tools.verify_structure`);
the report is the one the cursor walk gives.  This module is the entry point and the report; the content
checks themselves are :mod:`lmdbstore.tools.verify_checks`'s, the writer lock :mod:`lmdbstore.store.locks`'.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmdbstore.config import (
    DEFAULT_MAX_PROBLEMS,
    DEFAULT_VERIFY_CHECKSUMS,
    DEFAULT_VERIFY_STRUCTURE,
    DEFAULT_VERIFY_WORKERS,
)
from lmdbstore.errors import LmdbStoreError
from lmdbstore.store.env import DATA_FILE, check_store_dir, open_env
from lmdbstore.store.locks import lock_table_writable, release_lock
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.registry import ENVS
from lmdbstore.tools.verify_checks import ContentChecks
from lmdbstore.tools.verify_findings import SamplesFindings
from lmdbstore.tools.verify_structure import AtRest, structure_and_values
from lmdbstore.tools.verify_values import ValueOptions, check_values, value_table

__all__ = ["PROBLEM_KINDS", "Problem", "VerifyReport", "verify_store"]

#: Every ``Problem.kind`` verify can report, with what it means.
PROBLEM_KINDS: dict[str, str] = {
    "structure": "the LMDB file's page structure is damaged (lmdb.verify)",
    "scan": "LMDB reported corruption while the contents were being read",
    "missing-value": "a sample value the count implies is absent",
    "extra-value": "a sample value beyond the count or off the samples_per_value grid",
    "value-length": "a sample value has the wrong number of bytes",
    "checksum": "a sample value's checksum trailer does not match its bytes",
    "missing-label-chunk": "a label chunk the count implies is absent",
    "extra-label-chunk": "a label chunk beyond the count or off the label_chunk grid",
    "label-chunk-length": "a label chunk has the wrong number of bytes",
    "label-range": "a label is not a valid class id",
    "class-count": "meta.class_counts disagrees with the labels",
    "missing-classidx-chunk": "a chunk of a class's index list is absent",
    "extra-classidx-chunk": "a class-index chunk beyond the class's count, or of an unknown class",
    "classidx-length": "a class-index chunk has the wrong number of bytes",
    "classidx-mismatch": "a class's index list differs from the positions of its labels",
    "bad-key": "a key of the wrong width in a sub-database",
    "extra-db": "an unknown sub-database or key in the main database",
    "extra-meta-key": "an unknown key in the metadata sub-database",
    "progress": "a malformed resume-ledger entry",
    "stats": "the value statistics do not cover exactly count samples",
}


@dataclass(frozen=True)
class Problem:
    """One finding: its ``kind`` (see :data:`PROBLEM_KINDS`), the sample index or list position it
    concerns (``None`` when it concerns no single index) and a one-line message."""

    kind: str
    index: int | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f" at {self.index}" if self.index is not None else ""
        return f"{self.kind}{where}: {self.message}"


@dataclass
class VerifyReport:
    """What :func:`verify_store` checked and found.

    Attributes:
        path: the store verified.
        ok: no problem found.
        problems: the first ``max_problems`` problems, in the order found.
        complete: every check ran to the end (``False`` after stopping at ``max_problems`` or when
            the structure check found damage and the content checks were skipped).
        count: samples according to the metadata.
        structure_checked: whether the page-level LMDB check ran (see the module docstring).
        notes: why a check was skipped, if one was.
        values_checked, samples_checked, checksums_checked, label_chunks_checked, labels_checked,
        class_index_entries_checked, progress_entries_checked: how much was looked at.
    """

    path: str
    ok: bool = True
    problems: list[Problem] = field(default_factory=list)
    complete: bool = True
    count: int = 0
    structure_checked: bool = False
    notes: list[str] = field(default_factory=list)
    values_checked: int = 0
    samples_checked: int = 0
    checksums_checked: int = 0
    label_chunks_checked: int = 0
    labels_checked: int = 0
    class_index_entries_checked: int = 0
    progress_entries_checked: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (``problems`` as a list of dicts)."""
        d = asdict(self)
        d["problems"] = [p.to_dict() for p in self.problems]
        return d

    def summary(self) -> str:
        """One line: OK or the number of problems, and what was checked."""
        head = "OK" if self.ok else f"{len(self.problems)} problem(s){'' if self.complete else ' (stopped early)'}"
        return (
            f"{self.path}: {head}: {self.samples_checked} samples in {self.values_checked} values, "
            f"{self.checksums_checked} checksums, {self.labels_checked} labels, "
            f"{self.class_index_entries_checked} class-index entries"
        )


class _Enough(Exception):
    """Raised internally once ``max_problems`` problems are collected."""


class _Once:
    """Calls ``fn`` on the first call only (``None``: never)."""

    def __init__(self, fn: Callable[[int], None] | None):
        self.fn = fn

    def __call__(self, n: int) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn(n)


class _Collector:
    """The problems found so far; raises :class:`_Enough` when the ``limit``-th is added."""

    def __init__(self, limit: int):
        self.items: list[Problem] = []
        self.limit = limit

    def add(self, kind: str, index: int | None, message: str) -> None:
        self.items.append(Problem(kind, index, message))
        if len(self.items) >= self.limit:
            raise _Enough


def verify_store(
    path: str | os.PathLike[str] | StoreReader,
    *,
    checksums: bool = DEFAULT_VERIFY_CHECKSUMS,
    max_problems: int = DEFAULT_MAX_PROBLEMS,
    progress: Callable[[int], None] | None = None,
    structure: bool = DEFAULT_VERIFY_STRUCTURE,
    workers: int | None = DEFAULT_VERIFY_WORKERS,
    total: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check a store's contents against its metadata; see the module docstring for the checks.

    Args:
        path: the store directory, or an open :class:`StoreReader` whose snapshot is checked (it is
            left open; useful where the process already has the store open, as LMDB forbids opening
            it twice in one process).
        checksums: recompute every value's checksum (when the store has them).
        max_problems: stop after this many problems.
        progress: called with the number of samples checked so far, after each chunk of values read.
        structure: also run the page-level LMDB check first (when ``lmdb.verify`` exists and no
            writer holds the store).
        workers: processes that read the values and compute their checksums (the report is the same for
            any number); ``None`` (default): the cores, but one per 512 MiB of values at most, so a small
            store is checked in this process (see :mod:`lmdbstore.tools.verify_values`).
        total: called once, before the first ``progress`` call, with the samples the store holds (a
            progress bar's total, for its time left).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is ``False`` when anything is wrong.

    Raises:
        ValueError: ``max_problems`` is not positive, or ``workers`` below 1.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: the store cannot be opened
            at all (see the module docstring).
        LmdbStoreError: a worker process died or failed, or a writer overwrote the snapshot meanwhile.
    """
    if max_problems < 1:
        raise ValueError(f"max_problems must be positive, got {max_problems}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    own = not isinstance(path, StoreReader)
    if own:
        # A registered snapshot where LMDB's reader table can be written; a read-only store is read
        # lock-free unless a writer is active (see :func:`lmdbstore.store.locks.resolve_lock`).
        p = Path(path)  # type: ignore[arg-type]
        reader = StoreReader(p, lock=True if lock_table_writable(p) else None)
    else:
        reader = path  # type: ignore[assignment]
    assert isinstance(reader, StoreReader)
    report = VerifyReport(path=str(reader.path))
    found = _Collector(max_problems)
    announce = _Once(total)
    opts = ValueOptions(checksums, workers, max_problems, progress, announce)
    lock = -1
    try:
        rest = samples = None
        if structure and own:
            _check_opens(reader.path)
            lock, rest, samples = structure_and_values(reader.path, report, found.add, opts)
        elif structure:
            report.notes.append("structure check skipped: the store was passed as an open reader")
        if found.items:  # liblmdb may crash on a damaged B-tree: do not open the store with it
            raise _Enough
        meta = reader.meta  # open errors propagate from here; the snapshot is taken while writers are held off
        release_lock(lock)
        lock = -1
        report.count = meta.count
        announce(meta.count)
        if rest is None or not _same_snapshot(reader, rest):
            samples = reader_values(reader, opts)
        ContentChecks(reader, meta, report, found.add, checksums, progress, samples, max_problems).run()
    except _Enough:
        report.complete = False
        if found.items and found.items[0].kind == "structure":
            report.notes.append("content checks skipped: the LMDB file structure is damaged")
    finally:
        release_lock(lock)
        if own:
            reader.close()
    report.problems = found.items
    report.ok = not found.items
    return report


def _same_snapshot(reader: StoreReader, rest: AtRest) -> bool:
    """Whether ``reader`` shows the snapshot the value pass read at rest (it does while writers are held off)."""
    h = reader._handle()
    return h.snapshot.txnid == rest.snap.txnid and h.meta == rest.meta


def reader_values(reader: StoreReader, opts: ValueOptions) -> SamplesFindings | None:
    """The value pass over ``reader``'s snapshot (protected by its read transaction meanwhile), or ``None`` where
    its ``samples`` tree cannot be read without liblmdb (the cursor walk then checks it).

    Raises:
        LmdbStoreError: a writer overwrote the snapshot meanwhile (a lock-free reader), or a worker failed.
    """
    h = reader._take()
    try:
        snap = h.snapshot.meta
        values = None if snap is None else value_table(h.fd, snap, reader.path)
        if values is None:
            return None
        findings = check_values(values, h.meta, reader.path / DATA_FILE, h.fd, opts)
        if not h.protected():
            raise LmdbStoreError(
                "a writer overwrote the snapshot while verify read it", path=reader.path, hint="run verify again"
            )
        return findings
    finally:
        reader._give(h)


def _check_opens(path: Path) -> None:
    """Raise what opening would (missing, not a store, truncated data file) before the page walk,
    so those stay errors rather than structure problems.  Reads only LMDB's meta pages."""
    check_store_dir(path)
    ENVS.acquire(path, writable=False, lock=False, opener=lambda: open_env(path, readonly=True, lock=False)).release()
