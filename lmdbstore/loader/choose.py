"""The sampler for a store and a set of its samples, chosen the same way for every consumer: every feed
(PyTorch's ``make_loader``, the trainer, the Keras ``PyDataset``, the ``tf.data`` factory); numpy only, no torch.

:func:`split_indices` gives the samples of a ``train``/``val`` split (the one ``lmdbstore train`` uses) of a store
as it is; a :class:`SplitRecord` says what a run's split was drawn from, and draws it again exactly.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_VAL_FRACTION, LoaderConfig
from lmdbstore.configcheck import check_int
from lmdbstore.errors import LmdbStoreError
from lmdbstore.format.meta import StoreMeta
from lmdbstore.loader.mixing import MixedBatchSampler, store_parts
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
from lmdbstore.loader.sets import SetBatches, SetPrefetch, grouped, set_space
from lmdbstore.loader.window import WindowBatchSampler, bound_window_bytes, choose_shuffle
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import Reader, data_file_bytes
from lmdbstore.util.splits import check_val_fraction

__all__ = [
    "SPLITS",
    "Sampler",
    "SplitRecord",
    "make_sampler_for",
    "pick_shuffle",
    "recorded_splits",
    "run_split",
    "split_indices",
]

#: Any sampler this module builds (a window or mixed sampler is an epoch sampler; a set's batches come grouped
#: by store).
Sampler = EpochBatchSampler | BalancedBatchSampler | SetBatches
#: The parts of a store :func:`split_indices` knows.
SPLITS = ("train", "val")


def pick_shuffle(lcfg: LoaderConfig, reader: Reader, say: Callable[[str], None]) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by the size of the reader's data file(s)
    against memory, and says so."""
    if lcfg.order != "auto":
        return lcfg.order
    choice = choose_shuffle(data_file_bytes(reader))
    say(f"shuffle: {choice.shuffle} ({choice.reason})")
    return choice.shuffle


def split_indices(
    labels: np.ndarray,
    split: str | None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = LoaderConfig.seed,
    *,
    recorded: Sequence[SplitRecord] | None = None,
    path: Path | None = None,
) -> np.ndarray:
    """The sample indices of ``split``: ``None`` all of them, ``"train"``/``"val"`` the parts of
    :func:`~lmdbstore.loader.samplers.stratified_split` (seeded, every class split alike), or with ``recorded``
    (a training run's :class:`SplitRecord`\\ s) that run's parts exactly (:func:`run_split`).

    Raises:
        ValueError: an unknown ``split`` or a bad ``val_fraction``.
        LmdbStoreError: no record of ``recorded`` is of these labels (the store ``path`` changed since the run).
    """
    if split is None:
        return np.arange(len(labels), dtype=np.int64)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if recorded is not None:
        train, val = run_split(recorded, labels, path).parts(labels)
    else:
        train, val = stratified_split(labels, val_fraction, seed)
    return train if split == "train" else val


@dataclass(frozen=True)
class SplitRecord:
    """What a train/val split was drawn from: :func:`~lmdbstore.loader.samplers.stratified_split`'s
    ``val_fraction`` and ``seed``, over the store's first ``samples`` samples (a store only grows at its end),
    whose labels have the sha256 digest ``labels``.  Every checkpoint holds its run's; ``ValueError`` (naming it)
    for a field out of range.
    """

    val_fraction: float
    seed: int
    samples: int
    labels: str

    def __post_init__(self) -> None:
        check_val_fraction(self.val_fraction)
        check_int("seed", self.seed, None)
        check_int("samples", self.samples, 0)
        if not isinstance(self.labels, str) or len(self.labels) != 64:
            raise ValueError("labels must be a sha256 digest")

    @classmethod
    def drawn(cls, labels: np.ndarray, val_fraction: float, seed: int) -> SplitRecord:
        """The record of the split of ``labels`` (every sample of a store) by ``val_fraction`` and ``seed``."""
        return cls(val_fraction, seed, len(labels), _digest(labels))

    def parts(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(train, val)`` indices of this split of a store :func:`run_split` found it for: exactly the ones
        drawn, on a store that grew since too (its later samples are in neither)."""
        return stratified_split(labels[: self.samples], self.val_fraction, self.seed)


def run_split(records: Sequence[SplitRecord], labels: np.ndarray, path: Path | None = None) -> SplitRecord:
    """The one of a run's split ``records`` (one per set of shards under multi-node training) drawn from the
    first samples of a store whose labels are ``labels`` now.

    Raises:
        LmdbStoreError: none was: the store changed since the run (another store, or one replaced).
    """
    for r in records:
        if len(labels) >= r.samples and _digest(labels[: r.samples]) == r.labels:
            return r
    raise LmdbStoreError(
        f"the store changed since the run split its first {records[0].samples} samples: their labels are not the run's",
        path=path,
        hint="give the store the run was trained on",
    )


def recorded_splits(
    ckpt: dict[str, Any], path: Path, val_fraction: float | None = None, seed: int | None = None
) -> list[SplitRecord]:
    """The split records (:class:`SplitRecord`) of a checkpoint's run (one per set of shards under multi-node
    training); with ``val_fraction`` and ``seed`` (a resumed run's), checked to be the run's.

    Raises:
        LmdbStoreError: none recorded (a checkpoint of an earlier version), malformed, or of another
            ``val_fraction`` or ``seed``.
    """
    if "split" not in ckpt:
        raise LmdbStoreError("the checkpoint records no split (an earlier version wrote it)", path=path)
    try:
        records = [SplitRecord(**d) for d in json.loads(ckpt["split"])]
        run = records[0]
    except (TypeError, ValueError, IndexError) as exc:
        raise LmdbStoreError(f"malformed checkpoint: its split record ({str(exc)[:200]})", path=path) from None
    if val_fraction is not None and (run.val_fraction, run.seed) != (val_fraction, seed):
        raise LmdbStoreError(
            f"the checkpoint's run held out val_fraction {run.val_fraction} with seed {run.seed}, "
            f"not {val_fraction} with seed {seed}",
            path=path,
            hint="resume with the run's val_fraction= and seed=",
        )
    return records


def _digest(labels: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(labels).data).hexdigest()  # 40M labels: ~30 ms


def _prefetch(reader: Reader) -> Callable[[np.ndarray, np.ndarray], None]:
    """The window sampler's read-ahead: this process's own reader (the loaders' one is closed)."""
    if isinstance(reader, StoreSet):
        return SetPrefetch(copy.deepcopy(reader), set_space(reader))
    return StoreReader(reader.path).prefetch


def make_sampler_for(
    reader: Reader,
    meta: StoreMeta,
    labels: np.ndarray,
    indices: np.ndarray,
    lcfg: LoaderConfig,
    *,
    shuffle: str | None = None,
    window_bytes: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> Sampler:
    """The sampler of ``indices`` of ``reader`` (a store's, or a :class:`~lmdbstore.store.multi.StoreSet`):
    per-store shares with ``lcfg.weights`` (:mod:`lmdbstore.loader.mixing`), class-balanced with ``lcfg.balanced``,
    else in the order ``shuffle`` names (default: :func:`pick_shuffle`; a ``window`` of ``window_bytes``, default
    ``lcfg.window_mb``, else an eighth of available memory).  Over a set of several stores the orders are drawn
    in its padded index space and every batch comes grouped by store (:mod:`lmdbstore.loader.sets`).

    Raises:
        ValueError: a class with no sample among ``indices`` under ``balanced``, not one weight per store,
            bad sizes.
    """
    kw: dict[str, Any] = {"seed": lcfg.seed, "rank": rank, "world_size": world_size}
    if lcfg.weights is not None:
        return MixedBatchSampler(store_parts(reader, indices), lcfg.weights, lcfg.batch_size, **kw)
    if lcfg.balanced:
        classes: Sequence[str] = meta.classes
        of = labels[indices]  # once, not once per class
        per_class = [indices[of == c] for c in range(len(classes))]
        del of
        balanced = BalancedBatchSampler(per_class, lcfg.batch_size, class_names=classes, **kw)
        return grouped(balanced, reader)
    shuffle = shuffle if shuffle is not None else pick_shuffle(lcfg, reader, say)
    space = set_space(reader)
    idx = space.to_padded(indices) if space is not None else indices
    sampler: EpochBatchSampler
    if shuffle == "window":
        sampler = WindowBatchSampler(
            idx,
            lcfg.batch_size,
            samples_per_value=meta.samples_per_value,
            sample_bytes=meta.sample_bytes,
            window_bytes=window_bytes
            if window_bytes is not None or lcfg.window_mb is None
            else bound_window_bytes(lcfg.window_mb << 20, len(idx) * meta.sample_bytes, "window_mb"),
            prefetch=_prefetch(reader),
            **kw,
        )
    else:
        sampler = EpochBatchSampler(
            idx,
            lcfg.batch_size,
            shuffle=shuffle,  # type: ignore[arg-type]
            samples_per_value=meta.samples_per_value,
            block_buffer=lcfg.block_buffer,
            **kw,
        )
    return grouped(sampler, reader, space)
