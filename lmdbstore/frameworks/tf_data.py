"""TensorFlow: a ``tf.data.Dataset`` over a store, with known length, reads in parallel reader processes
that work ahead (the prefetch), and a new order every time it is iterated.  Imports TensorFlow, never
torch.

The pipeline is one ``from_generator`` whose generator begins a pass of the feed
(:class:`~lmdbstore.frameworks.feed.BatchFeed`) each time the dataset is iterated -- so every epoch of
``model.fit`` or every ``for`` over it has the sampler's next order -- and yields the pass's batches, then
``assert_cardinality`` (``len(ds)``; Keras knows the steps per epoch).  The reader processes read
``workers * prefetch`` batches ahead; a ``.prefetch()`` on top adds nothing but threads (measured: a
final ``prefetch(2)`` and a ``map`` of a ``py_function`` each cost throughput on 2 cores,
docs/benchmarks.md).

No copy on the way: a batch lies in a 4 KiB-aligned shared-memory slot, and TensorFlow makes a tensor of
aligned numpy memory without copying it, holding the array while the tensor lives; the slot is reused
only after that (:mod:`lmdbstore.frameworks.slots`).

Iterating the dataset again while an earlier iterator is unfinished abandons the earlier one: its next
batch is an error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from lmdbstore.config import FeedConfig
from lmdbstore.errors import LmdbStoreError
from lmdbstore.frameworks.feed import EXTRA_SLOTS, BatchFeed, feed_config, open_feed
from lmdbstore.loader.transform import Transform

__all__ = ["TF_EXTRA_SLOTS", "tf_dataset"]

#: Slots beyond the feed's usual ones, for what ``tf.data`` and Keras hold (a ``.prefetch()`` on top holds
#: more; when none is free, a batch is read in the consuming thread instead, slower but right).
TF_EXTRA_SLOTS = 2


class _Passes:
    """The dataset's hold on the feed: one pass per iteration, batches taken under a lock (tf.data may call
    the generators of two iterators from threads of its own)."""

    def __init__(self, feed: BatchFeed):
        self.feed = feed
        self.lock = threading.Lock()
        self.number = 0

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self.lock:
            self.feed.begin()
            self.number += 1
            mine = self.number
        while True:
            with self.lock:
                if mine != self.number:
                    raise LmdbStoreError("a newer iteration of this tf.data dataset started; this one is abandoned")
                try:
                    batch = self.feed.next()
                except StopIteration:
                    return
            yield batch


def tf_dataset(
    store: str | os.PathLike[str],
    config: FeedConfig | None = None,
    *,
    indices: Any = None,
    transform: Transform | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(x, y)`` batches of ``store``: ``x`` channels-last in the store's dtype,
    ``y`` int64; ``len(ds)`` batches; a new order each time it is iterated.

    Args: as :func:`lmdbstore.keras_dataset` (``config``/``options``: :class:`~lmdbstore.config.FeedConfig`,
    e.g. ``tf_dataset("train.lmdb", split="train", workers=2)``).  The readers start when it is first
    iterated (by ``forkserver``, TensorFlow being loaded: a script needs the ``if __name__ == "__main__":``
    guard) and stop when the dataset is garbage-collected.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValueError: an unknown option or a bad value (naming it).
    """
    feed = open_feed(
        store,
        feed_config(config, options),
        indices=indices,
        transform=transform,
        extra_slots=EXTRA_SLOTS + TF_EXTRA_SLOTS,
        rank=rank,
        world_size=world_size,
    )
    passes = _Passes(feed)
    spec = (
        tf.TensorSpec((None, *feed.layout.item_shape), tf.as_dtype(np.dtype(feed.layout.dtype))),
        tf.TensorSpec((None,), tf.int64),
    )
    ds = tf.data.Dataset.from_generator(passes.batches, output_signature=spec)
    return ds.apply(tf.data.experimental.assert_cardinality(len(feed)))
