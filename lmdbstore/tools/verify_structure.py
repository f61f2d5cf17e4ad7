"""``verify``'s page-structure check, and the value pass that overlaps it while the file is at rest.

The structure check is py-lmdb's offline page walker (``lmdb.verify``): it reads the file with plain ``read()``
calls and never hands it to liblmdb, so a damaged file cannot crash the process.  It needs the file at rest:
a shared lock on ``writer.lock`` (:func:`~lmdbstore.store.locks.hold_off_writers`) keeps a writer from
starting, and no check runs when a writer holds the store.

The walker reads the first page of every value's overflow run, one at a time: alone on a cold store it is
slower than reading the whole file in sequence.  So where the value pass uses worker processes or the store is
large, the walk runs at the same time in a process of its own (a :class:`~lmdbstore.util.workers.Worker`), just behind the
workers that bring those pages into the page cache.  Both read only through bounds-checked ``pread``\\s, so
neither needs the other's verdict first; the value pass reads the snapshot of the newest meta page and its
metadata record through lmdbstore's own page parser (:mod:`lmdbstore.format.btree`), not liblmdb.  The lock
is held until the caller has begun its read transaction (``release_lock(fd)`` then), so the snapshot liblmdb
shows the later checks is the one the pass read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.format import layout
from lmdbstore.format.btree import BTreeValues, record_position
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import LmdbMeta, PageReader, UnsupportedLayout, read_meta_page
from lmdbstore.store.env import DATA_FILE, check_count_fits
from lmdbstore.store.locks import hold_off_writers, release_lock
from lmdbstore.tools.verify_findings import SamplesFindings
from lmdbstore.tools.verify_values import ValueOptions, check_values, resolve_workers, value_table
from lmdbstore.util.workers import Worker, WorkerDied, stop

if TYPE_CHECKING:  # the report type only; verify.py imports this module
    from lmdbstore.tools.verify import VerifyReport

__all__ = ["BACKGROUND_WALK_BYTES", "AtRest", "at_rest", "structure_and_values", "walk_pages"]

#: Data files from this size on are walked in a process of their own while the values are read (the walk of a
#: cold 256 MiB file alone takes about half a second; starting the process, a few tenths).
BACKGROUND_WALK_BYTES = 256 << 20


@dataclass(frozen=True)
class AtRest:
    """The newest snapshot of a data file at rest, read without liblmdb: its meta page, metadata and values."""

    snap: LmdbMeta
    meta: StoreMeta
    values: BTreeValues


def walk_pages(data_path: str) -> list[str]:
    """py-lmdb's offline page walk of ``data_path``: one message per problem found (none: intact)."""
    from lmdb import verify as lmdb_verify

    try:
        return [str(m) for m in lmdb_verify.verify(data_path, subdir=False)]
    except lmdb_verify.VerifyError as exc:
        return [str(exc)]


def at_rest(path: Path, fd: int) -> AtRest | None:
    """The newest snapshot of the store's data file ``fd`` (the meta page LMDB would pick), its metadata record
    and the values of its ``samples`` tree, all read with lmdbstore's own parser; ``None`` where any of it
    cannot be read (the ordinary open then reports why, or the cursor walk checks the values)."""
    try:
        size = os.fstat(fd).st_size
        snap = max((read_meta_page(fd, size, which, path) for which in (0, 1)), key=lambda m: m.txnid)
        off, n = record_position(PageReader(fd, size, snap, path, None), snap.main, layout.DB_META, layout.META_KEY)
        raw = os.pread(fd, n, off)
        meta = StoreMeta.from_json(raw, path=str(path))
        check_count_fits(meta, path)
    except (LmdbStoreError, UnsupportedLayout, OSError, ValueError):
        return None
    values = value_table(fd, snap, path)
    return None if values is None else AtRest(snap, meta, values)


def structure_and_values(
    path: Path, report: VerifyReport, add: Callable[[str, int | None, str], None], opts: ValueOptions
) -> tuple[int, AtRest | None, SamplesFindings | None]:
    """Walk the page structure and, meanwhile, check the values, while no writer can start.

    Returns ``(lock, at_rest, findings)``: the shared lock, still held (``-1``: none; the caller releases it
    once its read transaction has begun), the snapshot the value pass read and what it found (``None`` where
    the walk was skipped or the values could not be read without liblmdb).  Structure problems go through
    ``add`` (which may raise to stop; the lock is released then); a skipped walk is noted in ``report.notes``.

    Raises:
        CorruptStoreError, LmdbStoreError: the value pass failed (a data file replaced or truncated meanwhile,
            a worker process died) and the walk found the structure intact.
    """
    try:
        from lmdb import verify as _  # noqa: F401  # py-lmdb >= 3.0
    except ImportError:
        report.notes.append("structure check skipped: this py-lmdb has no lmdb.verify (py-lmdb >= 3.0)")
        return -1, None, None
    try:
        lock = hold_off_writers(path)  # a shared lock: no writer may start mid-walk
    except LmdbStoreError as exc:  # a writer is appending, or the lock file cannot be opened
        report.notes.append(f"structure check skipped: {exc.message}")
        return -1, None, None
    try:
        data = path / DATA_FILE
        with _open(data) as fd:
            rest = at_rest(path, fd)
            errors, findings = _walk_and_check(str(data), fd, rest, opts)
        report.structure_checked = True
        for msg in errors:
            add("structure", None, msg)
    except BaseException:
        release_lock(lock)
        raise
    return lock, rest, findings


@contextlib.contextmanager
def _open(data: Path) -> Iterator[int]:
    fd = os.open(data, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _walk_and_check(
    data: str, fd: int, rest: AtRest | None, opts: ValueOptions
) -> tuple[list[str], SamplesFindings | None]:
    """The walk's messages and the value pass's findings: where the pass runs in worker processes or the data
    file has :data:`BACKGROUND_WALK_BYTES` or more, the walk in a process of its own meanwhile; otherwise
    (a small store, where starting a process costs more than it saves) the walk first, in this process."""
    if rest is None:
        return walk_pages(data), None
    check = int(rest.values.sizes.sum()) if opts.checksums else 0
    if resolve_workers(opts.workers, check) <= 1 and os.fstat(fd).st_size < BACKGROUND_WALK_BYTES:
        errors = walk_pages(data)
        return errors, None if errors else _check(data, fd, rest, opts)
    walker = Worker(walk_pages, "spawn", "verify's structure-check process", main=False)
    try:
        walker.send(data)
        try:
            findings = _check(data, fd, rest, opts)
        except CorruptStoreError:
            errors = _walk_result(walker)  # a damaged structure explains it: the walk's verdict first
            if errors:
                return errors, None
            raise
        return _walk_result(walker), findings
    finally:
        stop([walker], 0)


def _check(data: str, fd: int, rest: AtRest, opts: ValueOptions) -> SamplesFindings:
    return check_values(rest.values, rest.meta, Path(data), fd, opts)


def _walk_result(walker: Worker) -> list[str]:
    """The background walk's messages; its process dying or failing is a one-line error."""
    try:
        return list(walker.receive())
    except WorkerDied as exc:
        raise LmdbStoreError(
            f"verify's structure-check process died (exit code {exc.exitcode})",
            hint="out of memory, or killed? run verify again",
        ) from None
    except Exception as exc:
        raise LmdbStoreError(f"verify's structure check failed: {type(exc).__name__}: {exc}") from None
