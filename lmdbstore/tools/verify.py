"""Check that a store's contents agree with its metadata (``lmdbstore verify``).

:func:`verify_store` streams through every sub-database once and reports what it finds as a list
of :class:`Problem`\\ s (kind, sample index, one-line message), stopping after ``max_problems``:

* ``structure``: the LMDB file itself (B-tree pages, overflow extents, free list) as checked by
  py-lmdb's offline verifier ``lmdb.verify``, which reads the file with plain ``read()`` calls and
  never hands it to liblmdb, so a damaged file cannot crash the process.  It runs first, and only
  when no writer holds the store; if it finds damage, the content checks are skipped (liblmdb may
  crash on a damaged B-tree).  Skipped, with a note, where py-lmdb has no ``lmdb.verify``.  A ``samples``
  B-tree lmdbstore's own page parser cannot read (a key of another width) is a ``structure`` problem too.
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

The checks are all on the file verify opened.  Where no writer is active it holds writers off (a shared lock on
``writer.lock``) and opens the data file once (:class:`~lmdbstore.tools.verify_structure.AtRest`): the page walk and
the ``samples`` check -- ``workers`` processes reading the values in large sequential runs and comparing their
checksums (:mod:`lmdbstore.tools.verify_values`) -- read that descriptor, liblmdb opens the store only once the
walk found the structure intact, and its snapshot must be of the same file and commit; a store replaced while it
was verified is a one-line :class:`~lmdbstore.errors.StoreReplacedError` ("run verify again").  Beside a writer, or
given an open reader, the same value pass reads the reader's registered snapshot (no page walk then).  The other
content checks run in one read transaction with ``lock=True`` (:mod:`lmdbstore.tools.verify_checks`, which also
defines the report).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from lmdbstore.config import (
    DEFAULT_MAX_PROBLEMS,
    DEFAULT_VERIFY_CHECKSUMS,
    DEFAULT_VERIFY_STRUCTURE,
    DEFAULT_VERIFY_WORKERS,
)
from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.format.pages import UnsupportedLayout
from lmdbstore.store.env import DATA_FILE, check_store_dir, open_env
from lmdbstore.store.locks import lock_table_writable
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.registry import ENVS
from lmdbstore.tools.verify_checks import PROBLEM_KINDS, Collector, ContentChecks, Enough, Problem, VerifyReport
from lmdbstore.tools.verify_structure import AtRest, unreadable
from lmdbstore.tools.verify_values import SamplesFindings, ValueOptions, check_values, value_table

__all__ = ["PROBLEM_KINDS", "Problem", "VerifyReport", "verify_store"]


class _Once:
    """Calls ``fn`` on the first call only (``None``: never)."""

    def __init__(self, fn: Callable[[int], None] | None):
        self.fn = fn

    def __call__(self, n: int) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn(n)


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
    found = Collector(max_problems)
    announce = _Once(total)
    opts = ValueOptions(checksums, workers, max_problems, progress, announce)
    rest = None
    try:
        if own:
            _check_opens(reader.path)
            rest = _at_rest(reader.path, report, structure)
        elif structure:
            report.notes.append("structure check skipped: the store was passed as an open reader")
        samples = None if rest is None else _rest_pass(rest, report, found, opts, structure)
        meta = reader.meta  # open errors propagate from here; the snapshot is taken while writers are held off
        if rest is not None:
            rest.check_same(reader)
            rest.close()
        report.count = meta.count
        announce(meta.count)
        if samples is None:
            samples = _snapshot_pass(reader, opts)
        if isinstance(samples, str):  # a tree the page parser cannot read
            found.add("structure", None, samples)
            raise Enough
        ContentChecks(reader, meta, report, found.add, lambda: _report(samples, report, found)).run()
    except Enough:
        report.complete = False
        if found.items and found.items[0].kind == "structure":
            report.notes.append("content checks skipped: the LMDB file structure is damaged")
    finally:
        if rest is not None:
            rest.close()
        if own:
            reader.close()
    report.problems = found.items
    report.ok = not found.items
    return report


def _at_rest(path: Path, report: VerifyReport, structure: bool) -> AtRest | None:
    """The data file held at rest (:class:`AtRest`), or ``None`` (noted when a walk was asked for) while a writer
    is appending or ``writer.lock`` cannot be opened."""
    try:
        return AtRest(path)
    except LmdbStoreError as exc:
        if structure:
            report.notes.append(f"structure check skipped: {exc.message}")
        return None


def _rest_pass(
    rest: AtRest, report: VerifyReport, found: Collector, opts: ValueOptions, structure: bool
) -> SamplesFindings | str | None:
    """The page walk (``structure``, where py-lmdb has one) and the value pass on the file at rest; structure
    problems are added to ``found`` and end the checks (:class:`Enough`) before liblmdb opens the file."""
    walk = structure
    if structure:
        try:
            from lmdb import verify as _  # noqa: F401  # py-lmdb >= 3.0
        except ImportError:
            report.notes.append("structure check skipped: this py-lmdb has no lmdb.verify (py-lmdb >= 3.0)")
            walk = False
    try:
        errors, samples = rest.check(opts, walk)
    except LmdbStoreError:
        rest.check_unchanged()  # a copy over the file explains it: said so instead
        raise
    rest.check_unchanged()
    report.structure_checked = walk
    for msg in errors:
        found.add("structure", None, msg)
    if errors:
        raise Enough  # liblmdb may crash on a damaged B-tree: do not open the store with it
    return samples


def _snapshot_pass(reader: StoreReader, opts: ValueOptions) -> SamplesFindings | str:
    """The value pass over ``reader``'s snapshot (protected by its read transaction meanwhile), or why its
    ``samples`` tree cannot be read.

    Raises:
        LmdbStoreError: a writer overwrote the snapshot meanwhile (a lock-free reader), or a worker failed.
    """
    h = reader._take()
    try:
        try:
            if h.snapshot.meta is None:
                raise UnsupportedLayout("lmdbstore's page parser does not know this data file's layout")
            values = value_table(h.fd, h.snapshot.meta, reader.path)
            out: SamplesFindings | str = check_values(values, h.meta, h.fd, reader.path / DATA_FILE, opts)
        except (CorruptStoreError, UnsupportedLayout) as exc:
            out = unreadable(exc)
        if not h.protected():
            raise LmdbStoreError(
                "a writer overwrote the snapshot while verify read it", path=reader.path, hint="run verify again"
            )
        return out
    finally:
        reader._give(h)


def _report(samples: SamplesFindings, report: VerifyReport, found: Collector) -> None:
    """The value pass's problems, in key order, and its counters (up to the last problem reported when they
    reach ``max_problems``)."""
    problems = samples.first(found.limit - len(found.items))
    full = len(found.items) + len(problems) >= found.limit
    upto = problems[-1][0] if full and problems else None
    report.values_checked, report.samples_checked, report.checksums_checked = samples.counts(upto)
    if not samples.complete:
        report.complete = False
    for index, kind in problems:
        found.add(kind, index, samples.message(index, kind))


def _check_opens(path: Path) -> None:
    """Raise what opening would (missing, not a store, truncated data file) before the page walk,
    so those stay errors rather than structure problems.  Reads only LMDB's meta pages."""
    check_store_dir(path)
    ENVS.acquire(path, writable=False, lock=False, opener=lambda: open_env(path, readonly=True, lock=False)).release()
