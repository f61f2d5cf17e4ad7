"""Check that a store's contents agree with its metadata (``lmdbstore verify``): one route, on the file opened
(what it checks, and the guarantees: docs/reliability.md#checksums-and-lmdbstore-verify).

:func:`verify_store` reports what it finds as a list of :class:`Problem`\\ s (kind, sample index, one-line
message), stopping after ``max_problems``:

* ``structure``: py-lmdb's offline page walk (``lmdb.verify``, which never hands the file to liblmdb), when no
  writer holds the store; damage found there skips the content checks (liblmdb may crash on a damaged B-tree).
  A ``samples`` B-tree lmdbstore's own page parser cannot read is a ``structure`` problem too.
* ``samples``: the value pass of :mod:`lmdbstore.tools.verify_values`, on every core.
* ``labels``, ``classidx``, ``meta``/``progress``/main database, statistics: through liblmdb, against the
  metadata (:mod:`lmdbstore.tools.verify_checks`, which also defines the report).

**On the file opened.**  Where no writer is active verify holds writers off and opens the data file once
(:class:`AtRest`): the page walk and the value pass read that descriptor, liblmdb must then show the same file and
commit, and a file replaced meanwhile is a :class:`~lmdbstore.errors.StoreReplacedError`, never a report on another
file.  Beside a writer, or given an open reader, the value pass reads the reader's registered snapshot (no walk).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmdbstore.config import (
    DEFAULT_MAX_PROBLEMS,
    DEFAULT_VERIFY_CHECKSUMS,
    DEFAULT_VERIFY_STRUCTURE,
    DEFAULT_VERIFY_WORKERS,
)
from lmdbstore.errors import CorruptStoreError, LmdbStoreError, StoreReplacedError
from lmdbstore.format import layout
from lmdbstore.format.btree import record_position
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import LmdbMeta, PageReader, UnsupportedLayout, read_meta_page
from lmdbstore.store.env import DATA_FILE, check_count_fits, check_store_dir, open_env
from lmdbstore.store.locks import hold_off_writers, lock_table_writable, release_lock
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.registry import ENVS
from lmdbstore.tools.verify_checks import PROBLEM_KINDS, Collector, ContentChecks, Enough, Problem, VerifyReport
from lmdbstore.tools.verify_values import SamplesFindings, ValueOptions, check_values, resolve_workers, value_table
from lmdbstore.util.workers import PassedFd, WorkerDied, Workers

__all__ = ["BACKGROUND_WALK_BYTES", "PROBLEM_KINDS", "AtRest", "Problem", "VerifyReport", "verify_store"]

#: Data files from this size on are walked in a process of their own while the values are read (the walk of a
#: cold 256 MiB file alone takes about half a second; starting the process, a few tenths).
BACKGROUND_WALK_BYTES = 256 << 20


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
        path: the store directory, or an open :class:`StoreReader` whose snapshot is checked (left open: LMDB
            forbids opening a store twice in one process).
        checksums: recompute every value's checksum (when the store has them).
        max_problems: stop after this many problems.
        progress: called with the number of samples checked so far, after each chunk of values read.
        structure: also run the page-level LMDB check first (when ``lmdb.verify`` exists and no writer holds
            the store).
        workers: processes that read the values and compute their checksums (the report is the same for any
            number); ``None`` (default): the cores, but one per 512 MiB of values at most.
        total: called once, before the first ``progress`` call, with the samples the store holds.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is ``False`` when anything is wrong.

    Raises:
        ValueError: ``max_problems`` is not positive, or ``workers`` below 1.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: the store cannot be opened at
            all (so callers can tell "damaged contents" from "cannot be read at all").
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
    opts = ValueOptions(checksums, workers, max_problems, progress, total)
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
    with reader.held() as h:
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


def walk_pages(fd: PassedFd, path: str) -> list[str]:
    """py-lmdb's offline page walk of the data file open as ``fd`` (``path`` where ``/proc`` is not there): one
    message per problem found (none: intact)."""
    from lmdb import verify as lmdb_verify

    own = f"/proc/self/fd/{fd.fd}"  # the file this process holds, whatever the path names now
    try:
        return [str(m) for m in lmdb_verify.verify(own if os.path.exists(own) else path, subdir=False)]
    except lmdb_verify.VerifyError as exc:
        return [str(exc)]


def unreadable(exc: Exception) -> str:
    """The ``structure`` problem of a ``samples`` tree the page parser cannot read."""
    return f"the samples B-tree cannot be read: {exc.message if isinstance(exc, LmdbStoreError) else exc}"


class AtRest:
    """The data file of the store at ``path``, opened once while no writer can start (see the module docstring);
    ``snap``, ``meta``: its newest snapshot and metadata record, read with lmdbstore's own parser (``None`` where
    they cannot be: the ordinary open then reports why).

    Raises:
        StoreLockedError: a writer is appending to the store.
        LmdbStoreError: ``writer.lock`` exists but cannot be opened.
    """

    def __init__(self, path: Path):
        self.path, self.data = path, path / DATA_FILE
        self.lock = hold_off_writers(path)
        try:
            self.fd = os.open(self.data, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            release_lock(self.lock)
            raise
        self.stat = os.fstat(self.fd)
        self.snap: LmdbMeta | None = None
        self.meta: StoreMeta | None = None
        try:
            size = self.stat.st_size
            snap = max((read_meta_page(self.fd, size, which, path) for which in (0, 1)), key=lambda m: m.txnid)
            pages = PageReader(self.fd, size, snap, path, None)
            off, n = record_position(pages, snap.main, layout.DB_META, layout.META_KEY)
            meta = StoreMeta.from_json(os.pread(self.fd, n, off), path=str(path))
            check_count_fits(meta, path)
            self.snap, self.meta = snap, meta
        except (LmdbStoreError, UnsupportedLayout, OSError, ValueError):
            pass

    def check(self, opts: ValueOptions, walk: bool) -> tuple[list[str], SamplesFindings | str | None]:
        """Walk the page structure (``walk``) and, meanwhile, check the values: the walk's messages, and what the
        value pass found (a string: why the ``samples`` tree cannot be read; ``None``: no snapshot to read, or the
        walk found damage first).

        Raises:
            CorruptStoreError, LmdbStoreError: the value pass failed (the data file truncated meanwhile, a worker
                process died) and the walk found the structure intact.
        """
        here = functools.partial(walk_pages, PassedFd(self.fd), str(self.data))
        if self.snap is None or self.meta is None:
            return (here() if walk else []), None
        try:
            values = value_table(self.fd, self.snap, self.path)
        except (CorruptStoreError, UnsupportedLayout) as exc:
            return (here() if walk else []), unreadable(exc)
        values_check = functools.partial(check_values, values, self.meta, self.fd, self.data, opts)
        if not walk:
            return [], values_check()
        check_bytes = int(values.sizes.sum()) if opts.checksums else 0
        if resolve_workers(opts.workers, check_bytes) <= 1 and self.stat.st_size < BACKGROUND_WALK_BYTES:
            errors = here()  # a small store: the walk first, in this process (a process would cost more)
            return errors, None if errors else values_check()
        name = "verify's structure-check process"
        walker = Workers(functools.partial(walk_pages, PassedFd(self.fd)), 1, "spawn", name, main=False)
        try:
            walker.send(str(self.data))
            try:
                findings = values_check()
            except CorruptStoreError:
                errors = _walk_result(walker)  # a damaged structure explains it: the walk's verdict first
                if errors:
                    return errors, None
                raise
            return _walk_result(walker), findings
        finally:
            walker.close(0)

    def replaced(self) -> StoreReplacedError:
        return StoreReplacedError(
            "the data file was replaced while it was verified", path=self.path, hint="run verify again"
        )

    def check_unchanged(self) -> None:
        """Raise :meth:`replaced` where the file was written to since it was opened (no writer could: a copy over
        it) or the path names another file now."""
        now = os.fstat(self.fd)
        try:
            named = os.stat(self.data)
        except OSError:
            raise self.replaced() from None
        when = (self.stat.st_size, self.stat.st_mtime_ns, self.stat.st_ctime_ns)
        if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != when or _file_id(named) != _file_id(self.stat):
            raise self.replaced()

    def check_same(self, reader: StoreReader) -> None:
        """Raise :meth:`replaced` where ``reader`` (opened since) shows another file or snapshot than the checks."""
        with reader.held() as h:
            same = h.file_id == _file_id(self.stat) and (
                self.snap is None or (h.snapshot.txnid == self.snap.txnid and h.meta == self.meta)
            )
        if not same:
            raise self.replaced()

    def close(self) -> None:
        """Let writers start again (once liblmdb's snapshot is taken) and close the descriptor; idempotent."""
        release_lock(self.lock)
        self.lock = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _file_id(st: Any) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _walk_result(walker: Workers) -> list[str]:
    """The background walk's messages; its process dying or failing is a one-line error."""
    try:
        return list(walker.answer())
    except WorkerDied as exc:
        raise LmdbStoreError(exc.message, hint="out of memory, or killed? run verify again") from None
    except Exception as exc:
        raise LmdbStoreError(f"verify's structure check failed: {type(exc).__name__}: {exc}") from None
