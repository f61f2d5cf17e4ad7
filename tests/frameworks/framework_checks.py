"""Checks of the Keras and tf.data adapters, run in one process per Keras backend (TensorFlow or Keras loaded
there for good; the test process must stay free of them): ``python framework_checks.py BACKEND STORES`` with
``KERAS_BACKEND`` set, ``STORES`` a directory holding ``small`` (2,000 samples), ``damaged`` (a garbled leaf)
and ``truncated``.

The backend's steps (:data:`PLANS`) run in order: first what the training scripts of test_lifecycle.py do
when they end by themselves (nothing of theirs may be left once they dropped their datasets), then the checks,
then the Ctrl-C steps: each prints ``READY STEP`` once batches flow and reads until the test presses Ctrl-C;
the last one lets KeyboardInterrupt end the process (nothing it started may outlive it).  Each step prints
``RESULT {json}`` (``ok``, or the error's traceback) and a failing step does not stop the next;
test_keras_tf.py reads them.

The store's samples encode their index in their first value (tests/conftest.py ``make_data``).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from lifecycle_script import ready, settle

import lmdbstore
from lmdbstore.loader.choose import split_indices
from lmdbstore.loader.samplers import EpochBatchSampler

BATCH = 64


def ids(x: Any) -> list[int]:
    """The sample numbers of a channels-last batch."""
    return np.rint(np.asarray(x)[:, 0, 0, 0]).astype(np.int64).tolist()


def expected(labels: np.ndarray, split: str, epoch: int) -> list[list[int]]:
    """The batches of ``epoch`` of the split, from a sampler made here (seed 0, random order)."""
    s = EpochBatchSampler(split_indices(labels, split, 0.1, 0), BATCH, shuffle="random", seed=0)
    return [b.tolist() for b in s.batches_from(epoch, 0)]


def crop(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Another shape: the top-left 21x21 of each sample (its first value, the sample number, stays)."""
    return np.ascontiguousarray(x[:, :21, :21]), y


def half(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Another dtype: float16 (sample numbers up to 2,048 are exact)."""
    return x.astype(np.float16), y


def uneven(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """21x21 for whole batches, 20x20 for the last, shorter one: no one element spec fits."""
    n = 21 if len(x) == BATCH else 20
    return np.ascontiguousarray(x[:, :n, :n]), y


def broken_at_the_end(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fails on the last, shorter batch (not on the first, which tf_dataset reads for its element spec)."""
    if len(x) < BATCH:
        raise ValueError("augmentation failed")
    return x, y


# ------------------------------------------------------------------ tf_dataset
def check_tf(store: str) -> None:
    """tf_dataset: known length, every sample once per iteration in the sampler's next order (in Python, in
    a dataset made from it, in a graph), kept tensors never overwritten, the same forkserver readers all
    along, an abandoned iteration an error; make_loader in this process starts forkserver workers too."""
    import tensorflow as tf

    from lmdbstore.feed import idle

    idle.IDLE_MIN_SECONDS = 60.0  # however slow the machine, the readers wait between iterations here
    reader = lmdbstore.open_reader(store)
    x_all, labels = reader.read_range(0, len(reader)), reader.labels()
    ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")
    n = len(expected(labels, "train", 0))
    assert len(ds) == int(ds.cardinality()) == n, (len(ds), n)
    assert ds.element_spec[0].shape.as_list() == [None, 25, 25, 1] and ds.element_spec[1].dtype == tf.int64
    for epoch in range(2):
        assert [ids(x) for x, _ in ds] == expected(labels, "train", epoch)
    kept = list(ds)  # every tensor kept: no slot may be reused under them
    assert [ids(x) for x, _ in kept] == expected(labels, "train", 2)
    for x, y in kept:
        idx = ids(x)
        np.testing.assert_array_equal(x.numpy()[..., 0], x_all[idx])
        np.testing.assert_array_equal(y.numpy(), labels[idx])
    kinds = {type(p).__name__ for p in mp.active_children()}
    assert "ForkServerProcess" in kinds, kinds
    readers = {p.pid for p in ds._lmdbstore_passes.feed.pool.procs}
    # a dataset made from it is iterated by TensorFlow's own iterators (a pass per iteration, in graph)
    derived = ds.map(lambda x, y: (x, y))
    assert [ids(x) for x, _ in derived] == expected(labels, "train", 3)
    graph_batches = tf.function(lambda d: d.reduce(tf.constant(0, tf.int64), lambda n, b: n + 1))
    assert int(graph_batches(ds)) == n
    assert [ids(x) for x, _ in ds] == expected(labels, "train", 5)  # the count above was epoch 4
    assert {p.pid for p in ds._lmdbstore_passes.feed.pool.procs} == readers  # the same readers all along
    check_tf_abandoned(ds, derived)
    err = _replaced_before_the_first_epoch(
        store, lambda s: lmdbstore.tf_dataset(s, split="val", batch_size=BATCH, workers=1)
    )
    assert "StoreReplacedError" in err and "replaced" in err, err
    import torch  # noqa: F401  (torch is installed in the test environment)

    from lmdbstore.config import LoaderConfig

    loader = lmdbstore.make_loader(
        lmdbstore.LmdbBatchDataset(store),
        EpochBatchSampler(np.arange(len(labels)), BATCH),
        LoaderConfig(batch_size=BATCH, workers=2),
    )
    assert sum(len(y) for _, y in loader) == len(labels)
    assert type(loader.multiprocessing_context).__name__ == "ForkServerContext"
    loader.close()
    check_tf_left_midway(store, labels)


def check_tf_left_midway(store: str, labels: np.ndarray) -> None:
    """Issue 35 #11: a loop that breaks out after 3 batches and keeps the dataset no longer keeps its readers:
    they stop once idle (they lived >= 40 s); iterated again, the dataset is whole."""
    import time

    from lmdbstore.feed import idle
    from lmdbstore.util.lifeline import process_start_time

    idle.IDLE_MIN_SECONDS = 1.0
    ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")
    feed = ds._lmdbstore_passes.feed
    for k, _ in enumerate(ds):
        if k == 2:
            pids = [p.pid for p in feed.pool.procs]
            break
    deadline = time.monotonic() + 30
    while (
        feed.pool is not None or any(process_start_time(p) is not None for p in pids)
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert feed.pool is None, "the readers of a pass left midway were not stopped"
    assert all(process_start_time(p) is None for p in pids), pids
    assert [ids(x) for x, _ in ds] == expected(labels, "train", 1)  # the next pass, whole, by new readers
    idle.IDLE_MIN_SECONDS = 60.0


def check_tf_abandoned(ds: Any, derived: Any) -> None:
    """Iterating again abandons an unfinished iteration: its next batch is an error naming it, in Python and
    in TensorFlow's iterators alike; the newer iteration goes on with whole batches of its pass."""
    import tensorflow as tf

    for make in (lambda: iter(ds), lambda: iter(derived)):
        older = make()
        next(older)
        newer = make()
        first = ids(next(newer)[0])
        try:
            next(older)
        except tf.errors.OpError as exc:
            assert "LmdbStoreError: a newer iteration of this tf.data dataset started" in str(exc), str(exc)
        else:
            raise AssertionError("an abandoned iteration went on")
        rest = [ids(x) for x, _ in newer]
        assert len(rest) == len(ds) - 1 and all(len(b) == BATCH for b in [first, *rest[:-1]])


def check_tf_error(store: str, damaged: str, truncated: str) -> None:
    """A store that cannot be opened (a truncated file) is its own one-line CorruptStoreError when the dataset is
    made; damage found while reading (a garbled leaf) and an error inside a pass (a transform's) reach the loop
    and model.fit as TensorFlow's error, its message naming the original exception and its line (and, from a
    reader, where the reader raised it), with or without readers."""
    import keras
    import tensorflow as tf

    from lmdbstore.errors import CorruptStoreError

    for workers in (2, 0):
        try:
            lmdbstore.tf_dataset(truncated, batch_size=BATCH, workers=workers)
        except CorruptStoreError as exc:
            assert "\n" not in str(exc) and "Traceback" not in str(exc) and "truncated" in str(exc), str(exc)
        else:
            raise AssertionError("no error from a truncated store")
        try:
            list(lmdbstore.tf_dataset(damaged, batch_size=BATCH, workers=workers, shuffle="none"))
        except tf.errors.OpError as exc:
            assert f"CorruptStoreError: {damaged}: " in str(exc), str(exc)
        else:
            raise AssertionError("no error from a damaged store")
    ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, transform=broken_at_the_end)
    for consume in (list, lambda d: _model(keras, (25, 25, 1)).fit(d, verbose=0)):
        try:
            consume(ds)
        except tf.errors.InvalidArgumentError as exc:
            assert "ValueError: augmentation failed" in str(exc) and "in broken_at_the_end" in str(exc), str(exc)
        else:
            raise AssertionError("a transform's error was lost")


def check_tf_transforms(store: str) -> None:
    """Issue 39 #6: a transform that changes the shape (a 21x21 crop) or the dtype (float16) is delivered as
    it returns it, its element spec the transform's (in Python and to model.fit); one that returns another
    shape for a later batch is an error naming the transform."""
    import keras
    import tensorflow as tf

    reader = lmdbstore.open_reader(store)
    x_all, labels = reader.read_range(0, len(reader)), reader.labels()
    for transform, shape, dtype in ((crop, (21, 21, 1), np.float32), (half, (25, 25, 1), np.float16)):
        ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, transform=transform)
        assert ds.element_spec[0].shape.as_list() == [None, *shape], ds.element_spec
        assert ds.element_spec[0].dtype == tf.as_dtype(dtype), ds.element_spec
        seen = []
        for x, y in ds:
            assert x.shape[1:] == shape and x.dtype == tf.as_dtype(dtype), (x.shape, x.dtype)
            idx = ids(x)
            want, _ = transform(x_all[idx][..., None], labels[idx])
            np.testing.assert_array_equal(x.numpy(), want)
            np.testing.assert_array_equal(y.numpy(), labels[idx])
            seen += idx
        assert sorted(seen) == sorted(split_indices(labels, "train", 0.1, 0).tolist())
        history = _model(keras, shape).fit(ds, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
    ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, transform=uneven)
    try:
        list(ds)
    except tf.errors.InvalidArgumentError as exc:
        assert "the transform returned samples of shape (20, 20, 1)" in str(exc), str(exc)
        assert "its first batch (21, 21, 1)" in str(exc), str(exc)
    else:
        raise AssertionError("a batch of another shape than the element spec was delivered")


def _model(keras: Any, shape: tuple[int, ...]) -> Any:
    model = keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _replaced_before_the_first_epoch(store: str, make: Any) -> str:
    """Make a dataset of a copy of ``store`` (split ``val``), then copy another store (the same samples, another
    id) over its data file before the first epoch, and iterate: the error's text (issue 25 #4: it used to read
    the new store through the old split)."""
    import shutil
    import tempfile

    from lmdbstore.tools.copy import copy_store

    base = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(store, base / "mine")
        copy_store(store, base / "other")
        ds = make(str(base / "mine"))
        shutil.copyfile(base / "other" / "data.mdb", base / "mine" / "data.mdb")
        try:
            for _ in ds:
                pass
        except Exception as exc:  # TensorFlow wraps what the generator raised
            return f"{type(exc).__name__}: {exc}"
        finally:
            if hasattr(ds, "close"):
                ds.close()
        raise AssertionError("a store replaced before the first epoch was read through the old split")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------ keras_dataset
def _recording(ds: Any) -> list[list[list[int]]]:
    """Wrap ``ds``'s feed so that every pass's delivered batches are recorded (observed, not changed)."""
    passes: list[list[list[int]]] = []
    feed = ds.feed
    begin, nxt = feed.begin, feed.next
    ds.reader_pids = []  # the reader processes of every pass

    def recorded_begin() -> None:
        passes.append([])
        begin()
        ds.reader_pids.append(tuple(p.pid for p in feed.pool.procs))

    def recorded_next() -> Any:
        x, y = nxt()
        passes[-1].append(ids(x))
        return x, y

    feed.begin, feed.next = recorded_begin, recorded_next
    return passes


def check_keras(store: str) -> None:
    """keras_dataset under model.fit on this backend: each epoch a whole new order of the training split
    (Keras shuffles the numbers it asks for; the dataset answers in its own order) read by the same reader
    processes, the validation split whole each time, and through Keras' TF adapter kept batches are never
    overwritten."""
    import keras

    from lmdbstore.feed import idle

    idle.IDLE_MIN_SECONDS = 60.0  # however slow the machine, the readers wait between epochs here

    reader = lmdbstore.open_reader(store)
    labels = reader.labels()
    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")
    val = lmdbstore.keras_dataset(store, split="val", batch_size=BATCH, workers=1)
    seen, seen_val = _recording(train), _recording(val)
    model = _model(keras, (25, 25, 1))
    history = model.fit(train, validation_data=val, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    whole = [p for p in seen if len(p) == len(train)]
    assert len(whole) == 3, [len(p) for p in seen]  # a pass per epoch (plus, on torch, Keras' first look)
    assert len(set(train.reader_pids)) == 1, train.reader_pids  # the same readers every epoch: no restarts
    everything = sorted(split_indices(labels, "train", 0.1, 0).tolist())
    for p in whole:
        assert sorted(i for b in p for i in b) == everything
    assert whole[0] != whole[1] != whole[2]
    val_order = [i for b in expected(labels, "val", 0) for i in sorted(b)]
    for p in seen_val:
        assert sorted(i for b in p for i in b) == sorted(val_order)
    if keras.backend.backend() == "tensorflow":
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        adapter = PyDatasetAdapter(train, shuffle=True)
        tfds = adapter.get_tf_dataset()
        adapter.on_epoch_begin()
        kept = list(tfds)
        adapter.on_epoch_end()
        x_all = reader.read_range(0, len(reader))
        for x, y in kept:
            idx = ids(x)
            np.testing.assert_array_equal(np.asarray(x)[..., 0], x_all[idx])
            np.testing.assert_array_equal(np.asarray(y), labels[idx])
    train.close()
    val.close()
    check_keras_resume(store, model, labels)
    err = _replaced_before_the_first_epoch(
        store, lambda s: lmdbstore.keras_dataset(s, split="val", batch_size=BATCH, workers=1)
    )
    assert err.startswith("StoreReplacedError: ") and "\n" not in err, err


def check_keras_resume(store: str, model: Any, labels: np.ndarray) -> None:
    """A state saved by a callback after k training steps of model.fit (``state_dict(batch + 1)``: Keras'
    adapter holds batches ahead of the step) resumes a new dataset at exactly the rest of that epoch."""
    import keras

    k, saved = 3, {}
    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")

    def save(batch: int, logs: Any = None) -> None:
        if batch + 1 == k:
            saved["handed"] = train.feed.delivered
            saved["state"] = train.state_dict(batch + 1)
            model.stop_training = True

    model.fit(train, epochs=1, verbose=0, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=save)])
    assert (saved["state"]["epoch"], saved["state"]["position"]) == (0, k), saved
    assert saved["handed"] >= k, saved  # on TensorFlow, Keras' adapter held more
    train.close()
    resumed = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")
    resumed.load_state_dict(saved["state"])
    rest = [ids(x) for x, _ in resumed]
    assert rest == expected(labels, "train", 0)[k:], (len(rest), len(resumed))
    resumed.close()


def check_keras_transforms(store: str) -> None:
    """The sibling of issue 39 #6: keras_dataset delivers a transform's other shape (a 21x21 crop) or dtype
    (float16) as it returns it, iterated and under model.fit on this backend."""
    import keras

    reader = lmdbstore.open_reader(store)
    x_all, labels = reader.read_range(0, len(reader)), reader.labels()
    for transform, shape, dtype in ((crop, (21, 21, 1), np.float32), (half, (25, 25, 1), np.float16)):
        ds = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2, transform=transform)
        for x, y in ds:
            assert x.shape[1:] == shape and x.dtype == dtype, (x.shape, x.dtype)
            idx = ids(x)
            np.testing.assert_array_equal(x, transform(x_all[idx][..., None], labels[idx])[0])
            np.testing.assert_array_equal(y, labels[idx])
        history = _model(keras, shape).fit(ds, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
        ds.close()


class Recorder:
    """A transform that records the sample numbers of every batch (run in this process: ``workers=0``)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.batches.append(np.rint(x[:, 0, 0, 0]).astype(np.int64).tolist())
        return x, y


def check_keras_make_loader(store: str) -> None:
    """model.fit(make_loader(...)) on this backend: Keras never calls set_epoch, and still every epoch is
    a new order of every training sample (the sampler's next epoch on every pass)."""
    import keras

    from lmdbstore.config import LoaderConfig

    labels = lmdbstore.open_reader(store).labels()
    train_idx = split_indices(labels, "train", 0.1, 0)
    record = Recorder()
    loader = lmdbstore.make_loader(
        lmdbstore.LmdbBatchDataset(store, transform=record),
        EpochBatchSampler(train_idx, BATCH, seed=0),
        LoaderConfig(batch_size=BATCH, workers=0),
    )
    model = keras.Sequential([keras.Input((1, 25, 25)), keras.layers.Flatten(), keras.layers.Dense(5)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(loader, epochs=3, verbose=0)
    n = len(loader)
    seen = record.batches[-3 * n :]  # before them at most Keras' first look at the data
    epochs = [sorted(i for b in seen[e * n : (e + 1) * n] for i in b) for e in range(3)]
    assert all(e == sorted(train_idx.tolist()) for e in epochs)
    orders = [seen[e * n] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]


# ------------------------------------------------------------------ what test_lifecycle.py's scripts did
def drop_tf(store: str) -> None:
    """Break out of a tf_dataset's epoch, drop it, collect: no reader left; then whole epochs of datasets made
    and dropped: none left either."""
    ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2)
    for _ in ds:
        break
    del ds
    settle("tf_dataset, early stop")
    for _ in range(3):  # datasets iterated and dropped
        ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2)
        for _ in ds:
            pass
        del ds
    settle("tf_dataset, whole epochs")


def drop_keras(store: str) -> None:
    """The same for keras_dataset: an epoch broken out of, then one of model.fit."""
    import keras

    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2)
    val = lmdbstore.keras_dataset(store, split="val", batch_size=BATCH, workers=1)
    for _ in train:
        break
    del train, val
    settle("keras_dataset, early stop")
    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2)
    _model(keras, (25, 25, 1)).fit(train, epochs=1, verbose=0)
    del train
    settle("keras_dataset after model.fit")


#: Datasets whose loops Ctrl-C broke, kept to the end: their readers must end with the process.
INTERRUPTED: list[Any] = []


def interrupt_keras(store: str) -> None:
    """model.fit on keras_dataset (2 readers, validation with 1) until Ctrl-C."""
    import keras

    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2)
    val = lmdbstore.keras_dataset(store, split="val", batch_size=BATCH, workers=1)
    INTERRUPTED.extend([train, val])
    _model(keras, (25, 25, 1)).fit(
        train, validation_data=val, epochs=10_000, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=ready)],
    )  # fmt: skip


def interrupt_tf(store: str) -> None:
    """A for loop over tf_dataset (2 readers, started by forkserver) until Ctrl-C."""
    ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2)
    INTERRUPTED.append(ds)
    while True:
        for _ in ds:
            ready()


#: The steps of each backend, in order (the module docstring); a Ctrl-C step last ends the process.
PLANS: dict[str, list[str]] = {
    "tensorflow": [
        "drop_tf", "drop_keras", "tf", "tf_error", "tf_transforms", "keras", "keras_transforms",
        "keras_make_loader", "interrupt_keras", "interrupt_tf",
    ],
    "torch": ["drop_keras", "keras", "keras_transforms", "keras_make_loader", "interrupt_keras"],
    "jax": ["drop_keras", "keras", "keras_transforms", "interrupt_keras"],
}  # fmt: skip

STEPS: dict[str, Callable[..., None]] = {
    "drop_tf": drop_tf, "drop_keras": drop_keras, "tf": check_tf, "tf_error": check_tf_error,
    "tf_transforms": check_tf_transforms, "keras": check_keras, "keras_transforms": check_keras_transforms,
    "keras_make_loader": check_keras_make_loader, "interrupt_keras": interrupt_keras, "interrupt_tf": interrupt_tf,
}  # fmt: skip


def run_step(name: str, stores: Path, last: bool) -> None:
    """Run one step and print its RESULT; a Ctrl-C step waits for Ctrl-C (the last one ends the process)."""
    import lifecycle_script

    args = [str(stores / s) for s in (("small", "damaged", "truncated") if name == "tf_error" else ("small",))]
    lifecycle_script.said = False  # ready() says READY once per step
    error = None
    try:
        STEPS[name](*args)
        if name.startswith("interrupt_"):
            error = "the loop ended before Ctrl-C"
    except KeyboardInterrupt:
        if not name.startswith("interrupt_") or last:
            raise
    except BaseException:  # SystemExit from settle() too
        error = traceback.format_exc()
    print("RESULT " + json.dumps({"step": name, "error": error}), flush=True)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks when it waited too long
    backend, stores = sys.argv[1], Path(sys.argv[2])
    plan = PLANS[backend]
    for k, name in enumerate(plan):
        run_step(name, stores, last=k == len(plan) - 1)


if __name__ == "__main__":
    main()
