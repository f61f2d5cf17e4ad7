"""TensorFlow: a ``tf.data.Dataset`` over a feed, with a known length and a new order every time it is iterated
(imports TensorFlow, never torch; TensorFlow's public API only).

``range(len(ds))`` scanned by one ``numpy_function`` per batch returning the pass's next batch; batch 0 begins a
pass, whose number the scan's state carries (an older iterator's next batch is then an error).  TensorFlow's
injected prefetch is off (the readers work ahead).  No copy: slots are 4 KiB-aligned, which TensorFlow wraps.
TensorFlow keeps a dataset's functions for good, so they hold the feed weakly; the dataset (and every dataset
and iterator made from it) holds it.  A reader's error reaches the iterator as an ``OpError`` with its line.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from lmdbstore.config import LoaderConfig
from lmdbstore.errors import LmdbStoreError
from lmdbstore.feed.feed import EXTRA_SLOTS, BatchFeed
from lmdbstore.feed.opening import channels_last_feed

__all__ = ["TF_EXTRA_SLOTS", "tf_dataset"]

#: Slots beyond the feed's usual ones, for what ``tf.data`` and Keras hold (a ``.prefetch()`` on top holds
#: more; when none is free, a batch is read in the consuming thread instead, slower but right).
TF_EXTRA_SLOTS = 2


class _Passes:
    """The dataset's hold on the feed: one pass per iterator, numbered (a newer one abandons the older),
    batches taken under a lock (tf.data may run the functions of two iterators in threads of its own)."""

    def __init__(self, feed: BatchFeed, item: tuple[tuple[int, ...], np.dtype[Any]]):
        self.feed, self.item = feed, item
        self.lock = threading.Lock()
        self.number = 0

    def take(self, number: int, k: int) -> tuple[np.int64, np.ndarray, np.ndarray]:
        """Batch ``k`` of the iterator on pass ``number`` (``k == 0``: begin a pass), and the pass's number."""
        with self.lock:
            if k == 0:
                self.feed.begin()
                self.number = number = self.number + 1
            elif number != self.number:
                raise LmdbStoreError("a newer iteration of this tf.data dataset started; this one is abandoned")
            try:
                x, y = self.feed.next()
            except StopIteration:
                raise LmdbStoreError(f"the pass ended after {k} of {len(self.feed)} batches") from None
            if self.feed.delivered == len(self.feed):
                self.feed.rest()  # the readers wait for the next iteration (and stop if none comes)
        if (x.shape[1:], x.dtype) != self.item:
            raise ValueError(
                f"the transform returned samples of shape {x.shape[1:]} and dtype {x.dtype} for batch {k}, its "
                f"first batch {self.item[0]} and {self.item[1]} (tf_dataset's element spec): a transform must "
                "return one shape and dtype"
            )
        return np.int64(number), x, y


def _pipeline(ref: weakref.ref[_Passes], batches: int, x_spec: tf.TensorSpec) -> tf.data.Dataset:
    """The dataset of the module docstring; its function (which TensorFlow keeps for good) holds the passes
    only through ``ref``."""

    def take(number: np.ndarray, k: np.ndarray) -> tuple[np.int64, np.ndarray, np.ndarray]:
        passes = ref()
        if passes is None:
            raise LmdbStoreError("this tf_dataset was garbage-collected", hint="keep a reference to the dataset")
        return passes.take(int(number), int(k))

    @tf.autograph.experimental.do_not_convert  # type: ignore[misc]
    def step(number: tf.Tensor, k: tf.Tensor) -> tuple[tf.Tensor, tuple[tf.Tensor, tf.Tensor]]:
        number, x, y = tf.numpy_function(take, [number, k], (tf.int64, x_spec.dtype, tf.int64), stateful=True)
        number.set_shape(())
        x.set_shape(x_spec.shape)
        y.set_shape((None,))
        return number, (x, y)

    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    return tf.data.Dataset.range(batches).scan(np.int64(0), step).with_options(options)


def tf_dataset(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    config: LoaderConfig | None = None,
    **options: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(x, y)`` batches of ``store``: ``x`` channels-last in the store's dtype (or
    as ``transform`` returns it), ``y`` int64; ``len(ds)`` batches; a new order each time it is iterated.

    Args: as :func:`lmdbstore.keras_dataset` (``indices``, ``transform``, ``rank``, ``world_size`` among the
    ``options``; the others: fields of :class:`~lmdbstore.config.LoaderConfig`, e.g.
    ``tf_dataset("train.lmdb", split="train", workers=2)``).  With a ``transform``, the next pass's first
    batch is read and transformed here for the element spec (TensorFlow needs the dtype before the first batch).
    The readers start when it is first iterated (by ``forkserver``: a script needs the ``__main__`` guard) and
    stop when the dataset and all made from it are garbage-collected.

    Raises:
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        ValueError: an unknown option or a bad value (naming it).
        Exception: what ``transform`` raises on the batch read for the element spec.
    """
    feed = channels_last_feed(store, config, options, lambda _batch, _sample: EXTRA_SLOTS + TF_EXTRA_SLOTS)
    layout = feed.source.layout
    item: tuple[tuple[int, ...], np.dtype[Any]] = (tuple(layout.item_shape), np.dtype(layout.dtype))
    if feed.source.transform is not None and len(feed):
        x = np.asarray(feed.peek(0)[0])
        item = (x.shape[1:], x.dtype)
    passes = _Passes(feed, item)
    ds = _pipeline(weakref.ref(passes), len(feed), tf.TensorSpec((None, *item[0]), tf.as_dtype(item[1])))
    ds._lmdbstore_passes = passes  # the dataset holds the feed (every dataset made from it, and iterator, holds it)
    return ds
