"""Keras: a ``keras.utils.PyDataset`` over a feed, for ``model.fit`` on every backend (imports keras, never torch
or TensorFlow itself).

``on_epoch_begin`` begins a pass (the sampler's next order).  Keras may shuffle the batch numbers it asks for;
the ``k``-th distinct number asked in an epoch gets the ``k``-th batch of the feed's order, so the readers read
ahead the right batches; outside an epoch ``ds[i]`` is batch ``i`` of the next epoch.  Keras' own workers stay
off (its pools would only add copies).  Batches are channels-last, in the store's dtype, with int64 labels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.feed.feed import EXTRA_SLOTS, BatchFeed
from lmdbstore.feed.opening import channels_last_feed
from lmdbstore.feed.slots import slot_bytes
from lmdbstore.loader.transform import Transform

__all__ = ["KERAS_HELD_BYTES", "KERAS_HELD_MAX", "StorePyDataset", "keras_dataset", "keras_extra_slots"]

#: Shared memory for the batches Keras' adapter holds on the TensorFlow backend, beyond the feed's usual
#: slots: its ``prefetch(AUTOTUNE)`` buffer grows to 5-13 batches (measured: batch 1024 on a 1M-sample
#: store), and while the consumer holds every slot the next batch is read in its own thread, slowly.
KERAS_HELD_BYTES = 64 << 20
#: At most this many slots for them (at least 2).
KERAS_HELD_MAX = 12


def keras_extra_slots(batch_size: int, item_bytes: int) -> int:
    """Slots for the batches the consumer holds under Keras: the feed's usual ones plus what
    :data:`KERAS_HELD_BYTES` holds of batches this size (2 to :data:`KERAS_HELD_MAX`)."""
    held = KERAS_HELD_BYTES // slot_bytes(batch_size, item_bytes)[1]
    return EXTRA_SLOTS + min(KERAS_HELD_MAX, max(2, held))


class StorePyDataset(keras.utils.PyDataset):  # type: ignore[misc]
    """A ``keras.utils.PyDataset`` over a :class:`~lmdbstore.feed.feed.BatchFeed` (see the module
    docstring).  Made by :func:`keras_dataset`; ``close()`` stops its readers (so does garbage collection)."""

    def __init__(self, feed: BatchFeed):
        super().__init__(workers=1, use_multiprocessing=False)
        self.feed = feed
        self._served: dict[int, int] = {}  # batch number Keras asked for -> batch of the pass it got
        self._in_epoch = False

    def __len__(self) -> int:
        return len(self.feed)

    @property
    def num_batches(self) -> int:
        return len(self.feed)

    @property
    def sampler(self) -> Any:
        """The batch sampler (``set_epoch`` pins the next epoch's order; its own ``state_dict`` counts the
        batches the readers read ahead too: save :meth:`state_dict`)."""
        return self.feed.sampler

    def state_dict(self, taken: int | None = None) -> dict[str, Any]:
        """The sampler's state after the batches handed out, or the first ``taken`` of them (Keras' adapter on
        TensorFlow holds batches ahead: a callback saves ``state_dict(batch + 1)`` at ``on_train_batch_end``).

        Raises:
            ValueError: ``taken`` is more than the batches handed out in this epoch, or negative.
        """
        return self.feed.state_dict(taken)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or the sampler's): the next epoch yields the rest of that epoch's
        batches, unread until then (after a finished epoch: the whole next one).

        Raises:
            ValueError: the state is malformed or belongs to another sampler (naming what differs).
        """
        self.feed.load_state_dict(state)

    def on_epoch_begin(self) -> None:
        self._begin()

    def on_epoch_end(self) -> None:
        self._in_epoch = False
        self.feed.rest()  # the readers wait for the next epoch, and stop if none comes (Keras may keep us for good)

    def _begin(self) -> None:
        self.feed.begin()
        self._served = {}
        self._in_epoch = True

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of a dataset of {len(self)} batches")
        if not self._in_epoch:
            return self.feed.peek(index)
        k = self._served.get(index)
        if k is not None:
            return self.feed.read(k)
        self._served[index] = self.feed.delivered
        return self.feed.next()

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._begin()
        try:
            while True:
                try:
                    yield self.feed.next()
                except StopIteration:
                    return
        finally:
            self._in_epoch = False
            self.feed.rest()

    def close(self) -> None:
        """Stop the reader processes and free their shared memory."""
        self.feed.close()


def keras_dataset(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    config: LoaderConfig | None = None,
    *,
    indices: Any = None,
    transform: Transform | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> StorePyDataset:
    """A ``keras.utils.PyDataset`` of ``store`` for ``model.fit`` (any Keras backend); a new order every epoch.

    Args:
        store: the store directory, or a list of them read as one set (as :func:`lmdbstore.open_reader`).
        config: :class:`~lmdbstore.config.LoaderConfig`; ``options`` override its fields, e.g.
            ``keras_dataset("train.lmdb", split="train", batch_size=4096, workers=2)``.
        indices: read only these samples (instead of ``split``).
        transform: ``transform(x, y) -> (x, y)`` on numpy batches in the readers (:mod:`lmdbstore.loader.transform`).
        rank, world_size: this process's share under data-parallel training (default: the only one).

    Once TensorFlow's or JAX's runtime runs, readers start by ``forkserver``: a script needs the ``__main__``
    guard (one line says so when it is missing).

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValueError: an unknown option or a bad value (naming it).
    """
    options.update(indices=indices, transform=transform, rank=rank, world_size=world_size)
    return StorePyDataset(channels_last_feed(store, config, options, keras_extra_slots))
