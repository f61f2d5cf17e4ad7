"""The read measurements, one definition each, through the library's public API only: the disk's limits on a store's
data file, ``read_batch`` cold and warm, a numpy memmap of the same samples, epochs through ``make_loader``, and the
feed under every framework (``make_loader``, ``tf_dataset``, ``keras_dataset``) against one in-process reader.

Every rate is samples/s (a limit in bytes is divided by the store's sample bytes), wall clock.  A cold measurement
opens its store, then calls ``ctx.drop()`` (pages dropped after open); a warm one reads its batches once untimed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import machine
from .data import same_samples
from .spec import Ctx, Measure

#: Batches of a warm measurement (read once untimed, then timed pass after pass).
WARM_BATCHES = 32


# ============================================================================ timing: one definition each
def timed(items: Iterable[Any], seconds: float, consume: Callable[[Any], int]) -> float:
    """Samples/s of ``consume`` (which returns a count) over ``items`` until ``seconds`` have passed (at least two
    items) or the items run out."""
    n, t0 = 0, time.perf_counter()
    for k, item in enumerate(items):
        n += consume(item)
        if k >= 1 and time.perf_counter() - t0 >= seconds:
            break
    return n / max(time.perf_counter() - t0, 1e-9)


def passes(fn: Callable[[np.ndarray], Any], batches: list[np.ndarray], seconds: float) -> float:
    """Samples/s of ``fn`` over ``batches``, pass after pass for ``seconds``, after one untimed pass (warm)."""
    for b in batches:
        fn(b)

    def forever() -> Iterator[np.ndarray]:
        while True:
            yield from batches

    return timed(forever(), seconds, lambda b: (fn(b), len(b))[1])


def epochs(start: Callable[[], Iterable[Any]], seconds: float) -> float:
    """Samples/s of whole epochs of ``start()`` (batches ``(x, y)``), epoch starts included, until ``seconds``
    have passed (at least one epoch), after one untimed epoch (readers started and woken, pages cached)."""
    for _ in start():
        pass
    n, t0 = 0, time.perf_counter()
    while True:
        for _x, y in start():
            n += len(y)
        if time.perf_counter() - t0 >= seconds:
            return n / (time.perf_counter() - t0)


def first_then_rate(it: Iterator[Any], seconds: float) -> dict[str, float]:
    """The wait for the first batch ``(x, y)`` of ``it``, then samples/s of the following ones for ``seconds``."""
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    return {"first_batch_s": first, "rate": timed(it, seconds, lambda b: len(b[1]))}


# ============================================================================ batches
def sampler(n: int, batch: int, order: str, spv: int, seed: int) -> Any:
    """The public sampler of ``order`` (``random``, ``block`` with ``block_buffer`` 2) over ``n`` samples."""
    import lmdbstore

    shuffle = "block" if order == "block" else "random"
    return lmdbstore.EpochBatchSampler(np.arange(n), batch, shuffle=shuffle, samples_per_value=spv, seed=seed)


def warm_batches(n: int, batch: int, order: str, spv: int, seed: int) -> list[np.ndarray]:
    """:data:`WARM_BATCHES` batches: sorted random ones, block order, or contiguous ranges at random starts
    (``ranges``: what a memmap reads as slices)."""
    if order == "ranges":
        starts = np.random.default_rng(seed).integers(0, max(1, n - batch), WARM_BATCHES)
        return [np.arange(a, min(a + batch, n)) for a in starts.tolist()]
    out: list[np.ndarray] = []
    s = sampler(n, batch, order, spv, seed)
    while len(out) < WARM_BATCHES:
        out += [np.sort(b) for b in s]
    return out[:WARM_BATCHES]


def layout(path: Path) -> tuple[int, int, int, int]:
    """Samples, samples per value, sample bytes and value bytes (checksum included) of the store at ``path``."""
    import lmdbstore

    with lmdbstore.StoreReader(path) as r:
        m = r.meta
        return len(r), m.samples_per_value, m.sample_bytes, m.value_bytes + m.trailer_bytes


# ============================================================================ the disk's limits
def pread(what: str, inflight: int) -> Measure:
    """Random ``pread``\\s of one sample's (``what="sample"``) or one value's bytes at ``inflight``, on the store's
    data file, pages dropped: samples/s (a value read counts its samples)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        path = ctx.path("store")
        _n, spv, sb, vb = layout(path)
        nbytes, per = (sb, 1) if what == "sample" else (vb, spv)
        return {"rate": per * machine.pread_rate(path / "data.mdb", nbytes, inflight, ctx.seconds / 2, ctx.round)}

    return Measure(f"pread of one {what}, {inflight} in flight", fn)


def seq_read() -> Measure:
    """The sequential read of the store's data file (up to 2 GiB at a new offset each time, pages dropped): the
    bytes/s over the sample bytes."""

    def fn(ctx: Ctx) -> dict[str, float]:
        f = ctx.path("store") / "data.mdb"
        size = f.stat().st_size
        nbytes = min(size, ctx.pick(2 << 30, 64 << 20))
        offset = (ctx.round * 7919 << 20) % max(1, size - nbytes) // 4096 * 4096
        return {"rate": machine.seq_read_rate(f, nbytes, offset) / ctx.data.sample_bytes}

    return Measure("sequential read", fn)


def seq_write() -> Measure:
    """The sequential write of a probe file (an eighth of the store's bytes, 16 MiB to 4 GiB, fsynced): the
    bytes/s over the sample bytes."""

    def fn(ctx: Ctx) -> dict[str, float]:
        nbytes = min(4 << 30, max(16 << 20, ctx.data.samples * ctx.data.sample_bytes // 8))
        return {"rate": machine.seq_write_rate(ctx.scratch / "probe.bin", nbytes) / ctx.data.sample_bytes}

    return Measure("sequential write (fsync)", fn, uses=())


# ============================================================================ read_batch and the memmap
def read_batch(order: str, cold: bool, kind: str = "store") -> Measure:
    """``read_batch`` in one process: cold (pages dropped after open; the sampler's batches for ``ctx.seconds``)
    or warm (:func:`warm_batches` into one preallocated buffer) -- of the store, or of the set (``kind="set4"``)
    of the same samples through ``open_reader``."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        paths = ctx.stores(kind)
        spv = layout(paths[0])[1]
        reader = lmdbstore.open_reader(paths if kind == "set4" else paths[0])
        n = len(reader)
        try:
            if cold:
                ctx.drop()
                return {
                    "rate": timed(
                        sampler(n, ctx.batch, order, spv, ctx.round), ctx.seconds, lambda b: len(reader.read_batch(b))
                    )
                }
            batches = warm_batches(n, ctx.batch, order, spv, ctx.round)
            buf = np.empty((ctx.batch, *reader.shape), reader.dtype)
            if not same_samples(batches[0], reader.read_batch(batches[0])):
                raise RuntimeError(f"read_batch returned other samples than asked from {paths[0]}")
            return {"rate": passes(lambda b: reader.read_batch(b, out=buf[: len(b)]), batches, ctx.seconds)}
        finally:
            reader.close()

    where = "set of 4 stores" if kind == "set4" else "one store"
    return Measure(f"read_batch, {order}, {'cold' if cold else 'warm'}, {where}", fn, uses=(kind,))


def memmap(order: str) -> Measure:
    """The warm memmap of the same samples: ``np.take`` of :func:`warm_batches` into a preallocated buffer (random),
    or slices copied into it (``ranges``)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        mm = np.load(ctx.path("npy") / "x.npy", mmap_mode="r")
        buf = np.empty((ctx.batch, *mm.shape[1:]), mm.dtype)
        batches = warm_batches(len(mm), ctx.batch, order, 1, ctx.round)

        def take(b: np.ndarray) -> None:
            if order == "ranges":
                buf[: len(b)] = mm[int(b[0]) : int(b[-1]) + 1]
            else:
                np.take(mm, b, axis=0, out=buf[: len(b)])

        return {"rate": passes(take, batches, ctx.seconds)}

    how = "slices copied" if order == "ranges" else "np.take"
    return Measure(f"numpy memmap, {how} into a buffer (warm)", fn, uses=("npy",))


# ============================================================================ make_loader epochs
def loader_epoch(order: str, cold: bool, kind: str = "store", job: bool = False) -> Measure:
    """An epoch through ``make_loader(workers=2)`` in ``order``: the wait for its first batch and samples/s of the
    next ``ctx.seconds`` (or to the epoch's end); cold: pages dropped once the loader is made; ``job``: another
    job (a process spinning on one core) runs meanwhile."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        paths = [str(p) for p in ctx.stores(kind)]
        loader = lmdbstore.make_loader(
            paths if kind == "set4" else paths[0], batch_size=ctx.batch, workers=2, shuffle=order, seed=ctx.round
        )
        try:
            if cold:
                ctx.drop()
            with machine.Job() if job else contextlib.nullcontext():
                return first_then_rate(iter(loader), ctx.seconds)
        finally:
            loader.close()

    label = f"make_loader(workers=2), {order}, {'cold' if cold else 'warm'}"
    label += ", set of 4 stores" if kind == "set4" else ""
    return Measure(label + (", another job running" if job else ""), fn, uses=(kind,), warm=not cold)


# ============================================================================ the feed under every framework
def feed(path: str, how: str, batch: int) -> tuple[Callable[[], Iterable[Any]], Callable[[], None]]:
    """How one epoch of the training split starts (random order, 2 readers or one process), and how it closes."""
    import lmdbstore

    opts: dict[str, Any] = {"split": "train", "batch_size": batch, "workers": 2, "shuffle": "random"}
    if how == "make_loader":
        loader = lmdbstore.make_loader(path, **opts)
        return lambda: loader, loader.close
    if how in ("tf_dataset", "keras_dataset"):
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        ds = getattr(lmdbstore, how)(path, **opts)
        return lambda: ds, getattr(ds, "close", lambda: None)  # tf_dataset's readers stop when it is collected
    reader = lmdbstore.open_reader(path)
    labels = reader.labels()
    s = lmdbstore.EpochBatchSampler(lmdbstore.stratified_split(labels, 0.1, 0)[0], batch, shuffle="random")
    buf = np.empty((batch, *reader.shape), reader.dtype)

    def epoch() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for idx in s:
            yield reader.read_batch(idx, out=buf[: len(idx)]), labels[idx]

    return epoch, reader.close


def feed_epochs(how: str, batch: int) -> Measure:
    """Whole epochs of the training split, data only, warm, through ``how``: ``make_loader``, ``tf_dataset``,
    ``keras_dataset`` (2 readers each) or ``read_batch`` (one process, into one buffer)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        start, close = feed(str(ctx.path("store")), how, batch)
        try:
            return {"rate": epochs(start, ctx.seconds)}
        finally:
            close()
            del start, close
            gc.collect()  # the readers gone before the next measurement

    who = "read_batch(out=), one process" if how == "read_batch" else f"{how}(workers=2)"
    return Measure(f"{who}, batch {batch}", fn, warm=True)


# ============================================================================ sizes
def built(kind: str) -> Measure:
    """Samples/s of building artifact ``kind`` (in this run, or when ``--store-dir`` kept it)."""
    return Measure(
        f"building {kind}", lambda ctx: {"rate": ctx.data.samples / ctx.built[kind]}, uses=(kind,), once=True
    )


def disk_bytes(kind: str, name: str = "lmdbstore") -> Measure:
    """Bytes on disk (allocated blocks) per sample of artifact ``kind`` (``name``), or the raw sample bytes
    (``kind="raw"``)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        if kind == "raw":
            return {"bytes": float(ctx.data.sample_bytes)}
        return {"bytes": machine.size_on_disk(ctx.path(kind)) / ctx.data.samples}

    return Measure(
        "raw sample bytes" if kind == "raw" else f"{name} on disk", fn, uses=() if kind == "raw" else (kind,), once=True
    )


#: Samples of the one-file-per-sample format (a million files take too long to build).
NPY_FILES = 50_000
