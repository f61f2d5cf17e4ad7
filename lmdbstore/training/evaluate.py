"""Scoring a model on a store: the evaluation loop the trainer validates with each epoch, and
:func:`evaluate` (what ``lmdbstore eval`` runs) for a checkpoint from :func:`~lmdbstore.training.trainer.train`.

Both go through :func:`score_loader`, so validation during training and a later ``eval`` of the same split
count losses, accuracy and the confusion matrix the same way.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.errors import LmdbStoreError, preview
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.choose import recorded_splits, split_indices
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.store.metaview import check_in_range, sample_indices
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import as_reader
from lmdbstore.training.batches import autocast, place_model, to_device
from lmdbstore.training.checkpoint import check_checkpoint, load_checkpoint, model_channels, model_from_checkpoint
from lmdbstore.training.distributed import DistInfo, all_reduce, resolve_device
from lmdbstore.training.factory import call_model
from lmdbstore.util.paths import check_output_file, write_errors

__all__ = ["Scores", "class_map", "confusion_summary", "evaluate", "format_confusion", "score_loader"]


@dataclass
class Scores:
    """What :func:`score_loader` counted (summed over ranks)."""

    loss_sum: float
    confusion: torch.Tensor  # (classes, classes) int64 on the CPU; rows: true class, columns: predicted
    predictions: list[np.ndarray] = field(default_factory=list)  # per batch, uint16 class ids (if kept)
    batches: int = 0  # batches this rank scored

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
    label_map: torch.Tensor | None = None,
    model_ref: str = "model",
) -> Scores:
    """Run ``model`` (put in eval mode) over every ``(x, y)`` batch of ``loader`` and count the summed
    cross-entropy and the confusion matrix, all-reduced over the ranks of ``info`` (default: one process).

    ``amp``: bfloat16 autocast on CUDA.  ``keep_predictions``: keep each batch's predicted class ids (uint16).
    ``label_map``: the model's class id of each of the loader's label ids.  ``model_ref``: the model's factory,
    named when the model raises in ``forward``.
    """
    model.eval()
    k = n_classes
    conf = torch.zeros(k, k, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    preds: list[np.ndarray] = []
    lmap = label_map.to(device) if label_map is not None else None
    batches = 0
    for x, y in loader:
        batches += 1
        x, y = to_device(x, y, device)
        if lmap is not None:
            y = lmap[y]
        with autocast(device, amp):
            logits = call_model(model, x, k, model_ref)
        loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
        pred = logits.argmax(1)
        conf += torch.bincount(y * k + pred, minlength=k * k).view(k, k)
        if keep_predictions:
            preds.append(pred.cpu().numpy().astype(np.uint16))
    info = info or DistInfo()
    all_reduce(conf, info)
    all_reduce(loss_sum, info)
    return Scores(float(loss_sum), conf.cpu(), preds, batches)


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


def class_map(store_classes: list[str], model_classes: list[str], ckpt_path: Path) -> torch.Tensor | None:
    """The model's class id of each of the store's classes, matched by name (``None``: the same list).

    Raises:
        LmdbStoreError: a class of the store the model was not trained on.
    """
    if store_classes == model_classes:
        return None
    unknown = [c for c in store_classes if c not in model_classes]
    if unknown:
        raise LmdbStoreError(
            f"the store has classes the checkpoint was not trained on: [{preview(unknown)}] "
            f"(it knows [{preview(model_classes)}])",
            path=ckpt_path,
            hint="score stores whose classes are among the checkpoint's",
        )
    return torch.tensor([model_classes.index(c) for c in store_classes], dtype=torch.int64)


def evaluate(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    checkpoint: str | os.PathLike[str],
    *,
    batch_size: int = LoaderConfig.batch_size,
    workers: int = LoaderConfig.workers,
    device: str = TrainConfig.device,
    indices: np.ndarray | None = None,
    predictions_out: str | os.PathLike[str] | None = None,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    split: str | None = None,
) -> dict[str, Any]:
    """Score ``store`` (or its ``indices``, in sorted order) with a checkpoint of
    :func:`~lmdbstore.training.trainer.train`; classes are matched by name (the store's may be any of the
    checkpoint's, in any order), the scores are over the checkpoint's (``None`` for a class with no sample).

    Args:
        store: the store directory, or a list of them scored as one set (one index space, classes by name).
        checkpoint: ``checkpoint.pt`` or ``best.pt`` of a training run.
        batch_size, workers, device: as :class:`LoaderConfig` and :class:`TrainConfig` (default 4096, 2, auto).
        predictions_out: where to save the predicted class ids (uint16, in index order) as ``.npy``.
        model, model_args: the factory of a checkpoint of the user's own model (required for one: a checkpoint
            never chooses code to import) and its arguments (default: the built-in CNN; the checkpoint's).
        split: ``"train"`` or ``"val"``: exactly that part of the run's split (its record in the checkpoint:
            :class:`~lmdbstore.loader.choose.SplitRecord`); default ``None``: every sample (or ``indices``).

    Returns a dict with ``samples``, ``loss``, ``accuracy``, ``per_class_accuracy`` and ``confusion`` over
    the checkpoint's ``classes`` (and ``store``: the first store, ``stores``: all, ``checkpoint``).

    Raises:
        ValidationError: samples of a shape the CNN cannot take; stores of a set that do not make one set.
        LmdbStoreError: unreadable checkpoint, or one of other channels or sample shape, or without a class of
            the store; ``predictions_out`` cannot be written; with ``split``: a checkpoint that records no
            split, or a store that changed since the run.
        ModelError: a checkpoint of the user's model without ``model``, or of another factory or arguments.
        ValueError: ``split`` not ``"train"``/``"val"``, or with ``indices``; indices that are not integers.
        IndexError: an index outside the store.
    """
    if split not in (None, "train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if split is not None and indices is not None:
        raise ValueError("split and indices exclude each other")
    reader = as_reader(store)
    path = reader.path
    if predictions_out is not None:
        check_output_file(predictions_out, "predictions file", sources=list(getattr(reader, "paths", [path])))
    with reader:
        meta = reader.meta
        labels = reader.labels() if split is not None else None
    if model is None:
        model_channels(meta.shape, path)  # the built-in CNN's shapes
    dev = resolve_device(device, DistInfo())
    ckpt = load_checkpoint(checkpoint, map_location=dev)
    classes = list(ckpt["classes"])
    check_checkpoint(ckpt, classes, meta.shape, Path(checkpoint))  # shape and channels; classes by name below
    label_map = class_map(list(meta.classes), classes, Path(checkpoint))
    net = place_model(model_from_checkpoint(ckpt, Path(checkpoint), model, model_args), dev)
    idx = np.arange(meta.count, dtype=np.int64) if indices is None else np.sort(sample_indices(indices))
    check_in_range(idx, meta.count)
    if labels is not None:
        idx = split_indices(labels, split, recorded=recorded_splits(ckpt, Path(checkpoint)), path=path)
    loader = make_loader(
        LmdbBatchDataset(reader),
        EpochBatchSampler(idx, batch_size, shuffle="none"),
        LoaderConfig(batch_size=batch_size, workers=workers, persistent_workers=False),
    )
    scores = score_loader(
        net,
        loader,
        dev,
        len(classes),
        keep_predictions=predictions_out is not None,
        label_map=label_map,
        model_ref=model or "the built-in CNN",
    )
    if predictions_out is not None:
        with write_errors(predictions_out, "write predictions"):
            preds = scores.predictions
            np.save(predictions_out, np.concatenate(preds) if preds else np.zeros(0, np.uint16))
    acc, per_class = confusion_summary(scores.confusion, classes)
    n = scores.samples
    return {
        "store": str(path),
        "stores": [str(p) for p in (reader.paths if isinstance(reader, StoreSet) else [path])],
        "checkpoint": str(checkpoint),
        "samples": n,
        "loss": scores.loss_sum / n if n else None,
        "accuracy": acc,
        "per_class_accuracy": per_class,
        "confusion": scores.confusion.tolist(),
        "classes": classes,
        "split": split,
    }
