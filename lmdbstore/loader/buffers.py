"""Reusable shared-memory batch buffers between DataLoader workers and the main process.

Without them, every batch a worker reads lands in a fresh shared-memory segment: created, faulted in page
by page (2,500 pages for 4,096 samples of 25x25 float32), sent to the main process as a file descriptor,
mapped there and torn down again once the batch is dropped.  That costs more than reading the batch: on 2
cores, 2 workers delivered 0.44M samples/s that way against 0.91M/s with reused buffers
(``scripts/bench/peers.py``, docs/benchmarks.md).

How it works: before the workers start, the main process allocates per worker ``slots`` buffers of one full
batch each in shared memory (workers inherit them across ``fork`` or receive them by file descriptor with
``spawn``).  A worker reads a batch into one of its own free slots and sends only the slot number and the
labels.  The main process hands out a tensor on that slot and frees the slot when nothing references its
memory any more: not the tensor, not a view of it, not a numpy array made from it (the storage's reference
count tells), not its storage object (its Python reference count tells).  A consumer that keeps batches
(``list(loader)``) is therefore safe: those slots stay taken and the worker falls back to a fresh segment
when it has no free slot.

Slot states, one int64 per slot in shared memory: ``FREE`` (0); ``HELD`` (-1: delivered, maybe referenced);
a generation ``g > 0``: being filled or in flight for the main process's iteration ``g``.  Only the owning
worker moves FREE -> g, only the main process moves g -> HELD -> FREE.  Each batch request carries the
generation of the iteration that asked for it (:class:`~lmdbstore.loader.sampling.LoaderSampler`), so a slot still marked with an older
generation belongs to a result that an abandoned iteration never delivered (persistent workers drain
those before the next iteration starts): it counts as free.

A batch handed out on a slot never reaches another process as a view of it: pickled (queues, spawned
processes) it travels as a copy, and a child forked while it is held gets a private copy of the slot
(:mod:`lmdbstore.loader.sharing`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from lmdbstore.loader.sharing import track

FREE = 0
HELD = -1
EXTRA_SLOTS = 3  # per worker beyond its prefetch: the one being filled and the two the consumer holds


def reuse_supported() -> bool:
    """Whether this torch exposes storage reference counts (needed to know when a slot is free again)."""
    return hasattr(torch._C, "_storage_Use_Count")


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))  # type: ignore[attr-defined]


def _storage_object_held(t: torch.Tensor) -> bool:
    """Whether something holds the Python storage object of ``t`` (``x.untyped_storage()``): torch keeps one
    such object per storage and does not count it in the storage's use count."""
    return sys.getrefcount(t.untyped_storage()) > 2  # the temporary and getrefcount's own argument


class TaggedBatch(np.ndarray):
    """A batch request: the sample indices (an int64 array: a ``Dataset`` subclass's ``__getitem__`` can use
    it as the indices it is) carrying ``gen``, the generation of the iteration that asked for them."""

    gen: int

    def __new__(cls, gen: int, indices: Any) -> TaggedBatch:
        out = np.asarray(indices, dtype=np.int64).reshape(-1).view(cls)
        out.gen = gen
        return out

    def __array_finalize__(self, obj: Any) -> None:
        self.gen = getattr(obj, "gen", 0)

    def __reduce__(self) -> tuple[Any, ...]:  # to a worker with its generation (ndarray's would drop it)
        return (TaggedBatch, (self.gen, np.asarray(self)))

    @property
    def indices(self) -> np.ndarray:
        """The indices as a plain array."""
        return np.asarray(self)


class SlotBatch(NamedTuple):
    """What a worker sends instead of the samples: where they are, how many, and the labels as bytes with their
    dtype and shape (pickled by value: a tensor, or a numpy array the DataLoader turns into one, would cross in
    a shared-memory segment of its own, created, sent by descriptor and mapped for every batch)."""

    slot: int
    rows: int
    y: bytes
    y_dtype: str
    y_shape: tuple[int, ...]

    @classmethod
    def of(cls, slot: int, rows: int, y: torch.Tensor) -> SlotBatch:
        a = y.numpy()
        return cls(slot, rows, a.tobytes(), a.dtype.str, a.shape)

    def labels(self) -> torch.Tensor:
        """The labels as a tensor of their own memory."""
        return torch.from_numpy(np.frombuffer(bytearray(self.y), self.y_dtype).reshape(self.y_shape))


@dataclass(frozen=True)
class BufferSpec:
    """The shape of a loader's buffers: ``workers * slots`` batches of ``batch_shape`` (rows first)."""

    workers: int
    slots: int
    batch_shape: tuple[int, ...]
    dtype: torch.dtype

    def allocate(self) -> BatchBuffers:
        return BatchBuffers(self)


class BatchBuffers:
    """The slots of one loader (see the module docstring).  Created in the main process."""

    def __init__(self, spec: BufferSpec):
        self.spec = spec
        n = spec.workers * spec.slots
        self.slots = [torch.empty(spec.batch_shape, dtype=spec.dtype).share_memory_() for _ in range(n)]
        self.state = torch.zeros(n + 1, dtype=torch.int64).share_memory_()  # [n]: the current generation
        # per worker: batches through a reused slot, batches through a fresh segment
        self.stats = torch.zeros(spec.workers, 2, dtype=torch.int64).share_memory_()
        self._base = [_use_count(s) for s in self.slots]  # main process only
        self._held: dict[int, None] = {}
        self.owner_pid = os.getpid()
        self._ranges = [(s.untyped_storage().data_ptr(), s.untyped_storage().nbytes()) for s in self.slots]
        track(self)

    def held_slots(self) -> Iterator[tuple[int, tuple[int, int]]]:
        """``(slot, (address, bytes))`` of every slot handed out and not yet known to be free (main process)."""
        return ((slot, self._ranges[slot]) for slot in list(self._held))

    def pin(self, slot: int) -> None:
        """Never reuse ``slot`` (another process may see its batch): it stays taken; workers use the others."""
        self._held.pop(slot, None)

    # ---------------------------------------------------------------- worker side
    def acquire(self, worker: int, rows: int, gen: int) -> int | None:
        """A free slot of ``worker`` for ``rows`` samples of a request of generation ``gen``, marked in
        flight; ``None``: use a fresh segment."""
        counts = self.stats.numpy()[worker]
        if rows > self.spec.batch_shape[0]:
            counts[1] += 1
            return None
        state = self.state.numpy()
        current = max(int(state[-1]), gen)
        first = worker * self.spec.slots
        for slot in range(first, first + self.spec.slots):
            s = int(state[slot])
            if s == FREE or 0 < s < current:
                state[slot] = gen
                counts[0] += 1
                return slot
        counts[1] += 1
        return None

    def abandon(self, slot: int) -> None:
        """Give back a slot whose batch could not be read (worker side)."""
        self.state.numpy()[slot] = FREE

    # ---------------------------------------------------------------- main side
    def new_generation(self) -> int:
        """Start an iteration: slots of older, undelivered results become free for the workers."""
        state = self.state.numpy()
        state[-1] += 1
        return int(state[-1])

    @property
    def generation(self) -> int:
        return int(self.state[-1])

    def deliver(self, item: SlotBatch, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` for a worker's :class:`SlotBatch`.  ``pin``: copy into page-locked memory and free the
        slot at once (what the pin-memory thread would otherwise do with a fresh segment)."""
        x = self.slots[item.slot][: item.rows]
        if pin:
            pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            pinned.copy_(x)
            self.state.numpy()[item.slot] = FREE
            return pinned, item.labels()
        self.state.numpy()[item.slot] = HELD
        self._held[item.slot] = None
        return x, item.labels()

    def release_unreferenced(self) -> None:
        """Free every delivered slot whose memory nothing outside these buffers references any more."""
        state = self.state.numpy()
        for slot in list(self._held):
            if _use_count(self.slots[slot]) <= self._base[slot] and not _storage_object_held(self.slots[slot]):
                state[slot] = FREE
                del self._held[slot]

    def reuse_counts(self) -> tuple[int, int]:
        """Batches that went through a reused slot, and through a fresh segment, since allocation."""
        reused, fresh = self.stats.sum(0).tolist()
        return int(reused), int(fresh)
