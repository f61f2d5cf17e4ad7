"""What ``verify``'s value pass found in the ``samples`` sub-database, and how it is reported: exactly as the cursor
walk of :class:`~lmdbstore.tools.verify_checks.ContentChecks` reports it -- the same problems in key order, the same
messages, the same counters at the moment each problem is reported (so also when ``max_problems`` stops the
report early).  :func:`grid_problems` finds from the keys and sizes alone what that walk reports as
``missing-value``, ``extra-value`` and ``value-length``; the checksums are :mod:`lmdbstore.tools.verify_values`'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from lmdbstore.format.btree import BTreeValues
from lmdbstore.format.meta import StoreMeta

if TYPE_CHECKING:  # the report type only; verify.py imports this module
    from lmdbstore.tools.verify import VerifyReport

__all__ = ["SamplesFindings", "grid_problems"]


@dataclass
class SamplesFindings:
    """What the pass over the ``samples`` sub-database found, to be reported in key order (:meth:`emit`).

    Attributes:
        missing, extra, wrong_length, bad_checksum: the sample indices (keys) of each kind of problem, sorted.
        lengths: the actual length of each value in ``wrong_length``.
        accepted: the keys on the grid ``0, spv, ... < count`` (each present value the cursor walk counts).
        checksums: whether checksums were compared.
        complete: every chunk was read (``False`` after a stop at ``max_problems``).
    """

    meta: StoreMeta
    missing: np.ndarray
    extra: np.ndarray
    wrong_length: np.ndarray
    lengths: np.ndarray
    accepted: np.ndarray
    checksums: bool
    bad_checksum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    complete: bool = True

    def first(self, limit: int | None) -> list[tuple[int, str]]:
        """The first ``limit`` problems (``None``: all) in key order as ``(index, kind)``."""
        parts = [
            (self.missing[:limit], "missing-value"),
            (self.extra[:limit], "extra-value"),
            (self.wrong_length[:limit], "value-length"),
            (self.bad_checksum[:limit], "checksum"),
        ]
        merged = [(int(i), kind) for keys, kind in parts for i in keys.tolist()]
        return sorted(merged)[:limit]

    def known_before(self, bound: int) -> int:
        """Problems at indices below ``bound`` (those later chunks cannot add to)."""
        b = np.uint64(bound)
        keys = (self.missing, self.extra, self.wrong_length, self.bad_checksum)
        return sum(int(np.searchsorted(k, b)) for k in keys)

    def message(self, index: int, kind: str) -> str:
        """The cursor walk's message for the problem ``kind`` at ``index``."""
        m = self.meta
        if kind == "missing-value":
            return f"value of samples {index}.. is missing"
        if kind == "extra-value":
            why = (
                "beyond the count" if index >= m.count else f"not a multiple of samples_per_value {m.samples_per_value}"
            )
            return f"unexpected sample value ({why}; count {m.count})"
        if kind == "value-length":
            have = int(self.lengths[int(np.searchsorted(self.wrong_length, np.uint64(index)))])
            return f"value has {have} bytes, expected {m.expected_value_len(index)}"
        return f"{m.checksum} mismatch in the value of samples {index}.."

    def _samples_in(self, n: int) -> int:
        """Samples in the first ``n`` accepted values (the last value of the store may be short)."""
        if n == 0:
            return 0
        spv, count = self.meta.samples_per_value, self.meta.count
        return n * spv - max(0, int(self.accepted[n - 1]) + spv - count)

    def _count_to(self, report: VerifyReport, n: int, wrong: int) -> None:
        """Set the counters for the first ``n`` accepted values, ``wrong`` of them of the wrong length."""
        report.values_checked = n
        report.samples_checked = self._samples_in(n)
        report.checksums_checked = n - wrong if self.checksums else 0

    def emit(self, report: VerifyReport, add: Callable[[str, int | None, str], None], limit: int | None) -> None:
        """Report the problems through ``add`` in key order, each with the counters the cursor walk has when it
        reports it (``add`` may raise to stop), then the totals."""
        for index, kind in self.first(limit):
            at = np.uint64(index)
            n = int(np.searchsorted(self.accepted, at)) + (kind in ("value-length", "checksum"))
            self._count_to(report, n, int(np.searchsorted(self.wrong_length, at, side="right")))
            add(kind, index, self.message(index, kind))
        self._count_to(report, len(self.accepted), len(self.wrong_length))


def grid_problems(values: BTreeValues, meta: StoreMeta, checksums: bool) -> tuple[SamplesFindings, np.ndarray]:
    """The problems the keys and sizes show, and which values (by position in ``values``) are to be checksummed:
    those on the grid with the right length (none when ``checksums`` is off or the store has none)."""
    keys, spv, count = values.keys, np.uint64(meta.samples_per_value), meta.count
    on = (keys % spv == 0) & (keys < np.uint64(count))
    grid = np.zeros(meta.n_values, bool)
    grid[(keys[on] // spv).astype(np.int64)] = True
    accepted = keys[on]
    want = np.full(len(accepted), meta.samples_per_value * meta.sample_bytes + meta.trailer_bytes, np.int64)
    last = accepted + spv > np.uint64(count)
    want[last] = [meta.expected_value_len(int(k)) for k in accepted[last].tolist()]
    bad_len = values.sizes[on] != want
    compare = checksums and meta.trailer_bytes > 0
    findings = SamplesFindings(
        meta=meta,
        missing=(np.flatnonzero(~grid).astype(np.uint64) * spv),
        extra=keys[~on],
        wrong_length=accepted[bad_len],
        lengths=values.sizes[on][bad_len],
        accepted=accepted,
        checksums=compare,
    )
    check = np.flatnonzero(on)[~bad_len] if compare else np.zeros(0, np.int64)
    return findings, check
