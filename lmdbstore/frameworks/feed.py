"""A feed: passes over a store's batches in a sampler's order, read ahead by reader processes into shared
slots and handed out as numpy arrays without a copy; what the Keras ``PyDataset`` and the ``tf.data``
factory are built on.  numpy only, no torch.

* :meth:`BatchFeed.begin` starts a pass: the sampler's next epoch (:mod:`lmdbstore.loader.passes`), so
  every pass has a new order unless ``set_epoch`` pinned one; a pass still running is abandoned.
* :meth:`BatchFeed.next` returns the pass's next batch ``(x, y)`` (``x`` in the layout's shape and the
  store's dtype, ``y`` int64), in the sampler's order, while ``workers * prefetch`` later batches are read.
* A returned batch's slot is reused only when nothing references its memory
  (:class:`~lmdbstore.frameworks.slots.SharedSlots`); a consumer holding every slot gets the next batch
  read in its own thread into fresh memory, so keeping batches is safe, only slower.
* :meth:`BatchFeed.read` reads batch ``k`` of the current pass again, :meth:`BatchFeed.peek` batch ``i``
  of the next pass without starting it (what Keras' first look at a dataset needs).
* The readers start with the first pass and wait between passes: :meth:`BatchFeed.rest` (or the end of a
  pass) lets them stop once no pass began for a while (:mod:`lmdbstore.frameworks.idle`), and the next
  :meth:`BatchFeed.begin` starts them again; :meth:`BatchFeed.close` and garbage collection stop them at once.
* :meth:`BatchFeed.state_dict` is the sampler's state at the batches *handed out* (as a ``make_loader``
  loader's, :mod:`lmdbstore.loader.delivered`): the sampler's own counts the ``workers * prefetch`` batches
  the readers read ahead too.  :meth:`BatchFeed.load_state_dict` makes the next pass resume there.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmdbstore.config import FeedConfig
from lmdbstore.frameworks.idle import IdleStop
from lmdbstore.frameworks.readers import BatchLayout, InlineReader, ReaderPool, raise_answer, read_into
from lmdbstore.frameworks.slots import SharedSlots
from lmdbstore.loader.choose import Sampler, make_sampler_for, split_indices
from lmdbstore.loader.passes import PassIterator
from lmdbstore.loader.transform import Transform
from lmdbstore.store.readers import Reader, as_reader

__all__ = ["EXTRA_SLOTS", "BatchFeed", "feed_config", "open_feed"]

#: Slots beyond those in flight: the batch the consumer works on and the ones it (or its framework's own
#: prefetch) still holds.
EXTRA_SLOTS = 3

FREE, INFLIGHT, HELD = 0, 1, 2


class BatchFeed:
    """Passes over ``sampler``'s batches of ``store`` (see the module docstring).

    Args:
        store: the store directory, a list of them (read as one set), or the reader or set the sampler's
            indices and ``labels`` were taken from (its pin of the store and data file then holds for every
            pass: a store replaced since is a :class:`~lmdbstore.errors.StoreReplacedError`, never other
            samples under the old split).
        sampler: a batch sampler of :mod:`lmdbstore.loader` (its ``batch_size`` bounds a slot).
        layout: how samples lie in a batch.
        workers: reader processes (0: read in the consumer's thread, one batch at a time).
        prefetch: batches each reader works ahead.
        extra_slots: slots for batches the consumer holds (default :data:`EXTRA_SLOTS`).
        transform: run on every batch where it is read (:mod:`lmdbstore.loader.transform`).
        context: start method of the readers (``None``: ``forkserver`` once TensorFlow's or JAX's runtime runs).
        labels: every label of the store, read with ``store``'s reader (default: read on first use).

    Raises:
        OSError: no room for the slots in shared memory.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader,
        sampler: Sampler,
        layout: BatchLayout,
        *,
        workers: int,
        prefetch: int,
        extra_slots: int = EXTRA_SLOTS,
        transform: Transform | None = None,
        context: str | None = None,
        labels: np.ndarray | None = None,
    ):
        self.reader = as_reader(store)
        self.sampler, self.layout, self.transform = sampler, layout, transform
        self.workers, self.context = workers, context
        self.depth = workers * prefetch if workers else 1
        self.extra_slots = extra_slots
        self.slots = self._new_slots()
        self.pool: ReaderPool | InlineReader | None = None
        self.state = [FREE] * self.slots.n
        self.queue: deque[int] = deque()  # slots in flight, in batch order
        self.plan: list[np.ndarray] = []  # the indices of this pass's batches so far
        self.it: PassIterator | None = None
        self.exhausted = True
        self.pass_: tuple[int, int] | None = None  # (epoch, first batch) of the latest pass
        self._labels = labels
        self.lock = threading.RLock()  # passes begin, end and stop from the consumer's and the timer's threads
        self.idle = IdleStop(self, BatchFeed.close, self.lock)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def labels(self) -> np.ndarray:
        """Every label of the store (read once, in the consumer's process)."""
        if self._labels is None:
            self._labels = self.reader.labels()
        return self._labels

    def _new_slots(self) -> SharedSlots:
        slots = SharedSlots(
            self.depth + self.extra_slots, self.sampler.batch_size, self.layout.item_bytes, shared=self.workers > 0
        )
        self._free_memory = weakref.finalize(self, slots.close)
        return slots

    # ---------------------------------------------------------------- passes
    def begin(self) -> None:
        """Start a new pass (abandoning the one running, if any; starting the readers if stopped)."""
        with self.lock:
            self.idle.wake()
            self._begin()

    def _begin(self) -> None:
        if self.slots.closed:
            self.slots = self._new_slots()
            self.state = [FREE] * self.slots.n
        if self.pool is None:
            self.reader.read_path  # noqa: B018  # the position table, inherited by forked readers
            if self.workers:
                self.pool = ReaderPool(self.reader, self.layout, self.slots, self.workers, self.transform, self.context)
            else:
                self.pool = InlineReader(self.reader, self.layout, self.slots, self.transform)
        self._drain()
        self.it = iter(self.sampler)  # type: ignore[assignment]
        self.plan = []
        self.pass_ = self.sampler.upcoming_pass()  # taken again at the first draw (a pin may come before it)
        self.exhausted = False

    @property
    def delivered(self) -> int:
        """Batches of this pass handed out so far."""
        return len(self.plan) - len(self.queue)

    def state_dict(self, taken: int | None = None) -> dict[str, Any]:
        """The sampler's state after the batches of the latest pass handed out so far (not those read ahead),
        or after its first ``taken`` of them (what a consumer that holds batches itself, like Keras' adapter,
        has really used): loaded (:meth:`load_state_dict`), the next pass yields the rest of that epoch.

        Raises:
            ValueError: ``taken`` is not a count of batches handed out in this pass.
        """
        with self.lock:
            if taken is not None and (
                not isinstance(taken, int) or isinstance(taken, bool) or not 0 <= taken <= self.delivered
            ):
                raise ValueError(f"taken must be a count of the {self.delivered} batches handed out, got {taken!r}")
            if self.pass_ is None or self.sampler.pinned_pass() is not None:
                return dict(self.sampler.state_dict())  # nothing handed out since a pin (or ever)
            epoch, start = self.pass_
            return dict(self.sampler.state_at(epoch, start + (self.delivered if taken is None else taken)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass resume from ``state`` (:meth:`state_dict`'s, or the sampler's own): the rest of
        that epoch's batches, unread until then; after a finished pass, the whole next epoch.

        Raises:
            ValueError: the state is malformed or belongs to another sampler (naming what differs).
        """
        with self.lock:
            self.sampler.load_state_dict(state)
            self.pass_ = None

    def rest(self) -> None:
        """The pass is over (or abandoned): the readers wait for the next one, and stop if none begins in
        :func:`~lmdbstore.frameworks.idle.idle_seconds`.  Also done when :meth:`next` finds the pass over."""
        with self.lock:
            if self.pool is not None:
                self.idle.rest()

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch of the pass.

        Raises:
            StopIteration: the pass is over (or none was begun).
            LmdbStoreError, ValueError: a reader's error (the store, or the transform), one line.
        """
        with self.lock:
            try:
                return self._next()
            except StopIteration:
                self.rest()
                raise

    def _next(self) -> tuple[np.ndarray, np.ndarray]:
        self._release()
        self._fill()
        if not self.queue:
            if self.exhausted or self.it is None:
                raise StopIteration
            try:  # every slot is held by the consumer: this one is read here, into fresh memory
                idx = self._draw()
            except StopIteration:
                self.exhausted = True
                raise
            return self.read_fresh(idx)
        slot = self.queue.popleft()
        answer = self.pool.answer()  # type: ignore[union-attr]
        if answer[0] != "slot":
            self.state[slot] = FREE
            if answer[0] == "error":
                raise_answer(answer[1], answer[2])
            return answer[2], answer[3]
        self.state[slot] = HELD
        rows = answer[2]
        x = self.slots.x(slot, rows, self.layout.item_shape, np.dtype(self.layout.dtype))
        y = self.slots.y(slot, rows)
        self._fill()  # the readers work on while the consumer does
        return x, y

    def read(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``k`` of the current pass again (it must have been handed out), read here."""
        return self.read_fresh(self.plan[k])

    def peek(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``i`` of the next pass, read here, without starting that pass.

        Raises:
            IndexError: ``i`` is not a batch number of a pass.
        """
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} of a pass of {len(self)} batches")
        epoch = self.sampler.upcoming_epoch()
        return self.read_fresh(next(iter(self.sampler.batches_from(epoch, i))))

    def read_fresh(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``idx`` read in this thread into new memory (slot-sized batches in a private slot)."""
        private = SharedSlots(1, len(idx), self.layout.item_bytes, shared=False)
        answer = read_into(self.reader, self.labels, self.layout, private, 0, idx, self.transform)
        if answer[0] == "fresh":
            return answer[2], answer[3]
        x = private.x(0, len(idx), self.layout.item_shape, np.dtype(self.layout.dtype))
        return x, private.y(0, len(idx))

    def close(self) -> None:
        """Stop the readers and free the shared memory (also done when the feed is garbage-collected); the
        next :meth:`begin` starts them again."""
        with self.lock:
            self.idle.cancel()
            if isinstance(self.pool, ReaderPool):
                self.pool.close()  # the readers finish what they were sent, then stop
            self.pool = None
            del self.plan[len(self.plan) - len(self.queue) :]  # read ahead, never handed out
            self.queue.clear()
            self.it, self.exhausted = None, True
            self._free_memory()

    # ---------------------------------------------------------------- slots
    def _release(self) -> None:
        for slot, s in enumerate(self.state):
            if s == HELD and self.slots.unreferenced(slot):
                self.state[slot] = FREE

    def _fill(self) -> None:
        """Send requests until ``depth`` are in flight, the pass is exhausted or no slot is free."""
        while len(self.queue) < self.depth and not self.exhausted and self.it is not None:
            slot = next((k for k, s in enumerate(self.state) if s == FREE), None)
            if slot is None:
                return
            try:
                idx = self._draw()
            except StopIteration:
                self.exhausted = True
                return
            self.pool.submit(slot, idx)  # type: ignore[union-attr]
            self.state[slot] = INFLIGHT
            self.queue.append(slot)

    def _draw(self) -> np.ndarray:
        """The pass's next batch from the sampler (``StopIteration``: none left); the first draw begins the
        sampler's pass, so where it begins is taken just before."""
        assert self.it is not None
        if not self.plan:
            self.pass_ = self.sampler.upcoming_pass()
        idx = next(self.it)
        self.plan.append(idx)
        return idx

    def _drain(self) -> None:
        """Wait out the requests of an abandoned pass (their readers write into those slots)."""
        while self.queue:
            slot = self.queue.popleft()
            if isinstance(self.pool, ReaderPool):
                self.pool.answer()
            elif self.pool is not None:
                self.pool.pending.clear()
            self.state[slot] = FREE


def feed_config(config: FeedConfig | None, options: dict[str, Any]) -> FeedConfig:
    """``config`` (default ``FeedConfig()``) with the fields in ``options`` replaced.

    Raises:
        ValueError: an option that is no field of :class:`~lmdbstore.config.FeedConfig`, or a bad value.
    """
    base = config or FeedConfig()
    unknown = sorted(set(options) - set(FeedConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (options are the fields of FeedConfig)")
    return dataclasses.replace(base, **options)


def open_feed(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Reader,
    config: FeedConfig,
    *,
    indices: Any = None,
    transform: Transform | None = None,
    extra_slots: int = EXTRA_SLOTS,
    rank: int | None = None,
    world_size: int | None = None,
) -> BatchFeed:
    """A :class:`BatchFeed` of ``store`` (a path, or a list of them read as one set of stores: one index
    space, classes mapped by name) as ``config`` says: the split (or ``indices``), its sampler
    (:func:`~lmdbstore.loader.choose.make_sampler_for`), the layout, the readers.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValidationError: stores of a set that do not make one set.
        ValueError: ``indices`` out of range, or a split or sampler that cannot be made.
    """
    reader = as_reader(store)  # its pin of the store and file travels with the feed and its readers
    with reader:
        meta, labels = reader.meta, reader.labels()
    if indices is None:
        idx = split_indices(labels, config.split, config.val_fraction, config.seed)
    elif config.split is not None:
        raise ValueError("give indices or a split, not both")
    else:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= meta.count):
            raise ValueError(f"indices must be sample numbers in 0..{meta.count - 1}")
    lcfg = config.loader_config()
    sampler = make_sampler_for(
        reader, meta, labels, idx, lcfg, shuffle=config.order if config.order != "auto" else None,
        rank=rank, world_size=world_size,
    )  # fmt: skip
    if config.drop_last and hasattr(sampler, "drop_last"):
        sampler.drop_last = True  # type: ignore[union-attr]
    layout = BatchLayout(tuple(meta.shape), meta.dtype, config.channels_last)
    return BatchFeed(
        reader, sampler, layout, workers=config.workers, prefetch=config.prefetch, extra_slots=extra_slots,
        transform=transform, context=config.multiprocessing_context, labels=labels,
    )  # fmt: skip
