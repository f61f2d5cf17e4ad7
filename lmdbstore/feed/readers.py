"""Reader processes of a feed (:class:`~lmdbstore.util.workers.Workers`): each reads whole batches straight into a
shared-memory slot (:mod:`lmdbstore.feed.slots`) and answers with the slot number.  numpy only.

A reader reads a *source* (:class:`StoreSource`, or the PyTorch adapter's dataset), inherited by ``fork`` or
pickled (checked first: :func:`check_sendable`).  For its ``k``-th batch the feed writes the sample numbers into
the slot's label area and sends ``(slot, rows, seed)`` to reader ``k % workers``; readers answer in order:
``("slot", slot, rows)`` or ``("fresh", slot, item)`` (something else than the slot's batch, sent back).
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import Any

import numpy as np

from lmdbstore.feed.layout import BatchLayout
from lmdbstore.feed.seeding import BatchSeed, seeded
from lmdbstore.feed.slots import SharedSlots
from lmdbstore.loader.transform import Transform, apply_transform
from lmdbstore.store.readers import Reader
from lmdbstore.util.procs import check_main_guard, needs_main, start_hint, start_method
from lmdbstore.util.workers import PassedFd, Workers

__all__ = ["InlineReader", "ReadServer", "ReaderPool", "StoreSource"]


class StoreSource:
    """What the readers read: samples of ``reader`` laid out by ``layout``, their labels (``label_table``, read
    on first use: a forked reader inherits it, a spawned one reads it again) and ``transform``, run on each
    batch where it is read (:mod:`lmdbstore.loader.transform`)."""

    def __init__(
        self, reader: Reader, layout: BatchLayout, transform: Transform | None = None, labels: np.ndarray | None = None
    ):
        self.reader, self.layout, self.transform = reader, layout, transform
        self._labels = labels

    @property
    def label_table(self) -> np.ndarray:
        """Every label of the store."""
        if self._labels is None:
            self._labels = self.reader.labels()
        return self._labels

    @property
    def user_code(self) -> bool:
        """Whether reading a batch runs the user's code (then each batch's generators are seeded)."""
        return self.transform is not None

    def payload(self) -> list[tuple[str, Any]]:
        """The user's objects the readers receive, named for an error when one cannot be pickled."""
        return [("the transform", self.transform)] if self.transform is not None else []

    def fill(self, slots: SharedSlots, slot: int, idx: np.ndarray) -> tuple[Any, ...]:
        """Read batch ``idx`` into ``slot`` and transform it: the protocol's answer."""
        rows = len(idx)
        x = slots.x(slot, rows, self.layout.item_shape, np.dtype(self.layout.dtype))
        fresh = self.read_into(x, slots.y(slot, rows), idx)
        return ("slot", slot, rows) if fresh is None else ("fresh", slot, fresh)

    def read_into(self, x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Read batch ``idx`` into ``x`` and its labels into ``y``, then the transform; ``None`` when the result
        is in ``x`` and ``y``, else the transform's other arrays."""
        self.layout.read(self.reader, idx, x)
        y[:] = self.label_table[idx]
        if self.transform is None:
            return None
        tx, ty, in_buffer = apply_transform(self.transform, x, y)
        if not in_buffer:
            return np.ascontiguousarray(tx), ty
        y[:] = ty
        return None

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_labels": None}


class ReadServer:
    """A reader process's function (:class:`~lmdbstore.util.workers.Workers`): maps the shared ``segment`` of
    ``shape`` ``(slots, rows per slot, bytes per sample)`` and reads the labels as it starts, then fills the slot
    of each ``(slot, rows, seed)`` request (the sample numbers are in the slot's label area)."""

    def __init__(self, source: StoreSource, segment: PassedFd, shape: tuple[int, int, int]):
        self.source, self.segment, self.shape = source, segment, shape
        self.slots: SharedSlots | None = None

    def start(self) -> None:
        self.slots = SharedSlots(*self.shape, segment=self.segment)
        self.source.label_table  # noqa: B018  # read before the first batch, not during it

    def __call__(self, request: tuple[int, int, BatchSeed | None]) -> tuple[Any, ...]:
        slot, rows, seed = request
        assert self.slots is not None  # started
        idx = self.slots.y(slot, rows).copy()  # the sample numbers, where the labels go
        with seeded(seed, restore=False):
            return self.source.fill(self.slots, slot, idx)

    def close(self) -> None:
        self.source.close()
        if self.slots is not None:
            self.slots.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "slots": None}


class InlineReader:
    """The reader "pool" without processes: reads each batch when its answer is asked for, in the
    consumer's thread (``workers=0``); the user's code runs with the batch's seeds and the consumer's own
    generators are put back afterwards."""

    def __init__(self, source: StoreSource, slots: SharedSlots):
        self.source, self.slots = source, slots
        self.pending: deque[tuple[int, np.ndarray, BatchSeed | None]] = deque()

    def submit(self, slot: int, idx: np.ndarray, seed: BatchSeed | None = None) -> None:
        self.pending.append((slot, idx, seed))

    def answer(self) -> tuple[Any, ...]:
        slot, idx, seed = self.pending.popleft()
        with seeded(seed, restore=True):
            return self.source.fill(self.slots, slot, idx)

    def drop(self) -> None:
        """Forget the requests not yet answered."""
        self.pending.clear()

    def close(self) -> None:
        self.pending.clear()


def check_sendable(source: StoreSource, method: str) -> None:
    """Refuse, before any process starts, a source a ``spawn``/``forkserver`` reader cannot receive.

    Raises:
        ValueError: naming the object that cannot be pickled and what to do.
    """
    if method == "fork":
        return
    for what, obj in [*source.payload(), ("the store's reader", source)]:
        try:
            pickle.dumps(obj)
        except Exception as exc:
            raise ValueError(
                f"the reader processes start by {method} and cannot receive {what} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): make it a module-level function or class "
                "(a lambda or a function defined inside another cannot be pickled), or set the loader's "
                "multiprocessing_context to 'fork' where forking is safe"
            ) from None


class ReaderPool(Workers):
    """``workers`` (at least 1) reader processes over ``source`` (its reader is closed here: no open environment
    crosses into them) and the caller's ``slots``, started by ``context`` (see the module docstring).

    Raises:
        ValueError: the source cannot be sent to readers started by that method.
        LmdbStoreError: a reader could not open the store or the slots (its error, one line).
    """

    def __init__(self, source: StoreSource, slots: SharedSlots, workers: int, context: str | None = None):
        method = start_method(context)
        check_main_guard(method, "the reader processes")
        check_sendable(source, method)
        self.slots = slots
        source.reader.close()  # no open environment crosses into the readers
        server = ReadServer(source, slots.segment, (slots.n, slots.rows, source.layout.item_bytes))
        main = any(needs_main(obj) for _, obj in source.payload())
        super().__init__(server, workers, method, "reader process {}", hint=start_hint(method), main=main)

    def submit(self, slot: int, idx: np.ndarray, seed: BatchSeed | None = None) -> None:
        """Send the next batch's request to its reader (the sample numbers go into the slot).

        Raises:
            WorkerDied: the reader died.
        """
        self.slots.y(slot, len(idx))[:] = idx  # the reader takes them from there (protocol: module docstring)
        self.send((slot, len(idx), seed))
