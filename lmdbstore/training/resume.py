"""Where a training run stands between epochs, and how ``--resume`` restores it from ``checkpoint.pt``.

A resumed run needs the checkpoint of the same model (classes, channels, sample shape and width), its
weights and optimizer state, the epoch reached, the metrics history, the best validation accuracy and the
last validation confusion matrix.  Every reason a checkpoint cannot be resumed is one
:class:`~lmdbstore.errors.LmdbStoreError` line naming the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.errors import LmdbStoreError
from lmdbstore.training.checkpoint import (
    RESUME_KEYS,
    check_checkpoint,
    first_line,
    is_int,
    load_checkpoint,
    load_weights,
)
from lmdbstore.training.metrics import EpochMetrics, history_from_json

__all__ = ["RunState", "restore_state", "resume_run"]


@dataclass
class RunState:
    """The run so far: first epoch still to run, best validation accuracy (-1 before any), the epochs'
    metrics, and the last validation confusion matrix (``None`` before any, or from a checkpoint of before
    it was kept)."""

    start_epoch: int = 0
    best_accuracy: float = -1.0
    history: list[EpochMetrics] = field(default_factory=list)
    confusion: torch.Tensor | None = None


def resume_run(
    ckpt_path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    classes: list[str],
    shape: tuple[int, ...],
    width: int,
    device: torch.device,
) -> RunState:
    """Load ``ckpt_path`` into ``model`` and ``optimizer`` and return where its run stopped.

    Raises:
        LmdbStoreError: no usable checkpoint there, one trained on other classes, channels, shape or
            ``width``, weights that do not fit, or resume state missing or malformed.
    """
    ckpt = load_checkpoint(ckpt_path, map_location=device)
    check_checkpoint(ckpt, classes, shape, ckpt_path)
    if ckpt["width"] != width:
        raise LmdbStoreError(f"checkpoint was trained with width {ckpt['width']}, not {width}", path=ckpt_path)
    load_weights(model, ckpt, ckpt_path)
    return restore_state(ckpt, optimizer, len(classes), ckpt_path)


def restore_state(ckpt: dict[str, Any], optimizer: torch.optim.Optimizer, n_classes: int, ckpt_path: Path) -> RunState:
    """Restore the optimizer from a loaded checkpoint and return the run state it recorded (the first epoch
    to run is the one after the checkpoint's).

    Raises:
        LmdbStoreError: a resume key missing, or one of them malformed (one line, the first line of the cause).
    """
    missing = sorted(RESUME_KEYS - ckpt.keys())
    if missing:
        raise LmdbStoreError(f"checkpoint cannot be resumed (no {', '.join(missing)})", path=ckpt_path)
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch = ckpt["epoch"]
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
        best_acc = float(ckpt.get("best_accuracy", -1.0))
        history = history_from_json(ckpt["history"])
        conf = torch.tensor(ckpt["confusion"], dtype=torch.int64) if "confusion" in ckpt else None
        if conf is not None and tuple(conf.shape) != (n_classes, n_classes):
            raise ValueError(f"confusion matrix of shape {tuple(conf.shape)}, expected {n_classes}x{n_classes}")
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise LmdbStoreError(f"checkpoint cannot be resumed ({first_line(exc)})", path=ckpt_path) from exc
    return RunState(epoch + 1, best_acc, history, conf)
