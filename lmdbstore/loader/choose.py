"""The sampler for a store and a set of its samples, chosen the same way for every consumer: every feed
(PyTorch's ``make_loader``, the trainer, the Keras ``PyDataset``, the ``tf.data`` factory); numpy only, no torch.

* ``weights``: :class:`~lmdbstore.loader.mixing.MixedBatchSampler`, each store's share of every epoch;
* ``balanced``: :class:`~lmdbstore.loader.samplers.BalancedBatchSampler` over the classes of the samples;
* ``shuffle="auto"``: ``random`` when the store fits the page cache, ``window`` when it does not (said in
  one line);
* ``window``: :class:`~lmdbstore.loader.window.WindowBatchSampler`, reading each next window ahead;
* ``random``, ``block``, ``none``: :class:`~lmdbstore.loader.samplers.EpochBatchSampler`.

:func:`split_indices` gives the samples of a ``train``/``val`` split (the one ``lmdbstore train`` uses).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.format.meta import StoreMeta
from lmdbstore.loader.mixing import MixedBatchSampler, store_parts
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
from lmdbstore.loader.sets import SetBatches, SetPrefetch, grouped, set_space
from lmdbstore.loader.window import WindowBatchSampler, bound_window_bytes, choose_shuffle
from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import Reader, data_file_bytes

__all__ = ["SPLITS", "Sampler", "make_sampler_for", "pick_shuffle", "split_indices"]

#: Any sampler this module builds (a window or mixed sampler is an epoch sampler; a set's batches come grouped
#: by store).
Sampler = EpochBatchSampler | BalancedBatchSampler | SetBatches
#: The parts of a store :func:`split_indices` knows.
SPLITS = ("train", "val")


def _data_bytes(store: Path | Reader) -> int:
    if isinstance(store, (StoreReader, StoreSet)):
        return data_file_bytes(store)
    return os.path.getsize(Path(store) / DATA_FILE)


def pick_shuffle(lcfg: LoaderConfig, store: Path | Reader, say: Callable[[str], None]) -> str:
    """The shuffle to use: ``auto`` picks ``random`` or ``window`` by the size of the store's data file(s)
    (a path, a reader or a set of stores) against memory, and says so."""
    if lcfg.order != "auto":
        return lcfg.order
    choice = choose_shuffle(_data_bytes(store))
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


def _prefetch(store: Path | Reader) -> Callable[[np.ndarray, np.ndarray], None]:
    """The window sampler's read-ahead: this process's own reader (the loaders' one is closed)."""
    if isinstance(store, StoreSet):
        return SetPrefetch(copy.deepcopy(store), set_space(store))
    return StoreReader(store.path if isinstance(store, StoreReader) else store).prefetch


def make_sampler_for(
    store: Path | Reader,
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
    """The sampler of ``indices`` of ``store`` (a path, a reader, or a :class:`~lmdbstore.store.multi.StoreSet`):
    class-balanced with ``lcfg.balanced``, else in the order ``shuffle`` names (default: :func:`pick_shuffle`
    of ``lcfg``; ``"none"``: index order; a ``window`` of ``window_bytes``, default ``lcfg.window_mb``, else an
    eighth of available memory).  Over a set of several stores the orders are drawn in its padded
    index space (:mod:`lmdbstore.loader.sets`: each store's packed values kept whole) and every batch comes
    grouped by store.

    With ``lcfg.weights`` each store's share of every epoch is fixed (:mod:`lmdbstore.loader.mixing`).

    Raises:
        ValueError: a class with no sample among ``indices`` under ``balanced``, not one weight per store,
            bad sizes.
    """
    kw: dict[str, Any] = {"seed": lcfg.seed, "rank": rank, "world_size": world_size}
    reader = store if isinstance(store, (StoreReader, StoreSet)) else None
    if lcfg.weights is not None:
        parts = store_parts(reader, indices) if reader is not None else [indices]
        return MixedBatchSampler(parts, lcfg.weights, lcfg.batch_size, **kw)
    if lcfg.balanced:
        classes: Sequence[str] = meta.classes
        of = labels[indices]  # once, not once per class
        per_class = [indices[of == c] for c in range(len(classes))]
        del of
        balanced = BalancedBatchSampler(per_class, lcfg.batch_size, class_names=classes, **kw)
        return grouped(balanced, reader) if reader is not None else balanced
    shuffle = shuffle if shuffle is not None else pick_shuffle(lcfg, store, say)
    space = set_space(reader) if reader is not None else None
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
            prefetch=_prefetch(store),
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
    return grouped(sampler, reader, space) if reader is not None else sampler
