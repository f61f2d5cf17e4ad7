"""The epoch loop: train one epoch, validate, report, checkpoint; repeat.

Each epoch's metrics are summed over the ranks; only rank 0 prints, appends to ``metrics.jsonl`` and writes
``checkpoint.pt`` (every epoch) and ``best.pt`` (a better validation accuracy), both atomically.  The loop
also measures how long it waits for the next batch (the data-wait share), the number that says whether
the loader keeps the model busy.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.training.batches import autocast, to_device
from lmdbstore.training.checkpoint import CHECKPOINT_FORMAT, atomic_save
from lmdbstore.training.data import Sampler, TrainData
from lmdbstore.training.distributed import DistInfo, all_reduce
from lmdbstore.training.evaluate import confusion_summary, score_loader
from lmdbstore.training.metrics import EpochMetrics, Log, append_metrics, epoch_line, history_to_json
from lmdbstore.training.resume import RunState
from lmdbstore.util.progress import progress_bar
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

__all__ = ["DataWait", "TrainRun", "run_epochs", "train_epoch"]


@dataclass
class TrainRun:
    """Everything the epoch loop works with, set up once by :func:`~lmdbstore.training.trainer.train`.

    ``model`` is the bare model (its state dict is what checkpoints hold); ``net`` is what steps run through
    (``model`` wrapped in DistributedDataParallel under torchrun, else ``model`` itself).
    """

    cfg: TrainConfig
    lcfg: LoaderConfig
    info: DistInfo
    device: torch.device
    data: TrainData
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    steps: int  # optimizer steps per epoch
    out: Path | None  # the output directory (``None``: nothing is written)
    progress: bool  # a progress bar per epoch on rank 0
    say: Log  # rank 0's lines (a no-op on the other ranks)


class DataWait:
    """Iterate a loader and add up the time spent waiting for the next batch (``wait``, seconds)."""

    def __init__(self, it: Iterator[Any]):
        self.it = it
        self.wait = 0.0

    def __iter__(self) -> DataWait:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.wait += time.perf_counter() - t0


def run_epochs(
    run: TrainRun, state: RunState, sampler: Sampler, train_loader: Any, val_loader: Any | None
) -> torch.Tensor:
    """Run the epochs from ``state.start_epoch`` to ``cfg.epochs``, updating ``state``; return the last
    validation confusion matrix (the resumed one, or zeros, when no epoch ran or there is no validation)."""
    k = len(run.data.classes)
    conf = state.confusion if state.confusion is not None else torch.zeros(k, k, dtype=torch.int64)
    for epoch in range(state.start_epoch, run.cfg.epochs):
        sampler.set_epoch(epoch)
        m = train_epoch(run, train_loader, epoch)
        if val_loader is not None:
            conf = _validate(run, val_loader, m)
        state.history.append(m)
        run.say(epoch_line(m))
        if run.out is not None and run.info.is_main:
            _save_epoch(run, run.out, state, m, conf)
        if m.val_accuracy is not None:
            state.best_accuracy = max(state.best_accuracy, m.val_accuracy)
    return conf


def _validate(run: TrainRun, loader: Any, m: EpochMetrics) -> torch.Tensor:
    """Score the validation split into ``m``; return its confusion matrix."""
    scores = score_loader(run.net, loader, run.device, len(run.data.classes), amp=run.cfg.amp, info=run.info)
    m.val_loss = scores.mean_loss
    m.val_accuracy, m.per_class_accuracy = confusion_summary(scores.confusion, run.data.classes)
    return scores.confusion


def _save_epoch(run: TrainRun, out: Path, state: RunState, m: EpochMetrics, conf: torch.Tensor) -> None:
    """Append ``m`` to ``out``'s metrics file and write ``checkpoint.pt`` there (and ``best.pt`` for a new
    best validation accuracy)."""
    append_metrics(out, m)
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "epoch": m.epoch,
        "classes": run.data.classes,
        "sample_shape": list(run.data.meta.shape),
        "in_channels": run.data.channels,
        "width": run.cfg.width,
        "history": history_to_json(state.history),
        "best_accuracy": max(state.best_accuracy, m.val_accuracy or -1.0),
        "confusion": conf.tolist(),
        "train_config": json.dumps(asdict(run.cfg)),
        "loader_config": json.dumps(asdict(run.lcfg)),
    }
    atomic_save(ckpt, out / CHECKPOINT_NAME)
    if m.val_accuracy is not None and m.val_accuracy > state.best_accuracy:
        atomic_save(ckpt, out / BEST_NAME)


def train_epoch(run: TrainRun, loader: Any, epoch: int) -> EpochMetrics:
    """One epoch of at most ``run.steps`` optimizer steps; its metrics summed over the ranks."""
    run.net.train()
    timed = DataWait(iter(loader))
    bar = (
        progress_bar(f"epoch {epoch + 1}", total=run.steps, unit="batch") if run.progress and run.info.is_main else None
    )
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    n_seen = 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(timed):
        if step >= run.steps:
            break
        loss = _step(run, x, y)
        loss_sum += loss.detach().double() * len(y)
        n_seen += len(y)
        if bar is not None:
            elapsed = time.perf_counter() - t0
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                sps=f"{n_seen * run.info.world_size / elapsed:,.0f}",
                wait=f"{100 * timed.wait / elapsed:.0f}%",
            )
            bar.update(1)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return _epoch_metrics(run, epoch, [float(loss_sum), float(n_seen), timed.wait, elapsed])


def _step(run: TrainRun, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer and scheduler step on batch ``(x, y)``; returns its mean loss."""
    x, y = to_device(x, y, run.device)
    with autocast(run.device, run.cfg.amp):
        logits = run.net(x)
    loss = nn.functional.cross_entropy(logits.float(), y)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    return loss


def _epoch_metrics(run: TrainRun, epoch: int, totals: list[float]) -> EpochMetrics:
    """The epoch's metrics from this rank's ``[loss sum, samples, data wait, seconds]``, summed over ranks
    (throughput and times are per rank, averaged)."""
    t = torch.tensor(totals, dtype=torch.float64, device=run.device)
    all_reduce(t, run.info)
    loss_total, n_total, wait_total, time_total = t.tolist()
    world = run.info.world_size
    wall = time_total / world
    return EpochMetrics(
        epoch=epoch,
        train_loss=loss_total / max(n_total, 1),
        train_samples=int(n_total),
        samples_per_s=n_total / wall if wall > 0 else 0.0,
        data_wait_share=wait_total / time_total if time_total > 0 else 0.0,
        step_time_ms=1000 * wall / max(1, min(run.steps, math.ceil(n_total / max(world, 1)))),
        lr=float(run.scheduler.get_last_lr()[0]),
        seconds=wall,
    )
