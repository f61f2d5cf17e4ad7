"""Writing ``checkpoint.pt`` (and ``best.pt``): at the end of every epoch, and with
``TrainConfig.checkpoint_every`` also every that many steps inside an epoch (docs/design.md#resuming-inside-an-epoch).

A checkpoint holds what resuming needs to continue exactly where it was written (:func:`checkpoint_dict`), only
tensors and primitives (it loads with ``torch.load(weights_only=True)``), written atomically.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import torch

from lmdbstore.errors import TrainingInterrupted
from lmdbstore.training.checkpoint import CHECKPOINT_FORMAT, atomic_save, model_name
from lmdbstore.training.factory import feed_shape, model_ref
from lmdbstore.training.metrics import EpochMetrics, history_to_json
from lmdbstore.training.order import order_of
from lmdbstore.training.resume import RunState
from lmdbstore.training.run import TrainRun
from lmdbstore.util.jsonsafe import json_safe
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

__all__ = ["checkpoint_dict", "save_epoch_end", "save_inside_epoch", "stop_here", "stop_requested"]


def checkpoint_dict(
    run: TrainRun, state: RunState, conf: torch.Tensor, *, finished: int, step: int, totals: list[float] | None
) -> dict[str, Any]:
    """The checkpoint of ``run`` after epoch ``finished`` (0-based; -1 before any) and ``step`` steps of the
    next one (``totals``: their summed ``[loss sum, samples, data wait, seconds]``)."""
    ckpt: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "epoch": finished,
        "step": step,
        "rng": torch.get_rng_state(),
        "classes": run.data.classes,
        "sample_shape": list(run.data.meta.shape),
        "in_channels": run.data.channels,
        "width": run.cfg.width,
        "model_factory": model_name(model_ref(run.cfg.model)),
        "model_args": json.dumps(run.cfg.model_kwargs, sort_keys=True),
        "in_shape": list(feed_shape(run.data.meta.shape)),
        "history": history_to_json(state.history),
        "best_accuracy": state.best_accuracy,
        "confusion": conf.tolist(),
        "train_config": json.dumps(asdict(run.cfg)),
        "loader_config": json.dumps(asdict(run.lcfg)),
        "order": order_of(run.sampler).to_json(),  # auto's choice and the window's size: a resumed run keeps them
        "split": run.splits,  # what the split was drawn from: eval, export and a resumed run draw it again exactly
    }
    if step:
        ckpt["epoch_totals"] = list(totals or [])
        # the loader's state: the batches it delivered, which the loop has trained (its sampler has drawn more
        # for the workers); the sampler's format, so checkpoints of earlier versions load the same way
        at = run.train_loader.state_dict()
        assert (at["epoch"], at["position"]) == (finished + 1, step), (at, finished, step)
        ckpt["sampler"] = json.dumps(at)
        ckpt["validations"] = json.dumps(json_safe(state.validations or []))  # this epoch's, inside it
    return ckpt


def save_epoch_end(run: TrainRun, state: RunState, m: EpochMetrics, conf: torch.Tensor) -> None:
    """After epoch ``m`` (its metrics already in ``state.history``): ``checkpoint.pt``, and ``best.pt`` for a
    new best validation accuracy (``state.best_accuracy`` is updated)."""
    improved = m.val_accuracy is not None and m.val_accuracy > state.best_accuracy
    if m.val_accuracy is not None:
        state.best_accuracy = max(state.best_accuracy, m.val_accuracy)
    if not run.writes:
        return
    assert run.out is not None
    ckpt = checkpoint_dict(run, state, conf, finished=m.epoch - 1, step=0, totals=None)
    atomic_save(ckpt, run.out / CHECKPOINT_NAME)
    if improved:
        atomic_save(ckpt, run.out / BEST_NAME)


def save_inside_epoch(
    run: TrainRun, state: RunState, conf: torch.Tensor, epoch: int, step: int, totals: list[float]
) -> None:
    """``checkpoint.pt`` after ``step`` steps of epoch ``epoch`` (0-based), ``totals`` summed over ranks."""
    if run.writes:
        assert run.out is not None
        ckpt = checkpoint_dict(run, state, conf, finished=epoch - 1, step=step, totals=totals)
        atomic_save(ckpt, run.out / CHECKPOINT_NAME)


def stop_requested(run: TrainRun) -> bool:
    """Whether the run's ``stop`` callback asks to stop now."""
    return run.stop is not None and bool(run.stop())


def stop_here(
    run: TrainRun, state: RunState, conf: torch.Tensor, epoch: int, step: int | None, totals: list[float] | None
) -> None:
    """Stop the run ``step`` steps into epoch ``epoch`` (0-based): write ``checkpoint.pt`` there (``step`` 0 or
    ``None``, inside a step or a validation: the last one written stays) and raise.

    Raises:
        TrainingInterrupted: always, naming the checkpoint to resume from (``None`` when there is none).
    """
    path = run.out / CHECKPOINT_NAME if run.out is not None else None
    if step and run.writes:
        save_inside_epoch(run, state, conf, epoch, step, totals or [])
    if path is not None and not path.is_file():
        path = None
    where = f"after step {step} of epoch {epoch + 1}" if step else f"in epoch {epoch + 1}"
    if step == 0:
        where = f"after epoch {epoch}"
    saved = f"checkpoint {'written' if step else 'kept'}" if path is not None else "no checkpoint written"
    raise TrainingInterrupted(f"training stopped {where}; {saved}", checkpoint=path, epoch=epoch + 1, step=step or 0)
