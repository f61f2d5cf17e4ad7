"""A feed of a store as a :class:`~lmdbstore.config.LoaderConfig` says -- the split (or given indices), the
sampler chosen from the options (:func:`~lmdbstore.loader.choose.make_sampler_for`), the layout, the readers --
made the same way for every adapter: :func:`open_feed`.  numpy only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.feed.feed import EXTRA_SLOTS, BatchFeed, Fence
from lmdbstore.feed.layout import BatchLayout, Channels
from lmdbstore.feed.readers import StoreSource
from lmdbstore.feed.slots import SharedSlots
from lmdbstore.loader.choose import make_sampler_for, split_indices
from lmdbstore.loader.transform import Transform
from lmdbstore.store.metaview import check_in_range, sample_indices
from lmdbstore.store.readers import Reader, as_reader
from lmdbstore.util.procs import worker_processes

__all__ = ["channels_last_feed", "loader_config", "open_feed"]

StoreArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader


def loader_config(config: LoaderConfig | None, options: dict[str, Any]) -> LoaderConfig:
    """``config`` (default ``LoaderConfig()``) with the fields in ``options`` replaced.

    Raises:
        ValueError: an option that is no field of :class:`~lmdbstore.config.LoaderConfig`, or a bad value.
    """
    base = config or LoaderConfig()
    unknown = sorted(set(options) - set(LoaderConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (options are the fields of LoaderConfig)")
    return dataclasses.replace(base, **options)


def channels_last_feed(
    store: StoreArg, config: LoaderConfig | None, options: dict[str, Any], held: Callable[[int, int], int]
) -> BatchFeed:
    """The feed of the Keras and tf.data adapters: ``options`` are :func:`open_feed`'s ``indices``,
    ``transform``, ``rank``, ``world_size`` and fields of ``config`` to replace; ``held(batch_size, sample_bytes)``
    the slots for batches the consumer holds.  Raises as :func:`loader_config` and :func:`open_feed`."""
    kw = {k: options.pop(k) for k in ("indices", "transform", "rank", "world_size") if k in options}
    cfg = loader_config(config, options)
    reader = as_reader(store)
    with reader:
        sample_bytes = reader.meta.sample_bytes
    return open_feed(reader, cfg, channels="last", held=held(cfg.batch_size, sample_bytes), **kw)


def open_feed(
    store: StoreArg,
    config: LoaderConfig,
    *,
    channels: Channels = "last",
    indices: Any = None,
    transform: Transform | None = None,
    sampler: Any = None,
    source: StoreSource | None = None,
    held: int = EXTRA_SLOTS,
    rank: int | None = None,
    world_size: int | None = None,
    fence: Callable[[], Fence] | None = None,
    pin: Callable[[SharedSlots], Callable[[], None]] | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> BatchFeed:
    """A :class:`~lmdbstore.feed.feed.BatchFeed` of ``store`` (a path, a list of them read as one set of
    stores -- one index space, classes mapped by name -- or a reader) as ``config`` says.

    Args:
        channels: the layout when ``config.channels`` does not name one (the adapter's convention).
        indices: read only these samples (instead of ``config.split``); transform: run on each batch where read.
        sampler: the batch sampler to use instead of one built from ``config``'s options.
        source: what the readers read (default: a :class:`~lmdbstore.feed.readers.StoreSource` of ``store``).
        rank, world_size: this process's share under data-parallel training (default: the process group's).
        held, fence, pin: as :class:`~lmdbstore.feed.feed.BatchFeed`.
        say: where the one line saying what ``shuffle="auto"`` chose goes.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: stores of a set that do not make one set.
        ValueError: ``indices`` not integers or given with a split, a sampler that cannot be made, or not even
            one batch per reader fitting in memory.  IndexError: an index outside the store.
    """
    reader = as_reader(store)  # its pin of the store and file travels with the feed and its readers
    with reader:
        meta = reader.meta
        labels = reader.labels() if source is None else source.label_table
    if sampler is None:
        sampler = _sampler(reader, meta, labels, config, indices, rank, world_size, say)
    elif indices is not None or config.split is not None:
        raise ValueError("give a sampler, or indices or a split to build one from, not both")
    layout = BatchLayout(tuple(meta.shape), meta.dtype, config.channels or channels)
    src = source if source is not None else StoreSource(reader, layout, transform, labels)
    return BatchFeed(
        src, sampler, samples=meta.count, workers=worker_processes(config.workers),
        prefetch=config.prefetch, held=held, context=config.multiprocessing_context, seed=config.seed,
        persistent=config.persistent_workers, fence=fence, pin=pin,
    )  # fmt: skip


def _sampler(
    reader: Reader,
    meta: Any,
    labels: np.ndarray,
    config: LoaderConfig,
    indices: Any,
    rank: int | None,
    world_size: int | None,
    say: Callable[[str], None],
) -> Any:
    """The sampler ``config``'s options ask for, over its split or ``indices``."""
    if indices is None:
        idx = split_indices(labels, config.split, config.val_fraction, config.seed)
    elif config.split is not None:
        raise ValueError("give indices or a split, not both")
    else:
        idx = sample_indices(indices)
        check_in_range(idx, meta.count)
    order = config.order
    sampler = make_sampler_for(
        reader, meta, labels, idx, config, shuffle=None if order == "auto" else order, rank=rank,
        world_size=world_size, say=say,
    )  # fmt: skip
    if config.drop_last and hasattr(sampler, "drop_last"):
        sampler.drop_last = True  # type: ignore[union-attr]
    return sampler
