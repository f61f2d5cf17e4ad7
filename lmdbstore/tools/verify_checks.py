"""What ``lmdbstore verify`` reports (:class:`Problem`, :class:`VerifyReport`, :data:`PROBLEM_KINDS`), and its
content checks (:class:`ContentChecks`): every sub-database but ``samples`` walked once through liblmdb, against
the metadata, each problem reported through a callback.  Memory stays bounded by the label table: the class-index
lists are compared chunk by chunk (:class:`ClassPositions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format import layout
from lmdbstore.format.ledger import parse_entry
from lmdbstore.format.meta import StoreMeta
from lmdbstore.store.reader import StoreReader

__all__ = ["PROBLEM_KINDS", "AddProblem", "ClassPositions", "Collector", "ContentChecks", "Problem", "VerifyReport"]

#: How a check reports a problem: ``add(kind, index, message)``.
AddProblem = Callable[[str, int | None, str], None]

#: Every ``Problem.kind`` verify can report, with what it means.
PROBLEM_KINDS: dict[str, str] = {
    "structure": "the LMDB file's page structure is damaged (lmdb.verify), or a B-tree lmdbstore cannot read",
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

    def __str__(self) -> str:
        where = f" at {self.index}" if self.index is not None else ""
        return f"{self.kind}{where}: {self.message}"


@dataclass
class VerifyReport:
    """What :func:`~lmdbstore.tools.verify.verify_store` checked and found: ``ok`` (no problem), the first
    ``max_problems`` problems in the order found, whether every check ran to the end (``complete``: not after a
    stop at ``max_problems``, nor when damage to the structure skipped the content checks), the metadata's
    ``count``, whether the page-level check ran, ``notes`` on checks skipped, and the ``*_checked`` counters
    (after a stop at ``max_problems``: up to the last problem reported)."""

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
        return asdict(self)


class Enough(Exception):
    """Raised by :class:`Collector` once ``max_problems`` problems are collected."""


class Collector:
    """The problems found so far; raises :class:`Enough` when the ``limit``-th is added."""

    def __init__(self, limit: int):
        self.items: list[Problem] = []
        self.limit = limit

    def add(self, kind: str, index: int | None, message: str) -> None:
        self.items.append(Problem(kind, index, message))
        if len(self.items) >= self.limit:
            raise Enough


class ContentChecks:
    """The content checks of ``verify`` over ``reader``'s current snapshot, against ``meta``: they advance
    ``report``'s counters and call ``add(kind, index, message)`` for each problem (it may raise to stop them);
    ``samples()`` reports the value pass's findings, in their place after the main database's check."""

    def __init__(
        self, reader: StoreReader, meta: StoreMeta, report: VerifyReport, add: AddProblem, samples: Callable[[], None]
    ):
        self.reader, self.meta, self.report, self.add, self.samples = reader, meta, report, add, samples

    def run(self) -> None:
        """Run every check in order; LMDB reporting corruption mid-scan is a ``scan`` problem that ends them."""
        try:
            self.check_main_db()
            self.samples()
            labels = self.check_labels()
            self.check_class_index(labels)
            self.check_meta_db()
            self.check_progress()
            self.check_stats()
        except CorruptStoreError as exc:  # LMDB itself reported corruption mid-scan
            self.add("scan", None, str(exc))
            self.report.complete = False

    # ------------------------------------------------------------------ main db, meta db
    def check_main_db(self) -> None:
        """The main database names the store's sub-databases and nothing else."""
        for key, _ in self.reader.iter_raw(None):
            if key not in layout.ALL_DBS:
                self.add("extra-db", None, f"unknown entry {key!r} in the main database")

    def check_meta_db(self) -> None:
        """The metadata sub-database holds its one record and nothing else."""
        for key, _ in self.reader.iter_raw(layout.DB_META):
            if key != layout.META_KEY:
                self.add("extra-meta-key", None, f"unknown key {key!r} in the metadata sub-database")

    # ------------------------------------------------------------------ labels
    def _label_chunks(self) -> Iterator[tuple[int, memoryview]]:
        """The ``(first, chunk)`` entries of the labels sub-database keyed ``0, label_chunk, ... < count``, in key
        order; a key of the wrong width (``bad-key``), each chunk absent (``missing-label-chunk``) and each key off
        that grid or beyond the count (``extra-label-chunk``) are reported on the way, not yielded."""
        count, step, expected = self.meta.count, self.meta.label_chunk, 0
        for key, value in self.reader.iter_raw(layout.DB_LABELS):
            if len(key) != layout.KEY_BYTES:
                self.add("bad-key", None, f"labels key {key.hex()} has {len(key)} bytes, expected {layout.KEY_BYTES}")
                continue
            first = layout.decode_key(key)
            while expected < min(first, count):
                self.add("missing-label-chunk", expected, f"label chunk of samples {expected}.. is missing")
                expected += step
            if first != expected or first >= count:
                self.add("extra-label-chunk", first, f"unexpected label chunk (label_chunk {step}, count {count})")
                continue
            expected += step
            yield first, value
        while expected < count:
            self.add("missing-label-chunk", expected, f"label chunk of samples {expected}.. is missing")
            expected += step

    def check_labels(self) -> np.ndarray:
        """Check the label chunks and return the label table (missing chunks filled with an
        impossible class id where the dtype allows, so the class-index check flags them too)."""
        m, rep = self.meta, self.report
        chunk, count, n_classes, ldt = m.label_chunk, m.count, len(m.classes), m.label_dtype
        labels = np.full(count, np.iinfo(ldt).max, ldt)
        for first, value in self._label_chunks():
            n = min(chunk, count - first)
            if len(value) != n * ldt.itemsize:
                self.add(
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
                self.add("label-range", i, f"label {int(part[bad[0]])} is not a class id (0..{n_classes - 1})")
        per_class = np.bincount(labels[labels < n_classes], minlength=n_classes)
        for c, (have, want) in enumerate(zip(per_class.tolist(), m.class_counts, strict=True)):
            if have != want:
                self.add(
                    "class-count", None, f"class {m.classes[c]!r} has {have} labels but meta.class_counts says {want}"
                )
        return labels

    # ------------------------------------------------------------------ class index
    def check_class_index(self, labels: np.ndarray) -> None:
        """Walk the class-index chunks in key order (class by class), comparing each with the labels."""
        n_classes = len(self.meta.classes)
        next_pos = [0] * n_classes
        current = 0  # classes below this one are finished
        positions = ClassPositions(labels, 0)
        for key, value in self.reader.iter_raw(layout.DB_CLASSIDX):
            if len(key) != layout.CLASSIDX_KEY_BYTES:
                self.add(
                    "bad-key",
                    None,
                    f"classidx key {key.hex()} has {len(key)} bytes, expected {layout.CLASSIDX_KEY_BYTES}",
                )
                continue
            c, pos = layout.decode_classidx_key(key)
            while current < min(c, n_classes):
                self._finish_class(current, positions, next_pos)
                current += 1
                positions = ClassPositions(labels, current)
            if c >= n_classes:
                self.add("extra-classidx-chunk", pos, f"class-index chunk of unknown class id {c}")
                continue
            self._class_chunk(c, pos, value, positions, next_pos)
        while current < n_classes:
            self._finish_class(current, positions, next_pos)
            current += 1
            positions = ClassPositions(labels, current)

    def _finish_class(self, c: int, positions: ClassPositions, next_pos: list[int]) -> None:
        """After the last chunk of class ``c``: the chunks still missing, and labelled samples not listed."""
        self._missing_class_chunks(c, self.meta.class_counts[c], next_pos)
        self._class_tail(c, positions)

    def _class_chunk(
        self, c: int, pos: int, value: bytes | memoryview, positions: ClassPositions, next_pos: list[int]
    ) -> None:
        """One chunk of class ``c``'s index list, at list position ``pos``: placed, sized and equal to the labels."""
        m = self.meta
        chunk, n_c, name = m.label_chunk, m.class_counts[c], m.classes[c]
        self._missing_class_chunks(c, min(pos, n_c), next_pos)
        if pos != next_pos[c] or pos >= n_c:
            self.add(
                "extra-classidx-chunk", pos, f"unexpected chunk of class {name!r} (class_counts says {n_c} entries)"
            )
            return
        next_pos[c] += chunk
        n = min(chunk, n_c - pos)
        want_bytes = n * layout.INDEX_DTYPE.itemsize
        if len(value) != want_bytes:
            what = f"chunk of class {name!r} at list position {pos}"
            self.add("classidx-length", pos, f"{what} has {len(value)} bytes, expected {want_bytes}")
            positions.take(pos + n, 0)  # past this chunk's positions
            return
        got = np.frombuffer(value, layout.INDEX_DTYPE)
        want = positions.take(pos, n)
        self.report.class_index_entries_checked += n
        if len(want) < n or not np.array_equal(got, want):
            j = _first_difference(got, want)
            have_j = int(got[j])
            want_j = f"sample {int(want[j])}" if j < len(want) else "no further sample of this class"
            self.add(
                "classidx-mismatch",
                have_j,
                f"class {name!r} index list position {pos + j} holds sample {have_j}, labels give {want_j}",
            )

    def _missing_class_chunks(self, c: int, upto: int, next_pos: list[int]) -> None:
        """Report class ``c``'s chunks from ``next_pos[c]`` up to list position ``upto`` as missing."""
        while next_pos[c] < upto:
            self.add(
                "missing-classidx-chunk",
                next_pos[c],
                f"chunk of class {self.meta.classes[c]!r} at list position {next_pos[c]} is missing",
            )
            next_pos[c] += self.meta.label_chunk

    def _class_tail(self, c: int, positions: ClassPositions) -> None:
        """Samples labelled ``c`` beyond what the class's (shorter) index list covers."""
        extra = positions.take(positions.consumed, 1)
        if len(extra) and self.meta.class_counts[c] == positions.consumed:
            i = int(extra[0])
            self.add(
                "classidx-mismatch", i, f"sample {i} is labelled {self.meta.classes[c]!r} but not in that class's list"
            )

    # ------------------------------------------------------------------ ledger, stats
    def check_progress(self) -> None:
        """Every resume-ledger entry is well-formed (see :func:`~lmdbstore.format.ledger.parse_entry`)."""
        for key, value in self.reader.iter_raw(layout.DB_PROGRESS):
            self.report.progress_entries_checked += 1
            try:
                parse_entry(value, self.reader.path, repr(key))
            except CorruptStoreError:
                self.add("progress", None, f"resume-ledger entry {key!r} is not valid JSON with a 'done' count")

    def check_stats(self) -> None:
        """The value statistics cover exactly ``count`` samples' values (finite ones plus non-finite ones)."""
        m = self.meta
        vs = m.value_stats
        want = m.count * int(np.prod(m.shape))
        if vs.n + vs.nonfinite != want:
            self.add(
                "stats",
                None,
                f"value statistics cover {vs.n + vs.nonfinite} values, expected {want} ({m.count} samples)",
            )


class ClassPositions:
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
        self.buf = np.zeros(0, layout.INDEX_DTYPE)
        self.consumed = 0  # list position of buf[0]

    def _fill(self, need: int) -> None:
        parts = [self.buf]
        have = len(self.buf)
        while have < need and self.scan < len(self.labels):
            hi = min(self.scan + self.WINDOW, len(self.labels))
            found = np.flatnonzero(self.labels[self.scan : hi] == self.c).astype(layout.INDEX_DTYPE) + np.uint64(
                self.scan
            )
            parts.append(found)
            have += len(found)
            self.scan = hi
        self.buf = np.concatenate(parts) if len(parts) > 1 else self.buf

    def take(self, pos: int, n: int) -> np.ndarray:
        """List entries ``pos..pos+n-1`` (fewer at the end of the labels); ``pos`` never goes back."""
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
