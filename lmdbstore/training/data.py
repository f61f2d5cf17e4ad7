"""What the trainer reads and how: the store's metadata and labels, the checks made before any step, the
epoch order of the training split (random, block, window or class-balanced) and the two DataLoaders.

Everything here raises before a model is built or a file is written, so a run that cannot work fails at
once with one :class:`~lmdbstore.errors.ValidationError` line.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
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
from lmdbstore.loader.sets import SetBatches, SetPrefetch, grouped, set_space
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader, as_reader, data_file_bytes
from lmdbstore.training.checkpoint import model_channels
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.metrics import Log

__all__ = ["TrainData", "check_inputs", "make_loaders", "make_sampler", "pick_shuffle", "read_store"]

Sampler = EpochBatchSampler | BalancedBatchSampler | SetBatches


@dataclass(frozen=True)
class TrainData:
    """The store (or set of stores) as the trainer sees it: path (a set's first store), metadata, labels, class
    names, CNN input channels, and the (closed) reader the loaders' dataset is made from."""

    path: Path
    reader: Reader
    meta: StoreMeta
    labels: np.ndarray
    classes: list[str]
    channels: int


def read_store(store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader) -> TrainData:
    """Read the metadata and labels of ``store`` -- a path, or a list of them read as one set -- (the reader is
    closed again at once: workers open their own) and check that the CNN can take its samples.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: samples the CNN cannot take (not (H, W) or (C, H, W), or smaller than 4x4); stores
            of a set that do not make one set.
    """
    reader = as_reader(store)
    with reader:
        meta = reader.meta
        labels = reader.labels()
    path = reader.path
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


def pick_shuffle(lcfg: LoaderConfig, reader: Reader, say: Log) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by store size against memory, and says so."""
    if lcfg.shuffle != "auto":
        return lcfg.shuffle
    choice = choose_shuffle(data_file_bytes(reader))
    say(f"shuffle: {choice.shuffle} ({choice.reason})")
    return choice.shuffle


def make_sampler(data: TrainData, train_idx: np.ndarray, lcfg: LoaderConfig, info: DistInfo, say: Log) -> Sampler:
    """This rank's sampler of the training split: class-balanced with ``lcfg.balanced``, else in the order
    :func:`pick_shuffle` chooses (the window order reads each next window ahead, in large runs)."""
    meta, rank, world, reader = data.meta, info.rank, info.world_size, data.reader
    if lcfg.balanced:
        per_class = [train_idx[data.labels[train_idx] == c] for c in range(len(data.classes))]
        return grouped(
            BalancedBatchSampler(
                per_class, lcfg.batch_size, seed=lcfg.seed, rank=rank, world_size=world, class_names=data.classes
            ),
            reader,
        )
    shuffle = pick_shuffle(lcfg, reader, say)
    space = set_space(reader)  # a set of stores: orders drawn where each store starts on a value boundary
    idx = space.to_padded(train_idx) if space is not None else train_idx
    if shuffle == "window":
        fresh = copy.deepcopy(reader)  # this process's own reader for the read-ahead (the loaders' is closed)
        prefetch = SetPrefetch(fresh, space) if isinstance(fresh, StoreSet) else fresh.prefetch
        window = WindowBatchSampler(
            idx,
            lcfg.batch_size,
            samples_per_value=meta.samples_per_value,
            sample_bytes=meta.sample_bytes,
            window_bytes=None if lcfg.window_mb is None else lcfg.window_mb << 20,
            prefetch=prefetch,
            seed=lcfg.seed,
            rank=rank,
            world_size=world,
        )
        return grouped(window, reader, space)
    epoch = EpochBatchSampler(
        idx,
        lcfg.batch_size,
        shuffle=shuffle,  # type: ignore[arg-type]
        samples_per_value=meta.samples_per_value,
        block_buffer=lcfg.block_buffer,
        seed=lcfg.seed,
        rank=rank,
        world_size=world,
    )
    return grouped(epoch, reader, space)


def make_loaders(
    data: TrainData,
    sampler: Sampler,
    val_idx: np.ndarray,
    lcfg: LoaderConfig,
    info: DistInfo,
    device: torch.device,
    val_batches: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any | None]:
    """The training DataLoader over ``sampler`` and the validation one over ``val_idx`` in index order
    (``None`` without a validation split; ``val_batches`` wraps its sampler, e.g. to equal steps on every
    rank); pinned memory by default when training on CUDA."""
    pin = lcfg.pin_memory if lcfg.pin_memory is not None else device.type == "cuda"
    dataset = LmdbBatchDataset(data.reader)
    train_loader = make_loader(dataset, sampler, lcfg, pin_memory=pin)
    if not len(val_idx):
        return train_loader, None
    val_sampler: Any = EpochBatchSampler(
        val_idx, lcfg.batch_size, shuffle="none", rank=info.rank, world_size=info.world_size
    )
    if val_batches is not None:
        val_sampler = val_batches(val_sampler)
    return train_loader, make_loader(dataset, val_sampler, lcfg, pin_memory=pin)
