"""The epoch loop: train one epoch, validate, report, checkpoint; repeat.

Each epoch's metrics (with the share of time spent waiting for data) are summed over the ranks; only rank 0
prints and writes files.  A resumed run starts inside its first epoch at the step its checkpoint recorded, its
metrics continuing from the recorded partial sums.  Epochs are numbered from 1 in every line, metric and JSON.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lmdbstore.training.batches import autocast, to_device
from lmdbstore.training.distributed import all_reduce
from lmdbstore.training.factory import call_model
from lmdbstore.training.metrics import EpochMetrics, append_metrics, epoch_line, validation_line
from lmdbstore.training.resume import RunState
from lmdbstore.training.run import TrainRun
from lmdbstore.training.saving import save_epoch_end, save_inside_epoch, stop_here, stop_requested
from lmdbstore.training.validation import validate
from lmdbstore.util.progress import bars_wanted, progress_bar

__all__ = ["DataWait", "run_epochs", "train_epoch"]


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


def run_epochs(run: TrainRun, state: RunState, train_loader: Any, val_loader: Any | None) -> torch.Tensor:
    """Run the epochs from ``state.start_epoch`` (at ``state.start_step``) to ``cfg.epochs``, updating
    ``state``; return the last validation confusion matrix (the resumed one, or zeros, when no epoch ran or
    there is no validation)."""
    k = len(run.data.classes)
    conf = state.confusion if state.confusion is not None else torch.zeros(k, k, dtype=torch.int64)
    for epoch in range(state.start_epoch, run.cfg.epochs):
        run.sampler.set_epoch(epoch)  # a restored position in this same epoch is kept
        m = train_epoch(run, train_loader, epoch, state, conf)
        if val_loader is not None:
            try:
                conf = _validate(run, val_loader, m)
            except Exception:
                if stop_requested(run):
                    stop_here(run, state, conf, epoch, None, None)
                raise
        state.history.append(m)
        state.start_epoch, state.start_step, state.partial = epoch + 1, 0, None
        run.say(epoch_line(m))
        if run.writes:
            append_metrics(run.out, m)  # type: ignore[arg-type]
        if run.tb is not None:
            run.tb.scalars((epoch + 1) * run.steps, _epoch_scalars(m))
        save_epoch_end(run, state, m, conf)
        if epoch + 1 < run.cfg.epochs and stop_requested(run):
            stop_here(run, state, conf, epoch + 1, 0, None)
    return conf


def _validate(run: TrainRun, loader: Any, m: EpochMetrics) -> torch.Tensor:
    """Score the validation split (or its ``val_limit`` subset) into ``m``; return its confusion matrix."""
    v = validate(run, loader)
    m.val_loss, m.val_accuracy, m.per_class_accuracy = v.loss, v.accuracy, v.per_class
    m.val_samples, m.val_batches = v.samples, v.batches
    return v.confusion


def _validate_inside(run: TrainRun, epoch: int, done: int) -> dict[str, Any]:
    """A validation after step ``done`` of the run, inside epoch ``epoch`` (0-based): said, logged to
    TensorBoard, and returned as its record; the model is put back in training mode."""
    v = validate(run, run.val_loader)
    run.net.train()
    record = v.record(done)
    run.say(validation_line(epoch + 1, record))
    if run.tb is not None:
        run.tb.scalars(done, {"val/loss": v.loss, "val/accuracy": v.accuracy, "val/samples": v.samples,
                              "val/batches": v.batches})  # fmt: skip
    return record


def _epoch_scalars(m: EpochMetrics) -> dict[str, float | None]:
    return {
        "epoch/train_loss": m.train_loss,
        "epoch/val_loss": m.val_loss,
        "epoch/val_accuracy": m.val_accuracy,
        "epoch/samples_per_s": m.samples_per_s,
        "epoch/data_wait_share": m.data_wait_share,
        "epoch/val_samples": m.val_samples,
        "epoch/val_batches": m.val_batches,
    }


def train_epoch(
    run: TrainRun, loader: Any, epoch: int, state: RunState | None = None, conf: torch.Tensor | None = None
) -> EpochMetrics:
    """Epoch ``epoch`` (0-based) up to ``run.steps`` optimizer steps, from ``state.start_step`` when it is
    the epoch ``state`` stops in (whose partial sums it continues); its metrics summed over the ranks.
    With ``cfg.checkpoint_every``, ``checkpoint.pt`` is written every that many steps (``state`` and
    ``conf`` go into it)."""
    run.net.train()
    start = state.start_step if state is not None and state.start_epoch == epoch else 0
    resumed = state.partial if start and state is not None and state.partial and run.info.is_main else None
    loss0, n0, wait0, secs0 = resumed or [0.0, 0.0, 0.0, 0.0]
    validations = list(state.validations or []) if start and state is not None else []
    val_secs = 0.0  # validations inside the epoch: not training time
    timed = DataWait(iter(loader))
    show = bars_wanted(run.progress) and run.info.is_main
    bar = progress_bar(f"epoch {epoch + 1}", total=run.steps, initial=start, unit="batch", enabled=show)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    n_seen = 0
    t0 = time.perf_counter()

    def totals() -> list[float]:
        secs = secs0 + time.perf_counter() - t0 - val_secs
        return [loss0 + float(loss_sum), n0 + n_seen, wait0 + timed.wait, secs]

    for step in range(start, run.steps):
        try:
            x, y = next(timed)
        except StopIteration:
            break
        except Exception:  # e.g. the workers, stopped by the same Ctrl-C
            if stop_requested(run):
                stop_here(run, state or RunState(), _conf(run, conf), epoch, step, totals())
            raise
        loss = _step(run, x, y)
        loss_sum += loss.detach().double() * len(y)
        n_seen += len(y)
        done = epoch * run.steps + step + 1  # optimizer steps of the whole run
        if run.tb is not None and done % run.cfg.log_every == 0:
            run.tb.scalars(done, {"train/loss": loss.item(), "train/lr": run.scheduler.get_last_lr()[0]})
        if run.val_loader is not None and run.cfg.val_every and done % run.cfg.val_every == 0 and step + 1 < run.steps:
            v0 = time.perf_counter()
            validations.append(_validate_inside(run, epoch, done))  # before a checkpoint of the same step
            val_secs += time.perf_counter() - v0
        if run.cfg.checkpoint_every and done % run.cfg.checkpoint_every == 0 and step + 1 < run.steps:
            summed = all_reduce(torch.tensor(totals(), dtype=torch.float64, device=run.device), run.info).tolist()
            kept = state or RunState()
            kept.validations = validations  # this epoch's so far: a resumed run reports them too
            save_inside_epoch(run, kept, _conf(run, conf), epoch, step + 1, summed)
        if show:
            elapsed = time.perf_counter() - t0
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                sps=f"{n_seen * run.info.world_size / elapsed:,.0f}",
                wait=f"{100 * timed.wait / elapsed:.0f}%",
            )
        bar.update(1)
        if step + 1 < run.steps and stop_requested(run):
            bar.close()
            stop_here(run, state or RunState(), _conf(run, conf), epoch, step + 1, totals())
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    bar.close()
    m = _epoch_metrics(run, epoch, totals())
    m.validations = validations
    return m


def _conf(run: TrainRun, conf: torch.Tensor | None) -> torch.Tensor:
    k = len(run.data.classes)
    return conf if conf is not None else torch.zeros(k, k, dtype=torch.int64)


def _step(run: TrainRun, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer and scheduler step on batch ``(x, y)``; returns its mean loss."""
    x, y = to_device(x, y, run.device)
    with autocast(run.device, run.cfg.amp):
        logits = call_model(run.net, x, len(run.data.classes), run.cfg.model)
    loss = nn.functional.cross_entropy(logits.float(), y, label_smoothing=run.cfg.label_smoothing)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    return loss


def _epoch_metrics(run: TrainRun, epoch: int, totals: list[float]) -> EpochMetrics:
    """The metrics of epoch ``epoch`` (0-based; numbered ``epoch + 1``) from this rank's ``[loss sum,
    samples, data wait, seconds]``, summed over ranks (throughput and times are per rank, averaged)."""
    t = torch.tensor(totals, dtype=torch.float64, device=run.device)
    all_reduce(t, run.info)
    loss_total, n_total, wait_total, time_total = t.tolist()
    world = run.info.world_size
    wall = time_total / world
    return EpochMetrics(
        epoch=epoch + 1,
        train_loss=loss_total / max(n_total, 1),
        train_samples=int(n_total),
        samples_per_s=n_total / wall if wall > 0 else 0.0,
        data_wait_share=wait_total / time_total if time_total > 0 else 0.0,
        step_time_ms=1000 * wall / max(1, min(run.steps, math.ceil(n_total / max(world, 1)))),
        lr=float(run.scheduler.get_last_lr()[0]),
        seconds=wall,
    )
