"""Pictures: samples of a store (:func:`show_samples`), training runs (:func:`plot_runs`), a store's class
counts and value histogram (:func:`plot_stats`).  PNG via matplotlib (the ``viz`` extra; without it one
:class:`~lmdbstore.errors.LmdbStoreError` naming the extra), of a fixed size (``figsize * dpi`` pixels), from a
bounded number of samples.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import (
    DEFAULT_DPI,
    DEFAULT_HIST_BINS,
    DEFAULT_HIST_SAMPLES,
    DEFAULT_PER_CLASS,
    DEFAULT_SAMPLE_SEED,
    SAMPLE_READ_CHUNK,
)
from lmdbstore.errors import LmdbStoreError
from lmdbstore.store.metaview import sample_indices
from lmdbstore.store.reader import StoreReader
from lmdbstore.util.paths import check_output_file
from lmdbstore.util.runfiles import METRICS_NAME

__all__ = ["VIZ_EXTRA", "Picture", "load_metrics", "plot_runs", "plot_stats", "require_pyplot", "show_samples"]

#: The optional extra that installs matplotlib.
VIZ_EXTRA = "viz"
#: Inches per sample panel in :func:`show_samples`.
CELL_IN = 1.3


@dataclass(frozen=True)
class Picture:
    """A written PNG: its path and size in pixels."""

    path: str
    width: int
    height: int


def require_pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises:
        LmdbStoreError: matplotlib is not installed (the message names the ``viz`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise LmdbStoreError(
            "drawing pictures needs matplotlib, which is not installed", hint=f"pip install 'lmdbstore[{VIZ_EXTRA}]'"
        ) from exc
    return plt


def _save(plt: Any, fig: Any, out: str | os.PathLike[str], dpi: int) -> Picture:
    p = Path(out)  # checked (check_output_file) before any work
    w, h = fig.get_size_inches()
    try:
        fig.savefig(p, dpi=dpi, format="png")
    except OSError as exc:
        raise LmdbStoreError(f"cannot write the picture ({exc.strerror or exc})", path=p) from exc
    finally:
        plt.close(fig)
    return Picture(str(p), round(w * dpi), round(h * dpi))


def _check_dpi(dpi: int) -> None:
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 10 <= dpi <= 1000:
        raise ValueError(f"dpi must be an integer in 10..1000, got {dpi!r}")


def _as_image(x: np.ndarray) -> np.ndarray:
    """A sample as a 2-D picture: 1-D as one row, 2-D as is, more dimensions folded into the columns."""
    if x.ndim == 1:
        return x[None, :]
    return x.reshape(x.shape[0], -1)


def _colour_scale(x: np.ndarray) -> tuple[str, float, float]:
    """Colour map and limits: a diverging map symmetric about 0 for signed (e.g. z-scored) data, clipped
    at the 99.5th percentile of |value| so one outlier does not wash out the rest; grey for non-negative data."""
    f = x.astype(np.float64, copy=False)
    f = f[np.isfinite(f)]
    if not f.size:
        return "RdBu_r", -1.0, 1.0
    if f.min() >= 0:
        hi = float(np.percentile(f, 99.5)) or float(f.max()) or 1.0
        return "gray", 0.0, hi
    lim = float(np.percentile(np.abs(f), 99.5)) or float(np.abs(f).max()) or 1.0
    return "RdBu_r", -lim, lim


def _pick(reader: StoreReader, per_class: int, seed: int, indices: Any) -> list[tuple[int, np.ndarray]]:
    """(class id, sample indices) per row of the grid."""
    if indices is not None:
        idx = sample_indices(indices)
        if not idx.size:
            raise ValueError("indices must name at least one sample")
        labels = reader.labels_of(idx)  # indices outside the store: IndexError
        return [(int(c), idx[labels == c]) for c in sorted(set(labels.tolist()))]
    if isinstance(per_class, bool) or not isinstance(per_class, int) or not 1 <= per_class <= 64:
        raise ValueError(f"per_class must be an integer in 1..64, got {per_class!r}")
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(len(reader.classes)):
        members = reader.class_indices(c)
        if len(members):
            rows.append((c, np.sort(rng.choice(members, size=min(per_class, len(members)), replace=False))))
    if not rows:
        raise ValueError("the store holds no samples to show")
    return rows


def show_samples(
    store: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    per_class: int = DEFAULT_PER_CLASS,
    indices: Any = None,
    seed: int = DEFAULT_SAMPLE_SEED,
    dpi: int = DEFAULT_DPI,
) -> Picture:
    """Draw a grid of samples, one row per class, and save it as a PNG.

    Each row holds ``per_class`` samples (default ``DEFAULT_PER_CLASS``, 8) of its class drawn with ``seed``
    (default 0), or, with ``indices``, the given samples grouped by class.  All panels share one colour scale,
    symmetric about zero for signed data.  Size: ``(cols * 1.3 + 1.2) x (rows * 1.3 + 0.7)`` inches at ``dpi``
    (default ``DEFAULT_DPI``, 100).

    Raises:
        ValueError / IndexError: bad ``per_class``, ``dpi`` or ``indices``; an empty store.
        LmdbStoreError: matplotlib missing, the store unreadable, the output not writable.
    """
    _check_dpi(dpi)
    check_output_file(out, "output", sources=[store])  # before any work
    with StoreReader(store) as r:
        rows = _pick(r, per_class, seed, indices)
        data = [r.read_batch(idx) for _, idx in rows]
        names = r.classes
    plt = require_pyplot()
    cols = max(len(idx) for _, idx in rows)
    cmap, lo, hi = _colour_scale(np.concatenate([d.reshape(-1) for d in data]))
    fig, axes = plt.subplots(
        len(rows), cols, figsize=(cols * CELL_IN + 1.2, len(rows) * CELL_IN + 0.7), squeeze=False, layout="constrained"
    )
    im = None
    for i, ((c, idx), x) in enumerate(zip(rows, data, strict=True)):
        for j in range(cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(idx):
                ax.axis("off")
                continue
            im = ax.imshow(_as_image(x[j]), cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
            ax.set_title(f"#{int(idx[j])}", fontsize=7)
            if j == 0:
                ax.set_ylabel(names[c], fontsize=9)
    fig.suptitle(f"{Path(store).name}: {sum(len(i) for _, i in rows)} samples", fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="value")
    return _save(plt, fig, out, dpi)


# ---------------------------------------------------------------------------------------------- runs
def load_metrics(run: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The per-epoch records of a run directory's ``metrics.jsonl`` (or of that file), in epoch order; an epoch
    that appears twice (a run restarted in the same directory): the last.

    Raises:
        LmdbStoreError: no metrics file, or a line that is not a JSON object with an ``epoch``.
    """
    p = Path(run)
    f = p / METRICS_NAME if p.is_dir() else p
    try:
        text = f.read_text()
    except OSError as exc:
        raise LmdbStoreError(
            f"cannot read the run's metrics ({exc.strerror or exc})",
            path=f,
            hint="give a run directory that train wrote (its out_dir=)",
        ) from None
    by_epoch: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("epoch"), int):
            raise LmdbStoreError("not a metrics record (a JSON object with an integer epoch)", path=f, key=f"line {n}")
        by_epoch[rec["epoch"]] = rec
    if not by_epoch:
        raise LmdbStoreError("the run has no finished epoch yet", path=f)
    return [by_epoch[e] for e in sorted(by_epoch)]


def _series(recs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["epoch"], float(r[key])) for r in recs if isinstance(r.get(key), (int, float))]
    return [e for e, _ in pts], [v for _, v in pts]


def plot_runs(
    runs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *, dpi: int = DEFAULT_DPI
) -> Picture:
    """Plot training and validation loss, validation accuracy and samples/s per epoch of one or more runs
    (overlaid) and save a PNG of 15 x 4.2 inches at ``dpi`` (default 100).  Raises ``ValueError`` (no runs, bad
    ``dpi``) or ``LmdbStoreError`` (a run without metrics, matplotlib missing)."""
    _check_dpi(dpi)
    if not runs:
        raise ValueError("runs must name at least one run directory")
    read = [Path(r) / METRICS_NAME if Path(r).is_dir() else Path(r) for r in runs]  # a run's picture may lie beside
    check_output_file(out, "output", sources=read)
    loaded = [(Path(r), load_metrics(r)) for r in runs]
    plt = require_pyplot()
    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (path, recs) in enumerate(loaded):
        name = (path if path.is_dir() else path.parent).name or str(path)
        col = colours[k % len(colours)]
        ax_loss.plot(*_series(recs, "train_loss"), "-o", color=col, ms=3, label=f"{name} train")
        ax_loss.plot(*_series(recs, "val_loss"), "--s", color=col, ms=3, label=f"{name} val")
        ax_acc.plot(*_series(recs, "val_accuracy"), "-o", color=col, ms=3, label=name)
        ax_speed.plot(*_series(recs, "samples_per_s"), "-o", color=col, ms=3, label=name)
    for ax, title in ((ax_loss, "loss"), (ax_acc, "validation accuracy"), (ax_speed, "training samples/s")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    return _save(plt, fig, out, dpi)


# ---------------------------------------------------------------------------------------------- stats
def plot_stats(
    store: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    sample: int = DEFAULT_HIST_SAMPLES,
    bins: int = DEFAULT_HIST_BINS,
    seed: int = DEFAULT_SAMPLE_SEED,
    dpi: int = DEFAULT_DPI,
) -> Picture:
    """Draw the class counts and a histogram of the values of ``sample`` random samples (default
    ``DEFAULT_HIST_SAMPLES``, 20,000; drawn with ``seed``, read in chunks) in ``bins`` bins (default 100), over
    the mean +/- 6 standard deviations clipped to the exact minimum and maximum (values outside are counted), and
    save a PNG of 12 x 4.2 inches at ``dpi`` (default 100).

    Raises:
        ValueError: bad ``sample``, ``bins`` or ``dpi``.  LmdbStoreError: matplotlib missing, unreadable store.
    """
    _check_dpi(dpi)
    for name, v in (("sample", sample), ("bins", bins)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    check_output_file(out, "output", sources=[store])
    with StoreReader(store) as r:
        m = r.meta
        vs = m.value_stats
        counts, names, n = list(m.class_counts), list(m.classes), m.count
        hist = np.zeros(bins, np.int64)
        edges = np.linspace(0.0, 1.0, bins + 1)
        outside = 0
        if n and vs.mean is not None and vs.std is not None and vs.min is not None and vs.max is not None:
            spread = 6 * vs.std if vs.std > 0 else 1.0
            lo, hi = max(vs.min, vs.mean - spread), min(vs.max, vs.mean + spread)
            if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
                lo, hi = vs.mean - 1.0, vs.mean + 1.0
            edges = np.linspace(lo, hi, bins + 1)
            k = min(sample, n)
            idx = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))
            for a in range(0, k, SAMPLE_READ_CHUNK):
                vals = r.read_batch(idx[a : a + SAMPLE_READ_CHUNK]).reshape(-1).astype(np.float64)
                h, _ = np.histogram(vals, edges)
                hist += h
                outside += int(vals.size - h.sum())
    plt = require_pyplot()
    fig, (ax_c, ax_h) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    ax_c.bar(range(len(names)), counts, color="#4c72b0")
    ax_c.set_xticks(range(len(names)), [s[:12] for s in names], rotation=30 if len(names) > 6 else 0, fontsize=8)
    ax_c.set_title(f"samples per class ({n:,} in total)")
    ax_c.grid(axis="y", alpha=0.3)
    if hist.sum():
        ax_h.stairs(hist, edges, fill=True, alpha=0.7)
    stat = "" if vs.mean is None else f"; mean {vs.mean:.3g}, std {vs.std:.3g}, min {vs.min:.3g}, max {vs.max:.3g}"
    ax_h.set_title(f"values of {min(sample, n):,} random samples{stat}", fontsize=9)
    if outside:
        ax_h.set_xlabel(f"value ({outside:,} values beyond mean +/- 6 std not shown)")
    else:
        ax_h.set_xlabel("value")
    ax_h.set_ylabel("count")
    fig.suptitle(Path(store).name, fontsize=10)
    return _save(plt, fig, out, dpi)
