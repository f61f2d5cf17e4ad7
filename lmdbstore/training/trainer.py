"""Training the CNN (or the user's model) on a store, on one process or under ``torchrun`` (DDP): :func:`train`,
what ``lmdbstore train`` runs.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank joins a process group (NCCL on CUDA, gloo on CPU), reads its
own disjoint share of each epoch's order, and only rank 0 prints and writes files
(docs/design.md#ddp-beyond-one-machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lmdbstore.config import BUILTIN_MODEL, LoaderConfig, TrainConfig
from lmdbstore.errors import LmdbStoreError
from lmdbstore.loader.choose import recorded_splits
from lmdbstore.training.batches import place_model
from lmdbstore.training.checkpoint import check_checkpoint, load_checkpoint, model_name
from lmdbstore.training.data import TrainData, make_loaders, read_store
from lmdbstore.training.distributed import DistInfo, device_kind, init_distributed, resolve_device
from lmdbstore.training.evaluate import format_confusion
from lmdbstore.training.factory import build_from, feed_shape, load_factory, model_ref
from lmdbstore.training.loop import run_epochs
from lmdbstore.training.metrics import EpochMetrics, Log, clear_metrics, rewrite_metrics, write_summary
from lmdbstore.training.optim import compiled, make_optimizer
from lmdbstore.training.order import order_of, recorded_order
from lmdbstore.training.placement import rank_data, split_sizes
from lmdbstore.training.resume import RunState, resume_run
from lmdbstore.training.run import TrainRun
from lmdbstore.training.rundir import prepare_run_dir, remove_run_files
from lmdbstore.training.tboard import ScalarLog, open_scalar_log
from lmdbstore.training.validation import limit_validation, plan_words
from lmdbstore.util.launch import launch
from lmdbstore.util.paths import make_output_dir
from lmdbstore.util.runfiles import CHECKPOINT_NAME

__all__ = ["TrainResult", "train"]

#: Share of the one-cycle schedule spent warming up to the peak learning rate.
WARMUP_SHARE = 0.15


@dataclass
class TrainResult:
    """The outcome of :func:`train`: per-epoch metrics, the final confusion matrix, file paths."""

    epochs: list[EpochMetrics]
    confusion: list[list[int]]
    classes: list[str]
    out_dir: Path | None
    checkpoint: Path | None
    #: the model trained: its factory (``lmdbstore.training.model:build_cnn``: the built-in CNN) and arguments
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> EpochMetrics:
        """The last epoch's metrics."""
        return self.epochs[-1]


def train(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str] | None,
    config: TrainConfig | None = None,
    loader: LoaderConfig | None = None,
    *,
    resume: bool = False,
    log: Log | None = print,
    progress: bool | None = None,
    overwrite: bool = False,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train the model (the built-in CNN, or ``config.model``'s) on ``store`` and return the metrics.

    Args:
        store: the store directory, or a list of them read as one set (:class:`~lmdbstore.store.multi.StoreSet`).
        out_dir: where ``checkpoint.pt`` (every epoch and ``config.checkpoint_every`` steps), ``best.pt`` (best
            validation accuracy), ``metrics.jsonl``, ``summary.json`` and TensorBoard scalars (with the
            ``tensorboard`` package) go; ``None`` writes nothing.
        config, loader: :class:`TrainConfig` and :class:`LoaderConfig` (default: their defaults).
        resume: continue from ``out_dir/checkpoint.pt`` inside the epoch it was written in (same order, the
            batches trained skipped, every sample counted once; on the CPU the weights of an uninterrupted run).
        log: where rank 0 sends its lines (default ``print``; ``None``: silent).
        progress: a tqdm bar per epoch on rank 0 (default ``None``: when stderr is a terminal).
        overwrite: start afresh in an ``out_dir`` holding an earlier run, removing its files first (default
            ``False``: such a directory is refused unless ``resume``).
        stop: called after every step (one process); when true, ``checkpoint.pt`` is written there and
            :class:`~lmdbstore.errors.TrainingInterrupted` raised (``lmdbstore train`` sets it on Ctrl-C).

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: empty store or split, batch larger than the split, ``balanced`` with an empty class,
            samples the CNN cannot take, a set whose stores share no class name, all before any step.
        ModelError: the factory cannot be loaded or fails, its model raises in a step, or the checkpoint to
            resume holds another model.
        TrainingInterrupted: ``stop`` asked to stop.
        LmdbStoreError: ``resume`` without a usable checkpoint, or one written inside an epoch by a run of
            another batch size, seed, order or number of processes.
        ValueError: ``resume`` without ``out_dir``.
    """
    cfg, lcfg = config or TrainConfig(), loader or LoaderConfig()
    ref = model_ref(cfg.model)
    load_factory(ref)  # a model that cannot be loaded fails before the store is read
    data = read_store(
        store, cnn=ref.builtin, allow_disjoint_classes=cfg.allow_disjoint_classes, say=log if launch().is_main else None
    )
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other (continue the run in out_dir, or replace it)")
    if resume and out_dir is None:
        raise ValueError("resume needs out_dir")
    stale: list[Path] = []  # an earlier run's files, removed (overwrite) once every check has passed
    if out_dir is not None and launch().is_main:
        stores = [store] if isinstance(store, (str, os.PathLike)) else list(store)
        make_output_dir(out_dir, sources=stores)  # before any work: a file, a file's child, a store fails now
        stale = prepare_run_dir(Path(out_dir), resume=resume, overwrite=overwrite)
    info = init_distributed(device_kind(cfg.device))
    device = resolve_device(cfg.device, info)
    say: Log = log if (log is not None and info.is_main) else (lambda _msg: None)
    out = Path(out_dir) if out_dir is not None else None
    ckpt = load_checkpoint(out / CHECKPOINT_NAME, device) if resume and out else None  # its order now, weights below
    splits = None
    if ckpt is not None and out is not None:  # its sample shape first (its classes once the ranks agree on them)
        check_checkpoint(ckpt, list(ckpt["classes"]), data.meta.shape, out / CHECKPOINT_NAME)
        splits = recorded_splits(ckpt, out / CHECKPOINT_NAME, cfg.val_fraction, lcfg.seed)
    mine = rank_data(data, cfg.val_fraction, lcfg, info, say, device, recorded_order(ckpt), splits)  # or shards
    data, sampler, placement = mine.data, mine.sampler, mine.placement
    model, net = _build_model(data, cfg, lcfg.seed, info, device)
    steps = len(sampler) if cfg.max_steps_per_epoch is None else min(len(sampler), cfg.max_steps_per_epoch)
    optimizer = make_optimizer(model, cfg)
    state = _resume(ckpt, out, model, optimizer, data, cfg, say) if ckpt is not None and out is not None else RunState()
    val_idx = limit_validation(
        data.labels, mine.val_idx, cfg.val_limit, lcfg.batch_size, placement.share.world_size, lcfg.seed
    )  # what one validation reads: all of the split, or a fixed stratified subset
    train_loader, val_loader = make_loaders(data, sampler, val_idx, lcfg, placement.share, device, mine.val_batches)
    _continue_inside(state, train_loader, steps, out)
    scheduler = _one_cycle(optimizer, cfg, steps, state.global_step(steps))
    remove_run_files(stale)
    tb = _run_files(out if info.is_main else None, state, steps, resume)
    run = TrainRun(
        cfg, lcfg, info, device, data, model, net, optimizer, scheduler, steps, out, progress, say, sampler, tb,
        train_loader, stop if not info.active else None, val_loader, mine.splits,
    )  # fmt: skip
    validated = split_sizes(placement, len(mine.train_idx), len(val_idx), info)[1]  # every rank calls it: a gather
    n_batches = len(val_loader) if val_loader is not None else 0
    words = plan_words(validated, n_batches, cfg.val_every, validated < mine.sizes[1], mine.sizes[1])
    say(_plan_line(run, *mine.sizes, words) + (f", {placement.groups} sets of shards" if placement.sharded else ""))
    first = state.start_epoch
    try:
        conf = run_epochs(run, state, train_loader, val_loader)
    finally:
        if tb is not None:
            tb.close()
    if state.history and first < cfg.epochs:  # not for a finished run resumed
        _report(run, conf, state, has_val=val_loader is not None)
    if info.active:
        dist.barrier()
    model_ = {"factory": cfg.model, "args": cfg.model_kwargs}
    return TrainResult(
        state.history, conf.tolist(), data.classes, out, (out / CHECKPOINT_NAME) if out else None, model_
    )


def _continue_inside(state: RunState, loader: Any, steps: int, out: Path | None) -> None:
    """For a run resumed inside an epoch: the training loader skips the batches the checkpoint says were
    trained (its state checked to be of this run's sampler), and torch's generator continues where it was.

    Raises:
        LmdbStoreError: the checkpoint's sampler differs from this run's, or its step is past this run's epoch.
    """
    if state.rng is not None:
        torch.set_rng_state(state.rng)
    if not state.start_step:
        return
    path = (out or Path(".")) / CHECKPOINT_NAME
    if state.start_step >= steps:
        raise LmdbStoreError(f"checkpoint is {state.start_step} steps into an epoch of {steps}", path=path)
    try:
        loader.load_state_dict(state.sampler)  # type: ignore[arg-type]
    except ValueError as exc:
        raise LmdbStoreError(
            f"checkpoint was written inside an epoch by another sampler: {exc}",
            path=path,
            hint="resume with the same batch_size=, seed=, shuffle= and number of processes",
        ) from None


def _run_files(out: Path | None, state: RunState, steps: int, resume: bool) -> ScalarLog | None:
    """On the writing rank: a fresh run's old metrics cleared, a resumed run's rewritten from its checkpoint
    (a kill between writing the two leaves them consistent), and the TensorBoard scalar log opened."""
    if out is None:
        return None
    if resume:
        rewrite_metrics(out, state.history)
    else:
        clear_metrics(out)  # a fresh run: an older run's metrics are not this run's
    return open_scalar_log(out, resumed_at=state.global_step(steps) if resume else None, fresh=not resume)


def _build_model(
    data: TrainData, cfg: TrainConfig, seed: int, info: DistInfo, device: torch.device
) -> tuple[nn.Module, nn.Module]:
    """The model ``cfg`` names (the built-in CNN by default) for the store's samples (weights seeded by
    ``seed``) on ``device``, and what the steps run through: the same model, or under torchrun the model wrapped
    in DistributedDataParallel; with ``cfg.compile`` through ``torch.compile``."""
    torch.manual_seed(seed)
    ref = model_ref(cfg.model)
    model = place_model(build_from(ref, feed_shape(data.meta.shape), len(data.classes), cfg.model_kwargs), device)
    net: nn.Module = model
    if info.active:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, compiled(net, ref.text) if cfg.compile else net


def _plan_line(run: TrainRun, n_train: int, n_val: int, validation: str = "") -> str:
    """The line that says what the run is about to do (``validation``: what each validation reads, and when)."""
    lcfg, cfg = run.lcfg, run.cfg
    model = "the built-in CNN" if cfg.model == BUILTIN_MODEL else cfg.model
    return (
        f"training on {run.device} ({run.info.world_size} process(es)): {n_train} train / {n_val} val samples, "
        f"batch {lcfg.batch_size}, {run.steps} steps/epoch, {validation + ', ' if validation else ''}"
        f"{lcfg.workers} workers, shuffle {_shuffle_used(run)}, model {model}"
        f"({', '.join(f'{k}={v!r}' for k, v in cfg.model_kwargs.items())})"
    )


def _shuffle_used(run: TrainRun) -> str:
    """The order the sampler draws: ``balanced``, or its shuffle (``auto`` says what it chose, e.g. ``window
    (auto)``), looking through the wrappers (equal steps per rank, set grouping)."""
    if run.lcfg.balanced:
        return "balanced"
    used = order_of(run.sampler).shuffle or run.lcfg.order
    return f"{used} (auto)" if run.lcfg.order == "auto" and used != "auto" else used


def _resume(
    ckpt: dict[str, Any],
    out: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TrainData,
    cfg: TrainConfig,
    say: Log,
) -> RunState:
    """The state of the run in ``out`` (its checkpoint ``ckpt`` loaded into ``model`` and ``optimizer``), said
    so."""
    path = out / CHECKPOINT_NAME
    spec = (model_name(model_ref(cfg.model)), cfg.model_kwargs)
    state = resume_run(ckpt, path, model, optimizer, data.classes, data.meta.shape, spec)
    if state.start_step:
        say(f"resuming epoch {state.start_epoch + 1} after its step {state.start_step} from {path}")
    else:
        say(f"resuming after epoch {state.start_epoch} from {path}")
    if state.start_epoch >= cfg.epochs:
        say(f"checkpoint already has {state.start_epoch} epochs; nothing to do (raise epochs= to train more)")
    return state


def _one_cycle(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps: int, done: int) -> Any:
    """One-cycle schedule over the (possibly extended) run.  On resume it continues at the step reached
    (``done`` steps; the learning rate is a closed form of the step, so it is exactly the uninterrupted
    run's), and asking for more epochs than the first run stretches the remaining schedule instead of
    failing."""
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=cfg.lr,
        total_steps=max(1, cfg.epochs * steps, done + 1),
        pct_start=WARMUP_SHARE,
        last_epoch=done - 1 if done else -1,
    )


def _report(run: TrainRun, conf: torch.Tensor, state: RunState, *, has_val: bool) -> None:
    """After the last epoch: the validation confusion matrix on the log, ``summary.json`` on rank 0."""
    classes = run.data.classes
    if has_val:
        run.say("confusion matrix on the validation split (rows: true, columns: predicted):")
        run.say(format_confusion(conf.tolist(), classes))
    if run.out is not None and run.info.is_main:
        write_summary(run.out, classes, conf.tolist(), state.history[-1], run.data.path)
