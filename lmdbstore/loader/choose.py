"""The sampler for a store and a set of its samples, chosen the same way for every consumer: the trainer,
the Keras ``PyDataset`` and the ``tf.data`` factory (numpy only, no torch).

* ``balanced``: :class:`~lmdbstore.loader.samplers.BalancedBatchSampler` over the classes of the samples;
* ``shuffle="auto"``: ``random`` when the store fits the page cache, ``window`` when it does not (said in
  one line);
* ``window``: :class:`~lmdbstore.loader.window.WindowBatchSampler`, reading each next window ahead;
* ``random``, ``block``, ``none``: :class:`~lmdbstore.loader.samplers.EpochBatchSampler`.

:func:`split_indices` gives the samples of a ``train``/``val`` split (the one ``lmdbstore train`` uses).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.format.meta import StoreMeta
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle
from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.reader import StoreReader

__all__ = ["SPLITS", "Sampler", "make_sampler_for", "pick_shuffle", "split_indices"]

#: Any sampler this module builds (a window sampler is an epoch sampler).
Sampler = EpochBatchSampler | BalancedBatchSampler
#: The parts of a store :func:`split_indices` knows.
SPLITS = ("train", "val")


def pick_shuffle(lcfg: LoaderConfig, path: Path, say: Callable[[str], None]) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by store size against memory, and says so."""
    if lcfg.shuffle != "auto":
        return lcfg.shuffle
    choice = choose_shuffle(os.path.getsize(path / DATA_FILE))
    say(f"shuffle: {choice.shuffle} ({choice.reason})")
    return choice.shuffle


def split_indices(labels: np.ndarray, split: str | None, val_fraction: float, seed: int) -> np.ndarray:
    """The sample indices of ``split``: ``None`` all of them, ``"train"``/``"val"`` the parts of
    :func:`~lmdbstore.loader.samplers.stratified_split` (seeded, every class split alike).

    Raises:
        ValueError: an unknown ``split`` or a ``val_fraction`` outside [0, 1).
    """
    if split is None:
        return np.arange(len(labels), dtype=np.int64)
    if split not in SPLITS:
        raise ValueError(f"split must be None, 'train' or 'val', got {split!r}")
    train, val = stratified_split(labels, val_fraction, seed)
    return train if split == "train" else val


def make_sampler_for(
    path: Path,
    meta: StoreMeta,
    labels: np.ndarray,
    indices: np.ndarray,
    lcfg: LoaderConfig,
    *,
    shuffle: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> Sampler:
    """The sampler of ``indices`` of the store at ``path``: class-balanced with ``lcfg.balanced``, else in
    the order ``shuffle`` names (default: :func:`pick_shuffle` of ``lcfg``; ``"none"``: index order).

    Raises:
        ValueError: a class with no sample among ``indices`` under ``balanced``, bad sizes.
    """
    kw = {"seed": lcfg.seed, "rank": rank, "world_size": world_size}
    if lcfg.balanced:
        classes: Sequence[str] = meta.classes
        per_class = [indices[labels[indices] == c] for c in range(len(classes))]
        return BalancedBatchSampler(per_class, lcfg.batch_size, class_names=classes, **kw)  # type: ignore[arg-type]
    shuffle = shuffle if shuffle is not None else pick_shuffle(lcfg, path, say)
    if shuffle == "window":
        return WindowBatchSampler(
            indices,
            lcfg.batch_size,
            samples_per_value=meta.samples_per_value,
            sample_bytes=meta.sample_bytes,
            window_bytes=None if lcfg.window_mb is None else lcfg.window_mb << 20,
            prefetch=StoreReader(path).prefetch,
            **kw,  # type: ignore[arg-type]
        )
    return EpochBatchSampler(
        indices,
        lcfg.batch_size,
        shuffle=shuffle,  # type: ignore[arg-type]
        samples_per_value=meta.samples_per_value,
        block_buffer=lcfg.block_buffer,
        **kw,  # type: ignore[arg-type]
    )
