"""PyTorch integration: a batch-level Dataset over a store and a DataLoader factory.

:class:`LmdbBatchDataset` is indexed by a whole batch of sample indices and returns
``(x, y)`` with ``x`` in the store's dtype and ``y`` int64 labels: ``x`` is ``(N, 1, H, W)`` for 2-D samples
(a channel axis is added), ``(N, C, H, W)`` for 3-D samples (C, H, W), which have one already.  Inside a
DataLoader worker the batch is read straight into shared memory, so it crosses to the main process without
another copy: by default into one of the worker's reusable buffers (:mod:`lmdbstore.loader.buffers`), otherwise
into a fresh shared-memory tensor.  A ``transform`` (:mod:`lmdbstore.loader.transform`) runs on each batch
in the worker that read it, on the buffer itself.  ``ds[indices]`` is always ``(x, y)``; a subclass may
override ``__getitem__`` and return anything: what it returns is checked in the worker
(:func:`worker_collate`), and only an ``(x, y)`` whose ``x`` is the buffer's batch as read travels as a slot
number; anything else that holds buffer memory is copied out first and the buffer given back.

:func:`make_loader` wraps the sampler (:mod:`lmdbstore.loader.sampling`: buffer generations, state, DDP
under Lightning), starts workers by ``forkserver`` once TensorFlow's or JAX's runtime runs in this process
(:mod:`lmdbstore.util.procs`: forked from it they can hang), and ties them to this process
(:mod:`lmdbstore.util.lifeline`: they die with it, whatever kills it).
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, default_convert, get_worker_info

from lmdbstore.config import LoaderConfig
from lmdbstore.format.dtypes import DTYPES
from lmdbstore.loader.buffers import EXTRA_SLOTS, BatchBuffers, BufferSpec, SlotBatch, reuse_supported
from lmdbstore.loader.delivered import Delivered
from lmdbstore.loader.sampling import LoaderSampler
from lmdbstore.loader.transform import Transform, apply_transform
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader, as_reader
from lmdbstore.util.lifeline import Lifeline, WorkerInit
from lmdbstore.util.procs import check_main_guard, start_method

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
        transform: ``transform(x, y) -> (x, y)`` on numpy arrays, run on every batch in the process that
            reads it (default ``None``); see :mod:`lmdbstore.loader.transform`.  Example, noise and
            horizontal flips for augmentation (a module-level function, so that spawned workers can load it)::

                def augment(x, y):
                    rng = np.random.default_rng()
                    x += rng.normal(0, 0.1, x.shape).astype(x.dtype)
                    flip = rng.random(len(x)) < 0.5
                    x[flip] = x[flip, ..., ::-1]
                    return x, y

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
    """

    buffers: BatchBuffers | None = None  # set on a loader's own copy by make_loader

    def __init__(
        self,
        store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader,
        *,
        add_channel: bool = True,
        transform: Transform | None = None,
    ):
        self.reader = as_reader(store)
        self.transform = transform
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

    def __getitem__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        gen = getattr(indices, "gen", None)  # a TaggedBatch from the loader's sampler
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        rows = len(idx)
        # index_select, not ``labels[tensor]``: advanced indexing runs on torch's intra-op thread pool and
        # cost ~8 ms per 4096-sample batch in a 2-thread main process (index_select: ~0.01 ms).
        y = torch.index_select(self.labels, 0, torch.from_numpy(idx)).long()
        worker = get_worker_info()
        slot = None
        if worker is not None and self.buffers is not None:
            slot = self.buffers.acquire(worker.id, rows, self.buffers.generation if gen is None else gen)
        if slot is None:
            x = torch.empty(self.batch_shape(rows), dtype=self.torch_dtype)
            if worker is not None:
                x.share_memory_()  # filled in place; pickling to the main process then copies nothing
        else:
            x = self.buffers.slots[slot][:rows]  # type: ignore[union-attr]
        try:
            self.reader.read_batch(idx, out=x.numpy().reshape(rows, *self.shape))
            if self.transform is not None:
                x, y, in_buffer = self._transformed(x, y, shared=worker is not None)
                if not in_buffer and slot is not None:
                    self.buffers.abandon(slot)  # type: ignore[union-attr]
                    slot = None
        except BaseException:
            if slot is not None:
                self.buffers.abandon(slot)  # type: ignore[union-attr]
            raise
        if slot is not None:
            self.pending.append(slot)  # worker_collate decides what travels: the slot number or a copy
        return x, y

    @property
    def pending(self) -> list[int]:
        """Buffer slots read into by this worker and not yet handed on (see :func:`worker_collate`)."""
        if "_pending" not in self.__dict__:
            self._pending: list[int] = []
        return self._pending

    def _transformed(
        self, x: torch.Tensor, y: torch.Tensor, *, shared: bool
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The transform applied to a batch read into ``x``; whether the result is still in ``x``."""
        assert self.transform is not None
        tx, ty, in_buffer = apply_transform(self.transform, x.numpy(), y.numpy())
        if in_buffer:
            return x, torch.from_numpy(ty), True
        out = torch.from_numpy(np.ascontiguousarray(tx))
        if shared:  # to the main process without another copy
            out = torch.empty_like(out).share_memory_().copy_(out)
        return out, torch.from_numpy(ty), False

    def batch_shape(self, rows: int) -> tuple[int, ...]:
        """Shape of ``x`` for a batch of ``rows`` samples."""
        if self.add_channel and len(self.shape) < 3:
            return (rows, 1, *self.shape)
        return (rows, *self.shape)


def _holds(obj: Any, ranges: list[tuple[int, int]]) -> bool:
    """Whether the tensor or array ``obj`` lies in one of the address ``ranges``."""
    if isinstance(obj, torch.Tensor):
        start = obj.untyped_storage().data_ptr()
    elif isinstance(obj, np.ndarray):
        start = obj.__array_interface__["data"][0]
    else:
        return False
    return any(lo <= start < hi for lo, hi in ranges)


def _copied_out(obj: Any, ranges: list[tuple[int, int]]) -> Any:
    """``obj`` (tensors, arrays, and tuples, lists and dicts of them) with everything in ``ranges`` copied."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if _holds(obj, ranges) else obj
    if isinstance(obj, np.ndarray):
        return obj.copy() if _holds(obj, ranges) else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_copied_out(o, ranges) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copied_out(o, ranges) for o in obj)
    if isinstance(obj, dict):
        return {k: _copied_out(v, ranges) for k, v in obj.items()}
    return obj


def worker_collate(result: Any) -> Any:
    """The loader's ``collate_fn``, run in a worker on what ``dataset[indices]`` returned: a
    :class:`~lmdbstore.loader.buffers.SlotBatch` when it is ``(x, y)`` with ``x`` the buffer slot's batch as
    read (the usual case, and a subclass that changed it in place); else ``result`` as torch's
    ``default_convert`` makes it, with everything in this worker's buffers copied out, the slots given back
    (a subclass of :class:`LmdbBatchDataset` that returns other things, views, crops, more items)."""
    info = get_worker_info()
    ds = getattr(info, "dataset", None)
    buffers = getattr(ds, "buffers", None)
    if buffers is None or not isinstance(ds, LmdbBatchDataset) or not ds.pending:
        return default_convert(result)
    pending, ds._pending = ds.pending, []
    if isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result):
        x, y = result
        for slot in pending:
            view = buffers.slots[slot][: len(x)]
            same = x.data_ptr() == view.data_ptr() and x.shape == view.shape and x.stride() == view.stride()
            if same and x.dtype == view.dtype and y.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
                for other in pending:
                    if other != slot:
                        buffers.abandon(other)
                return SlotBatch.of(slot, len(x), y)
    first = info.id * buffers.spec.slots  # type: ignore[union-attr]
    ranges = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
              for t in buffers.slots[first : first + buffers.spec.slots]]  # fmt: skip
    out = _copied_out(default_convert(result), ranges)
    for slot in pending:
        buffers.abandon(slot)
    return out


class BufferedLoader(DataLoader[Any]):
    """The DataLoader :func:`make_loader` builds: workers read whole batches, by default into reusable
    shared-memory buffers (:mod:`lmdbstore.loader.buffers`).

    It yields ``(x, y)`` like any DataLoader over :class:`LmdbBatchDataset`, and counts the batches it
    delivers: :meth:`state_dict` / :meth:`load_state_dict` resume after them (not after the batches its workers
    drew ahead; :mod:`lmdbstore.loader.delivered`).  A batch's memory is reused
    only after nothing references it (the batch, a view of it or a numpy array of it), so keeping batches
    is safe; the buffers' benefit needs the consumer to drop each batch before taking about
    ``prefetch_factor + 2`` more, as a training loop does.  ``buffer_spec`` ``None``: a fresh segment per
    batch.  Without an explicit ``multiprocessing_context`` the workers start by ``forkserver`` when
    TensorFlow's or JAX's runtime runs in this process by the time they start
    (:func:`~lmdbstore.util.procs.start_method`); they die with this process (:mod:`lmdbstore.util.lifeline`).
    """

    def __init__(self, dataset: LmdbBatchDataset, buffer_spec: BufferSpec | None, **kwargs: Any):
        self._auto_context = kwargs.get("multiprocessing_context") is None
        super().__init__(dataset, **kwargs)
        self.buffer_spec = buffer_spec
        self._pin = bool(kwargs.get("pin_memory")) and torch.cuda.is_available()
        self._delivered = Delivered(self.sampler)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: LmdbBatchDataset = self.dataset  # type: ignore[assignment]
        starting = self.num_workers > 0 and (self._iterator is None or not self.persistent_workers)
        if self._iterator is None or not self.persistent_workers:  # before the workers start: they take these
            ds.buffers = self._allocate()
            if starting:
                self._prepare_workers()
        iteration = self._delivered.begin()  # before the workers draw the pass's first batches
        buffers = ds.buffers
        if buffers is not None:  # else no workers, no reuse, or no room for the buffers: a fresh segment per batch
            buffers.new_generation()
        batches = self._start(starting)
        while True:
            if buffers is not None:
                buffers.release_unreferenced()  # before waiting: the worker may need the slot for the next batch
            try:
                item = next(batches)
            except StopIteration:
                return
            if buffers is not None and isinstance(item, SlotBatch):
                item = buffers.deliver(item, self._pin)
            self._delivered.delivered(iteration)
            yield item

    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands: the sampler's state after the batches this loader has *delivered* (not the
        ones its workers have drawn ahead).  Saved after the loop received ``k`` batches of an epoch, it makes
        a resumed loader deliver that epoch's batches from ``k`` on -- with any workers and prefetch, also
        after a finished epoch (then the next one) -- the contract of torchdata's ``StatefulDataLoader``,
        which PyTorch Lightning checkpoints mid-epoch.  See :mod:`lmdbstore.loader.delivered`."""
        return self._delivered.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or a sampler's ``state_dict`` of the same sampler): the next pass
        delivers the rest of that epoch, skipping the batches already delivered unread.

        Raises:
            ValueError: the state is malformed or belongs to another sampler (seed, batch size, samples,
                world size or kind differ), naming what differs.
        """
        self._delivered.load_state_dict(state)

    def _method(self) -> str | None:
        ctx = self.multiprocessing_context
        return ctx.get_start_method() if ctx is not None else None  # type: ignore[no-any-return]

    def _prepare_workers(self) -> None:
        """Before workers start: the start method (``forkserver`` once TensorFlow's or JAX's runtime runs,
        unless one was given), the ``__main__`` guard it needs, and the lifeline that ties them here."""
        if self._auto_context:
            self.multiprocessing_context = start_method(None)
        method = self._method()
        check_main_guard(method, "the DataLoader workers")
        self.worker_init_fn = WorkerInit(Lifeline.here(method))

    def _start(self, starting: bool) -> Iterator[Any]:
        """``DataLoader.__iter__``; workers that cannot receive the dataset (a lambda transform under
        ``spawn``/``forkserver``) are one line."""
        try:
            return super().__iter__()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            if not starting or self._method() not in ("spawn", "forkserver"):
                raise
            raise ValueError(
                f"the DataLoader workers start by {self._method()} and cannot receive the dataset ({exc}); "
                "make the transform a module-level function (a lambda or a local function cannot be pickled)"
            ) from None

    def _allocate(self) -> BatchBuffers | None:
        if self.buffer_spec is None:
            return None
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
    same = len({d.add_channel for d in ours}) == 1 and len({id(d.transform) for d in ours}) == 1
    if parts and len(ours) == len(parts) and same:
        readers = [r for d in ours for r in (d.reader.readers if isinstance(d.reader, StoreSet) else [d.reader])]
        return LmdbBatchDataset(StoreSet(readers), add_channel=ours[0].add_channel, transform=ours[0].transform)
    raise ValueError(
        f"dataset must be an LmdbBatchDataset, got {type(dataset).__name__}; for several stores use "
        "LmdbBatchDataset([store_a, store_b, ...]) (one set of stores, one index space)"
    )


def make_loader(
    dataset: LmdbBatchDataset | ConcatDataset[Any],
    sampler: Any,
    config: LoaderConfig | None = None,
    *,
    pin_memory: bool = False,
) -> BufferedLoader:
    """A DataLoader that asks each worker for whole batches chosen by ``sampler``.

    ``batch_size=None`` turns off PyTorch's per-sample batching and collate: every element the sampler
    yields is one index array, and the dataset answers it with one ready tensor.  The result is a
    :class:`BufferedLoader` over a copy of ``dataset`` (so that two loaders of one dataset never share
    buffers); with workers and ``config.reuse_buffers`` (the default) its workers read into reusable
    buffers.  Its ``sampler`` is ``sampler`` wrapped (:class:`~lmdbstore.loader.sampling.LoaderSampler`):
    ``loader.sampler.set_epoch`` reaches ``sampler``, and PyTorch Lightning keeps it under DDP.
    Each pass over the loader is a pass over ``sampler``: the next epoch's order unless ``set_epoch``
    pinned one (:mod:`lmdbstore.loader.passes`).  To resume inside an epoch, save ``loader.state_dict()``
    and give it to ``load_state_dict`` of the resumed run's loader: it counts the batches delivered to the
    loop (``sampler.state_dict()`` counts those drawn, which workers run ahead of;
    :mod:`lmdbstore.loader.delivered`).  A ``ConcatDataset`` of datasets over stores is read as the
    set of those stores (:func:`as_batch_dataset`).
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
    own = copy.copy(dataset)
    own.buffers = None
    spec = None
    rows = getattr(sampler, "batch_size", None)
    if config.workers > 0 and config.reuse_buffers and isinstance(rows, int) and reuse_supported():
        slots = config.prefetch_factor + EXTRA_SLOTS
        spec = BufferSpec(config.workers, slots, dataset.batch_shape(rows), dataset.torch_dtype)
    kwargs.update(
        sampler=LoaderSampler(sampler, own),
        batch_size=None,
        collate_fn=worker_collate,
        num_workers=config.workers,
        pin_memory=pin_memory,
        # the workers' base seed comes from here, not from torch's global generator: starting workers then
        # draws nothing from the stream dropout uses, so a resumed run draws what an uninterrupted one does
        generator=torch.Generator().manual_seed(config.seed),
    )
    return BufferedLoader(own, spec, **kwargs)
