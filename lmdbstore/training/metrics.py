"""What a training run reports: the metrics of each epoch, the line rank 0 prints for it, and the files in
the output directory (``metrics.jsonl``, one JSON object per epoch, and ``summary.json`` at the end).

Every JSON written here is valid JSON: non-finite numbers (a NaN loss) are written as ``null``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmdbstore.util.atomic import atomic_paths
from lmdbstore.util.jsonsafe import json_safe
from lmdbstore.util.runfiles import METRICS_NAME, SUMMARY_NAME

__all__ = [
    "EpochMetrics",
    "Log",
    "append_metrics",
    "clear_metrics",
    "rewrite_metrics",
    "epoch_line",
    "validation_line",
    "history_from_json",
    "history_to_json",
    "write_summary",
]


#: Where rank 0 sends its lines (``print`` by default).
Log = Callable[[str], None]


@dataclass
class EpochMetrics:
    """What one epoch measured (rank-0 view, reduced over ranks); ``epoch`` counts from 1."""

    epoch: int
    train_loss: float
    train_samples: int
    samples_per_s: float
    data_wait_share: float
    step_time_ms: float
    val_loss: float | None = None
    val_accuracy: float | None = None
    per_class_accuracy: dict[str, float | None] = field(default_factory=dict)
    lr: float = 0.0
    seconds: float = 0.0
    val_samples: int | None = None  #: samples the epoch-end validation read (all ranks)
    val_batches: int | None = None  #: batches it read on each rank
    #: validations inside the epoch (``TrainConfig.val_every``): step of the run, samples, batches, loss, accuracy
    validations: list[dict[str, Any]] = field(default_factory=list)


def epoch_line(m: EpochMetrics) -> str:
    """The one line an epoch prints: losses, validation accuracy, throughput, data wait, time."""
    val = f", val loss {m.val_loss:.4f}, val acc {m.val_accuracy:.4f}" if m.val_accuracy is not None else ""
    if val and m.val_samples is not None:
        val += f" ({m.val_samples:,} samples)"
    return (
        f"epoch {m.epoch}: train loss {m.train_loss:.4f}{val}, {m.samples_per_s:,.0f} samples/s, "
        f"data wait {100 * m.data_wait_share:.1f}%, {m.seconds:.1f}s"
    )


def validation_line(epoch: int, v: dict[str, Any]) -> str:
    """The line a validation inside an epoch prints (``v``: its record, see :attr:`EpochMetrics.validations`)."""
    acc = "-" if v["accuracy"] is None else f"{v['accuracy']:.4f}"
    return (
        f"epoch {epoch} step {v['step']}: val loss {v['loss']:.4f}, val acc {acc} "
        f"({v['samples']:,} samples, {v['batches']} batch(es) a process)"
    )


def history_to_json(history: list[EpochMetrics]) -> str:
    """The epochs so far as a JSON string (how a checkpoint keeps them: a string, not a pickled object)."""
    return json.dumps([asdict(h) for h in history])


def history_from_json(text: str) -> list[EpochMetrics]:
    """The inverse of :func:`history_to_json`.

    Raises:
        ValueError, TypeError: not such a JSON list (the caller words the error).
    """
    return [EpochMetrics(**m) for m in json.loads(text)]


def clear_metrics(out: Path) -> None:
    """Remove ``out/metrics.jsonl`` left by an earlier run (a new run, not a resumed one, starts it afresh)."""
    (out / METRICS_NAME).unlink(missing_ok=True)


def _line(m: EpochMetrics) -> str:
    return json.dumps(json_safe(asdict(m)), allow_nan=False) + "\n"


def append_metrics(out: Path, m: EpochMetrics) -> None:
    """Add epoch ``m`` as one JSON line to ``out/metrics.jsonl``."""
    with open(out / METRICS_NAME, "a") as fh:
        fh.write(_line(m))


def rewrite_metrics(out: Path, history: list[EpochMetrics]) -> None:
    """Write ``out/metrics.jsonl`` anew from ``history`` (a resumed run's, from its checkpoint), atomically."""
    with atomic_paths([out / METRICS_NAME]) as (tmp,):
        tmp.write_text("".join(_line(m) for m in history))


def write_summary(out: Path, classes: list[str], confusion: list[list[int]], final: EpochMetrics, store: Path) -> None:
    """Write ``out/summary.json``: the classes, the validation confusion matrix, the last epoch, the store."""
    summary = {"classes": classes, "confusion": confusion, "final": asdict(final), "store": str(store)}
    (out / SUMMARY_NAME).write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
