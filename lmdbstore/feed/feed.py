"""A feed: passes over a sampler's batches, read ahead by reader processes into shared slots and handed out
as numpy arrays without a copy; what every framework adapter is built on (docs/design.md#the-feed).  numpy only.

:meth:`BatchFeed.begin` starts a pass, :meth:`BatchFeed.next` returns its next batch while ``workers * prefetch``
later ones are read; a slot is reused once nothing references its memory and, with a ``fence`` (a GPU copying
from page-locked slots), once the copy that read it is done.  Readers wait between passes and stop when no batch
is asked for a while (:mod:`lmdbstore.feed.idle`).  :meth:`BatchFeed.state_dict` is the sampler's state after
the batches *handed out* (not those read ahead).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from lmdbstore.feed.idle import IdleStop
from lmdbstore.feed.readers import InlineReader, ReaderPool, StoreSource
from lmdbstore.feed.seeding import BatchSeed
from lmdbstore.feed.slots import SharedSlots, pool_slots, slot_bytes
from lmdbstore.loader.passes import CountedPasses
from lmdbstore.store.metaview import sample_indices
from lmdbstore.util.procs import start_method

__all__ = ["EXTRA_SLOTS", "BatchFeed", "Fence", "largest_batch"]

#: Slots beyond those in flight: the batch the consumer works on and the ones it (or its framework's own
#: prefetch) still holds.
EXTRA_SLOTS = 3
#: Rows of a slot when a sampler does not say how large its batches are.
UNSIZED_ROWS = 4096

FREE, INFLIGHT, HELD, FENCED = 0, 1, 2, 3


class Fence(Protocol):
    """Recorded when a batch is let go; ``query()`` says when its slot may be written again (a CUDA event)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def largest_batch(sampler: Any, samples: int) -> int:
    """Rows of the largest batch ``sampler`` can yield over ``samples`` samples: its ``batch_size``, never more
    than ``samples`` unless it draws with replacement (class-balanced); the longest of a list of batches."""
    size = getattr(sampler, "batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        try:
            size = max((len(b) for b in sampler), default=1) if isinstance(sampler, (list, tuple)) else UNSIZED_ROWS
        except TypeError:
            size = UNSIZED_ROWS
    return size if getattr(sampler, "with_replacement", False) else max(1, min(size, samples))


class BatchFeed:
    """Passes over ``sampler``'s batches (a sampler of :mod:`lmdbstore.loader`, or any iterable of index arrays)
    of ``source`` (see the module docstring); the arguments are :class:`~lmdbstore.config.LoaderConfig`'s
    (``workers=0``: read in the consumer's thread; ``context=None``: :func:`~lmdbstore.util.procs.start_method`'s
    choice), and ``samples``: the store's (no slot holds more); ``held``: slots for batches the consumer holds;
    ``fence``: called when the consumer lets a batch go, says when its slot may be reused (default: at once);
    ``pin``: called with each new :class:`~lmdbstore.feed.slots.SharedSlots`, returns what to call before their
    memory is unmapped (page-locking for the GPU).

    Raises:
        ValueError: not even one batch per reader fits in the memory available.
    """

    def __init__(
        self,
        source: StoreSource,
        sampler: Any,
        *,
        samples: int,
        workers: int,
        prefetch: int,
        held: int = EXTRA_SLOTS,
        context: str | None = None,
        seed: int = 0,
        persistent: bool = True,
        fence: Callable[[], Fence] | None = None,
        pin: Callable[[SharedSlots], Callable[[], None]] | None = None,
    ):
        self.sampler = sampler if callable(getattr(sampler, "upcoming_pass", None)) else CountedPasses(sampler)
        try:
            batches = len(self.sampler)
        except TypeError:
            batches = workers * prefetch
        workers = min(workers, max(1, batches))  # a reader more than a pass has batches would never read
        self.source, self.workers, self.context = source, workers, context
        self.rows = largest_batch(sampler, samples)
        self.seed, self.persistent, self.fence, self.pin = seed, persistent, fence, pin
        depth = max(1, min(workers * prefetch, batches)) if workers else 1  # never more than a pass
        stride = slot_bytes(self.rows, source.layout.item_bytes)[1]
        n = pool_slots(depth + held, max(workers, 1) + 1, stride)
        self.depth = min(depth, max(1, n - 1))
        self.n_slots = n
        self.slots = self._new_slots()
        self.pool: ReaderPool | InlineReader | None = None
        self.state = [FREE] * self.slots.n
        self.fences: dict[int, Fence] = {}
        self.queue: deque[int] = deque()  # slots in flight, in batch order (-1: read here when its turn comes)
        self.redo: deque[np.ndarray] = deque()  # batches drawn, sent, and dropped when the readers stopped
        self.plan: list[np.ndarray] = []  # the indices of this pass's batches so far
        self.it: Any = None
        self.exhausted = True
        self.pass_: tuple[int, int] | None = None  # (epoch, first batch) of the latest pass
        #: how the batches handed out came: in a slot, sent pickled by a reader, read in the consumer's thread
        self.came = {"slot": 0, "sent": 0, "here": 0}
        self.lock = threading.RLock()  # passes begin, end and stop from the consumer's and the timer's threads
        self.idle = IdleStop(self, BatchFeed.close, self.lock)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def method(self) -> str:
        """The start method of the readers running, else of those the next pass would start."""
        return self.pool.method if isinstance(self.pool, ReaderPool) else start_method(self.context)

    def _new_slots(self) -> SharedSlots:
        slots = SharedSlots(self.n_slots, self.rows, self.source.layout.item_bytes, shared=self.workers > 0)
        unpin = self.pin(slots) if self.pin is not None else None
        self._free_memory = weakref.finalize(self, slots.close, unpin)
        return slots

    # ---------------------------------------------------------------- passes
    def begin(self) -> None:
        """Start a new pass (abandoning the one running, if any; starting the readers if stopped)."""
        with self.lock:
            self._drain()
            self.it = iter(self.sampler)
            self.plan = []
            self.redo.clear()
            self.pass_ = self.sampler.upcoming_pass()  # taken again at the first draw (a pin may come before it)
            self.exhausted = False
            self._start()

    def _start(self) -> None:
        """Readers (and slots) for the pass, where they stopped."""
        self.idle.wake()
        if self.slots.closed:
            self.slots = self._new_slots()
            self.state = [FREE] * self.slots.n
            self.fences.clear()
        if self.pool is None:
            self.source.reader.read_path  # noqa: B018  # the position table, inherited by forked readers
            if self.workers:
                self.pool = ReaderPool(self.source, self.slots, self.workers, self.context)
            else:
                self.pool = InlineReader(self.source, self.slots)

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
        :func:`~lmdbstore.feed.idle.idle_seconds` (at once when not ``persistent``).  Also done when
        :meth:`next` finds the pass over."""
        with self.lock:
            if not self.persistent:
                self.close()
            elif self.pool is not None:
                self.idle.rest()

    def next(self) -> tuple[Any, Any]:
        """The next batch of the pass.  Raises StopIteration when the pass is over (or none was begun), and a
        reader's error as itself (a transform's own exception, the reader's traceback its cause)."""
        with self.lock:
            try:
                return self._next()
            except StopIteration:
                self.rest()
                raise
            finally:
                self.idle.touch()

    def _next(self) -> tuple[Any, Any]:
        if self.it is None:
            raise StopIteration
        if self.pool is None:
            self._start()  # stopped while idle inside the pass
        self.idle.touch()
        self._release()
        self._fill()
        if not self.queue and self.fences:  # slots wait for the device's copies only: wait for them
            for fence in self.fences.values():
                fence.synchronize()
            self._release()
            self._fill()
        if not self.queue:
            idx = self._draw()  # every slot is held by the consumer: this one is read here, into fresh memory
            if idx is None:
                raise StopIteration
            return self.read_fresh(idx, self.delivered - 1)
        slot = self.queue.popleft()
        if slot < 0:
            return self.read_fresh(self.plan[self.delivered - 1], self.delivered - 1)
        try:
            answer = self.pool.answer()  # type: ignore[union-attr]
        except Exception:  # a reader's error (raised as itself) or its death
            self.state[slot] = FREE
            raise
        if answer[0] != "slot":
            self.state[slot] = HELD  # free once unreferenced: what a reader here returned may view the slot
            self.came["sent"] += 1
            return answer[2]  # type: ignore[no-any-return]
        self.came["slot"] += 1
        self.state[slot] = HELD
        rows = answer[2]
        x = self.slots.x(slot, rows, self.source.layout.item_shape, np.dtype(self.source.layout.dtype))
        y = self.slots.y(slot, rows)
        self._fill()  # the readers work on while the consumer does
        return x, y

    def read(self, k: int) -> tuple[Any, Any]:
        """Batch ``k`` of the current pass again (it must have been handed out), read here."""
        return self.read_fresh(self.plan[k], k)

    def peek(self, i: int) -> tuple[Any, Any]:
        """Batch ``i`` of the next pass, read here, without starting that pass.

        Raises:
            IndexError: ``i`` is not a batch number of a pass.
        """
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} of a pass of {len(self)} batches")
        epoch = self.sampler.upcoming_epoch()
        idx = next(iter(self.sampler.batches_from(epoch, i)))
        seed = (self.seed, epoch, i) if self.source.user_code else None
        return self.read_fresh(sample_indices(idx), seed=seed)

    def read_fresh(self, idx: np.ndarray, k: int | None = None, *, seed: BatchSeed | None = None) -> tuple[Any, Any]:
        """Batch ``idx`` (batch ``k`` of this pass: its user code with that batch's seeds, or ``seed``) read in
        this thread into new memory."""
        self.came["here"] += 1
        private = SharedSlots(1, max(1, len(idx)), self.source.layout.item_bytes, shared=False)
        reader = InlineReader(self.source, private)
        reader.submit(0, idx, self._seed(k) if k is not None else seed)
        answer = reader.answer()
        if answer[0] == "fresh":
            return answer[2]  # type: ignore[no-any-return]
        x = private.x(0, len(idx), self.source.layout.item_shape, np.dtype(self.source.layout.dtype))
        return x, private.y(0, len(idx))

    def close(self) -> None:
        """Stop the readers and free the shared memory (also done when the feed is garbage-collected); a pass
        running stays where it was (the batches read ahead are read again), and the next batch or
        :meth:`begin` starts them again."""
        with self.lock:
            self.idle.cancel()
            if self.pool is not None:
                self.pool.close()  # readers finish what they were sent, then stop
            self.pool = None
            ahead = len(self.queue)
            self.redo.extendleft(reversed(self.plan[len(self.plan) - ahead :]))
            del self.plan[len(self.plan) - ahead :]
            self.queue.clear()
            for fence in self.fences.values():  # no device copy may still read the memory unpinned below
                fence.synchronize()
            self._free_memory()

    # ---------------------------------------------------------------- slots
    def _release(self) -> None:
        for slot, s in enumerate(self.state):
            if s == HELD and self.slots.unreferenced(slot):
                if self.fence is None:
                    self.state[slot] = FREE
                else:
                    self.fences[slot] = self.fence()
                    self.state[slot] = FENCED
            elif s == FENCED and self.fences[slot].query():
                del self.fences[slot]
                self.state[slot] = FREE

    def _fill(self) -> None:
        """Send requests until ``depth`` are in flight, the pass is exhausted or no slot is free."""
        while len(self.queue) < self.depth and not (self.exhausted and not self.redo):
            slot = next((k for k, s in enumerate(self.state) if s == FREE), None)
            if slot is None:
                return
            idx = self._draw()
            if idx is None:
                return
            if len(idx) > self.slots.rows:  # larger than the sampler said: read here when its turn comes
                self.queue.append(-1)
                continue
            self.pool.submit(slot, idx, self._seed(len(self.plan) - 1))  # type: ignore[union-attr]
            self.state[slot] = INFLIGHT
            self.queue.append(slot)

    def _draw(self) -> np.ndarray | None:
        """The pass's next batch: one read ahead before the readers stopped, else the sampler's next (``None``:
        none left); the first draw begins the sampler's pass, so where it begins is taken just before."""
        if self.redo:
            idx = self.redo.popleft()
        else:
            if self.exhausted or self.it is None:
                return None
            if not self.plan:
                self.pass_ = self.sampler.upcoming_pass()
            try:
                idx = sample_indices(next(self.it))
            except StopIteration:
                self.exhausted = True
                return None
        self.plan.append(idx)
        return idx

    def _seed(self, k: int) -> BatchSeed | None:
        """The seeds of batch ``k`` of this pass (``None`` when no user code runs)."""
        if not self.source.user_code or self.pass_ is None:
            return None
        return (self.seed, self.pass_[0], self.pass_[1] + k)

    def _drain(self) -> None:
        """Wait out the requests of an abandoned pass (their readers write into those slots)."""
        if self.pool is not None:
            self.pool.drop()
        for slot in self.queue:
            if slot >= 0:
                self.state[slot] = FREE
        self.queue.clear()
