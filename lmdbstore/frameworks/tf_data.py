"""TensorFlow: a ``tf.data.Dataset`` over a feed, with a known length and a new order every time it is iterated
(imports TensorFlow, never torch).

Each batch crosses with as little per batch as TensorFlow allows (``from_generator`` costs about 0.3 ms of CPU
per batch, 2x this): a one-element dataset whose ``numpy_function`` begins a pass and returns its number, then
``flat_map`` to ``len(ds)`` calls of a second ``numpy_function`` returning the pass's next batch, a synchronous
map running in the calling thread; TensorFlow's injected prefetch is off (the readers already work ahead; add
``.prefetch()`` yourself where the consumer should run apart).  No copy: a slot is 4 KiB-aligned and TensorFlow
wraps aligned numpy memory, holding the array while the tensor lives.  Iterating again abandons an unfinished
iterator (its next batch is an error).  TensorFlow keeps a dataset's functions for good, so they hold the feed
weakly; the dataset and its iterators hold it, and its readers stop with them, or once idle.  An error in the
readers reaches TensorFlow's iterators as an ``UnknownError``; iterated in Python, the dataset raises the
original error.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from lmdbstore.config import LoaderConfig
from lmdbstore.errors import LmdbStoreError
from lmdbstore.feed.feed import EXTRA_SLOTS, BatchFeed
from lmdbstore.feed.opening import loader_config, open_feed
from lmdbstore.loader.transform import Transform

__all__ = ["TF_EXTRA_SLOTS", "tf_dataset"]

#: Slots beyond the feed's usual ones, for what ``tf.data`` and Keras hold (a ``.prefetch()`` on top holds
#: more; when none is free, a batch is read in the consuming thread instead, slower but right).
TF_EXTRA_SLOTS = 2

Spec = tuple[tf.TensorSpec, tf.TensorSpec]


class _Passes:
    """The dataset's hold on the feed: one pass per iteration, numbered (a newer one abandons the older),
    batches taken under a lock (tf.data may run the functions of two iterators in threads of its own)."""

    def __init__(self, feed: BatchFeed):
        self.feed = feed
        self.lock = threading.Lock()
        self.number = 0
        self.error: Exception | None = None  # the last error a pass raised, for the Python iterator

    def begin(self) -> np.ndarray:
        """Begin a pass (call with the lock held); its number."""
        with self._noting_errors():
            self.feed.begin()
            self.number += 1
            return np.array(self.number, dtype=np.int64)

    def take(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """The next batch of pass ``number`` (call with the lock held)."""
        with self._noting_errors():
            if number != self.number:
                raise LmdbStoreError("a newer iteration of this tf.data dataset started; this one is abandoned")
            try:
                batch = self.feed.next()
            except StopIteration:
                raise LmdbStoreError(
                    f"the pass ended after {self.feed.delivered} of {len(self.feed)} batches"
                ) from None
            if self.feed.delivered == len(self.feed):
                self.feed.rest()  # the readers wait for the next iteration (and stop if none comes)
            return batch

    def current(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch of the pass running (begun and checked by the Python iterator, which holds the
        lock while this runs in a thread of TensorFlow's)."""
        with self._noting_errors():
            return self.feed.next()

    @contextlib.contextmanager
    def _noting_errors(self) -> Iterator[None]:
        """Keep the error of the readers (the store's, or a transform's own) for the Python iterator to raise."""
        try:
            yield
        except Exception as exc:
            self.error = exc
            raise


def _held(ref: weakref.ref[_Passes]) -> _Passes:
    passes = ref()
    if passes is None:
        raise LmdbStoreError("this tf_dataset was garbage-collected", hint="keep a reference to the dataset")
    return passes


def _batch_fn(take: Callable[..., tuple[np.ndarray, np.ndarray]], spec: Spec) -> Callable[..., Any]:
    """A map function calling ``take(*inputs)`` as a ``numpy_function`` that returns one batch of ``spec``."""

    @tf.autograph.experimental.do_not_convert  # type: ignore[misc]
    def batch(*inputs: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x, y = tf.numpy_function(take, list(inputs), (spec[0].dtype, spec[1].dtype), stateful=True)
        x.set_shape(spec[0].shape)
        y.set_shape(spec[1].shape)
        return x, y

    return batch


def _pipeline(ref: weakref.ref[_Passes], batches: int, spec: Spec) -> tf.data.Dataset:
    """The dataset of the module docstring; its functions (which TensorFlow keeps for good) hold the passes
    only through ``ref``."""

    def begin() -> np.ndarray:
        passes = _held(ref)
        with passes.lock:
            return passes.begin()

    def take(number: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        passes = _held(ref)
        with passes.lock:
            return passes.take(int(number))

    @tf.autograph.experimental.do_not_convert  # type: ignore[misc]
    def begin_fn(_: tf.Tensor) -> tf.Tensor:
        return tf.numpy_function(begin, [], tf.int64, stateful=True)

    def one_pass(number: tf.Tensor) -> tf.data.Dataset:
        return _synchronous_map(tf.data.Dataset.from_tensors(number).repeat(batches), _batch_fn(take, spec))

    ds = tf.data.Dataset.from_tensors(np.int64(0)).map(begin_fn, synchronous=True).flat_map(one_pass)
    return _without_injected_prefetch(ds)


def _without_injected_prefetch(ds: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


def _synchronous_map(ds: tf.data.Dataset, fn: Callable[..., Any]) -> tf.data.Dataset:
    """``ds.map(fn, synchronous=True)`` whose function runs in the calling thread (no inter-op hand-off;
    TensorFlow's own ``_MapDataset``, the public map where that is gone)."""
    try:
        from tensorflow.python.data.ops.map_op import _MapDataset
    except ImportError:  # pragma: no cover - another TensorFlow
        return ds.map(fn, synchronous=True)
    return _MapDataset(ds, fn, force_synchronous=True, use_inter_op_parallelism=False)


class _EagerBatches:
    """The batches of whatever pass Python iteration began: one long-lived iterator over an endless map of
    the feed's next batch, so that iterating the dataset again costs no new TensorFlow iterator (several
    milliseconds each, a share of a small epoch); passes are begun, counted and numbered in Python."""

    def __init__(self, ref: weakref.ref[_Passes], spec: Spec):
        def take(_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _held(ref).current()

        endless = _synchronous_map(tf.data.Dataset.from_tensors(np.int64(0)).repeat(), _batch_fn(take, spec))
        self.iterator: Any = iter(_without_injected_prefetch(endless))


class _Iterator:
    """A pass of the dataset iterated in Python: raises a pass's own error instead of TensorFlow's wrapping
    of it (see the module docstring)."""

    def __init__(self, dataset: StoreDataset):
        self.dataset, self.passes = dataset, dataset._lmdbstore_passes
        with self.passes.lock:
            try:
                self.mine = int(self.passes.begin())
            except Exception as exc:
                self.passes.error = None
                raise exc from exc.__cause__  # as from a batch (__next__): the readers' traceback its cause
        self.left = len(self.passes.feed)

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> Any:
        passes = self.passes
        with passes.lock:
            if self.mine != passes.number:
                raise LmdbStoreError("a newer iteration of this tf.data dataset started; this one is abandoned")
            if self.left == 0:
                raise StopIteration
            try:
                batch = next(self.dataset._lmdbstore_eager().iterator)
            except tf.errors.OpError:
                self.dataset._lmdbstore_eager_batches = None  # a new iterator next time
                error, passes.error = passes.error, None
                if error is None:
                    raise
                raise error from error.__cause__  # the readers' traceback, not TensorFlow's wrapping
            self.left -= 1
            if self.left == 0:
                passes.feed.rest()  # the readers wait for the next iteration (and stop if none comes)
            return batch


class StoreDataset(dataset_ops.UnaryUnchangedStructureDataset):  # type: ignore[misc]
    """The dataset :func:`tf_dataset` returns: its input as it is (what TensorFlow and datasets made from it
    iterate), holding the feed (the readers live as long as it, or a dataset or iterator made from it);
    iterated in Python, its passes run through one long-lived iterator (:class:`_EagerBatches`) and raise
    a pass's own error."""

    def __init__(self, input_dataset: tf.data.Dataset, passes: _Passes, spec: Spec):
        self._lmdbstore_passes = passes
        self._lmdbstore_spec = spec
        self._lmdbstore_eager_batches: _EagerBatches | None = None
        super().__init__(input_dataset, input_dataset._variant_tensor)

    def _lmdbstore_eager(self) -> _EagerBatches:
        if self._lmdbstore_eager_batches is None:
            self._lmdbstore_eager_batches = _EagerBatches(weakref.ref(self._lmdbstore_passes), self._lmdbstore_spec)
        return self._lmdbstore_eager_batches

    def __iter__(self) -> Any:
        return _Iterator(self) if tf.executing_eagerly() else super().__iter__()


def tf_dataset(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    config: LoaderConfig | None = None,
    *,
    indices: Any = None,
    transform: Transform | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(x, y)`` batches of ``store``: ``x`` channels-last in the store's dtype,
    ``y`` int64; ``len(ds)`` batches; a new order each time it is iterated.

    Args: as :func:`lmdbstore.keras_dataset` (``config``/``options``: :class:`~lmdbstore.config.LoaderConfig`,
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
        loader_config(config, options),
        channels="last",
        indices=indices,
        transform=transform,
        held=EXTRA_SLOTS + TF_EXTRA_SLOTS,
        rank=rank,
        world_size=world_size,
    )
    passes = _Passes(feed)
    spec = (
        tf.TensorSpec((None, *feed.source.layout.item_shape), tf.as_dtype(np.dtype(feed.source.layout.dtype))),
        tf.TensorSpec((None,), tf.int64),
    )
    ds = _pipeline(weakref.ref(passes), len(feed), spec)
    return StoreDataset(ds.apply(tf.data.experimental.assert_cardinality(len(feed))), passes, spec)
