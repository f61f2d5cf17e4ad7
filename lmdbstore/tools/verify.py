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
appends checks one consistent snapshot.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.layout import DB_CLASSIDX, DB_LABELS, DB_META, DB_PROGRESS, DB_SAMPLES, INDEX_DTYPE, META_KEY
from lmdbstore.format.ledger import parse_entry
from lmdbstore.format.meta import StoreMeta
from lmdbstore.store.env import DATA_FILE, ENVS, WRITER_LOCK_FILE, check_store_dir, lock_table_writable, open_env
from lmdbstore.store.reader import StoreReader

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

_KNOWN_DBS = (DB_SAMPLES, DB_LABELS, DB_CLASSIDX, DB_META, DB_PROGRESS)
_PROGRESS_EVERY = 1 << 16  # call ``progress`` about every this many samples


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


class _Collector:
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
    checksums: bool = True,
    max_problems: int = 20,
    progress: Callable[[int], None] | None = None,
    structure: bool = True,
) -> VerifyReport:
    """Check a store's contents against its metadata; see the module docstring for the checks.

    Args:
        path: the store directory, or an open :class:`StoreReader` whose snapshot is checked (it is
            left open; useful where the process already has the store open, as LMDB forbids opening
            it twice in one process).
        checksums: recompute every value's checksum (when the store has them).
        max_problems: stop after this many problems.
        progress: called with the number of samples checked so far, about every 65,536 samples.
        structure: also run the page-level LMDB check first (when ``lmdb.verify`` exists and no
            writer holds the store).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is ``False`` when anything is wrong.

    Raises:
        ValueError: ``max_problems`` is not positive.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: the store cannot be
            opened at all (see the module docstring).
    """
    if max_problems < 1:
        raise ValueError(f"max_problems must be positive, got {max_problems}")
    own = not isinstance(path, StoreReader)
    if own:
        # A registered snapshot where LMDB's reader table can be written; a read-only store is read
        # lock-free unless a writer is active (see :func:`lmdbstore.store.env.resolve_lock`).
        p = Path(path)  # type: ignore[arg-type]
        reader = StoreReader(p, lock=True if lock_table_writable(p) else None)
    else:
        reader = path  # type: ignore[assignment]
    assert isinstance(reader, StoreReader)
    report = VerifyReport(path=str(reader.path))
    found = _Collector(max_problems)
    try:
        if structure and own:
            _check_opens(reader.path)
            _check_structure(reader.path, report, found)
        elif structure:
            report.notes.append("structure check skipped: the store was passed as an open reader")
        if found.items:  # liblmdb may crash on a damaged B-tree: do not open the store with it
            raise _Enough
        meta = reader.meta  # open errors propagate from here
        report.count = meta.count
        _Checker(reader, meta, report, found, checksums, progress).run()
    except _Enough:
        report.complete = False
        if found.items and found.items[0].kind == "structure":
            report.notes.append("content checks skipped: the LMDB file structure is damaged")
    finally:
        if own:
            reader.close()
    report.problems = found.items
    report.ok = not found.items
    return report


def _check_opens(path: Path) -> None:
    """Raise what opening would (missing, not a store, truncated data file) before the page walk,
    so those stay errors rather than structure problems.  Reads only LMDB's meta pages."""
    check_store_dir(path)
    ENVS.acquire(path, writable=False, lock=False, opener=lambda: open_env(path, readonly=True, lock=False)).release()


def _check_structure(path: Path, report: VerifyReport, found: _Collector) -> None:
    """Run py-lmdb's offline page walker over ``data.mdb`` while no writer can start."""
    try:
        from lmdb import verify as lmdb_verify
    except ImportError:
        report.notes.append("structure check skipped: this py-lmdb has no lmdb.verify (py-lmdb >= 3.0)")
        return
    try:
        fd = os.open(path / WRITER_LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1
    except OSError as exc:
        report.notes.append(f"structure check skipped: cannot open {WRITER_LOCK_FILE} ({exc.strerror})")
        return
    try:
        if fd >= 0:
            try:
                # A shared lock keeps a writer from starting mid-walk; the walk needs the file at rest.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                report.notes.append("structure check skipped: a writer is appending to the store")
                return
        try:
            errors = lmdb_verify.verify(str(path / DATA_FILE), subdir=False)
        except lmdb_verify.VerifyError as exc:
            errors = [str(exc)]
        report.structure_checked = True
        for msg in errors:
            found.add("structure", None, str(msg))
    finally:
        if fd >= 0:
            os.close(fd)  # releases the shared lock


class _Checker:
    """The content checks over one read snapshot; problems go to ``found``."""

    def __init__(
        self,
        reader: StoreReader,
        meta: StoreMeta,
        report: VerifyReport,
        found: _Collector,
        checksums: bool,
        progress: Callable[[int], None] | None,
    ):
        self.reader = reader
        self.meta = meta
        self.report = report
        self.found = found
        self.checksum = compute_checksum(meta.checksum) if checksums else None
        self.progress = progress

    def run(self) -> None:
        try:
            self.check_main_db()
            self.check_samples()
            labels = self.check_labels()
            self.check_class_index(labels)
            self.check_meta_db()
            self.check_progress()
            self.check_stats()
        except CorruptStoreError as exc:  # LMDB itself reported corruption mid-scan
            self.found.add("scan", None, str(exc))
            self.report.complete = False

    def _items(self, db_name: bytes | None) -> Iterator[tuple[bytes, bytes | memoryview]]:
        if db_name is None:  # the main database, which lists the sub-databases
            h = self.reader._handle()
            for k, v in h.txn.cursor():
                yield bytes(k), v
        else:
            yield from self.reader.iter_raw(db_name)

    # ------------------------------------------------------------------ main db, meta db
    def check_main_db(self) -> None:
        for key, _ in self._items(None):
            if key not in _KNOWN_DBS:
                self.found.add("extra-db", None, f"unknown entry {key!r} in the main database")

    def check_meta_db(self) -> None:
        for key, _ in self._items(DB_META):
            if key != META_KEY:
                self.found.add("extra-meta-key", None, f"unknown key {key!r} in the metadata sub-database")

    # ------------------------------------------------------------------ samples
    def check_samples(self) -> None:
        m, rep = self.meta, self.report
        spv, count, trailer = m.samples_per_value, m.count, m.trailer_bytes
        expected = 0  # key of the next value we expect
        next_report = _PROGRESS_EVERY
        for key, value in self._items(DB_SAMPLES):
            first = self._decode(key, "samples")
            if first is None:
                continue
            while expected < min(first, count):
                self.found.add("missing-value", expected, f"value of samples {expected}.. is missing")
                expected += spv
            if first != expected or first >= count:
                why = "beyond the count" if first >= count else f"not a multiple of samples_per_value {spv}"
                self.found.add("extra-value", first, f"unexpected sample value ({why}; count {count})")
                continue
            expected += spv
            n = min(spv, count - first)
            want = m.expected_value_len(first)
            rep.values_checked += 1
            rep.samples_checked += n
            if len(value) != want:
                self.found.add("value-length", first, f"value has {len(value)} bytes, expected {want}")
            elif self.checksum is not None and trailer:
                rep.checksums_checked += 1
                if self.checksum(value[: want - trailer]) != bytes(value[want - trailer :]):
                    self.found.add("checksum", first, f"{m.checksum} mismatch in the value of samples {first}..")
            if self.progress is not None and rep.samples_checked >= next_report:
                self.progress(rep.samples_checked)
                next_report = rep.samples_checked + _PROGRESS_EVERY
        while expected < count:
            self.found.add("missing-value", expected, f"value of samples {expected}.. is missing")
            expected += spv
        if self.progress is not None:
            self.progress(rep.samples_checked)

    def _decode(self, key: bytes, db: str) -> int | None:
        if len(key) != 8:
            self.found.add("bad-key", None, f"{db} key {key.hex()} has {len(key)} bytes, expected 8")
            return None
        return int.from_bytes(key, "big")

    # ------------------------------------------------------------------ labels
    def check_labels(self) -> np.ndarray:
        """Check the label chunks and return the label table (missing chunks filled with an
        impossible class id where the dtype allows, so the class-index check flags them too)."""
        m, rep = self.meta, self.report
        chunk, count, n_classes, ldt = m.label_chunk, m.count, len(m.classes), m.label_dtype
        labels = np.full(count, np.iinfo(ldt).max, ldt)
        expected = 0
        for key, value in self._items(DB_LABELS):
            first = self._decode(key, "labels")
            if first is None:
                continue
            while expected < min(first, count):
                self.found.add("missing-label-chunk", expected, f"label chunk of samples {expected}.. is missing")
                expected += chunk
            if first != expected or first >= count:
                self.found.add(
                    "extra-label-chunk", first, f"unexpected label chunk (label_chunk {chunk}, count {count})"
                )
                continue
            expected += chunk
            n = min(chunk, count - first)
            if len(value) != n * ldt.itemsize:
                self.found.add(
                    "label-chunk-length", first, f"label chunk has {len(value)} bytes, expected {n * ldt.itemsize}"
                )
                continue
            part = np.frombuffer(value, ldt)
            labels[first : first + n] = part
            rep.label_chunks_checked += 1
            rep.labels_checked += n
            bad = np.flatnonzero(part >= n_classes)
            if bad.size:
                i = first + int(bad[0])
                self.found.add("label-range", i, f"label {int(part[bad[0]])} is not a class id (0..{n_classes - 1})")
        while expected < count:
            self.found.add("missing-label-chunk", expected, f"label chunk of samples {expected}.. is missing")
            expected += chunk
        per_class = np.bincount(labels[labels < n_classes], minlength=n_classes)
        for c, (have, want) in enumerate(zip(per_class.tolist(), m.class_counts, strict=True)):
            if have != want:
                self.found.add(
                    "class-count", None, f"class {m.classes[c]!r} has {have} labels but meta.class_counts says {want}"
                )
        return labels

    # ------------------------------------------------------------------ class index
    def check_class_index(self, labels: np.ndarray) -> None:
        """Walk the class-index chunks in key order (class by class), comparing each with the labels."""
        n_classes = len(self.meta.classes)
        next_pos = [0] * n_classes
        current = 0  # classes below this one are finished
        positions = _ClassPositions(labels, 0)
        for key, value in self._items(DB_CLASSIDX):
            if len(key) != 10:
                self.found.add("bad-key", None, f"classidx key {key.hex()} has {len(key)} bytes, expected 10")
                continue
            c, pos = int.from_bytes(key[:2], "big"), int.from_bytes(key[2:], "big")
            while current < min(c, n_classes):
                self._finish_class(current, positions, next_pos)
                current += 1
                positions = _ClassPositions(labels, current)
            if c >= n_classes:
                self.found.add("extra-classidx-chunk", pos, f"class-index chunk of unknown class id {c}")
                continue
            self._class_chunk(c, pos, value, positions, next_pos)
        while current < n_classes:
            self._finish_class(current, positions, next_pos)
            current += 1
            positions = _ClassPositions(labels, current)

    def _finish_class(self, c: int, positions: _ClassPositions, next_pos: list[int]) -> None:
        self._missing_class_chunks(c, self.meta.class_counts[c], next_pos)
        self._class_tail(c, positions)

    def _class_chunk(
        self, c: int, pos: int, value: bytes | memoryview, positions: _ClassPositions, next_pos: list[int]
    ) -> None:
        m = self.meta
        chunk, n_c, name = m.label_chunk, m.class_counts[c], m.classes[c]
        self._missing_class_chunks(c, min(pos, n_c), next_pos)
        if pos != next_pos[c] or pos >= n_c:
            self.found.add(
                "extra-classidx-chunk", pos, f"unexpected chunk of class {name!r} (class_counts says {n_c} entries)"
            )
            return
        next_pos[c] += chunk
        n = min(chunk, n_c - pos)
        if len(value) != n * INDEX_DTYPE.itemsize:
            self.found.add(
                "classidx-length",
                pos,
                f"chunk of class {name!r} at list position {pos} has {len(value)} bytes, expected {n * INDEX_DTYPE.itemsize}",
            )
            positions.skip_to(pos + n)
            return
        got = np.frombuffer(value, INDEX_DTYPE)
        want = positions.take(pos, n)
        self.report.class_index_entries_checked += n
        if len(want) < n or not np.array_equal(got, want):
            j = _first_difference(got, want)
            have_j = int(got[j])
            want_j = f"sample {int(want[j])}" if j < len(want) else "no further sample of this class"
            self.found.add(
                "classidx-mismatch",
                have_j,
                f"class {name!r} index list position {pos + j} holds sample {have_j}, labels give {want_j}",
            )

    def _missing_class_chunks(self, c: int, upto: int, next_pos: list[int]) -> None:
        while next_pos[c] < upto:
            self.found.add(
                "missing-classidx-chunk",
                next_pos[c],
                f"chunk of class {self.meta.classes[c]!r} at list position {next_pos[c]} is missing",
            )
            next_pos[c] += self.meta.label_chunk

    def _class_tail(self, c: int, positions: _ClassPositions) -> None:
        """Samples labelled ``c`` beyond what the class's (shorter) index list covers."""
        extra = positions.take(positions.consumed, 1)
        if len(extra) and self.meta.class_counts[c] == positions.consumed:
            i = int(extra[0])
            self.found.add(
                "classidx-mismatch", i, f"sample {i} is labelled {self.meta.classes[c]!r} but not in that class's list"
            )

    # ------------------------------------------------------------------ ledger, stats
    def check_progress(self) -> None:
        for key, value in self._items(DB_PROGRESS):
            self.report.progress_entries_checked += 1
            try:
                parse_entry(value, self.reader.path, repr(key))
            except CorruptStoreError:
                self.found.add("progress", None, f"resume-ledger entry {key!r} is not valid JSON with a 'done' count")

    def check_stats(self) -> None:
        m = self.meta
        vs = m.value_stats
        want = m.count * int(np.prod(m.shape))
        if vs.n + vs.nonfinite != want:
            self.found.add(
                "stats",
                None,
                f"value statistics cover {vs.n + vs.nonfinite} values, expected {want} ({m.count} samples)",
            )


class _ClassPositions:
    """The ascending positions of label ``c`` in ``labels``, produced window by window on demand.

    ``take(pos, n)`` returns entries ``pos..pos+n-1`` of ``np.flatnonzero(labels == c)`` while holding
    at most one window's worth of positions, so checking every class costs one pass over the label
    table per class and no memory proportional to the store.
    """

    WINDOW = 1 << 20

    def __init__(self, labels: np.ndarray, c: int):
        self.labels = labels
        self.c = c
        self.scan = 0  # labels scanned so far
        self.buf = np.zeros(0, INDEX_DTYPE)
        self.consumed = 0  # list position of buf[0]

    def _fill(self, need: int) -> None:
        parts = [self.buf]
        have = len(self.buf)
        while have < need and self.scan < len(self.labels):
            hi = min(self.scan + self.WINDOW, len(self.labels))
            found = np.flatnonzero(self.labels[self.scan : hi] == self.c).astype(INDEX_DTYPE) + np.uint64(self.scan)
            parts.append(found)
            have += len(found)
            self.scan = hi
        self.buf = np.concatenate(parts) if len(parts) > 1 else self.buf

    def skip_to(self, pos: int) -> None:
        self.take(pos, 0)

    def take(self, pos: int, n: int) -> np.ndarray:
        if pos > self.consumed:
            self._fill(pos - self.consumed)
            drop = min(pos - self.consumed, len(self.buf))
            self.buf = self.buf[drop:]
            self.consumed += drop
            if self.consumed < pos:  # fewer positions than pos: nothing to give
                return self.buf[:0]
        self._fill(n)
        out = self.buf[:n].copy()
        self.buf = self.buf[n:]
        self.consumed += len(out)
        return out


def _first_difference(got: np.ndarray, want: np.ndarray) -> int:
    """Index of the first entry where ``got`` and ``want`` differ (``want`` may be shorter)."""
    n = min(len(got), len(want))
    diff = np.flatnonzero(got[:n] != want[:n])
    return int(diff[0]) if diff.size else n
