"""A training script as users write it, for test_lifecycle.py: ``python lifecycle_script.py KIND MODE STORE``
(``KERAS_BACKEND`` set for ``keras``).

KIND: ``loader`` (make_loader, 2 workers), ``keras`` (model.fit on keras_dataset, 2 readers, validation
with 1), ``tf`` (a for loop over tf_dataset, 2 readers, started by forkserver: TensorFlow's runtime runs).

MODE ``wait``: print ``READY`` once batches flow, then read for ever (the test kills the process).
MODE ``drop``: break out of an epoch, drop everything, collect; then a whole epoch, drop, collect; each
time wait until no worker or reader process of this one is left and print ``CLEAN`` (else exit 1).
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import sys
import time

import lmdbstore

BATCH = 64


def workers_left() -> list[int]:
    """Descendants of this process, but the forkserver and the resource tracker (multiprocessing's own,
    which end with this process)."""
    own = set()
    for mod, attr in (("forkserver", "_forkserver"), ("resource_tracker", "_resource_tracker")):
        obj = getattr(getattr(mp, mod, None), attr, None)
        pid = getattr(obj, "_forkserver_pid", None) or getattr(obj, "_pid", None)
        if pid:
            own.add(pid)
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            todo.append(c)
            if c not in own:
                out.append(c)
    return out


def settle(what: str) -> None:
    gc.collect()
    deadline = time.monotonic() + 15
    while workers_left() and time.monotonic() < deadline:
        time.sleep(0.1)
        gc.collect()
    left = workers_left()
    if left:
        print(f"LEFT {what}: {left}", flush=True)
        sys.exit(1)


def ready(*_: object, **__: object) -> None:
    global said
    if not said:
        said = True
        print("READY", flush=True)


said = False


def make_loader(store: str):  # type: ignore[no-untyped-def]
    ds = lmdbstore.LmdbBatchDataset(store)
    sampler = lmdbstore.EpochBatchSampler(range(len(ds)), BATCH)
    return lmdbstore.make_loader(ds, sampler, lmdbstore.LoaderConfig(batch_size=BATCH, workers=2))


def run_loader(store: str, mode: str) -> None:
    if mode == "wait":
        loader = make_loader(store)
        while True:
            for _ in loader:
                ready()
    loader = make_loader(store)
    for _ in loader:
        break
    del loader
    settle("loader, early stop")
    loader = make_loader(store)
    for _ in loader:
        pass
    del loader
    settle("loader, whole epoch")


def run_keras(store: str, mode: str) -> None:
    import keras

    model = keras.Sequential([keras.Input((25, 25, 1)), keras.layers.Flatten(), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2)
    val = lmdbstore.keras_dataset(store, split="val", batch_size=BATCH, workers=1)
    if mode == "wait":
        model.fit(train, validation_data=val, epochs=10_000, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=ready)])  # fmt: skip
    for _ in train:
        break
    del train, val
    settle("keras_dataset, early stop")
    train = lmdbstore.keras_dataset(store, split="train", batch_size=BATCH, workers=2)
    model.fit(train, epochs=1, verbose=0)
    del train
    settle("keras_dataset after model.fit")


def run_tf(store: str, mode: str) -> None:
    ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2)
    if mode == "wait":
        while True:
            for _ in ds:
                ready()
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


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks when it waited too long
    kind, mode, store = sys.argv[1:4]
    {"loader": run_loader, "keras": run_keras, "tf": run_tf}[kind](store, mode)
    print("CLEAN", flush=True)


if __name__ == "__main__":
    main()
