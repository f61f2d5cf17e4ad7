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

Lifetime: TensorFlow keeps the generator function of a ``from_generator`` for as long as the process lives
(its graph functions are cached), so that function holds the feed only weakly; the dataset object (and
every dataset made from it, and every iterator of them) holds it strongly.  Once the dataset and its
iterators are gone, the feed is collected and its reader processes stop.

Errors: an error in the generator reaches the consumer as a TensorFlow ``UnknownError`` carrying a
traceback; iterated in Python (``for x, y in ds``), the dataset raises the original one-line
:class:`~lmdbstore.errors.LmdbStoreError` (or ``ValueError`` of a transform) instead.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

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
        self.error: Exception | None = None  # the last error a pass raised, for the Python iterator

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        try:
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
        except (LmdbStoreError, ValueError) as exc:
            self.error = exc
            raise


def _generator(ref: weakref.ref[_Passes]) -> Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]:
    """The generator function ``from_generator`` keeps (for good): it holds the passes weakly."""

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        passes = ref()
        if passes is None:
            raise LmdbStoreError("this tf_dataset was garbage-collected", hint="keep a reference to the dataset")
        yield from passes.batches()

    return batches


class _Iterator:
    """A dataset's eager iterator that raises a pass's own error instead of TensorFlow's wrapping of it."""

    def __init__(self, inner: Any, passes: _Passes):
        self.inner, self.passes = inner, passes

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.inner)
        except tf.errors.OpError:
            error, self.passes.error = self.passes.error, None
            if error is None:
                raise
            raise error from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StoreDataset(dataset_ops.UnaryUnchangedStructureDataset):  # type: ignore[misc]
    """The dataset :func:`tf_dataset` returns: its input as it is, holding the feed (the readers live as
    long as it, or a dataset or iterator made from it), and iterated in Python, raising a pass's own error."""

    def __init__(self, input_dataset: tf.data.Dataset, passes: _Passes):
        self._lmdbstore_passes = passes
        super().__init__(input_dataset, input_dataset._variant_tensor)

    def __iter__(self) -> Any:
        inner = super().__iter__()
        return _Iterator(inner, self._lmdbstore_passes) if tf.executing_eagerly() else inner


def tf_dataset(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
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
    iterated (by ``forkserver``, TensorFlow's runtime running: a script needs the ``if __name__ ==
    "__main__":`` guard) and stop when the dataset (and every dataset and iterator made from it) is
    garbage-collected; they die with the process whatever kills it.

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
    ds = tf.data.Dataset.from_generator(_generator(weakref.ref(passes)), output_signature=spec)
    return StoreDataset(ds.apply(tf.data.experimental.assert_cardinality(len(feed))), passes)
