"""``stats`` and ``verify`` over a set of stores read as one (:class:`~lmdbstore.store.multi.StoreSet`): each store
on its own, as for one store, then what only the whole tells (that the stores make one set, its samples, classes
mapped by name, bytes, the value statistics merged exactly).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmdbstore.config import DEFAULT_SAMPLE_SEED
from lmdbstore.store.multi import StoreSet
from lmdbstore.tools.stats import class_rows, exact_values, format_stats, sampled_stats, store_stats, summary_lines
from lmdbstore.tools.verify import VerifyReport, verify_store
from lmdbstore.util.memory import describe_bytes

__all__ = ["SetVerifyReport", "format_set_stats", "set_stats", "verify_set"]

StorePath = str | os.PathLike[str]


def set_stats(
    stores: Sequence[StorePath], *, sample: int | None = None, seed: int = DEFAULT_SAMPLE_SEED
) -> dict[str, Any]:
    """Describe each store (``"stores"``: :func:`store_stats` of each) and the set (``"set"``: value statistics
    exact, the stores' merged, or with ``sample=N`` from N random samples of the whole set).

    Raises:
        ValueError: ``sample`` below 1, no store or a store given twice.
        ValidationError: stores that do not make one set.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: a store.
    """
    with StoreSet(stores) as s:  # a store given twice: refused before anything is read
        per = [store_stats(r, sample=sample, seed=seed) for r in s.readers]  # the files the set opened
        m = s.meta
        values = exact_values(m.value_stats, "exact (the stores' statistics merged)")
        if sample is not None and m.count:
            values = sampled_stats(s, sample, seed)
        raw = m.count * m.sample_bytes
        on_disk = sum(d["bytes"]["used_pages_total"] for d in per)
        whole = {
            "paths": [str(p) for p in s.paths],
            "samples": m.count,
            "store_samples": s.counts,
            "shape": list(m.shape),
            "dtype": m.dtype,
            "sample_bytes": m.sample_bytes,
            "classes": class_rows(m.classes, m.class_counts),
            "bytes": {
                "raw": raw,
                "used_pages_total": on_disk,
                "file_size": sum(d["bytes"]["file_size"] for d in per),
                "ratio_total_to_raw": on_disk / raw if raw else None,
            },
            "values": values,
        }
    return {"stores": per, "set": whole}


def format_set_stats(s: dict[str, Any]) -> str:
    """Each store's table (:func:`format_stats`), then the set's: samples per store and per class, bytes and
    values over the whole."""
    w, b = s["set"], s["set"]["bytes"]
    ratio = b["ratio_total_to_raw"]
    table, values = summary_lines(w["classes"], w["values"])
    lines = [
        *(format_stats(d) + "\n" for d in s["stores"]),
        f"set          {len(w['paths'])} stores read as one: {', '.join(w['paths'])}",
        f"samples      {w['samples']:,} ({' + '.join(f'{n:,}' for n in w['store_samples'])})  shape "
        f"{tuple(w['shape'])}  dtype {w['dtype']}",
        "",
        *table,
        "",
        f"bytes        {describe_bytes(b['used_pages_total'])} in used pages, "
        f"{'-' if ratio is None else f'{ratio:.3f}x'} raw; files {describe_bytes(b['file_size'])}",
        *values,
    ]
    return "\n".join(lines)


@dataclass
class SetVerifyReport:
    """What :func:`verify_set` found: a :class:`VerifyReport` per store, in the set's order."""

    paths: list[str]
    reports: list[VerifyReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No store has a problem."""
        return all(r.ok for r in self.reports)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ok``, the paths and each store's report."""
        return {"ok": self.ok, "paths": self.paths, "stores": [r.to_dict() for r in self.reports]}


def verify_set(
    stores: Sequence[StorePath],
    *,
    progress: Callable[[int], None] | None = None,
    total: Callable[[int], None] | None = None,
    **options: Any,
) -> SetVerifyReport:
    """Verify every store (:func:`verify_store` with ``options``), then check that they make one set (not while a
    store's page structure is damaged); ``progress`` and ``total`` count over the whole set (``total`` once per
    store begun).

    Raises:
        ValueError: ``max_problems`` below 1, no store or a store given twice.
        ValidationError: stores that do not make one set.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: a store cannot be opened.
    """
    if not stores:
        raise ValueError("stores: give at least one store")
    report = SetVerifyReport([str(p) for p in stores])
    before = 0
    for path in stores:
        step = None if progress is None else _offset(progress, before)
        size = None if total is None else _offset(total, before)
        one = verify_store(path, progress=step, total=size, **options)
        report.reports.append(one)
        before += one.count
    damaged = any(p.kind == "structure" for r in report.reports for p in r.problems)
    if len(stores) > 1 and not damaged:
        StoreSet(stores).open().close()  # one shape and dtype, classes by name: or the one-line error
    return report


def _offset(progress: Callable[[int], None], before: int) -> Callable[[int], None]:
    """``progress`` for one store of a set: its count plus the samples of the stores before it."""
    return lambda done: progress(before + done)
