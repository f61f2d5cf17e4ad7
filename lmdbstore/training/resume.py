"""Where a training run stands (:class:`RunState`), and how ``--resume`` restores it from ``checkpoint.pt``
(written by :mod:`~lmdbstore.training.saving`).  Every reason a checkpoint cannot be resumed is one
:class:`~lmdbstore.errors.LmdbStoreError` line naming the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.errors import LmdbStoreError
from lmdbstore.training.checkpoint import (
    RESUME_KEYS,
    check_checkpoint,
    check_model_spec,
    first_line,
    is_int,
    load_weights,
)
from lmdbstore.training.metrics import EpochMetrics, history_from_json

__all__ = ["RunState", "restore_state", "resume_run"]

#: Entries of a checkpoint's ``epoch_totals``: loss sum, samples, data wait, seconds.
TOTALS = 4


@dataclass
class RunState:
    """The run so far: first epoch still to run and the steps of it already trained (with their summed
    ``[loss sum, samples, data wait, seconds]`` and the sampler state they left), best validation accuracy
    (-1 before any), the epochs' metrics, the last validation confusion matrix (``None`` before any, or
    from a checkpoint of before it was kept), and the random generator state to continue with."""

    start_epoch: int = 0
    start_step: int = 0
    partial: list[float] | None = None
    sampler: dict[str, Any] | None = None
    best_accuracy: float = -1.0
    history: list[EpochMetrics] = field(default_factory=list)
    confusion: torch.Tensor | None = None
    rng: torch.Tensor | None = None
    validations: list[dict[str, Any]] | None = None  # the validations of the epoch it stops in, before its step

    def global_step(self, steps: int) -> int:
        """Optimizer steps done before the run continues, at ``steps`` per epoch."""
        return self.start_epoch * steps + self.start_step


def resume_run(
    ckpt: dict[str, Any],
    ckpt_path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    classes: list[str],
    shape: tuple[int, ...],
    spec: tuple[str, dict[str, Any]],
) -> RunState:
    """Load the checkpoint ``ckpt`` (of ``ckpt_path``) into ``model`` and ``optimizer`` and return where its run
    stopped; ``spec``: the model's name and its factory's arguments, which the checkpoint's must equal.

    Raises:
        LmdbStoreError: no usable checkpoint there, one trained on other classes, channels or shape, weights
            that do not fit, or resume state missing or malformed.
        ModelError: a checkpoint of another model (factory or arguments).
    """
    check_checkpoint(ckpt, classes, shape, ckpt_path)
    check_model_spec(ckpt, spec[0], spec[1], ckpt_path)
    load_weights(model, ckpt, ckpt_path)
    return restore_state(ckpt, optimizer, len(classes), ckpt_path)


def restore_state(ckpt: dict[str, Any], optimizer: torch.optim.Optimizer, n_classes: int, ckpt_path: Path) -> RunState:
    """Restore the optimizer from a loaded checkpoint and return the run state it recorded.  Raises
    LmdbStoreError (one line) for a resume key missing or malformed."""
    missing = sorted(RESUME_KEYS - ckpt.keys())
    if missing:
        raise LmdbStoreError(f"checkpoint cannot be resumed (no {', '.join(missing)})", path=ckpt_path)
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch, step = ckpt["epoch"], ckpt.get("step", 0)
        if not is_int(step) or step < 0:
            raise ValueError(f"step {step!r} is not a non-negative integer")
        if not is_int(epoch) or epoch < (-1 if step else 0):
            raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
        best_acc = float(ckpt.get("best_accuracy", -1.0))
        history = history_from_json(ckpt["history"])
        conf = torch.tensor(ckpt["confusion"], dtype=torch.int64) if "confusion" in ckpt else None
        if conf is not None and tuple(conf.shape) != (n_classes, n_classes):
            raise ValueError(f"confusion matrix of shape {tuple(conf.shape)}, expected {n_classes}x{n_classes}")
        rng = ckpt.get("rng")
        if rng is not None and (not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8):
            raise ValueError("rng is not a random generator state")
        partial, sampler = _inside_epoch(ckpt) if step else (None, None)
        validations = _validations(ckpt) if step else None
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise LmdbStoreError(f"checkpoint cannot be resumed ({first_line(exc)})", path=ckpt_path) from exc
    return RunState(epoch + 1, step, partial, sampler, best_acc, history, conf, rng, validations)


def _validations(ckpt: dict[str, Any]) -> list[dict[str, Any]]:
    """The validations a checkpoint written inside an epoch recorded for it (none in checkpoints without them).

    Raises:
        ValueError: not a JSON list of objects.
    """
    found = json.loads(ckpt.get("validations", "[]"))
    if not isinstance(found, list) or not all(isinstance(v, dict) for v in found):
        raise ValueError("validations is not a JSON list of objects")
    return found


def _inside_epoch(ckpt: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    """The partial metrics and the sampler state of a checkpoint written inside an epoch.

    Raises:
        ValueError: either is missing or malformed.
    """
    totals = ckpt.get("epoch_totals")
    if not isinstance(totals, list) or len(totals) != TOTALS or not all(isinstance(v, (int, float)) for v in totals):
        raise ValueError(f"epoch_totals must be a list of {TOTALS} numbers")
    sampler = json.loads(ckpt["sampler"])
    if not isinstance(sampler, dict):
        raise ValueError("sampler state is not a JSON object")
    return [float(v) for v in totals], sampler
