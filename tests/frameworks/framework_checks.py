"""Checks of the Keras and tf.data adapters that must run in a process of their own (TensorFlow or Keras
loaded there for good; the test process must stay free of them): ``python framework_checks.py CHECK STORE``
with ``KERAS_BACKEND`` set.  Each check asserts and prints ``OK CHECK``; test_keras_tf.py runs them.

The store's samples encode their index in their first value (tests/conftest.py ``make_data``).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Any

import numpy as np

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
    check_tf_left_midway(store, labels)


def check_tf_left_midway(store: str, labels: np.ndarray) -> None:
    """Issue 35 #11: a loop that breaks out after 3 batches and keeps the dataset no longer keeps its readers:
    they stop once idle (they lived >= 40 s); iterated again, the dataset is whole."""
    import time

    from lmdbstore.feed import idle
    from lmdbstore.util.lifeline import process_start_time

    idle.IDLE_MIN_SECONDS = 1.0
    ds = lmdbstore.tf_dataset(store, split="train", batch_size=BATCH, workers=2, shuffle="random")
    for k, _ in enumerate(ds):
        if k == 2:
            break
    feed = ds._lmdbstore_passes.feed
    pids = [p.pid for p in feed.pool.procs]
    deadline = time.monotonic() + 30
    while (
        feed.pool is not None or any(process_start_time(p) is not None for p in pids)
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert feed.pool is None, "the readers of a pass left midway were not stopped"
    assert all(process_start_time(p) is None for p in pids), pids
    assert [ids(x) for x, _ in ds] == expected(labels, "train", 1)  # the next pass, whole, by new readers


def check_tf_abandoned(ds: Any, derived: Any) -> None:
    """Iterating again abandons an unfinished iteration: its next batch is a one-line error, in Python and
    in TensorFlow's iterators alike; the newer iteration goes on with whole batches of its pass."""
    import tensorflow as tf

    from lmdbstore.errors import LmdbStoreError

    for make in (lambda: iter(ds), lambda: iter(derived)):
        older = make()
        next(older)
        newer = make()
        first = ids(next(newer)[0])
        try:
            next(older)
        except (LmdbStoreError, tf.errors.OpError) as exc:
            assert "abandoned" in str(exc), str(exc)
        else:
            raise AssertionError("an abandoned iteration went on")
        rest = [ids(x) for x, _ in newer]
        assert len(rest) == len(ds) - 1 and all(len(b) == BATCH for b in [first, *rest[:-1]])


def _replaced_before_the_first_epoch(store: str, make: Any) -> str:
    """Make a dataset of a copy of ``store`` (split ``val``), then copy another store (the same samples, another
    id) over its data file before the first epoch, and iterate: the error's text (issue 25 #4: it used to read
    the new store through the old split)."""
    import shutil
    import tempfile
    from pathlib import Path

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
    model = keras.Sequential([keras.Input((25, 25, 1)), keras.layers.Flatten(), keras.layers.Dense(5)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
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


def check_tf_error(store: str) -> None:
    """tf_dataset over a damaged store (a garbled leaf): iterating it in Python raises the readers' own
    CorruptStoreError, one line, not TensorFlow's UnknownError with a traceback in its message."""
    from lmdbstore.errors import CorruptStoreError

    ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2, shuffle="none")
    try:
        for _ in ds:
            pass
    except CorruptStoreError as exc:
        import tensorflow as tf

        assert "\n" not in str(exc) and "Traceback" not in str(exc), str(exc)
        # raised in the parent, or in a reader (a leaf is read when a batch needs it: the reader's traceback is the
        # cause), never TensorFlow's wrapping
        assert not isinstance(exc.__cause__, tf.errors.OpError) and exc.__suppress_context__
    else:
        raise AssertionError("no error from a damaged store")
    ds2 = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=0, shuffle="none")  # read in TF's thread
    try:
        list(ds2)
    except CorruptStoreError:
        pass
    else:
        raise AssertionError("no error from a damaged store without readers")


if __name__ == "__main__":
    check, store = sys.argv[1], sys.argv[2]
    checks = {"tf": check_tf, "tf_error": check_tf_error, "keras": check_keras}
    checks["keras_make_loader"] = check_keras_make_loader
    checks[check](store)
    print(f"OK {check}")
