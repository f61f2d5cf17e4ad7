"""Validation at scale: what one validation reads (``TrainConfig.val_limit``), when it runs (every epoch's end, and
every ``TrainConfig.val_every`` steps), and what it reports (samples and batches, summed over the ranks).

``val_limit`` bounds each validation to batches per process (an int) or a share of the split (a float): a fixed
stratified subset, so every validation of the run scores the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lmdbstore.loader.samplers import stratified_split
from lmdbstore.training.evaluate import confusion_summary, score_loader
from lmdbstore.training.run import TrainRun

__all__ = ["Validation", "limit_validation", "plan_words", "validate"]


def limit_validation(
    labels: np.ndarray, val_idx: np.ndarray, limit: int | float | None, batch_size: int, world_size: int, seed: int
) -> np.ndarray:
    """The validation samples one validation reads: all of ``val_idx`` without ``limit``; else a subset of it,
    stratified by ``labels`` and seeded by ``seed`` (the same for the whole run), of ``limit`` batches of
    ``batch_size`` on each of ``world_size`` processes (an int) or of that share of ``val_idx`` (a float), sorted
    (index order reads the store in sequence)."""
    n = len(val_idx)
    if limit is None or n == 0:
        return val_idx
    want = limit * batch_size * world_size if isinstance(limit, int) else max(1, round(limit * n))
    if want >= n:
        return val_idx
    if want < 2:  # the split needs a count of 2 or more: one sample is the first of a seeded permutation
        return val_idx[np.sort(np.random.default_rng([seed, 0x7A1]).permutation(n)[:want])]
    _, keep = stratified_split(labels[val_idx], want, seed + 1)
    return val_idx[keep]


@dataclass(frozen=True)
class Validation:
    """What one validation measured: loss, accuracy, per-class accuracy, the confusion matrix, the samples read
    (summed over the ranks) and the batches each rank read."""

    loss: float
    accuracy: float | None
    per_class: dict[str, float | None]
    confusion: torch.Tensor
    samples: int
    batches: int

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record of a validation inside an epoch, after optimizer step ``step`` of the run."""
        return {"step": step, "samples": self.samples, "batches": self.batches, "loss": self.loss,
                "accuracy": self.accuracy}  # fmt: skip


def validate(run: TrainRun, loader: Any) -> Validation:
    """Score the run's model on ``loader`` (every rank its share) and count what it read.

    Raises:
        RuntimeError: the ranks read different numbers of batches (an invariant of the dealt subset).
    """
    cfg, classes, info = run.cfg, run.data.classes, run.info
    scores = score_loader(run.net, loader, run.device, len(classes), amp=cfg.amp, info=info, model_ref=cfg.model)
    span = torch.tensor([scores.batches, -scores.batches], dtype=torch.int64, device=run.device)
    if info.active:
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
    most, fewest = int(span[0]), -int(span[1])
    if most != fewest:
        raise RuntimeError(f"the ranks read {fewest} to {most} validation batches: they must read as many")
    acc, per_class = confusion_summary(scores.confusion, classes)
    return Validation(scores.mean_loss, acc, per_class, scores.confusion, scores.samples, most)


def plan_words(samples: int, batches: int, val_every: int | None, limited: bool, total: int) -> str:
    """The plan line's words on validation: how many samples each validation reads, and when."""
    if samples == 0:
        return "no validation"
    when = "every epoch's end" + (f" and every {val_every} steps" if val_every else "")
    of = f" of {total:,}" if limited else ""
    return f"validates {samples:,}{of} samples ({batches} batch(es) a process) at {when}"
