"""PyTorch integration: a batch-level Dataset over a store and a DataLoader factory.

:class:`LmdbBatchDataset` is indexed by a whole batch of sample indices and returns
``(x, y)`` with ``x`` in the store's dtype and ``y`` int64 labels: ``x`` is ``(N, 1, H, W)`` for 2-D samples
(a channel axis is added), ``(N, C, H, W)`` for 3-D samples (C, H, W), which have one already.  Inside a
DataLoader worker the batch is read straight into shared memory, so it crosses to the main process without
another copy: by default into one of the worker's reusable buffers (:mod:`lmdbstore.loader.buffers`), otherwise
into a fresh shared-memory tensor.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, get_worker_info

from lmdbstore.config import LoaderConfig
from lmdbstore.format.dtypes import DTYPES
from lmdbstore.loader.buffers import (
    EXTRA_SLOTS,
    BatchBuffers,
    BufferSpec,
    SlotBatch,
    TaggedBatch,
    TaggedSampler,
    reuse_supported,
)
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler
from lmdbstore.loader.sets import SetBatches
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader, as_reader

__all__ = ["BufferedLoader", "LmdbBatchDataset", "as_batch_dataset", "make_loader"]


class LmdbBatchDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batch-indexed dataset: ``ds[indices] -> (x, y)``.

    Args:
        store: a path, a list of paths (read as one set: :class:`~lmdbstore.store.multi.StoreSet`), or a
            :class:`StoreReader` or set (it is closed here, so that no open environment crosses into the
            workers; each process re-opens it lazily).
        add_channel: insert a channel axis after the batch axis for samples of fewer than 3 dimensions
            (default ``True``: (N, 1, H, W) for (H, W), (N, 1, L) for (L,)); samples of 3 or more dimensions
            are taken to have one first, (C, H, W), and come as (N, C, H, W).  ``False``: always (N, *shape).
    """

    buffers: BatchBuffers | None = None  # set on a loader's own copy by make_loader

    def __init__(
        self, store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader, *, add_channel: bool = True
    ):
        self.reader = as_reader(store)
        try:
            meta = self.reader.meta
            self.shape = meta.shape
            self.count = meta.count
            self.torch_dtype = getattr(torch, DTYPES[meta.dtype])
            self.add_channel = add_channel
            # the store's compact label table (uint8 up to 256 classes; 50 MB for 50M samples), shared with
            # every worker; widened to int64 per batch only
            labels = self.reader.labels()
            self.labels = torch.from_numpy(labels if labels.dtype == np.uint8 else labels.astype(np.int32))
            # the position table, built once here and inherited by forked workers (same snapshot)
            self.reader.read_path  # noqa: B018
        finally:
            self.reader.close()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor] | SlotBatch:  # type: ignore[override]
        gen = 0
        if isinstance(indices, TaggedBatch):
            gen, indices = indices
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        # index_select, not ``labels[tensor]``: advanced indexing runs on torch's intra-op thread pool and
        # cost ~8 ms per 4096-sample batch in a 2-thread main process (index_select: ~0.01 ms).
        y = torch.index_select(self.labels, 0, torch.from_numpy(idx)).long()
        worker = get_worker_info()
        if worker is not None and self.buffers is not None:
            slot = self.buffers.acquire(worker.id, len(idx), gen)
            if slot is not None:
                try:
                    self.reader.read_batch(idx, out=self.buffers.target(slot, len(idx), self.shape))
                except BaseException:
                    self.buffers.abandon(slot)
                    raise
                return SlotBatch(slot, len(idx), y)
        x = torch.empty(self.batch_shape(len(idx)), dtype=self.torch_dtype)
        if worker is not None:
            x.share_memory_()  # filled in place; pickling to the main process then copies nothing
        self.reader.read_batch(idx, out=x.numpy().reshape(len(idx), *self.shape))
        return x, y

    def batch_shape(self, rows: int) -> tuple[int, ...]:
        """Shape of ``x`` for a batch of ``rows`` samples."""
        if self.add_channel and len(self.shape) < 3:
            return (rows, 1, *self.shape)
        return (rows, *self.shape)


class BufferedLoader(DataLoader[Any]):
    """A DataLoader whose workers read into reusable shared-memory buffers (:mod:`lmdbstore.loader.buffers`).

    It yields ``(x, y)`` like any DataLoader over :class:`LmdbBatchDataset`.  A batch's memory is reused
    only after nothing references it (the batch, a view of it or a numpy array of it), so keeping batches
    is safe; the buffers' benefit needs the consumer to drop each batch before taking about
    ``prefetch_factor + 2`` more, as a training loop does.  Built by :func:`make_loader`.
    """

    def __init__(self, dataset: LmdbBatchDataset, spec: BufferSpec, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.buffer_spec = spec
        self._pin = bool(kwargs.get("pin_memory")) and torch.cuda.is_available()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: LmdbBatchDataset = self.dataset  # type: ignore[assignment]
        if self._iterator is None or not self.persistent_workers:  # before the workers start: they take these
            ds.buffers = self._allocate()
        buffers = ds.buffers
        if buffers is None:  # no room for them: a fresh segment per batch
            yield from super().__iter__()
            return
        buffers.new_generation()
        batches = super().__iter__()
        while True:
            buffers.release_unreferenced()  # before waiting: the worker may need the slot for the next batch
            try:
                item = next(batches)
            except StopIteration:
                return
            yield buffers.deliver(item, self._pin) if isinstance(item, SlotBatch) else item

    def _allocate(self) -> BatchBuffers | None:
        try:
            return self.buffer_spec.allocate()
        except (RuntimeError, OSError) as exc:  # e.g. a small /dev/shm in a container
            spec = self.buffer_spec
            size = spec.workers * spec.slots * int(np.prod(spec.batch_shape)) * spec.dtype.itemsize
            warnings.warn(
                f"lmdbstore: no room for {size / 2**20:.0f} MiB of reusable batch buffers in shared memory "
                f"({exc}); each batch gets a fresh segment instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return None

    def reuse_counts(self) -> tuple[int, int]:
        """Batches delivered through a reused buffer and through a fresh segment, over this loader's
        current buffers (all epochs with persistent workers, the last one otherwise)."""
        ds: LmdbBatchDataset = self.dataset  # type: ignore[assignment]
        return ds.buffers.reuse_counts() if ds.buffers is not None else (0, 0)


def as_batch_dataset(dataset: Any) -> LmdbBatchDataset:
    """``dataset`` itself, or for a ``ConcatDataset`` of :class:`LmdbBatchDataset` (``ds_a + ds_b``) the one
    dataset over the set of their stores, which has the same indices and reads whole batches.

    Raises:
        ValueError: anything else (a one-line error pointing to the set of stores).
    """
    if isinstance(dataset, LmdbBatchDataset):
        return dataset
    parts = list(dataset.datasets) if isinstance(dataset, ConcatDataset) else []
    ours = [d for d in parts if isinstance(d, LmdbBatchDataset)]
    if parts and len(ours) == len(parts) and len({d.add_channel for d in ours}) == 1:
        readers = [r for d in ours for r in (d.reader.readers if isinstance(d.reader, StoreSet) else [d.reader])]
        return LmdbBatchDataset(StoreSet(readers), add_channel=ours[0].add_channel)
    raise ValueError(
        f"dataset must be an LmdbBatchDataset, got {type(dataset).__name__}; for several stores use "
        "LmdbBatchDataset([store_a, store_b, ...]) (one set of stores, one index space)"
    )


def make_loader(
    dataset: LmdbBatchDataset | ConcatDataset[Any],
    sampler: EpochBatchSampler | BalancedBatchSampler | SetBatches,
    config: LoaderConfig | None = None,
    *,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    """A DataLoader that asks each worker for whole batches chosen by ``sampler``.

    ``batch_size=None`` turns off PyTorch's per-sample batching and collate: every element the sampler
    yields is one index array, and the dataset answers it with one ready tensor.  With workers and
    ``config.reuse_buffers`` (the default) the result is a :class:`BufferedLoader` over a copy of
    ``dataset`` (so that two loaders of one dataset never share buffers).  A ``ConcatDataset`` of datasets
    over stores is read as the set of those stores (:func:`as_batch_dataset`).
    """
    config = config or LoaderConfig()
    dataset = as_batch_dataset(dataset)
    kwargs: dict[str, Any] = {}
    if config.workers > 0:
        kwargs.update(
            prefetch_factor=config.prefetch_factor,
            persistent_workers=config.persistent_workers,
            multiprocessing_context=config.multiprocessing_context,
        )
    dataset.reader.close()
    kwargs.update(sampler=sampler, batch_size=None, num_workers=config.workers, pin_memory=pin_memory)
    rows = getattr(sampler, "batch_size", None)
    if config.workers > 0 and config.reuse_buffers and isinstance(rows, int) and reuse_supported():
        slots = config.prefetch_factor + EXTRA_SLOTS
        spec = BufferSpec(config.workers, slots, dataset.batch_shape(rows), dataset.torch_dtype)
        own = copy.copy(dataset)
        own.buffers = None
        kwargs["sampler"] = TaggedSampler(sampler, own)
        return BufferedLoader(own, spec, **kwargs)
    return DataLoader(dataset, **kwargs)
