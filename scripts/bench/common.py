"""What every benchmark shares: progress lines, numbers and tables, data and stores, timing, goals.

Not a benchmark itself: the benchmarks beside it (``storage``, ``scaling``, ``loader``, ``ooc``, ``parallel``,
``peers``) import it as ``bench.common``; what they know of the machine (its facts, its page cache, its own
limits measured in the same run) is in ``bench.machine``.  Each benchmark runs as
``python scripts/bench/<name>.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import lmdbstore
from lmdbstore.config import WriterConfig

#: Samples per writer append, per write of generated data and per sequential read chunk.
WRITE_CHUNK = 65536


# ============================================================================ output
def make_log(name: str) -> Callable[[str], None]:
    """A progress logger for benchmark ``name``: ``[name HH:MM:SS] msg`` on stderr (results go to stdout)."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def human(v: float | None, unit: str = "") -> str:
    """Compact number: 1.23M, 456k, 7.8 (``-`` for missing)."""
    if v is None or v != v:
        return "-"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}{unit}"
    return f"{v:.3g}{unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is zero."""
    return a / b if a is not None and b else None


def fmt_ratio(v: float | None) -> str:
    """A ratio for a table cell: three significant digits, whole numbers from 100 (``-`` for missing)."""
    return "-" if v is None else (f"{v:.3g}" if v < 100 else f"{v:.0f}")


def add_data_options(p: argparse.ArgumentParser, outputs: str) -> None:
    """The options of a benchmark on generated data: sample shape, classes, batch, seed, where the results
    (``outputs``, e.g. ``"CSV, JSON"``) and the data go, and whether the data is kept."""
    p.add_argument("--shape", default="25,25", help="sample shape (float32), default 25,25")
    p.add_argument("--classes", type=int, default=5, help="number of classes (default 5)")
    p.add_argument("--batch", type=int, default=4096, help="batch size (default 4096)")
    p.add_argument("--out", default="bench_out", help=f"output directory ({outputs})")
    p.add_argument("--data-dir", default=None, help="where the data files go (default OUT/data)")
    p.add_argument("--keep", action="store_true", help="keep the data files")
    p.add_argument("--seed", type=int, default=0)


def add_store_options(ap: argparse.ArgumentParser, samples: int, keep: bool = True) -> None:
    """``--samples`` (default ``samples``), ``--store``, ``--workdir``, ``--keep`` (unless ``keep`` is false) and
    ``--batch``: the options of the benchmarks that make a store or read an existing one."""
    ap.add_argument("--samples", type=int, default=samples, help="store size when creating one")
    ap.add_argument("--store", type=Path, help="use this existing store (read only)")
    ap.add_argument("--workdir", type=Path, help="where to create the store (default: a temporary directory)")
    if keep:
        ap.add_argument("--keep", action="store_true", help="keep the created store")
    ap.add_argument("--batch", type=int, default=4096)


@contextlib.contextmanager
def output_dirs(out: str | Path, data_dir: str | Path | None, keep: bool) -> Iterator[tuple[Path, Path]]:
    """The results directory ``out`` and the data directory (``data_dir``, default ``out/data``), both made;
    after a run that did not raise, the data directory goes if it is empty, unless ``keep``."""
    results = Path(out)
    results.mkdir(parents=True, exist_ok=True)
    data = Path(data_dir) if data_dir else results / "data"
    data.mkdir(parents=True, exist_ok=True)
    yield results, data
    if not keep:
        with contextlib.suppress(OSError):
            data.rmdir()  # only if empty


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """One row per record, the first record's keys as the header (an empty file for no records)."""
    if not records:
        path.write_text("")
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    """``data`` as JSON; values JSON cannot hold (paths, numpy scalars) written as their ``str``."""
    path.write_text(json.dumps(data, indent=indent, default=str))


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table: ``align`` is the separator line (e.g. ``"|---|---:|"``)."""
    return [f"| {' | '.join(header)} |", align, *(f"| {' | '.join(cells)} |" for cells in rows)]


# ============================================================================ data and stores
def make_data(n: int, shape: tuple[int, ...], n_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` standard-normal float32 samples (z-scored like the reference data) and uint8 labels."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, *shape), np.float32)
    for a in range(0, n, WRITE_CHUNK):
        b = min(a + WRITE_CHUNK, n)
        rng.standard_normal(dtype=np.float32, out=x[a:b])
    y = rng.integers(0, n_classes, n).astype(np.uint8)
    return x, y


def random_batches(n: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of distinct random indices (successive permutations of ``range(n)``)."""
    rng = np.random.default_rng([seed, 0xBA7C])
    out: list[np.ndarray] = []
    perm = rng.permutation(n)
    pos = 0
    while len(out) < count:
        if pos + batch > n:
            if pos == 0:  # fewer samples than one batch: batches of everything
                out.append(perm.copy())
                continue
            perm, pos = rng.permutation(n), 0
        out.append(perm[pos : pos + batch])
        pos += batch
    return out


def build_store(
    path: Path,
    parts: Iterable[tuple[np.ndarray, np.ndarray]],
    classes: Sequence[str],
    config: WriterConfig | None = None,
) -> None:
    """Ingest ``(x, y)`` parts into a new store at ``path`` through ``open_writer`` in appends of at most
    :data:`WRITE_CHUNK` samples; the first part gives the sample shape and dtype (no parts: no store).
    ``config`` defaults to ``WriterConfig()`` (fsync at every commit: an ingest rate includes durability).
    An error from a part aborts what is pending and releases the store."""
    it = iter(parts)
    first = next(it, None)
    if first is None:
        return
    shape, dtype = first[0].shape[1:], first[0].dtype
    with lmdbstore.open_writer(path, shape=shape, dtype=dtype, classes=classes, config=config) as writer:
        for x, y in itertools.chain([first], it):
            for a in range(0, len(x), WRITE_CHUNK):
                writer.append(x[a : a + WRITE_CHUNK], y[a : a + WRITE_CHUNK])


# ============================================================================ timing
def window_rate(sizes: Sequence[int], seconds: Sequence[float], window: int = 1) -> float:
    """Median samples/s over consecutive windows of ``window`` batches.

    The machine may be shared: a median over short windows ignores the bursts when another process
    takes the CPU or the disk, where one long average would fold them in.
    """
    if not sizes:
        return float("nan")
    window = max(1, min(window, len(sizes)))
    rates = [
        sum(sizes[i : i + window]) / max(sum(seconds[i : i + window]), 1e-9)
        for i in range(0, len(sizes) - window + 1, window)
    ]
    return float(np.median(rates))


def time_reads(fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], min_time: float) -> float:
    """Samples/s of ``fn`` over ``batches`` (median per batch) after one untimed warm-up batch.

    Stops once ``min_time`` seconds and at least two batches are timed, or when the batches run out
    (``min_time=math.inf`` times them all).
    """
    fn(batches[0])
    sizes: list[int] = []
    secs: list[float] = []
    t_start = time.perf_counter()
    for k, b in enumerate(batches[1:] if len(batches) > 1 else batches):
        t0 = time.perf_counter()
        fn(b)
        t1 = time.perf_counter()
        sizes.append(len(b))
        secs.append(t1 - t0)
        if t1 - t_start >= min_time and k >= 1:
            break
    return window_rate(sizes, secs)


def time_loader(loader: Iterable[Any], warmup: int, min_time: float) -> float:
    """Samples/s through a DataLoader, timed after the first ``warmup`` batches (worker start-up).

    Batches arrive in bursts when several workers finish together, so the rate is the median over
    windows of ``2 * warmup`` batches (``warmup`` is the worker count).
    """
    it: Iterator[Any] = iter(loader)
    sizes: list[int] = []
    secs: list[float] = []
    try:
        for _ in range(warmup):
            next(it)
        t_start = last = time.perf_counter()
        for k, (x, _y) in enumerate(it):
            now = time.perf_counter()
            sizes.append(len(x))
            secs.append(now - last)
            last = now
            if now - t_start >= min_time and k >= 3:
                break
    finally:
        del it  # shuts the workers down
    return window_rate(sizes, secs, window=2 * max(1, warmup))


def timed(batches: Iterable[Any], seconds: float, consume: Callable[[Any], int]) -> float:
    """Samples/s over ``batches`` until ``seconds`` have passed (at least one batch); ``consume`` handles
    one batch and returns its sample count."""
    n, t0 = 0, time.perf_counter()
    for b in batches:
        n += consume(b)
        if time.perf_counter() - t0 >= seconds:
            break
    return n / (time.perf_counter() - t0)


def time_rounds(fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], rounds: int) -> dict[str, Any]:
    """Run ``fn`` over all ``batches`` ``rounds`` times; wall and CPU samples/s (best and overall)."""
    samples = sum(len(b) for b in batches)
    walls, cpus = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for b in batches:
            fn(b)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "rate": samples / min(walls),
        "mean_rate": samples * rounds / sum(walls),
        "cpu_rate": samples / max(min(cpus), 1e-9),
        "windows": [samples / w for w in walls],
    }


# ============================================================================ goals
@dataclass(frozen=True)
class Goal:
    """A target for one ratio measured in the run: met, not met, or ``None`` when the ratio is missing."""

    name: str
    value: float | None
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def line(self) -> str:
        """``name  value  (goal >= target)  MET`` as printed under a result table."""
        cmp = ">=" if self.higher_is_better else "<="
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[self.met]
        val = "-" if self.value is None else f"{self.value:.2f}"
        return f"  {self.name:<58} {val:>8}  (goal {cmp} {self.target:g})  {verdict}"
