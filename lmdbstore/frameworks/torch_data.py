"""PyTorch on the feed (:mod:`lmdbstore.feed`): :class:`LmdbBatchDataset`, a batch-level ``Dataset`` over a
store, and :func:`make_loader`, a ``torch.utils.data.DataLoader`` whose batches come from the feed's reader
processes -- the same slots, resume counts and seeds as the Keras and tf.data adapters.

The loader's dataset is its passes (an ``IterableDataset``: Lightning leaves it as it is under DDP), its
``sampler`` the batch sampler, its ``state_dict`` the batches delivered (``StatefulDataLoader``'s contract).  A
batch is ``torch.from_numpy`` of its slot, no copy; ``pin_memory``/``device=``: :mod:`lmdbstore.frameworks.cuda`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, IterableDataset, get_worker_info

from lmdbstore.config import LoaderConfig
from lmdbstore.feed.feed import BatchFeed
from lmdbstore.feed.layout import BatchLayout
from lmdbstore.feed.opening import loader_config, open_feed
from lmdbstore.feed.readers import StoreSource
from lmdbstore.feed.slots import SharedSlots
from lmdbstore.format.dtypes import DTYPES
from lmdbstore.frameworks.cuda import PageLock, PinnedCopies, Staging, page_locking, stage
from lmdbstore.loader.transform import Transform
from lmdbstore.store.metaview import sample_indices
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import Reader, as_reader

__all__ = ["FeedLoader", "LmdbBatchDataset", "as_batch_dataset", "make_loader"]

StoreArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name])  # type: ignore[no-any-return]


class LmdbBatchDataset(StoreSource, Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batch-indexed dataset: ``ds[indices] -> (x, y)``, ``x`` in the store's dtype, ``y`` int64.

    It works in a plain ``DataLoader`` or torchdata's ``StatefulDataLoader`` (``batch_size=None``, a batch
    sampler as ``sampler``); under :func:`make_loader` it is what the readers read, and a subclass's own
    ``__getitem__`` runs there (its first read goes into the reader's slot, any other into memory of its own).

    Args:
        store: a path, a list of paths (one set: :class:`~lmdbstore.store.multi.StoreSet`), or a reader or set
            (closed here: each process re-opens it lazily).
        add_channel: a channel axis after the batch axis for samples of fewer than 3 dimensions (default
            ``True``: (N, 1, H, W) for (H, W)); (C, H, W) samples come as (N, C, H, W).  ``False``: (N, *shape).
        transform: ``transform(x, y) -> (x, y)`` on numpy batches where they are read (augmentation; a
            module-level function, :mod:`lmdbstore.loader.transform`).

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
    """

    def __init__(self, store: StoreArg, *, add_channel: bool = True, transform: Transform | None = None):
        reader = as_reader(store)
        try:
            meta = reader.meta
            labels = reader.labels()  # compact (uint8 up to 256 classes), widened per batch only
            reader.read_path  # noqa: B018  # the position table, built once and inherited by forked readers
        finally:
            reader.close()
        self.shape, self.count, self.dtype = meta.shape, meta.count, meta.dtype
        self.torch_dtype, self.add_channel = _torch_dtype(meta.dtype), add_channel
        layout = BatchLayout(tuple(meta.shape), meta.dtype, "first" if add_channel else "stored")
        super().__init__(reader, layout, transform, labels if labels.dtype == np.uint8 else labels.astype(np.int32))
        self._target: tuple[torch.Tensor, np.ndarray] | None = None  # a reader's slot, set by fill

    def __len__(self) -> int:
        return self.count

    @property
    def labels(self) -> torch.Tensor:
        """Every label of the store (the compact table as a tensor)."""
        return torch.from_numpy(self.label_table)

    @property
    def own(self) -> bool:
        """Whether a subclass overrides ``__getitem__``."""
        return type(self).__getitem__ is not LmdbBatchDataset.__getitem__

    @property
    def user_code(self) -> bool:
        return self.own or self.transform is not None

    def payload(self) -> list[tuple[str, Any]]:
        return [*super().payload(), *([(f"the dataset ({type(self).__name__})", self)] if self.own else [])]

    def batch_shape(self, rows: int) -> tuple[int, ...]:
        """Shape of ``x`` for a batch of ``rows`` samples."""
        return (rows, *self.layout.item_shape)

    def __getitem__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        idx = sample_indices(indices)
        target, self._target = self._target, None  # a reader's slot, for one read: a later one gets its own memory
        if target is not None and len(target[0]) == len(idx):
            x, y = target
        else:
            x, y = torch.empty(self.batch_shape(len(idx)), dtype=self.torch_dtype), np.empty(len(idx), np.int64)
            if get_worker_info() is not None:  # to a DataLoader's main process without another copy
                x.share_memory_()
        fresh = self.read_into(x.numpy(), y, idx)
        if fresh is not None:
            return torch.from_numpy(fresh[0]), torch.from_numpy(fresh[1])
        return x, torch.from_numpy(y)

    def fill(self, slots: SharedSlots, slot: int, idx: np.ndarray) -> tuple[Any, ...]:
        """The feed's read: straight into the slot, or a subclass's ``__getitem__`` with the slot as the target
        of its first read -- the batch stays there when ``x`` is the slot's memory as read (changed in place or
        not); anything else (other shapes, views, more items, more reads) travels as it is."""
        if not self.own:
            return super().fill(slots, slot, idx)
        rows = len(idx)
        x = torch.from_numpy(slots.x(slot, rows, self.layout.item_shape, np.dtype(self.layout.dtype)))
        y = slots.y(slot, rows)
        self._target = (x, y)
        try:
            out = self[idx]
        finally:
            self._target = None
        if (
            isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
            and (out[0].data_ptr(), out[0].shape, out[0].stride(), out[0].dtype) == (x.data_ptr(), x.shape, x.stride(), x.dtype)
            and out[1].shape == (rows,)
        ):  # fmt: skip
            if out[1].data_ptr() != y.ctypes.data:
                y[:] = out[1].numpy()
            return ("slot", slot, rows)
        return ("fresh", slot, out)


def as_batch_dataset(dataset: Any) -> LmdbBatchDataset:
    """``dataset`` itself, or for a ``ConcatDataset`` of :class:`LmdbBatchDataset` (``ds_a + ds_b``) the one
    dataset over the set of their stores (the same indices, whole batches).

    Raises:
        ValueError: anything else (a one-line error pointing to the set of stores).
    """
    if isinstance(dataset, LmdbBatchDataset):
        return dataset
    parts = list(dataset.datasets) if isinstance(dataset, ConcatDataset) else []
    ours = [d for d in parts if isinstance(d, LmdbBatchDataset)]
    same = len({d.add_channel for d in ours}) == 1 and len({id(d.transform) for d in ours}) == 1
    if parts and len(ours) == len(parts) and same:
        readers = [r for d in ours for r in (d.reader.readers if isinstance(d.reader, StoreSet) else [d.reader])]
        return LmdbBatchDataset(StoreSet(readers), add_channel=ours[0].add_channel, transform=ours[0].transform)
    raise ValueError(
        f"dataset must be an LmdbBatchDataset, got {type(dataset).__name__}; for several stores use "
        "LmdbBatchDataset([store_a, store_b, ...]) (one set of stores, one index space)"
    )


class FeedBatches(IterableDataset[Any]):
    """A :class:`FeedLoader`'s dataset: its passes (iterating it is one pass), ``len`` the batches of one;
    ``dataset`` is the :class:`LmdbBatchDataset` read (``None`` for a loader made from a path)."""

    def __init__(self, loader: FeedLoader, dataset: LmdbBatchDataset | None):
        self._loader = weakref.ref(loader)  # no cycle keeps the loader's readers alive
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        return iter(loader) if loader is not None else iter(())

    def __len__(self) -> int:
        loader = self._loader()
        return len(loader) if loader is not None else 0


def _as_torch(batch: Any) -> Any:
    """A feed batch as tensors (numpy arrays viewed, not copied; a dataset's own objects as they are)."""
    if isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(a, np.ndarray) for a in batch):
        return torch.from_numpy(batch[0]), torch.from_numpy(batch[1])
    return batch


class FeedLoader(DataLoader[Any]):
    """The ``DataLoader`` :func:`make_loader` returns: one feed pass per ``iter()``, ``len()`` batches a pass;
    :meth:`close` (or ``with``, or collection) stops the readers, which otherwise wait between passes and
    stop once idle."""

    def __init__(self, feed: BatchFeed, sampler: Any, dataset: LmdbBatchDataset | None, staging: Staging | None):
        self._feed, self._sampler, self._staging = feed, sampler, staging
        self._copies: PinnedCopies | None = None
        workers = feed.workers
        super().__init__(
            FeedBatches(self, dataset), batch_size=None, num_workers=workers,
            prefetch_factor=feed.depth // workers if workers else None,
            persistent_workers=feed.persistent and workers > 0, pin_memory=feed.pin is not None,
        )  # fmt: skip

    # DataLoader.__init__ sets both attributes; the feed decides them
    @property  # type: ignore[override]
    def sampler(self) -> Any:
        """The batch sampler (``set_epoch`` pins the next pass's epoch; its own ``state_dict`` counts the
        batches read ahead too: save the loader's)."""
        return self._sampler

    @sampler.setter
    def sampler(self, _value: Any) -> None:
        pass

    @property  # type: ignore[override]
    def multiprocessing_context(self) -> Any:
        """The context of the readers' start method (running, or that the next pass would start)."""
        return mp.get_context(self._feed.method) if self._feed.workers else None

    @multiprocessing_context.setter
    def multiprocessing_context(self, _value: Any) -> None:
        pass

    @property
    def feed(self) -> BatchFeed:
        return self._feed

    def __len__(self) -> int:
        return len(self._feed)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = self._pass()
        lock = self._feed.pin
        if isinstance(lock, PageLock) and lock.failed:  # slots not page-locked: a thread copies into pinned ones
            if self._copies is None:
                layout = self._feed.source.layout
                self._copies = PinnedCopies(
                    self._feed.rows, layout.item_shape, _torch_dtype(layout.dtype), self._feed.fence
                )
                self._feed.fence = None  # the slots are read by that thread's synchronous copies
            batches = self._copies(batches)
        return stage(batches, self._staging) if self._staging is not None else batches

    def _pass(self) -> Iterator[Any]:
        feed = self._feed
        feed.begin()
        try:
            while True:
                try:
                    box = [_as_torch(feed.next())]
                except StopIteration:
                    return
                yield box.pop()  # nothing here keeps the batch: its slot is free once the loop lets go
        finally:
            feed.rest()  # the pass is over or abandoned: the readers wait, and stop once idle

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the batches this loader has *delivered* (not those read ahead), in the
        sampler's format (``{"position", "batches"}`` for one that keeps none): loaded into a loader of the same
        sampler it delivers that epoch's batches from there on (after a finished epoch, the next one)."""
        return self._feed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or the sampler's own): the next pass delivers the rest of that
        epoch, the batches already delivered skipped unread.

        Raises:
            ValueError: the state is malformed or of another sampler, naming what differs.
        """
        self._feed.load_state_dict(state)

    def close(self) -> None:
        """Stop the readers and free the slots now (the next pass starts them again)."""
        self._feed.close()

    def __enter__(self) -> FeedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_loader(
    dataset: StoreArg | LmdbBatchDataset | ConcatDataset[Any],
    sampler: Any = None,
    config: LoaderConfig | None = None,
    *,
    pin_memory: bool | None = None,
    device: str | torch.device | None = None,
    indices: Any = None,
    transform: Transform | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    say: Callable[[str], None] = lambda _msg: None,
    **options: Any,
) -> FeedLoader:
    """A ``DataLoader`` of whole batches read by reader processes (see the module docstring).

    Args:
        dataset: a store path (or a list of them: one set), a reader, an :class:`LmdbBatchDataset` (a subclass's
            ``__getitem__`` runs in the readers) or a ``ConcatDataset`` of them (read as the set of their stores).
        sampler: the batch sampler (any iterable of index arrays; :mod:`lmdbstore.loader`'s resume exactly,
            others by count); default: built from ``config`` as ``keras_dataset`` does.
        config: :class:`~lmdbstore.config.LoaderConfig`; ``options`` override its fields:
            ``make_loader("train.lmdb", batch_size=4096, workers=8, split="train")``.
        pin_memory: page-lock the slots for asynchronous copies to CUDA (default ``config.pin_memory``).
        device: a CUDA device to deliver batches on, staged on a side stream (implies ``pin_memory``).
        indices, transform, rank, world_size: for the sampler built from the options (``transform``: for a
            path; a dataset has its own); say: where the one line on what ``shuffle="auto"`` chose goes.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValueError: an unknown option, a bad value, a sampler given with options that build one, a transform
            or dataset that spawned readers cannot receive, or not even one batch per reader fitting in memory.
    """
    cfg = loader_config(config, options)
    paths = isinstance(dataset, (str, os.PathLike, list, tuple, StoreReader, StoreSet))
    ds = None if paths else as_batch_dataset(dataset)
    if ds is not None and transform is not None:
        raise ValueError("give the transform to the LmdbBatchDataset, not to make_loader")
    if ds is not None and cfg.channels not in (None, ds.layout.channels):
        raise ValueError(f"channels={cfg.channels!r}: the dataset lays batches out {ds.layout.channels!r}")
    dev = torch.device(device) if device is not None else None
    cuda = torch.cuda.is_available()
    staging = Staging(dev) if dev is not None and dev.type == "cuda" and cuda else None
    pinned = bool(pin_memory if pin_memory is not None else cfg.pin_memory) or staging is not None
    fence, pin = page_locking(staging) if pinned and cuda else (None, None)
    feed = open_feed(
        dataset if ds is None else ds.reader, cfg, channels="first", indices=indices,  # type: ignore[arg-type]
        transform=transform, sampler=sampler, source=ds, rank=rank, world_size=world_size, fence=fence, pin=pin, say=say,
    )  # fmt: skip
    return FeedLoader(feed, sampler if sampler is not None else feed.sampler, ds, staging)
