"""The storage benchmark's results: one :class:`Row` per format, read method and order, the ratios and goals
computed from rows of the same run, and how they are shown (table, notes, CSV records, plot).

Not a benchmark itself: ``bench.storage`` measures the rows and calls these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Goal, fmt_ratio, human, ratio


@dataclass
class Row:
    """One line of the result table: a format read with one method in one index order."""

    format: str
    title: str
    mode: str
    order: str
    n: int
    ingest_s: float | None = None
    ingest_sps: float | None = None
    disk_bytes: int | None = None
    disk_per_sample: float | None = None
    disk_vs_raw: float | None = None
    used_per_sample: float | None = None
    read_1p: float | None = None
    read_2w: float | None = None
    cold_1p: float | None = None
    cold_resident_before: float | None = None
    cold_resident_after: float | None = None
    read_1p_vs_memmap: float | None = None
    read_1p_vs_h5py: float | None = None
    read_2w_vs_memmap: float | None = None
    read_2w_vs_h5py: float | None = None
    ingest_vs_npsave: float | None = None
    note: str = ""

    @property
    def label(self) -> str:
        extra = self.mode if self.order == "random" else f"{self.mode}, {self.order} order"
        return f"{self.title} ({extra})"


def add_ratios(rows: list[Row]) -> None:
    """Fill the ratio columns against memmap (fancy) and HDF5 contiguous per-sample reads."""
    mm = next((r for r in rows if r.format == "memmap"), None)
    h5 = next((r for r in rows if r.format == "h5py_contig" and r.mode == "per-sample"), None)
    for r in rows:
        if mm:
            r.read_1p_vs_memmap = ratio(r.read_1p, mm.read_1p)
            r.read_2w_vs_memmap = ratio(r.read_2w, mm.read_2w)
            r.ingest_vs_npsave = ratio(r.ingest_sps, mm.ingest_sps)
        if h5:
            r.read_1p_vs_h5py = ratio(r.read_1p, h5.read_1p)
            r.read_2w_vs_h5py = ratio(r.read_2w, h5.read_2w)


def evaluate_goals(rows: list[Row]) -> list[Goal]:
    """The issue's targets, computed from baselines measured in the same run."""

    def find(fmt: str, mode: str | None = None, order: str = "random") -> Row | None:
        return next(
            (r for r in rows if r.format == fmt and (mode is None or r.mode == mode) and r.order == order), None
        )

    ls, lb = find("lmdbstore"), find("lmdbstore", order="block")
    mm, h5 = find("memmap"), find("h5py_contig", "per-sample")
    nv = find("lmdb_naive")

    def rv(a: Row | None, b: Row | None, attr: str) -> float | None:
        return ratio(getattr(a, attr), getattr(b, attr)) if a and b else None

    return [
        Goal("lmdbstore ingest / np.save sequential write", rv(ls, mm, "ingest_sps"), 0.5),
        Goal("lmdbstore bytes on disk / raw", ls.disk_vs_raw if ls else None, 1.05, higher_is_better=False),
        Goal("lmdbstore random reads / h5py per-sample (1 proc)", rv(ls, h5, "read_1p"), 10),
        Goal("lmdbstore random reads / h5py per-sample (2 workers)", rv(ls, h5, "read_2w"), 10),
        Goal("lmdbstore random reads / naive LMDB (1 proc)", rv(ls, nv, "read_1p"), 3),
        Goal("lmdbstore random reads / naive LMDB (2 workers)", rv(ls, nv, "read_2w"), 3),
        Goal("lmdbstore block order / memmap random (1 proc)", rv(lb, mm, "read_1p"), 0.8),
        Goal("lmdbstore block order / memmap random (2 workers)", rv(lb, mm, "read_2w"), 0.8),
    ]


TABLE_COLS = (
    ("format / read method", 44),
    ("N", 6),
    ("ingest/s", 9),
    ("xnp.save", 8),
    ("B/sample", 8),
    ("xraw", 5),
    ("read 1p/s", 9),
    ("xmemmap", 7),
    ("xh5py", 7),
    ("read 2w/s", 9),
    ("xmemmap", 7),
    ("xh5py", 7),
    ("cold 1p/s", 9),
    ("drop", 5),
)


def format_table(rows: list[Row], workers: int) -> str:
    """The result table as fixed-width text."""
    header = "  ".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(TABLE_COLS))
    header = header.replace("2w", f"{workers}w")
    lines = [header, "-" * len(header)]
    for r in rows:
        drop = "-"
        if r.cold_resident_after is not None:
            drop = "ok" if r.cold_resident_after < 0.05 else f"{100 * (1 - r.cold_resident_after):.0f}%"
        cells = [
            r.label,
            human(r.n),
            human(r.ingest_sps),
            fmt_ratio(r.ingest_vs_npsave),
            f"{r.disk_per_sample:.0f}" if r.disk_per_sample else "-",
            f"{r.disk_vs_raw:.2f}" if r.disk_vs_raw else "-",
            human(r.read_1p),
            fmt_ratio(r.read_1p_vs_memmap),
            fmt_ratio(r.read_1p_vs_h5py),
            human(r.read_2w),
            fmt_ratio(r.read_2w_vs_memmap),
            fmt_ratio(r.read_2w_vs_h5py),
            human(r.cold_1p),
            drop,
        ]
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, (_, w)) in enumerate(zip(cells, TABLE_COLS, strict=True))
            )
        )
    return "\n".join(lines)


def row_record(r: Row) -> dict[str, Any]:
    """The row as a CSV / JSON record: its label first, floats rounded to 4 decimals."""
    d = asdict(r)
    d = {"label": r.label, **d}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def plot(rows: list[Row], path: Path, workers: int, batch: int, subtitle: str) -> Path | None:
    """Horizontal bars of read samples/s per format/method: 1 process, workers, cold (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("NOTE: matplotlib not installed; no plot")
        return None
    labels = [r.label + ("" if r.n == rows[0].n else f" [N={human(r.n)}]") for r in rows]
    series = [
        ("1 process, warm", [r.read_1p for r in rows]),
        (f"DataLoader {workers} workers, warm", [r.read_2w for r in rows]),
        ("1 process, cold cache", [r.cold_1p for r in rows]),
    ]
    series = [(name, vals) for name, vals in series if any(v for v in vals)]
    ypos = np.arange(len(rows))
    height = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.5))
    for k, (name, vals) in enumerate(series):
        ax.barh(ypos + (k - (len(series) - 1) / 2) * height, [v or 0 for v in vals], height, label=name)
    ax.set_yticks(ypos, labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"random-batch read throughput (samples/s, batch {batch}, log scale)")
    ax.set_title(f"Read throughput by format: {subtitle}", fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_report(
    rows: list[Row], goals: list[Goal], workers: int, shape: tuple[int, ...], batch: int, elapsed: float
) -> str:
    """Table, notes and goals as printed, for a run with ``workers`` DataLoader workers, samples of ``shape``
    float32 and batches of ``batch``."""
    parts = [format_table(rows, workers), ""]
    parts.append(
        "Columns: ingest/s includes the final fsync; B/sample = allocated disk blocks / samples (raw = "
        f"{int(np.prod(shape)) * 4} B); read = random batches of {batch} (x and labels), warm page cache, median rate over batches "
        "(robust to other processes on a shared machine); "
        f"{workers}w = DataLoader with {workers} workers (batch_size=None, one __getitem__ per batch); "
        "xmemmap / xh5py = ratio to numpy memmap / HDF5 contiguous per-sample reads in this run; cold = "
        "after posix_fadvise(DONTNEED) on every file of the format, drop = share of pages evicted "
        "('ok' = all)."
    )
    for r in rows:
        if r.cold_resident_after is not None and r.cold_resident_after > 0.05:
            parts.append(
                f"NOTE: dropping the page cache had little effect for {r.label}: "
                f"{100 * r.cold_resident_after:.0f}% still resident"
            )
    notes = {r.format: r.note for r in rows}
    parts += ["", "Formats:"] + [f"  {k:<13} {v}" for k, v in notes.items()]
    parts += ["", "Goals (ratios within this run):"] + [g.line() for g in goals]
    parts.append(f"\nTotal time: {elapsed:.0f}s")
    return "\n".join(parts)
