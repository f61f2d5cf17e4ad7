"""What the trainer reads and how: the store's metadata and labels, the checks made before any step (one
:class:`~lmdbstore.errors.ValidationError` line before a model is built or a file written) and the two loaders.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmdbstore.config import LoaderConfig
from lmdbstore.errors import ValidationError, preview
from lmdbstore.format.meta import StoreMeta
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.choose import Sampler
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader, as_reader
from lmdbstore.training.checkpoint import model_channels
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.factory import feed_shape
from lmdbstore.training.metrics import Log

__all__ = ["TrainData", "check_class_overlap", "check_inputs", "make_loaders", "read_store"]


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


def read_store(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader,
    *,
    cnn: bool = True,
    allow_disjoint_classes: bool = False,
    say: Log | None = None,
) -> TrainData:
    """Read the metadata and labels of ``store`` (a path, or a list of them read as one set; the reader is
    closed again at once) and, for the built-in CNN (``cnn``), check that it can take its samples.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: samples the CNN cannot take; stores of a set that do not make one set; classes as
            :func:`check_class_overlap` refuses them.
    """
    reader = as_reader(store)
    with reader:
        meta = reader.meta
        labels = reader.labels()
        if isinstance(reader, StoreSet):
            check_class_overlap(reader, allow_disjoint_classes, say)
    path = reader.path
    # before anything starts: a shape the CNN cannot take
    channels = model_channels(meta.shape, path) if cnn else feed_shape(meta.shape)[0]
    return TrainData(path, reader, meta, labels, list(meta.classes), channels)


def check_class_overlap(stores: StoreSet, allow: bool = False, say: Log | None = None) -> None:
    """Refuse (unless ``allow``) a set in which a store of bare class ids ``0..k-1`` shares no name with the
    other stores' named classes (``0..4`` next to ``circle, ...``: 10 classes where 5 were meant).  Any other store
    sharing no class name with the others is said in one line (``say``): stores split by class are such a set.

    Raises:
        ValidationError: naming the store and both class lists.
    """
    lists = [list(r.meta.classes) for r in stores.readers]
    for i, mine in enumerate(lists):
        others = {c for j, lst in enumerate(lists) if j != i for c in lst}
        if not others or others.intersection(mine):
            continue
        total = len(set(mine) | others)
        if _bare_ids(mine) and not _bare_ids(sorted(others, key=str)) and not allow:
            raise ValidationError(
                f"this store's classes are the bare ids [{preview(mine)}] and share no name with the other stores' "
                f"[{preview(sorted(others))}]: the set would train {total} separate classes",
                path=stores.paths[i],
                hint="ingest it again naming its classes (classes=), or train on the set as it is with "
                "allow_disjoint_classes=True",
            )
        if len(mine) > 1 and say is not None:
            say(
                f"note: {stores.paths[i]} shares no class name with the other stores of the set "
                f"([{preview(mine)}] vs [{preview(sorted(others))}]): {total} classes in all"
            )


def _bare_ids(names: list[str]) -> bool:
    """Whether ``names`` are some of the bare class ids ``"0"``, ``"1"``, ... (names nobody gave)."""
    return all(n.isdigit() for n in names)


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
        raise ValidationError("the training split is empty", path=path, hint="lower val_fraction=")
    if lcfg.batch_size * info.world_size > len(train_idx):
        raise ValidationError(
            f"batch {lcfg.batch_size} x {info.world_size} rank(s) is larger than the training split of {len(train_idx)} samples",
            path=path,
            hint="lower batch_size=",
        )
    if lcfg.balanced:
        counts = np.bincount(data.labels[train_idx], minlength=len(classes))
        empty = [classes[c] for c in range(len(classes)) if counts[c] == 0]
        if empty:
            raise ValidationError(
                f"balanced sampling needs samples of every class; class {empty[0]!r} has none in the training split",
                path=path,
            )


def make_loaders(
    data: TrainData,
    sampler: Sampler,
    val_idx: np.ndarray,
    lcfg: LoaderConfig,
    info: DistInfo,
    device: torch.device,
    val_batches: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any | None]:
    """The training loader over ``sampler`` and the validation one over ``val_idx`` in index order (``None``
    without a validation split; ``val_batches`` wraps its sampler, e.g. to equal steps on every rank).  On
    CUDA by default the slots are page-locked and each next batch is staged on the device while the step
    computes (:mod:`lmdbstore.frameworks.cuda`)."""
    pin = lcfg.pin_memory if lcfg.pin_memory is not None else device.type == "cuda"
    staged = device if pin and device.type == "cuda" else None
    dataset = LmdbBatchDataset(data.reader)
    train_loader = make_loader(dataset, sampler, lcfg, pin_memory=pin, device=staged)
    if not len(val_idx):
        return train_loader, None
    val_sampler: Any = EpochBatchSampler(
        val_idx, lcfg.batch_size, shuffle="none", rank=info.rank, world_size=info.world_size
    )
    if val_batches is not None:
        val_sampler = val_batches(val_sampler)
    return train_loader, make_loader(dataset, val_sampler, lcfg, pin_memory=pin, device=staged)
