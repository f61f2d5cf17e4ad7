"""What the trainer reads and how: the store's metadata and labels, the checks made before any step, the
epoch order of the training split (random, block, window or class-balanced) and the two DataLoaders.

Everything here raises before a model is built or a file is written, so a run that cannot work fails at
once with one :class:`~lmdbstore.errors.ValidationError` line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmdbstore.config import LoaderConfig
from lmdbstore.errors import ValidationError
from lmdbstore.format.meta import StoreMeta
from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle
from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import model_channels
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.metrics import Log

__all__ = ["TrainData", "check_inputs", "make_loaders", "make_sampler", "pick_shuffle", "read_store"]

Sampler = EpochBatchSampler | BalancedBatchSampler


@dataclass(frozen=True)
class TrainData:
    """The store as the trainer sees it: path, metadata, labels, class names, CNN input channels, and the
    (closed) reader the loaders' dataset is made from."""

    path: Path
    reader: StoreReader
    meta: StoreMeta
    labels: np.ndarray
    classes: list[str]
    channels: int


def read_store(store: str | os.PathLike[str]) -> TrainData:
    """Read the metadata and labels of ``store`` (the reader is closed again at once: workers open their own)
    and check that the CNN can take its samples.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: samples the CNN cannot take (not (H, W) or (C, H, W), or smaller than 4x4).
    """
    path = Path(store)
    with StoreReader(path) as reader:
        meta = reader.meta
        labels = reader.labels()
    channels = model_channels(meta.shape, path)  # before anything starts: a shape the CNN cannot take
    return TrainData(path, reader, meta, labels, list(meta.classes), channels)


def check_inputs(data: TrainData, train_idx: np.ndarray, lcfg: LoaderConfig, info: DistInfo) -> None:
    """Refuse what no epoch can run on.

    Raises:
        ValidationError: an empty store or training split, a batch (times the ranks) larger than the split,
            or ``balanced`` sampling with a class that has no training sample.
    """
    path, classes = data.path, data.classes
    if data.meta.count == 0:
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
        counts = np.bincount(data.labels[train_idx], minlength=len(classes))
        empty = [classes[c] for c in range(len(classes)) if counts[c] == 0]
        if empty:
            raise ValidationError(
                f"--balanced needs samples of every class; class {empty[0]!r} has none in the training split",
                path=path,
            )


def pick_shuffle(lcfg: LoaderConfig, path: Path, say: Log) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by store size against memory, and says so."""
    if lcfg.shuffle != "auto":
        return lcfg.shuffle
    choice = choose_shuffle(os.path.getsize(path / DATA_FILE))
    say(f"shuffle: {choice.shuffle} ({choice.reason})")
    return choice.shuffle


def make_sampler(data: TrainData, train_idx: np.ndarray, lcfg: LoaderConfig, info: DistInfo, say: Log) -> Sampler:
    """This rank's sampler of the training split: class-balanced with ``lcfg.balanced``, else in the order
    :func:`pick_shuffle` chooses (the window order reads each next window ahead, in large runs)."""
    meta, rank, world = data.meta, info.rank, info.world_size
    if lcfg.balanced:
        per_class = [train_idx[data.labels[train_idx] == c] for c in range(len(data.classes))]
        return BalancedBatchSampler(
            per_class, lcfg.batch_size, seed=lcfg.seed, rank=rank, world_size=world, class_names=data.classes
        )
    shuffle = pick_shuffle(lcfg, data.path, say)
    if shuffle == "window":
        return WindowBatchSampler(
            train_idx,
            lcfg.batch_size,
            samples_per_value=meta.samples_per_value,
            sample_bytes=meta.sample_bytes,
            window_bytes=None if lcfg.window_mb is None else lcfg.window_mb << 20,
            prefetch=StoreReader(data.path).prefetch,
            seed=lcfg.seed,
            rank=rank,
            world_size=world,
        )
    return EpochBatchSampler(
        train_idx,
        lcfg.batch_size,
        shuffle=shuffle,  # type: ignore[arg-type]
        samples_per_value=meta.samples_per_value,
        block_buffer=lcfg.block_buffer,
        seed=lcfg.seed,
        rank=rank,
        world_size=world,
    )


def make_loaders(
    data: TrainData, sampler: Sampler, val_idx: np.ndarray, lcfg: LoaderConfig, info: DistInfo, device: torch.device
) -> tuple[Any, Any | None]:
    """The training DataLoader over ``sampler`` and the validation one over ``val_idx`` in index order
    (``None`` without a validation split); pinned memory by default when training on CUDA."""
    pin = lcfg.pin_memory if lcfg.pin_memory is not None else device.type == "cuda"
    dataset = LmdbBatchDataset(data.reader)
    train_loader = make_loader(dataset, sampler, lcfg, pin_memory=pin)
    if not len(val_idx):
        return train_loader, None
    val_sampler = EpochBatchSampler(
        val_idx, lcfg.batch_size, shuffle="none", rank=info.rank, world_size=info.world_size
    )
    return train_loader, make_loader(dataset, val_sampler, lcfg, pin_memory=pin)
