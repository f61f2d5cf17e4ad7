"""The benchmarks' samples and the artifacts the driver builds from them: a store, the same samples as a set of four
stores of a quarter each, and as a numpy ``.npy`` file (the memmap baseline).  Other formats are in :mod:`.formats`.

Every artifact holds the same samples: :func:`produce` (standard-normal noise seeded per task, element ``[0, 0]`` the
index modulo 1,024, exact in float16; labels ``i * 7919 mod 5``), so a read can be checked for landing on the right
sample and the formats compare like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from .spec import Data

CLASSES = ["a", "b", "c", "d", "e"]
#: Samples a producer task makes, and a chunk of the other builders.
CHUNK = 1 << 16


def produce(task: tuple[int, int, str, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``lo..hi-1``: ``task = (lo, hi, dtype, shape)``.  Module level: ``write_parallel``'s spawned workers
    import it."""
    lo, hi, dtype, shape = task
    x = np.random.default_rng([7, lo]).standard_normal((hi - lo, *shape), dtype=np.float32)
    i = np.arange(lo, hi, dtype=np.int64)
    x.reshape(hi - lo, -1)[:, 0] = i % 1024
    return x.astype(dtype, copy=False), (i * 7919 % len(CLASSES)).astype(np.uint8)


def chunks(data: Data, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(first index, x, y)`` of samples ``lo..hi-1`` in chunks of :data:`CHUNK`."""
    hi = data.samples if hi is None else hi
    for a in range(lo, hi, CHUNK):
        b = min(a + CHUNK, hi)
        yield (a, *produce((a, b, data.dtype, data.shape)))


def write_store(path: Path, data: Data, lo: int = 0, hi: int | None = None) -> None:
    """Samples ``lo..hi-1`` into a new store at ``path`` through ``write_parallel`` (two producers from 1M samples
    on, the default writer: an fsync every commit)."""
    import lmdbstore

    hi = data.samples if hi is None else hi
    tasks = [(a, min(a + CHUNK, hi), data.dtype, data.shape) for a in range(lo, hi, CHUNK)]
    lmdbstore.write_parallel(
        path,
        produce,
        tasks,
        workers=2 if hi - lo >= 1_000_000 else 0,
        shape=data.shape,
        dtype=data.dtype,
        classes=CLASSES,
        name="bench",
        progress=False,
    )


def write_set(path: Path, data: Data) -> None:
    """The same samples as four stores of a quarter each, ``path/part0..part3``."""
    path.mkdir()
    for k in range(4):
        write_store(path / f"part{k}", data, k * data.samples // 4, (k + 1) * data.samples // 4)


def write_npy(path: Path, data: Data) -> None:
    """The same samples as ``path/x.npy``."""
    path.mkdir()
    mm = np.lib.format.open_memmap(path / "x.npy", "w+", data.dtype, (data.samples, *data.shape))
    for a, x, _y in chunks(data):
        mm[a : a + len(x)] = x
    mm.flush()
    del mm


#: kind -> (build(path, data), the bytes it takes on disk at most)
BUILDERS: dict[str, tuple[Callable[[Path, Data], None], Callable[[Data], int]]] = {
    "store": (write_store, lambda d: int(1.05 * d.samples * d.sample_bytes)),
    "set4": (write_set, lambda d: int(1.06 * d.samples * d.sample_bytes)),
    "npy": (write_npy, lambda d: d.samples * d.sample_bytes),
}


def same_samples(idx: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``x`` are samples ``idx`` of the benchmark data (element ``[0, 0]`` is the index modulo 1,024)."""
    return bool(np.array_equal(x.reshape(len(x), -1)[:, 0].astype(np.int64), np.asarray(idx) % 1024))
