#!/usr/bin/env python
"""Keras and tf.data benchmark: samples/s of ``lmdbstore.tf_dataset`` and ``lmdbstore.keras_dataset``
against ``make_loader`` with the same number of workers, data only, warm, in the same run.

Contenders, each a whole epoch of the training split in random order, batch ``--batch``, ``--workers``
reader processes (or DataLoader workers), timed after one untimed warm-up epoch, in interleaved rounds
(one epoch of each per round; the machine may be shared), medians reported: the epoch's rate (start to
end), the steady rate (from its first batch to its last) and the epoch's start (from ``iter()`` to the
first batch; small epochs feel it):

* ``make_loader``       the PyTorch path (``LmdbBatchDataset`` + ``make_loader``): the baseline;
* ``tf_dataset``        iterated as tensors (``for x, y in ds``);
* ``keras_dataset``     the ``PyDataset`` iterated directly, and through Keras' own data adapter on the
                        TensorFlow backend (``PyDatasetAdapter.get_tf_dataset``: what ``model.fit`` reads;
                        Keras copies each batch into a tensor there);
* what a user writes today: ``tf.data.Dataset.from_generator`` over ``StoreReader.read_batch`` (one
  thread), and a 20-line ``PyDataset`` calling ``read_batch`` with Keras' own ``workers`` threads.

Usage::

    python scripts/bench/frameworks.py                      # 200k samples, workers 2 (a few minutes)
    python scripts/bench/frameworks.py --quick --out /tmp/bf
    python scripts/bench/frameworks.py --store demo_out/store --workers 2,4

Prints a Markdown table with the ratios to ``make_loader`` and the goals (>= 0.8x for the tf.data and
the PyDataset paths); writes ``bench_frameworks.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
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

from bench.common import Goal, fmt_ratio, human, make_log, markdown_table, ratio, write_json
from bench.machine import describe_machine, machine_info

log = make_log("frameworks")

#: Ratio to make_loader the tf.data and the PyDataset paths are to reach (issue 19).
GOAL = 0.8


def epoch_rates(make_iter: Callable[[], Iterable[Any]]) -> tuple[float, float, float]:
    """One whole epoch of ``make_iter()``: samples/s from start to end, samples/s from the first batch to the
    last, and seconds to the first batch."""
    n, t0, first, n_first = 0, time.perf_counter(), 0.0, 0
    for _x, y in make_iter():
        if not n:
            first, n_first = time.perf_counter(), len(y)
        n += len(y)
    end = time.perf_counter()
    return n / (end - t0), (n - n_first) / max(end - first, 1e-9), first - t0


def contenders(store: Path, batch: int, workers: int) -> dict[str, Callable[[], Iterable[Any]]]:
    """Name -> a callable that starts one epoch, for every contender at ``workers``."""
    import keras
    import numpy as np
    import tensorflow as tf

    import lmdbstore
    from lmdbstore.config import LoaderConfig

    out: dict[str, Callable[[], Iterable[Any]]] = {}
    reader = lmdbstore.open_reader(store)
    labels = reader.labels()
    train, _ = lmdbstore.stratified_split(labels, 0.1, 0)
    ds = lmdbstore.LmdbBatchDataset(store)
    sampler = lmdbstore.EpochBatchSampler(train, batch, shuffle="random")
    loader = lmdbstore.make_loader(ds, sampler, LoaderConfig(batch_size=batch, workers=workers, shuffle="random"))
    out["make_loader"] = lambda: loader
    tfds = lmdbstore.tf_dataset(store, split="train", batch_size=batch, workers=workers, shuffle="random")
    out["tf_dataset"] = lambda: tfds
    kds = lmdbstore.keras_dataset(store, split="train", batch_size=batch, workers=workers, shuffle="random")
    out["keras_dataset (direct)"] = lambda: kds
    try:
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        kds2 = lmdbstore.keras_dataset(store, split="train", batch_size=batch, workers=workers, shuffle="random")
        adapter = PyDatasetAdapter(kds2, shuffle=True)
        tf_of_adapter = adapter.get_tf_dataset()

        def through_keras() -> Iterable[Any]:
            adapter.on_epoch_begin()
            try:
                yield from tf_of_adapter
            finally:
                adapter.on_epoch_end()

        out["keras_dataset (Keras TF adapter)"] = through_keras
    except ImportError:
        log("Keras' PyDatasetAdapter not found: its row is left out")

    def batches() -> Iterable[Any]:
        perm = np.random.default_rng().permutation(train)
        for a in range(0, len(perm), batch):
            idx = np.sort(perm[a : a + batch])
            yield reader.read_batch(idx)[..., None], labels[idx].astype(np.int64)

    spec = (tf.TensorSpec((None, *reader.shape, 1), tf.float32), tf.TensorSpec((None,), tf.int64))
    naive_tf = tf.data.Dataset.from_generator(batches, output_signature=spec).prefetch(2)
    out["naive: from_generator(read_batch)"] = lambda: naive_tf

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

    out["naive: PyDataset(read_batch), Keras threads"] = naive_keras
    return out


def run(store: Path, batch: int, workers: int, rounds: int) -> list[dict[str, Any]]:
    """Every contender at ``workers``: one warm-up epoch, then ``rounds`` interleaved timed epochs."""
    makers = contenders(store, batch, workers)
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in makers}
    for name, make in makers.items():
        log(f"workers={workers}: warm-up epoch of {name}")
        epoch_rates(make)
    for r in range(rounds):
        for name, make in makers.items():
            runs[name].append(epoch_rates(make))
        log(f"workers={workers}: round {r + 1}/{rounds}")
    med = {name: [statistics.median(col) for col in zip(*v, strict=True)] for name, v in runs.items()}
    base, base_steady = med["make_loader"][0], med["make_loader"][1]
    return [
        {
            "workers": workers,
            "path": name,
            "rate": rate,
            "ratio": ratio(rate, base),
            "steady": steady,
            "steady_ratio": ratio(steady, base_steady),
            "start_ms": 1000 * start,
        }
        for name, (rate, steady, start) in med.items()
    ]


def build(path: Path, n: int, log_: Callable[[str], None]) -> None:
    """The built-in synthetic 5-class dataset of ``n`` samples, ingested at ``path``."""
    from lmdbstore.ingestion.pipeline import ingest_synthetic

    log_(f"building a store of {n:,} synthetic samples at {path}")
    ingest_synthetic(path, n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, help="an existing store (default: a new synthetic one)")
    p.add_argument("-n", type=int, default=200_000, help="samples of the synthetic store (default 200k)")
    p.add_argument("--workers", default="2", help="comma-separated worker counts (default 2)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5, help="timed epochs of each contender (default 5)")
    p.add_argument("--quick", action="store_true", help="20k samples, 2 rounds: a smoke test")
    p.add_argument("--out", type=Path, default=Path("bench_frameworks_out"))
    a = p.parse_args(argv)
    n, rounds = (20_000, 2) if a.quick else (a.n, a.rounds)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        store = a.store if a.store is not None else Path(tmp) / "store"
        if a.store is None:
            build(store, n, log)
        rows = [row for w in (int(v) for v in a.workers.split(",")) for row in run(store, a.batch, w, rounds)]
        info = machine_info(store)
    goals = [
        Goal(f"{r['path']} / make_loader (workers={r['workers']})", r["ratio"], GOAL)
        for r in rows
        if r["path"] in ("tf_dataset", "keras_dataset (direct)", "keras_dataset (Keras TF adapter)")
    ]
    lines = [
        f"machine: {describe_machine(info)}",
        "",
        *markdown_table(
            ["workers", "path", "epoch samples/s", "x make_loader", "steady samples/s", "x make_loader", "epoch start"],
            "|---:|---|---:|---:|---:|---:|---:|",
            (
                [
                    str(r["workers"]),
                    r["path"],
                    human(r["rate"]),
                    fmt_ratio(r["ratio"]),
                    human(r["steady"]),
                    fmt_ratio(r["steady_ratio"]),
                    f"{r['start_ms']:.0f} ms",
                ]
                for r in rows
            ),
        ),
        "",
        "goals (same run, data only, warm):",
        *(g.line() for g in goals),
    ]
    text = "\n".join(lines)
    print(text)
    (a.out / "bench_frameworks.md").write_text(text + "\n")
    write_json(a.out / "bench_frameworks.json", {"machine": info, "rows": rows, "batch": a.batch, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
