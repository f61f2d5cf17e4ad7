"""Scoring a model on a store: the evaluation loop the trainer validates with each epoch, and
:func:`evaluate` (what ``lmdbstore eval`` runs) for a checkpoint from :func:`~lmdbstore.training.trainer.train`.

Both go through :func:`score_loader`, so validation during training and a later ``eval`` of the same split
count losses, accuracy and the confusion matrix the same way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.batches import autocast, place_model, to_device
from lmdbstore.training.checkpoint import check_checkpoint, load_checkpoint, model_channels, model_from_checkpoint
from lmdbstore.training.distributed import DistInfo, all_reduce, resolve_device
from lmdbstore.util.paths import check_output_file, write_errors

__all__ = ["Scores", "confusion_summary", "evaluate", "format_confusion", "score_loader"]


@dataclass
class Scores:
    """What :func:`score_loader` counted (summed over ranks)."""

    loss_sum: float
    confusion: torch.Tensor  # (classes, classes) int64 on the CPU; rows: true class, columns: predicted
    predictions: list[np.ndarray] = field(default_factory=list)  # per batch, uint16 class ids (if kept)

    @property
    def samples(self) -> int:
        return int(self.confusion.sum())

    @property
    def mean_loss(self) -> float:
        """Mean cross-entropy per sample (NaN when nothing was scored)."""
        n = self.samples
        return self.loss_sum / n if n else math.nan


@torch.no_grad()
def score_loader(
    model: nn.Module,
    loader: Any,
    device: torch.device,
    n_classes: int,
    *,
    amp: bool = False,
    info: DistInfo | None = None,
    keep_predictions: bool = False,
) -> Scores:
    """Run ``model`` (put in eval mode) over every ``(x, y)`` batch of ``loader`` and count the summed
    cross-entropy and the confusion matrix, all-reduced over the ranks of ``info`` (default: one process).

    ``amp``: bfloat16 autocast on CUDA (default off).  ``keep_predictions``: also keep each batch's predicted
    class ids (uint16), in loader order.
    """
    model.eval()
    k = n_classes
    conf = torch.zeros(k, k, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    preds: list[np.ndarray] = []
    for x, y in loader:
        x, y = to_device(x, y, device)
        with autocast(device, amp):
            logits = model(x)
        loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
        pred = logits.argmax(1)
        conf += torch.bincount(y * k + pred, minlength=k * k).view(k, k)
        if keep_predictions:
            preds.append(pred.cpu().numpy().astype(np.uint16))
    info = info or DistInfo()
    all_reduce(conf, info)
    all_reduce(loss_sum, info)
    return Scores(float(loss_sum), conf.cpu(), preds)


def confusion_summary(conf: torch.Tensor, classes: list[str]) -> tuple[float | None, dict[str, float | None]]:
    """``(accuracy, per-class accuracy)`` of a confusion matrix; ``None`` where there were no samples."""
    total = int(conf.sum())
    acc = float(conf.diag().sum()) / total if total else None
    per_class: dict[str, float | None] = {}
    for i, name in enumerate(classes):
        n = int(conf[i].sum())
        per_class[name] = float(conf[i, i]) / n if n else None
    return acc, per_class


def format_confusion(conf: list[list[int]], classes: list[str]) -> str:
    """Plain-text confusion matrix (rows: true class, columns: predicted)."""
    w = max(8, *(len(c) for c in classes)) + 1
    lines = ["true \\ pred".ljust(w) + "".join(c[: w - 1].rjust(w) for c in classes)]
    for name, row in zip(classes, conf, strict=True):
        lines.append(name[: w - 1].ljust(w) + "".join(str(v).rjust(w) for v in row))
    return "\n".join(lines)


def evaluate(
    store: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    *,
    batch_size: int = LoaderConfig.batch_size,
    workers: int = LoaderConfig.workers,
    device: str = TrainConfig.device,
    indices: np.ndarray | None = None,
    predictions_out: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Score ``store`` (or the given ``indices`` of it) with a checkpoint from
    :func:`~lmdbstore.training.trainer.train`.

    Args:
        store: the store directory.
        checkpoint: ``checkpoint.pt`` or ``best.pt`` of a training run.
        batch_size: samples per batch (default 4096); workers: DataLoader workers (default 2).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda:1"``...
        indices: the samples to score (default: all); scored in sorted order.
        predictions_out: with it, the predicted class ids (uint16, one per scored sample, in index order)
            are saved there as ``.npy``.

    Returns a dict with ``samples``, ``loss``, ``accuracy``, ``per_class_accuracy`` and ``confusion`` (and
    ``store``, ``checkpoint``, ``classes``).

    Raises:
        ValidationError: the store's samples have a shape the CNN cannot take.
        LmdbStoreError: unreadable checkpoint, or one trained on other classes, another number of
            channels or another sample shape; ``predictions_out`` cannot be written.
    """
    path = Path(store)
    if predictions_out is not None:
        check_output_file(predictions_out, "predictions file", sources=[path])  # before scoring, not after
    with StoreReader(path) as reader:
        meta = reader.meta
    model_channels(meta.shape, path)
    dev = resolve_device(device, DistInfo())
    ckpt = load_checkpoint(checkpoint, map_location=dev)
    check_checkpoint(ckpt, list(meta.classes), meta.shape, Path(checkpoint))
    model = place_model(model_from_checkpoint(ckpt, Path(checkpoint)), dev)
    idx = np.arange(meta.count, dtype=np.int64) if indices is None else np.sort(np.asarray(indices, np.int64))
    loader = make_loader(
        LmdbBatchDataset(reader),
        EpochBatchSampler(idx, batch_size, shuffle="none"),
        LoaderConfig(batch_size=batch_size, workers=workers, persistent_workers=False),
    )
    scores = score_loader(model, loader, dev, len(meta.classes), keep_predictions=predictions_out is not None)
    if predictions_out is not None:
        with write_errors(predictions_out, "write predictions"):
            preds = scores.predictions
            np.save(predictions_out, np.concatenate(preds) if preds else np.zeros(0, np.uint16))
    acc, per_class = confusion_summary(scores.confusion, list(meta.classes))
    n = scores.samples
    return {
        "store": str(path),
        "checkpoint": str(checkpoint),
        "samples": n,
        "loss": scores.loss_sum / n if n else None,
        "accuracy": acc,
        "per_class_accuracy": per_class,
        "confusion": scores.confusion.tolist(),
        "classes": list(meta.classes),
    }
