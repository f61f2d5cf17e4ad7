#!/usr/bin/env python
"""The feed under every framework: samples/s of ``make_loader``, ``lmdbstore.tf_dataset`` and
``lmdbstore.keras_dataset`` with the same number of reader processes, against one process reading with
``StoreReader.read_batch(out=)``, data only, warm, in the same run, swept over batch sizes and store sizes
(issue 33: ``make_loader(workers=2)`` >= 1.5x one in-process reader at batch 4096 and >= 1.0x at 256, and
>= 0.95x ``keras_dataset``/``tf_dataset`` iterated directly, on a 1M-sample store; issue 28: the Keras and
tf.data paths >= 0.8x ``make_loader`` at batch 256, 1024 and 4096 on stores of 30k, 100k and 1M samples).

For every store size (a synthetic store built in a temporary directory and deleted after its rows; the 1M
store is 2.5 GB) and every batch size, the contenders read the training split in random order with
``--workers`` reader processes:

* ``read_batch(out=), one process``  the sampler's batches read by ``StoreReader.read_batch`` into one
                        reused array in this process: what the readers must beat;
* ``make_loader``       the PyTorch path (``LmdbBatchDataset`` + ``make_loader``): the baseline of the ratios;
* ``tf_dataset``        iterated as tensors (``for x, y in ds``);
* ``keras_dataset``     the ``PyDataset`` iterated directly, and through Keras' own data adapter on the
                        TensorFlow backend (``PyDatasetAdapter.get_tf_dataset``: what ``model.fit`` reads);
* ``tf_dataset (Keras TF adapter)``: the ``tf.data.Dataset`` through the adapter ``model.fit`` makes of one on
  the TensorFlow backend (``TFDatasetAdapter``): on that backend, the way past the ``PyDataset`` adapter's cost;
* ``Keras TF adapter, no reading``: the same adapter over a ``PyDataset`` that hands out one batch it holds,
  as many times as the dataset has batches -- what Keras' adapter (``from_generator`` and a prefetch) costs
  by itself: the most any ``PyDataset`` can deliver through it;
* with ``--naive``, what a user writes without lmdbstore's feed: ``tf.data.Dataset.from_generator`` over
  ``StoreReader.read_batch`` (one thread) and a 20-line ``PyDataset`` with Keras' own ``workers`` threads.

The readers of ``keras_dataset`` and ``tf_dataset`` stay between epochs and stop after a few idle seconds
(``lmdbstore.feed.idle``); the interleaved rounds leave each contender idle while the others run, as
epochs back to back do not, so this benchmark lets readers wait a minute.  After one untimed warm-up epoch
of each, ``--rounds`` interleaved rounds (one measurement of each contender
per round; the machine may be shared) time whole epochs, as many as fill ``--seconds`` (a 30k-sample epoch
is tens of milliseconds), epoch starts included.  Reported: the median samples/s and its spread (lowest to
highest round), the ratio to ``make_loader`` (the median of the rounds' ratios: each round's contenders
ran side by side), the median epoch start (``iter()`` to the first batch), and the CPU seconds per million
samples of the process and its workers with its inverse ratio to ``make_loader``'s: on a machine that
others load, how much of the 2 cores each path needs says more than its share of them does (a path that
needs less CPU reads faster once the cores are its own, unless it waits for something else).

Usage::

    python scripts/bench/frameworks.py                              # the sweep (about 10 minutes)
    python scripts/bench/frameworks.py --sizes 30k,100k --batches 1024
    python scripts/bench/frameworks.py --store demo_out/store --batches 4096
    python scripts/bench/frameworks.py --quick --out /tmp/bf         # smoke test (a 20k store)

Prints Markdown tables and the goals; writes ``bench_frameworks.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file

from bench.common import Goal, fmt_ratio, human, make_log, markdown_table, write_json
from bench.machine import describe_machine, load_average, machine_info

log = make_log("frameworks")

#: Ratio to make_loader the tf.data and the Keras paths are to reach (issues 19 and 28).
GOAL = 0.8
#: The in-process reader, the baseline of issue 33's goals.
INPROC = "read_batch(out=), one process"
#: make_loader / the in-process reader, by batch size, on the 1M store (issue 33).
INPROC_GOALS = {4096: 1.5, 256: 1.0}
#: make_loader / keras_dataset and tf_dataset iterated directly (issue 33: one mechanism, one speed).
SAME_SPEED = 0.95
#: The rows the goal is for.
GOAL_PATHS = (
    "tf_dataset",
    "keras_dataset (direct)",
    "keras_dataset (Keras TF adapter)",
    "tf_dataset (Keras TF adapter)",
)
SIZES = "30k,100k,1M"
BATCHES = "256,1024,4096"

Maker = Callable[[], Iterable[Any]]


def parse_size(text: str) -> int:
    """``"30k"`` -> 30000, ``"1M"`` -> 1000000, ``"5000"`` -> 5000."""
    text = text.strip()
    scale = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and every process under it that still runs
    (reader processes, also through the forkserver): ``/proc``, Linux; 0 elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[tuple[int, float]]] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(p), (int(fields[11]) + int(fields[12])) / tick))
    total, todo = time.process_time(), [os.getpid()]
    while todo:
        for pid, cpu in children.get(todo.pop(), []):
            total += cpu
            todo.append(pid)
    return total


def epochs_for(make_iter: Maker, seconds: float) -> tuple[float, float, float]:
    """Whole epochs of ``make_iter()`` until ``seconds`` have passed (at least one): samples/s over them,
    starts included, the median seconds from ``iter()`` to an epoch's first batch, and the CPU seconds per
    million samples of this process and its workers (a measure a busy machine disturbs less)."""
    n, starts, t0, cpu0 = 0, [], time.perf_counter(), tree_cpu_seconds()
    while True:
        t_epoch = time.perf_counter()
        first = True
        for _x, y in make_iter():
            if first:
                starts.append(time.perf_counter() - t_epoch)
                first = False
            n += len(y)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n / elapsed, statistics.median(starts), 1e6 * (tree_cpu_seconds() - cpu0) / n


def contenders(
    store: Path, batch: int, workers: int, naive: bool, direct: bool = False
) -> tuple[dict[str, Maker], list[Any]]:
    """Name -> a callable that starts one epoch, for every contender (``direct``: the paths iterated directly
    only, no Keras adapter: their tf.data pipelines keep threads of TensorFlow's busy beside the others); and what
    to close afterwards."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    import lmdbstore
    from lmdbstore.config import LoaderConfig

    out: dict[str, Maker] = {}
    labels = lmdbstore.open_reader(store).labels()
    train, _ = lmdbstore.stratified_split(labels, 0.1, 0)
    out[INPROC] = in_process(store, train, batch)
    sampler = lmdbstore.EpochBatchSampler(train, batch, shuffle="random")
    cfg = LoaderConfig(batch_size=batch, workers=workers, shuffle="random")
    loader = lmdbstore.make_loader(lmdbstore.LmdbBatchDataset(store), sampler, cfg)
    out["make_loader"] = lambda: loader
    opts: dict[str, Any] = {"split": "train", "batch_size": batch, "workers": workers, "shuffle": "random"}
    tfds = lmdbstore.tf_dataset(store, **opts)
    out["tf_dataset"] = lambda: tfds
    kds = lmdbstore.keras_dataset(store, **opts)
    out["keras_dataset (direct)"] = lambda: kds
    if direct:
        return out, [kds]
    kds2 = lmdbstore.keras_dataset(store, **opts)
    adapter = PyDatasetAdapter(kds2, shuffle=True)  # what model.fit makes of it on the TensorFlow backend
    through_adapter = adapter.get_tf_dataset()

    def through_keras() -> Iterable[Any]:
        adapter.on_epoch_begin()
        try:
            yield from through_adapter
        finally:
            adapter.on_epoch_end()

    out["keras_dataset (Keras TF adapter)"] = through_keras
    tfds2 = lmdbstore.tf_dataset(store, **opts)
    tf_adapter = TFDatasetAdapter(tfds2)  # what model.fit makes of a tf.data.Dataset on the TensorFlow backend
    out["tf_dataset (Keras TF adapter)"] = tf_adapter.get_tf_dataset
    out["Keras TF adapter, no reading"] = adapter_ceiling(kds2, PyDatasetAdapter)
    if naive:
        out.update(naive_contenders(store, train, batch, workers))
    return out, [kds, kds2]


def in_process(store: Path, train: Any, batch: int) -> Maker:
    """One process reading the same random batches with ``read_batch(out=)`` into one reused array."""
    import numpy as np

    import lmdbstore

    reader = lmdbstore.open_reader(store)
    labels = reader.labels()
    sampler = lmdbstore.EpochBatchSampler(train, batch, shuffle="random")
    buf = np.empty((batch, *reader.shape), reader.dtype)

    def epoch() -> Iterable[Any]:
        for idx in sampler:
            x = buf[: len(idx)]
            reader.read_batch(idx, out=x)
            yield x, labels[idx].astype(np.int64)

    return epoch


def adapter_ceiling(like: Any, adapter_cls: Any) -> Maker:
    """Keras' adapter over a ``PyDataset`` that hands out one batch of ``like`` without reading anything."""
    import keras

    x, y = (a.copy() for a in like.feed.peek(0))

    class Held(keras.utils.PyDataset):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()

        def __len__(self) -> int:
            return len(like)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            return x, y

    adapter = adapter_cls(Held(), shuffle=True)
    ds = adapter.get_tf_dataset()

    def epoch() -> Iterable[Any]:
        adapter.on_epoch_begin()
        try:
            yield from ds
        finally:
            adapter.on_epoch_end()

    return epoch


def naive_contenders(store: Path, train: Any, batch: int, workers: int) -> dict[str, Maker]:
    """What a user writes without the feed: ``from_generator`` over ``read_batch``, and a ``PyDataset``
    calling ``read_batch`` with Keras' own threads."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    import lmdbstore

    reader = lmdbstore.open_reader(store)
    labels = reader.labels()

    def batches() -> Iterable[Any]:
        perm = np.random.default_rng().permutation(train)
        for a in range(0, len(perm), batch):
            idx = np.sort(perm[a : a + batch])
            yield reader.read_batch(idx)[..., None], labels[idx].astype(np.int64)

    spec = (tf.TensorSpec((None, *reader.shape, 1), tf.float32), tf.TensorSpec((None,), tf.int64))
    naive_tf = tf.data.Dataset.from_generator(batches, output_signature=spec).prefetch(2)

    class Naive(keras.utils.PyDataset):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(workers=workers, use_multiprocessing=False)
            self.order = np.random.default_rng().permutation(train)

        def __len__(self) -> int:
            return -(-len(self.order) // batch)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            idx = np.sort(self.order[i * batch : (i + 1) * batch])
            return reader.read_batch(idx)[..., None], labels[idx].astype(np.int64)

    naive_py = PyDatasetAdapter(Naive(), shuffle=True)

    def naive_keras() -> Iterable[Any]:
        naive_py.on_epoch_begin()
        try:
            yield from naive_py.get_tf_dataset()
        finally:
            naive_py.on_epoch_end()

    return {
        "naive: from_generator(read_batch)": lambda: naive_tf,
        "naive: PyDataset(read_batch), Keras threads": naive_keras,
    }


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_cell(store: Path, size: int, batch: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every contender on ``store`` at ``batch``: a warm-up epoch, then interleaved timed rounds."""
    makers, to_close = contenders(store, batch, a.workers, a.naive, a.direct)
    rates: dict[str, list[float]] = {name: [] for name in makers}
    starts: dict[str, list[float]] = {name: [] for name in makers}
    ratios: dict[str, list[float]] = {name: [] for name in makers}
    cpus: dict[str, list[float]] = {name: [] for name in makers}
    vs_inproc: list[float] = []
    for make in makers.values():
        epochs_for(make, 0.0)
    for r in range(a.rounds):
        for name, make in makers.items():
            rate, start, cpu = epochs_for(make, a.seconds)
            rates[name].append(rate)
            starts[name].append(start)
            cpus[name].append(cpu)
        for name in makers:
            ratios[name].append(rates[name][-1] / rates["make_loader"][-1])
        vs_inproc.append(rates["make_loader"][-1] / rates[INPROC][-1])
        log(f"{human(size)} samples, batch {batch}: round {r + 1}/{a.rounds}")
    for ds in to_close:
        ds.close()
    del makers, to_close
    gc.collect()  # the loader's workers and the tf_dataset's readers go with their objects
    rows = []
    for name in rates:
        rate, lo, hi = spread(rates[name])
        q, q_lo, q_hi = spread(ratios[name])
        rows.append(
            {
                "size": size, "batch": batch, "workers": a.workers, "path": name,
                "rate": rate, "rate_min": lo, "rate_max": hi,
                "ratio": q, "ratio_min": q_lo, "ratio_max": q_hi,
                "start_ms": 1000 * statistics.median(starts[name]),
                "cpu_s_per_M": statistics.median(cpus[name]),
                "cpu_ratio": statistics.median(cpus["make_loader"]) / max(statistics.median(cpus[name]), 1e-9),
            }
        )  # fmt: skip
    q, q_lo, q_hi = spread(vs_inproc)
    for r in rows:
        if r["path"] == "make_loader":
            r.update(inproc_ratio=q, inproc_ratio_min=q_lo, inproc_ratio_max=q_hi)
    return rows


def build(path: Path, n: int) -> None:
    """The built-in synthetic 5-class dataset of ``n`` samples, ingested at ``path``."""
    from lmdbstore.ingestion.pipeline import ingest_synthetic

    log(f"building a store of {n:,} synthetic samples at {path}")
    ingest_synthetic(path, n)


def report(rows: list[dict[str, Any]], info: dict[str, Any], loads: tuple[str, str], a: argparse.Namespace) -> str:
    goals = [
        Goal(f"{r['path']} / make_loader ({human(r['size'])}, batch {r['batch']})", r["ratio"], GOAL)
        for r in rows
        if r["path"] in GOAL_PATHS
    ]
    big = max(r["size"] for r in rows)
    inproc = {(r["size"], r["batch"]): r["rate"] for r in rows if r["path"] == INPROC}
    for r in rows:
        if r["size"] != big:
            continue
        if r["path"] == "make_loader" and r["batch"] in INPROC_GOALS:
            goals.append(Goal(f"make_loader / one in-process reader ({human(big)}, batch {r['batch']})",
                              r["inproc_ratio"], INPROC_GOALS[r["batch"]]))  # fmt: skip
        if r["path"] in ("tf_dataset", "keras_dataset (direct)"):
            goals.append(Goal(f"make_loader / {r['path']} ({human(big)}, batch {r['batch']})", 1 / r["ratio"],
                              SAME_SPEED))  # fmt: skip
    table = markdown_table(
        ["store", "batch", "path", "samples/s", "spread", "x make_loader", "spread", "x one process",
         "epoch start", "CPU s / M samples", "x make_loader (CPU)"],
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        (
            [
                human(r["size"]), str(r["batch"]), r["path"], human(r["rate"]),
                f"{human(r['rate_min'])}-{human(r['rate_max'])}", fmt_ratio(r["ratio"]),
                f"{fmt_ratio(r['ratio_min'])}-{fmt_ratio(r['ratio_max'])}", fmt_ratio(r["rate"] / inproc[r["size"], r["batch"]]),
                f"{r['start_ms']:.1f} ms",
                f"{r['cpu_s_per_M']:.2f}", fmt_ratio(r["cpu_ratio"]),
            ]
            for r in rows
        ),
    )  # fmt: skip
    return "\n".join(
        [
            f"machine: {describe_machine(info)}",
            f"load average (1/5/15 min) at the start: {loads[0]}; at the end: {loads[1]}",
            f"workers {a.workers}, {a.rounds} interleaved rounds of >= {a.seconds:g} s of whole epochs per "
            "contender, medians (spread: lowest-highest round)",
            "",
            *table,
            "",
            "goals (same run, data only, warm):",
            *(g.line() for g in goals),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=SIZES, help=f"store sizes to build (default {SIZES})")
    p.add_argument("--store", type=Path, help="an existing store instead (--sizes ignored)")
    p.add_argument("--batches", default=BATCHES, help=f"batch sizes (default {BATCHES})")
    p.add_argument("--workers", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (default 3)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds of whole epochs per measurement (default 1)")
    p.add_argument("--naive", action="store_true", help="also time what a user writes without the feed")
    p.add_argument(
        "--direct", action="store_true", help="only the paths iterated directly (issue 33's table): no Keras adapter"
    )
    p.add_argument("--tmp", type=Path, help="where to build the stores (default: a temporary directory in --out)")
    p.add_argument("--quick", action="store_true", help="a 20k store, batch 4096, 1 short round: a smoke test")
    p.add_argument("--out", type=Path, default=Path("bench_frameworks_out"))
    a = p.parse_args(argv)
    from lmdbstore.feed import idle

    idle.IDLE_MIN_SECONDS = 60.0  # readers wait through the other contenders' turns (module docstring)
    if a.quick:
        a.sizes, a.batches, a.rounds, a.seconds = "20k", "4096", 1, 0.2
    batches = [int(v) for v in a.batches.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    loads0 = load_average()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=a.tmp or a.out) as tmp:
        if a.store is not None:
            import lmdbstore

            stores = [(a.store, len(lmdbstore.open_reader(a.store)))]
        else:
            stores = [(Path(tmp) / f"store-{s}", parse_size(s)) for s in a.sizes.split(",")]
        for store, size in stores:
            if a.store is None:
                build(store, size)
            for batch in batches:
                rows += run_cell(store, size, batch, a)
            if a.store is None:
                shutil.rmtree(store)  # the 1M store is 2.5 GB
        info = machine_info(Path(tmp))
    text = report(rows, info, (loads0, load_average()), a)
    print(text)
    (a.out / "bench_frameworks.md").write_text(text + "\n")
    write_json(
        a.out / "bench_frameworks.json", {"machine": info, "rows": rows, "rounds": a.rounds, "seconds": a.seconds}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
