"""A training script as users write it, for test_lifecycle.py: ``python lifecycle_script.py KIND MODE STORE``.

KIND: ``loader`` (make_loader, 2 workers), ``tf`` (a for loop over tf_dataset, 2 readers, started by
forkserver: TensorFlow's runtime runs; ``wait`` only).

MODE ``wait``: print ``READY`` once batches flow, then read for ever (the test kills the process).
MODE ``drop``: break out of an epoch, drop everything, collect; then a whole epoch, drop, collect; each
time wait until no worker or reader process of this one is left and print ``CLEAN`` (else exit 1).

framework_checks.py does the same with keras_dataset and tf_dataset, with :func:`settle` and :func:`ready`.
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


def run_tf(store: str, mode: str) -> None:
    ds = lmdbstore.tf_dataset(store, batch_size=BATCH, workers=2)
    while True:
        for _ in ds:
            ready()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks when it waited too long
    kind, mode, store = sys.argv[1:4]
    {"loader": run_loader, "tf": run_tf}[kind](store, mode)
    print("CLEAN", flush=True)


if __name__ == "__main__":
    main()
