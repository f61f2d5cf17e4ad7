"""Reads in flight that follow the disk (lmdbstore.store.inflight) and ``io_threads`` as a setting."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import StoreInfo

from lmdbstore.store.inflight import MAX_IO_THREADS, MIN_IO_THREADS, MIN_RUNS_PER_READ, InFlight
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.preads import DEFAULT_IO_THREADS
from lmdbstore.store.reader import StoreReader


def feed(f: InFlight, rate_at: dict[int, float], steps: int) -> list[int]:
    """Counts visited when the disk delivers ``rate_at[count]`` reads/s."""
    seen = []
    for _ in range(steps):
        reads = MIN_RUNS_PER_READ * f.count * 4
        f.observe(reads, reads / rate_at[f.count])
        seen.append(f.count)
    return seen


def test_a_fast_disk_gets_more_reads_in_flight() -> None:
    f = InFlight(DEFAULT_IO_THREADS)
    rates = {4: 10e3, 8: 20e3, 16: 40e3, 32: 60e3, 64: 80e3}  # NVMe: more in flight, more reads
    seen = feed(f, rates, 12)
    assert seen[:2] == [32, 64] and max(seen) == MAX_IO_THREADS
    assert seen.count(64) >= len(seen) // 2  # it settles at the top, checking the step below now and then


def test_a_slow_disk_is_not_flooded() -> None:
    f = InFlight(DEFAULT_IO_THREADS)
    rates = {4: 900.0, 8: 1000.0, 16: 1000.0, 32: 700.0, 64: 500.0}  # a disk that suffers from a deep queue
    seen = feed(f, rates, 12)
    assert seen[0] == 32 and max(seen[2:]) <= 32 and seen[-4:].count(64) == 0
    assert min(seen) >= MIN_IO_THREADS


def test_small_batches_and_an_explicit_count_change_nothing() -> None:
    f = InFlight(16)
    f.observe(MIN_RUNS_PER_READ * 16 - 1, 0.01)  # too few reads to tell a rate
    assert f.count == 16
    fixed = InFlight(8, fixed=True)
    feed(fixed, {8: 1e3}, 5)
    assert fixed.count == 8


def test_io_threads_is_a_setting(small_store: StoreInfo) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        StoreReader(small_store.path, io_threads=0)
    b = np.arange(0, 2000, 3)
    for threads, fixed, count in ((None, False, DEFAULT_IO_THREADS), (8, True, 8), (1, True, 1)):
        with StoreReader(small_store.path, io_threads=threads) as r:
            assert r.read_batch(b).tobytes() == small_store.x[b].tobytes()
            engine = r._handle().engine
            assert engine is not None and engine.inflight.fixed is fixed and engine.inflight.count == count
    with StoreSet([small_store.path], io_threads=4) as s:
        assert s.readers[0].io_threads == 4
