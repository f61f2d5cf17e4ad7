"""The content checks of ``lmdbstore verify``: every sub-database walked once, against the metadata.

:class:`ContentChecks` reads one snapshot of an open :class:`~lmdbstore.store.reader.StoreReader` and
reports each problem it finds through a callback (:func:`lmdbstore.tools.verify.verify_store` collects
them); what each check covers is listed in :mod:`lmdbstore.tools.verify`'s docstring.  Memory stays bounded
by the label table: the class-index lists are compared chunk by chunk (:class:`ClassPositions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format import layout
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.ledger import parse_entry
from lmdbstore.format.meta import StoreMeta
from lmdbstore.store.reader import StoreReader

if TYPE_CHECKING:  # the report type only; verify.py imports this module
    from lmdbstore.tools.verify import VerifyReport
    from lmdbstore.tools.verify_findings import SamplesFindings

__all__ = ["PROGRESS_EVERY", "AddProblem", "ClassPositions", "ContentChecks"]

#: How a check reports a problem: ``add(kind, index, message)``.
AddProblem = Callable[[str, int | None, str], None]
#: ``progress`` is called about every this many samples.
PROGRESS_EVERY = 1 << 16


class ContentChecks:
    """The content checks of ``verify`` over one read snapshot.

    Args:
        reader: the open store; every check reads its current snapshot.
        meta: the metadata the contents are checked against (``reader.meta``).
        report: the report whose counters (``values_checked`` and the like) the checks advance.
        add: called with ``(kind, index, message)`` for each problem found (see
            :data:`~lmdbstore.tools.verify.PROBLEM_KINDS`); it may raise to stop the checks early.
        checksums: recompute every value's checksum (when the store has them).
        progress: called with the number of samples checked so far, about every 65,536 samples.
        samples: what the value pass (:mod:`lmdbstore.tools.verify_values`) found in this snapshot's ``samples``
            sub-database, reported in place of the cursor walk of :meth:`check_samples` (``None``: walk).
        limit: problems the report keeps at most (the value pass's findings are cut there).
    """

    def __init__(
        self,
        reader: StoreReader,
        meta: StoreMeta,
        report: VerifyReport,
        add: AddProblem,
        checksums: bool,
        progress: Callable[[int], None] | None,
        samples: SamplesFindings | None = None,
        limit: int | None = None,
    ):
        self.reader = reader
        self.meta = meta
        self.report = report
        self.add = add
        self.checksum = compute_checksum(meta.checksum) if checksums else None
        self.progress = progress
        self.samples = samples
        self.limit = limit

    def run(self) -> None:
        """Run every check in order; LMDB reporting corruption mid-scan is a ``scan`` problem that ends them."""
        try:
            self.check_main_db()
            self.check_samples()
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

    # ------------------------------------------------------------------ samples and labels
    def _walk_grid(
        self, db_name: bytes, step: int, kinds: tuple[str, str], missing: str, extra: Callable[[int], str]
    ) -> Iterator[tuple[int, memoryview]]:
        """The ``(first, value)`` entries of a sub-database keyed ``0, step, 2*step, ... < count``, in key order.

        What is not on that grid is reported on the way and not yielded: a key of the wrong width
        (``bad-key``), each grid key that is absent (``kinds[0]``, "<missing> of samples <key>.. is
        missing") and each key off the grid or beyond the count (``kinds[1]``, message ``extra(key)``).
        """
        count = self.meta.count
        expected = 0  # key of the next value we expect
        for key, value in self.reader.iter_raw(db_name):
            first = self._decode(key, db_name.decode())
            if first is None:
                continue
            while expected < min(first, count):
                self.add(kinds[0], expected, f"{missing} of samples {expected}.. is missing")
                expected += step
            if first != expected or first >= count:
                self.add(kinds[1], first, extra(first))
                continue
            expected += step
            yield first, value
        while expected < count:
            self.add(kinds[0], expected, f"{missing} of samples {expected}.. is missing")
            expected += step

    def _decode(self, key: bytes, db: str) -> int | None:
        """The sample index a key of ``db`` encodes; ``None`` (and a ``bad-key`` problem) for a wrong width."""
        if len(key) != layout.KEY_BYTES:
            self.add("bad-key", None, f"{db} key {key.hex()} has {len(key)} bytes, expected {layout.KEY_BYTES}")
            return None
        return layout.decode_key(key)

    def check_samples(self) -> None:
        """Every value the count implies is present, of the right length, with a matching checksum."""
        m, rep = self.meta, self.report
        if self.samples is not None:  # found by the value pass: reported as this walk reports it
            self.samples.emit(rep, self.add, self.limit)
            if self.progress is not None:
                self.progress(rep.samples_checked)
            return
        spv, count, trailer = m.samples_per_value, m.count, m.trailer_bytes

        def extra(first: int) -> str:
            why = "beyond the count" if first >= count else f"not a multiple of samples_per_value {spv}"
            return f"unexpected sample value ({why}; count {count})"

        next_report = PROGRESS_EVERY
        for first, value in self._walk_grid(layout.DB_SAMPLES, spv, ("missing-value", "extra-value"), "value", extra):
            n = min(spv, count - first)
            want = m.expected_value_len(first)
            rep.values_checked += 1
            rep.samples_checked += n
            if len(value) != want:
                self.add("value-length", first, f"value has {len(value)} bytes, expected {want}")
            elif self.checksum is not None and trailer:
                rep.checksums_checked += 1
                if self.checksum(value[: want - trailer]) != bytes(value[want - trailer :]):
                    self.add("checksum", first, f"{m.checksum} mismatch in the value of samples {first}..")
            if self.progress is not None and rep.samples_checked >= next_report:
                self.progress(rep.samples_checked)
                next_report = rep.samples_checked + PROGRESS_EVERY
        if self.progress is not None:
            self.progress(rep.samples_checked)

    def check_labels(self) -> np.ndarray:
        """Check the label chunks and return the label table (missing chunks filled with an
        impossible class id where the dtype allows, so the class-index check flags them too)."""
        m, rep = self.meta, self.report
        chunk, count, n_classes, ldt = m.label_chunk, m.count, len(m.classes), m.label_dtype
        labels = np.full(count, np.iinfo(ldt).max, ldt)
        kinds = ("missing-label-chunk", "extra-label-chunk")
        extra = f"unexpected label chunk (label_chunk {chunk}, count {count})"
        for first, value in self._walk_grid(layout.DB_LABELS, chunk, kinds, "label chunk", lambda _: extra):
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
            positions.skip_to(pos + n)
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

    def skip_to(self, pos: int) -> None:
        """Drop the positions before list position ``pos``."""
        self.take(pos, 0)

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
