"""What is in a store: counts, layout, bytes on disk against raw, LMDB depth and pages, value statistics.

:func:`store_stats` returns a JSON-ready dict (``lmdbstore stats --json`` prints it as is);
:func:`format_stats` renders the same dict as a human table.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_SAMPLE_SEED, SAMPLE_READ_CHUNK
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import Reader
from lmdbstore.util.memory import describe_bytes

__all__ = ["class_rows", "exact_values", "format_stats", "sampled_stats", "store_stats", "summary_lines"]


def sampled_stats(reader: Reader, sample: int, seed: int) -> dict[str, Any]:
    """Mean/std/min/max over ``sample`` random samples of a store or a set (read through the normal random-access
    path, :data:`SAMPLE_READ_CHUNK` at a time and folded into running statistics: memory is one chunk whatever
    ``sample`` is, beside the indices drawn)."""
    n = len(reader)
    k = min(sample, n)
    idx = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))
    vs = ValueStats()
    for i in range(0, k, SAMPLE_READ_CHUNK):
        vs.update(reader.read_batch(idx[i : i + SAMPLE_READ_CHUNK]))
    return exact_values(vs, f"random sample of {k} of {n} samples (seed {seed})")


def exact_values(vs: ValueStats, method: str) -> dict[str, Any]:
    """The ``values`` entry of a stats dict from value statistics, saying how they were obtained."""
    return {"method": method, "mean": vs.mean, "std": vs.std, "min": vs.min, "max": vs.max, "nonfinite": vs.nonfinite}


def class_rows(classes: list[str], counts: list[int]) -> list[dict[str, Any]]:
    """The ``classes`` entry of a stats dict: id, name, count and share of each class."""
    total = max(sum(counts), 1)
    return [
        {"id": i, "name": n, "count": c, "share": c / total}
        for i, (n, c) in enumerate(zip(classes, counts, strict=True))
    ]


def store_stats(
    path: str | os.PathLike[str] | StoreReader, *, sample: int | None = None, seed: int = DEFAULT_SAMPLE_SEED
) -> dict[str, Any]:
    """Describe the store at ``path`` (or the open reader's snapshot: it is left open).  Every figure is of the
    one file opened: the file's sizes are its descriptor's, never the path's again.

    Value statistics are exact (the writer accumulates them as it commits); with ``sample=N`` they are recomputed
    from N random samples drawn with ``seed`` (default ``DEFAULT_SAMPLE_SEED``, 0), read back from the disk.

    Raises:
        ValueError: ``sample`` below 1.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError.
    """
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
        raise ValueError(f"sample must be a positive number of samples, got {sample!r}")
    with StoreReader(Path(path)) if not isinstance(path, StoreReader) else contextlib.nullcontext(path) as reader:
        p = reader.path
        m = reader.meta
        env = reader.env_stats()
        psize = env["psize"]
        dbs = env["dbs"]
        pages = {name: d["branch_pages"] + d["leaf_pages"] + d["overflow_pages"] for name, d in dbs.items()}
        used_pages = sum(pages.values()) + env["main"]["leaf_pages"] + env["main"]["branch_pages"] + 2
        raw = m.count * m.sample_bytes
        sample_bytes_disk = pages["samples"] * psize
        with reader.held() as h:
            st = os.fstat(h.fd)
        values = exact_values(m.value_stats, "exact (accumulated by the writer over every value)")
        if sample is not None and m.count:
            values = sampled_stats(reader, sample, seed)
        total = max(m.count, 1)
        return {
            "path": str(p),
            "format_version": m.format_version,
            "created_by": m.created_by,
            "created_at": m.created_at,
            "updated_at": m.updated_at,
            "samples": m.count,
            "shape": list(m.shape),
            "dtype": m.dtype,
            "sample_bytes": m.sample_bytes,
            "samples_per_value": m.samples_per_value,
            "checksum": m.checksum,
            "classes": class_rows(m.classes, m.class_counts),
            "bytes": {
                "raw": raw,
                "samples_db": sample_bytes_disk,
                "used_pages_total": used_pages * psize,
                "file_size": st.st_size,
                "file_allocated": st.st_blocks * 512,
                "per_sample_raw": m.sample_bytes,
                "per_sample_on_disk": sample_bytes_disk / total,
                "per_sample_total": used_pages * psize / total,
                "ratio_samples_to_raw": sample_bytes_disk / raw if raw else None,
                "ratio_total_to_raw": used_pages * psize / raw if raw else None,
            },
            "lmdb": {
                "page_size": psize,
                "map_size": env["info"]["map_size"],
                "last_pgno": env["info"]["last_pgno"],
                "depth": {name: d["depth"] for name, d in dbs.items()},
                "pages": pages,
                "entries": {name: d["entries"] for name, d in dbs.items()},
            },
            "values": values,
        }


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def summary_lines(classes: list[dict[str, Any]], values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The class table and the value lines of a stats table (of a store or a set)."""
    v = values
    table = [f"{'class':<16}{'id':>4}{'count':>14}{'share':>9}"] + [
        f"{c['name'][:16]:<16}{c['id']:>4}{c['count']:>14,}{100 * c['share']:>8.2f}%" for c in classes
    ]
    return table, [
        f"values       mean {_num(v['mean'])}  std {_num(v['std'])}  min {_num(v['min'])}  max {_num(v['max'])}  "
        f"non-finite {v['nonfinite']}",
        f"             {v['method']}",
    ]


def format_stats(s: dict[str, Any]) -> str:
    """Human-readable table of :func:`store_stats`'s dict."""
    b, lm = s["bytes"], s["lmdb"]
    ratio, size = b["ratio_samples_to_raw"], describe_bytes
    table, values = summary_lines(s["classes"], s["values"])
    lines = [
        f"store        {s['path']}  (format v{s['format_version']}, {s['created_by']})",
        f"samples      {s['samples']:,}  shape {tuple(s['shape'])}  dtype {s['dtype']}  ({s['sample_bytes']:,} B each)",
        f"packing      {s['samples_per_value']} samples per value, checksum {s['checksum']}",
        "",
        *table,
        "",
        f"raw payload  {size(b['raw'])}",
        f"on disk      {size(b['samples_db'])} in sample pages ({b['per_sample_on_disk']:,.1f} B/sample, "
        f"{'-' if ratio is None else f'{ratio:.3f}x'} raw); {size(b['used_pages_total'])} all used pages; "
        f"file {size(b['file_size'])} ({size(b['file_allocated'])} allocated)",
        f"lmdb         page {lm['page_size']} B, depth {lm['depth']['samples']} (samples), "
        f"{lm['pages']['samples']:,} sample pages, map {size(lm['map_size'])}",
        *values,
    ]
    return "\n".join(lines)
