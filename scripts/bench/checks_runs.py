"""The measurements of ``scripts/bench/checks.py``: read rates with the safety checks on and off, in one run.

The checks (issue 18) are the snapshot rule before and after every read (``Snapshot.protected``, a 152-byte
``pread`` of a meta page for a lock-free reader, and since issue 25 a ``pread`` of the metadata record's
fingerprint for every reader), each value's overflow-page header at its first read in a process (the run is then
read from the header on, in one read), and (optional) the checksum of values read whole.  Issue 25 added the map
guard: a read lease on the data file around each batch's copies from the map (``MapGuard.hold``); without a lease
(a writer holds the file open, another user's file) copies from the map go through ``process_vm_readv``.  "Off" is obtained here by patching the rule out of a running reader (:func:`checks_off`) or marking
every header checked; the library has no switch to turn them off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import make_log
from bench.ooc_runs import drop_cache, samplers, warm_memmap
from lmdbstore.store.mapguard import MapGuard
from lmdbstore.store.positions import check_headers
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.snapshot import Snapshot

log = make_log("checks")


@contextlib.contextmanager
def no_lease() -> Iterator[None]:
    """Readers take no read lease for the block: their copies from the map go through the kernel, as when a
    writer holds the data file open."""
    saved = MapGuard._take
    MapGuard._take = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        MapGuard._take = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def checks_off(guard: bool = False) -> Iterator[None]:
    """Patch the snapshot rule (``guard``) out, for the block."""
    saved = Snapshot.protected
    if guard:
        Snapshot.protected = lambda *a, **k: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        Snapshot.protected = saved  # type: ignore[method-assign]


def cpu_rate(read: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], rounds: int = 3) -> float:
    """Best samples per CPU second over ``rounds`` passes (after one warm-up pass): what other processes on
    a shared machine disturb least."""
    for b in batches:
        read(b)
    best = 0.0
    for _ in range(rounds):
        t0 = time.process_time()
        for b in batches:
            read(b)
        best = max(best, sum(len(b) for b in batches) / max(time.process_time() - t0, 1e-9))
    return best


def warm(path: Path, n: int, args: Any, workdir: Path) -> dict[str, float]:
    """Warm ``read_batch`` rates, random and block order, with every check, without the snapshot rule, with
    whole-value checksums, against a numpy memmap of the same samples (sorted batches)."""
    m = min(n, args.warm_samples)
    rng = np.random.default_rng(args.seed)
    orders = {
        "random": [rng.integers(0, m, args.batch) for _ in range(args.batches)],
        "block": samplers(path, m, args.batch, None, args.seed, None)["block"].batches()[: args.batches],
    }
    reader, crc = StoreReader(path), StoreReader(path, check_whole_values=True)
    npy = workdir / "warm.npy"
    mm = warm_memmap(reader, m, npy)
    out: dict[str, float] = {}
    for name, bs in orders.items():
        out[f"{name} checks on"] = cpu_rate(reader.read_batch, bs)
        with checks_off(guard=True):
            out[f"{name} snapshot rule off"] = cpu_rate(reader.read_batch, bs)
        with no_lease():
            out[f"{name} no lease (kernel copy)"] = cpu_rate(reader.read_batch, bs)
        out[f"{name} + whole-value crc"] = cpu_rate(crc.read_batch, bs)
        out[f"{name} memmap"] = cpu_rate(lambda b: mm[np.sort(b)], bs)
        log(f"  warm {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in out.items() if k.startswith(name)))
    reader.close()
    crc.close()
    npy.unlink()  # the map stays valid until collected
    return out


def _cold(path: Path, batches: Sequence[np.ndarray], kw: dict[str, Any], off: dict[str, bool]) -> float:
    """Samples/s (wall) of ``read_batch`` over ``batches`` right after the page cache was dropped (the
    position table built before the drop; values' headers unchecked unless checked before)."""
    drop_cache(path)
    r = StoreReader(path, **kw)
    r.read_path  # noqa: B018  # build the table
    if off.get("headers") and r._table is not None:
        r._table.checked[:] = True  # as if every header had been checked: no header reads
    drop_cache(path)
    with checks_off(guard=off.get("guard", False)):
        t0 = time.perf_counter()
        for b in batches:
            r.read_batch(b)
        dt = time.perf_counter() - t0
    r.close()
    return sum(len(b) for b in batches) / dt


def cold(path: Path, n: int, args: Any) -> dict[str, float]:
    """Cold ``read_batch`` rates: random order on values read for the first time (headers checked then) with
    every check, without the header check, without the snapshot rule; block order with and without
    whole-value checksums.  Each is the median of ``args.repeats`` runs."""
    rng = np.random.default_rng(args.seed + 1)
    rand = [rng.integers(0, n, args.batch) for _ in range(args.cold_batches)]
    block = samplers(path, n, args.batch, None, args.seed, None)["block"].batches()[: args.cold_batches]
    runs = {
        "random checks on": (rand, {}, {}),
        "random header check off": (rand, {}, {"headers": True}),
        "random snapshot rule off": (rand, {}, {"guard": True}),
        "block checks on": (block, {}, {}),
        "block + whole-value crc": (block, {"check_whole_values": True}, {}),
    }
    out: dict[str, float] = {}
    for name, (bs, kw, off) in runs.items():
        out[name] = float(np.median([_cold(path, bs, kw, off) for _ in range(args.repeats)]))
        log(f"  cold {name}: {out[name]:,.0f} samples/s")
    return out


def costs(path: Path, args: Any) -> dict[str, float]:
    """What each check costs on its own: the snapshot rule per call (lock-free and registered, fingerprint
    included), the map guard per batch (file-size check, lease taken and released), the fingerprint's ``pread``,
    the table build, and all overflow headers checked at build instead of lazily (cold)."""
    out: dict[str, float] = {}
    for lock in (False, True):
        r = StoreReader(path, lock=lock)
        h = r._handle()
        t0 = time.perf_counter()
        for _ in range(20000):
            h.protected()
        out[f"snapshot rule us ({'registered' if lock else 'lock-free'})"] = (time.perf_counter() - t0) / 20000 * 1e6
        r.close()
    r = StoreReader(path)
    h = r._handle()
    t0 = time.perf_counter()
    for _ in range(20000):
        h.check_size()
    out["file-size check and lease us (map guard per batch)"] = (time.perf_counter() - t0) / 20000 * 1e6
    t0 = time.perf_counter()
    for _ in range(20000):
        h.snapshot.same_file(h.fd)
    out["record fingerprint check us (one pread)"] = (time.perf_counter() - t0) / 20000 * 1e6
    r.close()
    drop_cache(path)
    r = StoreReader(path)
    t0 = time.perf_counter()
    r.read_path  # noqa: B018
    out["table build s (cold)"] = time.perf_counter() - t0
    table, h = r._table, r._handle()
    assert table is not None and h.engine is not None
    table.checked[:] = False
    drop_cache(path)
    t0 = time.perf_counter()
    check_headers(table, np.arange(len(table.offsets)), h.engine, path)
    dt = time.perf_counter() - t0
    out["all headers at build us per value (cold)"] = dt / max(len(table.offsets), 1) * 1e6
    r.close()
    for k, v in out.items():
        log(f"  {k}: {v:,.3f}")
    return out
