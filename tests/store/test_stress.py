"""Concurrency stress: readers of every kind beside writers that append through map growths and hundreds of
commits; every sample read is compared with the ground truth.

Sample ``i`` is a function of ``i`` alone (:func:`truth`), so any reader can check any sample it gets, however
many have been appended since it opened.  Phase 1: a writer in another process appends in ~150 small
commits (its map starts at 1 MiB and doubles several times) while, in this process, a lock-free reader
opened before it started, a ``lock=True`` reader, two readers opened while it runs (one environment,
shared), a reader opened after it started, and DataLoaders with forked and spawned workers (datasets made
before it started) read.  Phase 2: a writer in *this* process appends ~150 more commits through more map
growths (each growth ends every transaction of the shared environment) while the same readers read, and a
forked DataLoader reads with the writer open in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from conftest import CLASSES, REPO

from lmdbstore import LoaderConfig, WriterConfig, open_writer
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.store.reader import StoreReader

SHAPE = (25, 25)
START = 2000  # samples before any writer runs
COMMITS = 150  # per phase
PER_COMMIT = 40
CFG = WriterConfig(sync=False, initial_map_size=1 << 20)


def truth(idx: Any) -> np.ndarray:
    """The samples at ``idx``: sample ``i`` holds ``i + k / 1000`` at flat position ``k`` (first element ``i``)."""
    i = np.asarray(idx, np.float64).reshape(-1, 1)
    return (i + np.arange(625) / 1000.0).astype(np.float32).reshape(-1, *SHAPE)


def labels(idx: Any) -> np.ndarray:
    return (np.asarray(idx, np.int64) % len(CLASSES)).astype(np.uint8)


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{tests!r}, {store_tests!r}]
    from test_stress import CFG, COMMITS, PER_COMMIT, labels, truth
    from lmdbstore import open_writer
    w = open_writer({path!r}, config=CFG)
    print("started", flush=True)
    n = w.count
    for c in range(COMMITS):
        if c == COMMITS // 2:
            print("half", flush=True)
            sys.stdin.readline()  # the second half runs while the readers check, without pinning them
        w.append(truth(range(n, n + PER_COMMIT)), labels(range(n, n + PER_COMMIT)))
        w.commit()
        n += PER_COMMIT
        time.sleep(0.01)
    w.close()
    print("done", n, flush=True)
    """
)


class Checker:
    """Reads from a reader and checks what it gets: random batches, a block range, the labels."""

    def __init__(self, name: str, reader: StoreReader, rng: np.random.Generator):
        self.name, self.r, self.rng = name, reader, rng
        self.reads = 0
        self.seen = 0

    def check(self, refresh: bool = False) -> None:
        if refresh and self.reads % 2:
            self.r.refresh()  # a long-lived snapshot pins pages: move on now and then, as the docs advise
        n = len(self.r)
        assert n >= self.seen, f"{self.name}: {n} samples after {self.seen}"
        self.seen = n
        idx = self.rng.integers(0, n, 300)
        np.testing.assert_array_equal(self.r.read_batch(idx), truth(idx), err_msg=self.name)
        lo = int(self.rng.integers(0, max(n - 100, 1)))
        np.testing.assert_array_equal(self.r.read_range(lo, min(lo + 100, n)), truth(range(lo, min(lo + 100, n))))
        # the tail: the last, partial value and label chunks are what each commit rewrites (and frees)
        np.testing.assert_array_equal(self.r.read_range(max(n - 40, 0), n), truth(range(max(n - 40, 0), n)))
        c = int(self.rng.integers(len(CLASSES)))
        got_c = self.r.class_indices(c)  # a lost snapshot is replaced by a newer one: count it after
        np.testing.assert_array_equal(got_c, np.arange(c, len(self.r), len(CLASSES)), err_msg=self.name)
        got = self.r.labels()
        np.testing.assert_array_equal(got, labels(range(len(got))), err_msg=self.name)
        self.reads += 1


def _lock_free_reader(path: Path, opened: Any, stop: Any, report: Any) -> None:
    """A child process: a default reader opened before any writer (so lock-free), reading and checking
    until ``stop``; reports how often it read and whether it noticed the writer (a registered snapshot)."""
    try:
        c = Checker("lock-free, opened before the writer", StoreReader(path).open(), np.random.default_rng(5))
        was = c.r._handle().snapshot.registered
        opened.set()
        while not stop.is_set():
            c.check()
        c.check()
        report.put(("ok", c.reads, was, c.r._handle().snapshot.registered, len(c.r)))
    except BaseException as exc:
        opened.set()
        report.put(("error", repr(exc)[:2000], None, None, None))


def _loader(path: Path, context: str) -> tuple[Any, EpochBatchSampler]:
    ds = LmdbBatchDataset(path)
    sampler = EpochBatchSampler(np.arange(len(ds)), 256, shuffle="random", seed=1)
    cfg = LoaderConfig(workers=2, multiprocessing_context=context, persistent_workers=True)
    return make_loader(ds, sampler, cfg), sampler


def _epoch(loader: Any, sampler: EpochBatchSampler) -> int:
    n = 0
    for (x, y), idx in zip(loader, sampler.batches(sampler.upcoming_epoch()), strict=True):
        np.testing.assert_array_equal(x[:, 0].numpy(), truth(idx))
        np.testing.assert_array_equal(y.numpy(), labels(idx))
        n += len(idx)
    return n


def test_readers_beside_writers_in_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES, config=CFG) as w:
        w.append(truth(range(START)), labels(range(START)))
    rng = np.random.default_rng(3)
    ctx = mp.get_context("fork")
    opened, stop, report = ctx.Event(), ctx.Event(), ctx.Queue()
    lock_free = ctx.Process(target=_lock_free_reader, args=(path, opened, stop, report), daemon=True)
    lock_free.start()
    try:
        _phases(path, rng, opened, stop, report, lock_free)
    finally:
        stop.set()
        lock_free.join(60)
        if lock_free.is_alive():
            lock_free.kill()


def _phases(path: Path, rng: np.random.Generator, opened: Any, stop: Any, report: Any, lock_free: Any) -> None:
    assert opened.wait(60)
    registered = Checker("lock=True", StoreReader(path, lock=True).open(), rng)
    forked, forked_sampler = _loader(path, "fork")
    spawned, spawned_sampler = _loader(path, "spawn")
    script = WRITER.format(tests=str(REPO / "tests"), store_tests=str(REPO / "tests" / "store"), path=str(path))
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline().strip() == "started"
    during = [Checker(f"opened during, {k}", StoreReader(path).open(), rng) for k in ("a", "b")]
    assert during[0].r._handle().env is during[1].r._handle().env  # one environment, shared
    after = Checker("opened after the writer started", StoreReader(path).open(), rng)
    checkers = [registered, *during, after]
    for loader, sampler in ((forked, forked_sampler), (spawned, spawned_sampler)):
        for c in checkers:
            c.check(refresh=True)
        _epoch(loader, sampler)  # persistent workers: they keep the snapshot they opened
    assert child.stdout.readline().strip() == "half"
    for c in checkers:
        c.r.refresh()
    child.stdin.write("\n")
    child.stdin.flush()
    while child.poll() is None:
        for c in checkers:
            c.check(refresh=True)
    assert child.returncode == 0 and child.stdout.read().split()[0] == "done"
    stop.set()
    status, reads, was_registered, now_registered, seen = report.get(timeout=120)
    lock_free.join(60)
    assert status == "ok", reads
    assert not was_registered and now_registered and reads > 0  # it noticed the writer that started later
    assert START < seen <= START + COMMITS * PER_COMMIT  # its new snapshot: registered, kept until refresh()
    for c in checkers:
        c.check()
    assert _epoch(forked, forked_sampler) == START  # the datasets keep the count they were made with

    # phase 2: a writer in this process, its map growing under readers that share its environment
    with open_writer(path, config=CFG) as w:
        n = w.count
        assert n == START + COMMITS * PER_COMMIT
        grown = w._env.info()["map_size"]
        for commit in range(COMMITS):
            w.append(truth(range(n, n + PER_COMMIT)), labels(range(n, n + PER_COMMIT)))
            w.commit()
            n += PER_COMMIT
            c = checkers[commit % len(checkers)]
            c.check()
            if commit == COMMITS // 2:
                loader, sampler = _loader(path, "fork")  # forked workers with the writer open here
                assert _epoch(loader, sampler) == n
        for _ in range(60):  # until the map grows (readers that stopped hold no old pages: LMDB reuses them)
            if w._env.info()["map_size"] > grown:
                break
            w.append(truth(range(n, n + 1000)), labels(range(n, n + 1000)))
            w.commit()
            n += 1000
            checkers[n % len(checkers)].check()
        assert w._env.info()["map_size"] > grown  # the map grew under the readers
    for c in checkers:
        c.r.refresh()
        c.check()
        assert len(c.r) == n
        c.r.close()
    assert sum(c.reads for c in checkers) > 2 * COMMITS // len(checkers)
