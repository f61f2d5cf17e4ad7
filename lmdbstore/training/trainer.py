"""Training and evaluation of the CNN on a store, on one process or under ``torchrun`` (DDP).

:func:`train` is what ``lmdbstore train`` runs.  It reads batches through
:class:`~lmdbstore.loader.dataset.LmdbBatchDataset` and DataLoader workers, measures how long the loop waits
for data, validates on a stratified split, writes metrics as JSON lines and checkpoints that load with
``torch.load(weights_only=True)``, and resumes from them.

Distributed: when started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every rank joins a
process group (NCCL on CUDA, gloo on CPU), wraps the model in DistributedDataParallel, reads its own
disjoint share of each epoch's order (same seed on every rank), all-reduces the metrics, and only
rank 0 prints and writes files.

Samples of every dtype a store may hold train: a batch crosses to the device in the store's dtype and is
converted to the model's float32 there.  2-D samples (H, W) are one-channel images, 3-D samples (C, H, W)
have C channels (kept in the checkpoint); other shapes, and images under 4x4, are refused before training.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.errors import LmdbStoreError, ValidationError
from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle
from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import (
    BEST_NAME,
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    RESUME_KEYS,
    atomic_save,
    check_checkpoint,
    is_int,
    load_checkpoint,
    load_weights,
    model_channels,
    model_from_checkpoint,
)
from lmdbstore.training.distributed import DistInfo, all_reduce, init_distributed, resolve_device
from lmdbstore.training.model import build_model
from lmdbstore.util.jsonsafe import json_safe
from lmdbstore.util.launch import launch
from lmdbstore.util.paths import check_output_file, make_output_dir, write_errors
from lmdbstore.util.progress import progress_bar

__all__ = ["DistInfo", "EpochMetrics", "TrainResult", "evaluate", "load_checkpoint", "train"]

METRICS_NAME = "metrics.jsonl"

Log = Callable[[str], None]


# ---------------------------------------------------------------------- metrics
@dataclass
class EpochMetrics:
    """What one epoch measured (rank-0 view, reduced over ranks)."""

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


@dataclass
class TrainResult:
    """The outcome of :func:`train`: per-epoch metrics, the final confusion matrix, file paths."""

    epochs: list[EpochMetrics]
    confusion: list[list[int]]
    classes: list[str]
    out_dir: Path | None
    checkpoint: Path | None

    @property
    def final(self) -> EpochMetrics:
        return self.epochs[-1]


def _confusion_summary(conf: torch.Tensor, classes: list[str]) -> tuple[float | None, dict[str, float | None]]:
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


def _shuffle(lcfg: LoaderConfig, path: Path, say: Log) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by store size against memory, and says so."""
    if lcfg.shuffle != "auto":
        return lcfg.shuffle
    choice = choose_shuffle(os.path.getsize(path / DATA_FILE))
    say(f"shuffle: {choice.shuffle} ({choice.reason})")
    return choice.shuffle


# ---------------------------------------------------------------------- loops
class _Timed:
    """Iterate a loader and add up the time spent waiting for the next batch."""

    def __init__(self, it: Iterator[Any]):
        self.it = it
        self.wait = 0.0

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.wait += time.perf_counter() - t0


def _autocast(device: torch.device, amp: bool) -> AbstractContextManager[Any]:
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def _to_device(
    x: torch.Tensor, y: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch to ``device``, then convert ``x`` to the model's ``dtype`` there (channels-last for
    images): the copy moves the store's own bytes, and a float32 batch is not converted at all."""
    nb = device.type == "cuda"
    x = x.to(device, non_blocking=nb)
    y = y.to(device, non_blocking=nb)
    fmt = torch.channels_last if x.dim() == 4 else torch.preserve_format
    if x.dtype != dtype:
        x = x.to(dtype, memory_format=fmt)  # one conversion, straight into the layout the model wants
    elif x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


@torch.no_grad()
def _evaluate_loader(
    model: nn.Module, loader: Any, device: torch.device, n_classes: int, amp: bool, info: DistInfo
) -> tuple[float, torch.Tensor, int]:
    """Sum of losses, confusion matrix and sample count over a loader (reduced over ranks)."""
    model.eval()
    conf = torch.zeros(n_classes, n_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = _to_device(x, y, device)
        with _autocast(device, amp):
            logits = model(x)
        loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum").double()
        pred = logits.argmax(1)
        conf += torch.bincount(y * n_classes + pred, minlength=n_classes * n_classes).view(n_classes, n_classes)
    all_reduce(conf, info)
    all_reduce(loss_sum, info)
    n = int(conf.sum())
    return (float(loss_sum) / n if n else math.nan), conf.cpu(), n


def _check_inputs(
    meta_count: int,
    labels: np.ndarray,
    classes: list[str],
    train_idx: np.ndarray,
    lcfg: LoaderConfig,
    info: DistInfo,
    path: Path,
) -> None:
    if meta_count == 0:
        raise ValidationError("the store holds no samples", path=path)
    if len(train_idx) == 0:
        raise ValidationError("the training split is empty", path=path, hint="lower --val-fraction")
    if lcfg.batch_size * info.world_size > len(train_idx):
        raise ValidationError(
            f"batch {lcfg.batch_size} x {info.world_size} rank(s) is larger than the training split of {len(train_idx)} samples",
            path=path,
            hint="lower --batch",
        )
    if lcfg.balanced:
        counts = np.bincount(labels[train_idx], minlength=len(classes))
        empty = [classes[c] for c in range(len(classes)) if counts[c] == 0]
        if empty:
            raise ValidationError(
                f"--balanced needs samples of every class; class {empty[0]!r} has none in the training split",
                path=path,
            )


def train(
    store: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None,
    config: TrainConfig | None = None,
    loader: LoaderConfig | None = None,
    *,
    resume: bool = False,
    log: Log | None = print,
    progress: bool = True,
) -> TrainResult:
    """Train the CNN on ``store`` and return the metrics.

    Args:
        store: the store directory.
        out_dir: where ``checkpoint.pt`` (every epoch), ``best.pt`` (best validation accuracy),
            ``metrics.jsonl`` (one JSON object per epoch) and ``summary.json`` go; ``None`` writes nothing.
        config: model/optimiser/epochs (:class:`TrainConfig`).
        loader: batch size, workers, shuffle mode, balanced sampling (:class:`LoaderConfig`).
        resume: continue from ``out_dir/checkpoint.pt`` (same store classes, channels and shape required).
        log: where rank 0 sends its lines (``None``: silent).
        progress: show a tqdm bar per epoch on rank 0.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: empty store or split, batch larger than the split, ``balanced`` with an empty class,
            samples the CNN cannot take (not (H, W) or (C, H, W), or smaller than 4x4), all before any step.
        LmdbStoreError: ``resume`` without a usable checkpoint.
    """
    cfg = config or TrainConfig()
    lcfg = loader or LoaderConfig()
    path = Path(store)
    with StoreReader(path) as reader:  # closed again at once: workers open their own
        meta = reader.meta
        labels = reader.labels()
    classes = list(meta.classes)
    channels = model_channels(meta.shape, path)  # before anything starts: a shape the CNN cannot take
    if out_dir is not None and launch().is_main:
        make_output_dir(out_dir)  # before any work: a file, a file's child or an unwritable place fails now
    device_kind = (
        "cuda" if (cfg.device == "auto" and torch.cuda.is_available()) or cfg.device.startswith("cuda") else "cpu"
    )
    info = init_distributed(device_kind)
    device = resolve_device(cfg.device, info)
    say: Log = log if (log is not None and info.is_main) else (lambda _msg: None)

    train_idx, val_idx = stratified_split(labels, cfg.val_fraction, lcfg.seed)
    _check_inputs(meta.count, labels, classes, train_idx, lcfg, info, path)

    torch.manual_seed(lcfg.seed)
    model = build_model(meta.shape, len(classes), cfg.width).to(device)
    if device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ddp_model: nn.Module = model
    if info.active:
        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    if lcfg.balanced:
        per_class = [train_idx[labels[train_idx] == c] for c in range(len(classes))]
        sampler: EpochBatchSampler | BalancedBatchSampler = BalancedBatchSampler(
            per_class, lcfg.batch_size, seed=lcfg.seed, rank=info.rank, world_size=info.world_size, class_names=classes
        )
    elif (shuffle := _shuffle(lcfg, path, say)) == "window":
        sampler = WindowBatchSampler(
            train_idx,
            lcfg.batch_size,
            samples_per_value=meta.samples_per_value,
            sample_bytes=meta.sample_bytes,
            window_bytes=None if lcfg.window_mb is None else lcfg.window_mb << 20,
            prefetch=StoreReader(path).prefetch,  # the next window is read ahead, in large runs
            seed=lcfg.seed,
            rank=info.rank,
            world_size=info.world_size,
        )
    else:
        sampler = EpochBatchSampler(
            train_idx,
            lcfg.batch_size,
            shuffle=shuffle,  # type: ignore[arg-type]
            samples_per_value=meta.samples_per_value,
            block_buffer=lcfg.block_buffer,
            seed=lcfg.seed,
            rank=info.rank,
            world_size=info.world_size,
        )
    val_sampler = EpochBatchSampler(
        val_idx, lcfg.batch_size, shuffle="none", rank=info.rank, world_size=info.world_size
    )
    steps = len(sampler) if cfg.max_steps_per_epoch is None else min(len(sampler), cfg.max_steps_per_epoch)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    out = Path(out_dir) if out_dir is not None else None
    start_epoch, best_acc = 0, -1.0
    history: list[EpochMetrics] = []
    conf_before: torch.Tensor | None = None
    if resume:
        if out is None:
            raise ValueError("resume needs out_dir")
        ckpt = load_checkpoint(out / CHECKPOINT_NAME, map_location=device)
        check_checkpoint(ckpt, classes, meta.shape, out / CHECKPOINT_NAME)
        if ckpt["width"] != cfg.width:
            raise LmdbStoreError(
                f"checkpoint was trained with width {ckpt['width']}, not {cfg.width}", path=out / CHECKPOINT_NAME
            )
        load_weights(model, ckpt, out / CHECKPOINT_NAME)
        start_epoch, best_acc, history, conf_before = _resume_state(
            ckpt, optimizer, len(classes), out / CHECKPOINT_NAME
        )
        say(f"resuming after epoch {start_epoch} from {out / CHECKPOINT_NAME}")
        if start_epoch >= cfg.epochs:
            say(f"checkpoint already has {start_epoch} epochs; nothing to do (raise --epochs to train more)")
    # One-cycle over the (possibly extended) run; on resume it continues at the step reached, so asking
    # for more epochs than the first run stretches the remaining schedule instead of failing.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=cfg.lr,
        total_steps=max(1, cfg.epochs * steps, start_epoch * steps + 1),
        pct_start=0.15,
        last_epoch=start_epoch * steps - 1 if start_epoch else -1,
    )
    if out is not None and info.is_main and not resume:  # made before any work (make_output_dir above)
        (out / METRICS_NAME).unlink(missing_ok=True)  # a fresh run: an older run's metrics are not this run's

    pin = lcfg.pin_memory if lcfg.pin_memory is not None else device.type == "cuda"
    dataset = LmdbBatchDataset(reader)
    train_loader = make_loader(dataset, sampler, lcfg, pin_memory=pin)
    val_loader = make_loader(dataset, val_sampler, lcfg, pin_memory=pin) if len(val_idx) else None
    say(
        f"training on {device} ({info.world_size} process(es)): {len(train_idx)} train / {len(val_idx)} val samples, "
        f"batch {lcfg.batch_size}, {steps} steps/epoch, {lcfg.workers} workers, shuffle "
        f"{'balanced' if lcfg.balanced else lcfg.shuffle}"
    )
    conf = conf_before if conf_before is not None else torch.zeros(len(classes), len(classes), dtype=torch.int64)
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        m = _train_epoch(ddp_model, train_loader, optimizer, scheduler, device, cfg, steps, epoch, info, progress, say)
        if val_loader is not None:
            vloss, conf, _ = _evaluate_loader(ddp_model, val_loader, device, len(classes), cfg.amp, info)
            m.val_loss = vloss
            m.val_accuracy, m.per_class_accuracy = _confusion_summary(conf, classes)
        history.append(m)
        say(_epoch_line(m))
        if out is not None and info.is_main:
            with open(out / METRICS_NAME, "a") as fh:
                fh.write(json.dumps(json_safe(asdict(m)), allow_nan=False) + "\n")
            state = {
                "format": CHECKPOINT_FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "classes": classes,
                "sample_shape": list(meta.shape),
                "in_channels": channels,
                "width": cfg.width,
                "history": json.dumps([asdict(h) for h in history]),
                "best_accuracy": max(best_acc, m.val_accuracy or -1.0),
                "confusion": conf.tolist(),
                "train_config": json.dumps(asdict(cfg)),
                "loader_config": json.dumps(asdict(lcfg)),
            }
            atomic_save(state, out / CHECKPOINT_NAME)
            if m.val_accuracy is not None and m.val_accuracy > best_acc:
                atomic_save(state, out / BEST_NAME)
        if m.val_accuracy is not None:
            best_acc = max(best_acc, m.val_accuracy)
    if history and val_loader is not None and start_epoch < cfg.epochs:
        say("confusion matrix on the validation split (rows: true, columns: predicted):")
        say(format_confusion(conf.tolist(), classes))
    if out is not None and info.is_main and history and start_epoch < cfg.epochs:  # not for a finished run resumed
        summary = {"classes": classes, "confusion": conf.tolist(), "final": asdict(history[-1]), "store": str(path)}
        (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
    if info.active:
        dist.barrier()
    return TrainResult(history, conf.tolist(), classes, out, (out / CHECKPOINT_NAME) if out else None)


def _resume_state(
    ckpt: dict[str, Any], optimizer: torch.optim.Optimizer, n_classes: int, ckpt_path: Path
) -> tuple[int, float, list[EpochMetrics], torch.Tensor | None]:
    """Restore the optimizer from a checkpoint; return (first epoch to run, best accuracy, history, the last
    validation confusion matrix or ``None`` for checkpoints from before it was kept)."""
    missing = sorted(RESUME_KEYS - ckpt.keys())
    if missing:
        raise LmdbStoreError(f"checkpoint cannot be resumed (no {', '.join(missing)})", path=ckpt_path)
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        epoch = ckpt["epoch"]
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
        best_acc = float(ckpt.get("best_accuracy", -1.0))
        history = [EpochMetrics(**m) for m in json.loads(ckpt["history"])]
        conf = torch.tensor(ckpt["confusion"], dtype=torch.int64) if "confusion" in ckpt else None
        if conf is not None and tuple(conf.shape) != (n_classes, n_classes):
            raise ValueError(f"confusion matrix of shape {tuple(conf.shape)}, expected {n_classes}x{n_classes}")
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LmdbStoreError(f"checkpoint cannot be resumed ({first})", path=ckpt_path) from exc
    return epoch + 1, best_acc, history, conf


def _epoch_line(m: EpochMetrics) -> str:
    val = f", val loss {m.val_loss:.4f}, val acc {m.val_accuracy:.4f}" if m.val_accuracy is not None else ""
    return (
        f"epoch {m.epoch + 1}: train loss {m.train_loss:.4f}{val}, {m.samples_per_s:,.0f} samples/s, "
        f"data wait {100 * m.data_wait_share:.1f}%, {m.seconds:.1f}s"
    )


def _train_epoch(
    model: nn.Module,
    loader: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    device: torch.device,
    cfg: TrainConfig,
    steps: int,
    epoch: int,
    info: DistInfo,
    progress: bool,
    say: Log,
) -> EpochMetrics:
    model.train()
    timed = _Timed(iter(loader))
    bar = progress_bar(f"epoch {epoch + 1}", total=steps, unit="batch") if progress and info.is_main else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_seen = 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(timed):
        if step >= steps:
            break
        x, y = _to_device(x, y, device)
        with _autocast(device, cfg.amp):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_sum += loss.detach().double() * len(y)
        n_seen += len(y)
        if bar is not None:
            elapsed = time.perf_counter() - t0
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                sps=f"{n_seen * info.world_size / elapsed:,.0f}",
                wait=f"{100 * timed.wait / elapsed:.0f}%",
            )
            bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    totals = torch.tensor([float(loss_sum), float(n_seen), timed.wait, elapsed], dtype=torch.float64, device=device)
    all_reduce(totals, info)
    loss_total, n_total, wait_total, time_total = totals.tolist()
    wall = time_total / info.world_size
    return EpochMetrics(
        epoch=epoch,
        train_loss=loss_total / max(n_total, 1),
        train_samples=int(n_total),
        samples_per_s=n_total / wall if wall > 0 else 0.0,
        data_wait_share=wait_total / time_total if time_total > 0 else 0.0,
        step_time_ms=1000 * wall / max(1, min(steps, math.ceil(n_total / max(info.world_size, 1)))),
        lr=float(scheduler.get_last_lr()[0]),
        seconds=wall,
    )


def evaluate(
    store: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    *,
    batch_size: int = 4096,
    workers: int = 2,
    device: str = "auto",
    indices: np.ndarray | None = None,
    predictions_out: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Score ``store`` (or the given ``indices`` of it) with a checkpoint from :func:`train`.

    Returns a dict with ``samples``, ``loss``, ``accuracy``, ``per_class_accuracy`` and ``confusion``.
    With ``predictions_out`` the predicted class ids (uint16, one per scored sample, in index order)
    are saved there as ``.npy``.

    Raises:
        ValidationError: the store's samples have a shape the CNN cannot take.
        LmdbStoreError: unreadable checkpoint, or one trained on other classes, another number of
            channels or another sample shape.
    """
    path = Path(store)
    if predictions_out is not None:
        check_output_file(predictions_out, "predictions file")  # before scoring, not after
    with StoreReader(path) as reader:
        meta = reader.meta
    model_channels(meta.shape, path)
    dev = resolve_device(device, DistInfo())
    ckpt = load_checkpoint(checkpoint, map_location=dev)
    check_checkpoint(ckpt, list(meta.classes), meta.shape, Path(checkpoint))
    model = model_from_checkpoint(ckpt, Path(checkpoint)).to(dev).eval()
    if dev.type == "cpu":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    idx = np.arange(meta.count, dtype=np.int64) if indices is None else np.sort(np.asarray(indices, np.int64))
    sampler = EpochBatchSampler(idx, batch_size, shuffle="none")
    loader = make_loader(
        LmdbBatchDataset(reader),
        sampler,
        LoaderConfig(batch_size=batch_size, workers=workers, persistent_workers=False),
    )
    k = len(meta.classes)
    conf = torch.zeros(k, k, dtype=torch.int64)
    loss_sum, preds = 0.0, []
    with torch.no_grad():
        for x, y in loader:
            xd, yd = _to_device(x, y, dev)
            logits = model(xd).float()
            loss_sum += float(nn.functional.cross_entropy(logits, yd, reduction="sum"))
            p = logits.argmax(1).cpu()
            conf += torch.bincount(y * k + p, minlength=k * k).view(k, k)
            preds.append(p.numpy().astype(np.uint16))
    acc, per_class = _confusion_summary(conf, list(meta.classes))
    if predictions_out is not None:
        with write_errors(predictions_out, "write predictions"):
            np.save(predictions_out, np.concatenate(preds) if preds else np.zeros(0, np.uint16))
    n = int(conf.sum())
    return {
        "store": str(path),
        "checkpoint": str(checkpoint),
        "samples": n,
        "loss": loss_sum / n if n else None,
        "accuracy": acc,
        "per_class_accuracy": per_class,
        "confusion": conf.tolist(),
        "classes": list(meta.classes),
    }
