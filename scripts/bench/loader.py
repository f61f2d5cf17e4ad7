#!/usr/bin/env python
"""Loader benchmark: samples/s through the real DataLoader against a numpy memmap baseline, same run.

What it measures, on one store of ``--n`` samples (default 1M z-scored 25x25 float32, 5 classes) and an
``.npy`` copy of exactly the same data:

* ``memmap``      the physical baseline: ``np.load(mmap_mode="r")`` fancy-indexed with random batches of
                  ``--batch`` indices in one process, warm cache; unsorted and sorted indices (sorted is
                  the fair one: lmdbstore sorts each batch too).  Measured at the start and at the end of the
                  run; the better of the two is the baseline.
* ``read_batch``  ``StoreReader.read_batch`` alone in one process, per shuffle mode.
* ``DataLoader``  the real path (``LmdbBatchDataset`` + ``make_loader`` + ``EpochBatchSampler``) for each
                  worker count (``--workers``, default 0,1,2,3) and shuffle mode (``random``, ``block`` with
                  ``block_buffer`` 1 and 4), persistent workers, after a warm-up epoch that is not timed.
* ``train``       ``lmdbstore.training.trainer.train`` on the store (CPU, random order, a few steps per epoch): the
                  trainer's own data-wait share, step time and samples/s, per worker count.

Rates are wall-clock samples/s; the best window of several is reported (the machine may be shared and
noisy) next to the mean.  Per-core ratios divide a rate by ``min(workers, cores)`` (0 workers = 1 core)
and compare it with the single-process memmap rate.  Single-process rows also give a CPU-time rate, which
other processes on the machine disturb much less.
Usage::

    python scripts/bench/loader.py                        # default run (a few minutes)
    python scripts/bench/loader.py --quick --out /tmp/bl  # seconds; a smoke test
    python scripts/bench/loader.py --store PATH --npy PATH.npy --workers 0,2   # reuse existing data

Outputs under ``--out`` (default ``./bench_loader_out``): ``bench_loader.md`` (the printed tables),
``bench_loader.csv`` (one row per measurement) and ``bench_loader.json`` (everything, with the machine).
The data goes to ``--workdir`` (default a temporary directory), removed at the end unless ``--keep``.
The measurements are in ``bench.loader_runs``, the rows, goals and report in ``bench.loader_report``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import WRITE_CHUNK, build_store, make_log
from bench.loader_report import Row, describe_machine, finish_rows, goal_summary, machine_info, render, write_outputs
from bench.loader_runs import (
    MODES,
    LoaderPlan,
    bench_loader,
    bench_read_batch,
    bench_train,
    mode_batches,
    random_batches,
)
from bench.machine import load_average, memmap_copy_rates
from lmdbstore.config import WriterConfig
from lmdbstore.ingestion.synth import SYNTH_CLASSES, SYNTH_SHAPE, synth_batches
from lmdbstore.store.reader import StoreReader

#: What ``--quick`` changes: a tiny store, small batches, few repeats (seconds, for smoke tests).
QUICK_DEFAULTS: dict[str, Any] = {
    "n": 20_000,
    "batch": 1024,
    "workers": "0,1",
    "rounds": 2,
    "sp_batches": 4,
    "warmup_batches": 2,
    "timed_batches": 6,
    "window": 3,
    "train_workers": "1",
    "train_steps": 2,
    "train_epochs": 1,
}


log = make_log("loader")


def parse_ints(text: str, name: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; raises ``ValueError`` naming ``name`` for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name} must be non-negative integers, got {text!r}")
    return values


def parse_modes(text: str) -> list[str]:
    """``"random,block4"`` -> the listed shuffle modes, checked against :data:`MODES`."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a comma-separated subset of {', '.join(MODES)}, got {text!r}")
    return modes


def sample_batches(n: int, seed: int, synth: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(x, y)`` chunks of the dataset: z-scored 25x25 float32 and int64 labels in 0..4.

    ``synth`` uses the built-in learnable dataset (``lmdbstore.ingestion.synth``, slower to generate); the default
    is per-sample z-scored Gaussian noise, which reads exactly the same and is generated ~10x faster.
    """
    if synth:
        yield from synth_batches(n, seed=seed, batch=WRITE_CHUNK)
        return
    rng = np.random.default_rng(seed)
    for lo in range(0, n, WRITE_CHUNK):
        b = min(WRITE_CHUNK, n - lo)
        x = rng.standard_normal((b, *SYNTH_SHAPE), dtype=np.float32)
        x -= x.mean(axis=(1, 2), keepdims=True)
        x /= x.std(axis=(1, 2), keepdims=True) + 1e-6
        yield x, rng.integers(0, len(SYNTH_CLASSES), b)


def copied_into(
    arr: np.ndarray, parts: Iterable[tuple[np.ndarray, np.ndarray]]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``parts`` as they are, each one's samples also written to the next rows of ``arr``."""
    pos = 0
    for x, y in parts:
        arr[pos : pos + len(x)] = x
        pos += len(x)
        yield x, y


def build_data(store: Path, npy: Path, n: int, seed: int, synth: bool) -> float:
    """Write the same ``n`` samples into a new store and an ``.npy`` file in one pass; return seconds.

    The store uses the default layout (``WriterConfig()``) but skips fsync: durability is not measured here.
    """
    t0 = time.perf_counter()
    arr = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(n, *SYNTH_SHAPE))
    build_store(store, copied_into(arr, sample_batches(n, seed, synth)), SYNTH_CLASSES, WriterConfig(sync=False))
    arr.flush()
    del arr
    return time.perf_counter() - t0


def export_npy(store: Path, npy: Path) -> None:
    """Copy every sample of an existing store into ``npy`` (the memmap baseline's file)."""
    with StoreReader(store) as r:
        arr = np.lib.format.open_memmap(npy, mode="w+", dtype=r.dtype, shape=(len(r), *r.shape))
        for lo, x, _ in r.iter_chunks():
            arr[lo : lo + len(x)] = x
        arr.flush()
        del arr


def warm_caches(store: Path, npy: Path) -> None:
    """Read both copies once, through their own readers, so every timing below is warm-cache."""
    mm = np.load(npy, mmap_mode="r")
    for lo in range(0, len(mm), WRITE_CHUNK):
        float(np.asarray(mm[lo : lo + WRITE_CHUNK]).sum())
    del mm
    with StoreReader(store) as r:
        for _ in r.iter_chunks():
            pass


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, checked (``--quick`` changes the defaults of the options left out); a bad value
    exits with status 2 and a message naming the option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="samples in the store (default 1M)")
    p.add_argument("--store", type=Path, help="reuse this store instead of building one")
    p.add_argument("--npy", type=Path, help="the .npy with the store's samples (default: exported from --store)")
    p.add_argument(
        "--synth", action="store_true", help="build the store from lmdbstore.ingestion.synth (slower) not noise"
    )
    p.add_argument("--workdir", type=Path, help="where data is written (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the data in --workdir")
    p.add_argument("--out", type=Path, default=Path("bench_loader_out"), help="results directory")
    p.add_argument("--batch", type=int, default=4096, help="samples per batch (default 4096)")
    p.add_argument("--workers", default="0,1,2,3", help="reader process counts (default 0,1,2,3)")
    p.add_argument("--modes", default=",".join(MODES), help=f"shuffle modes (default {','.join(MODES)})")
    p.add_argument("--rounds", type=int, default=3, help="repeats of each single-process measurement")
    p.add_argument("--sp-batches", type=int, default=24, help="batches per single-process round")
    p.add_argument("--warmup-batches", type=int, default=-1, help="loader warm-up batches (-1: a whole epoch)")
    p.add_argument("--timed-batches", type=int, default=48, help="timed loader batches per configuration")
    p.add_argument("--window", type=int, default=8, help="loader batches per timing window")
    p.add_argument("--prefetch", type=int, default=2, help="batches each reader works ahead (default 2)")
    p.add_argument(
        "--compare-dataloader",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time torch's own DataLoader workers over the same dataset and sampler (default: on)",
    )
    p.add_argument("--train-workers", default="1,2", help="worker counts for the trainer run ('' to skip)")
    p.add_argument("--train-steps", type=int, default=8, help="training steps per epoch")
    p.add_argument("--train-epochs", type=int, default=2, help="training epochs (the first one warms up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny run in seconds (smoke test): other defaults")
    if p.parse_args(argv).quick:  # --quick changes the defaults; options given explicitly still win
        p.set_defaults(**QUICK_DEFAULTS)
    args = p.parse_args(argv)
    for name in ("n", "batch", "rounds", "sp_batches", "timed_batches", "window", "prefetch", "train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    try:
        args.worker_list = parse_ints(args.workers, "--workers")
        args.mode_list = parse_modes(args.modes)
        args.train_list = parse_ints(args.train_workers, "--train-workers") if args.train_workers.strip() else []
    except ValueError as exc:
        p.error(str(exc))
    if args.npy is not None and args.store is None:
        p.error("--npy needs --store")
    return args


def prepare_data(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path, dict[str, Any]]:
    """Build (or find) the store and its ``.npy`` twin; returns their paths and facts about them."""
    facts: dict[str, Any] = {}
    if args.store is None:
        store, npy = workdir / "store", workdir / "samples.npy"
        log(f"building a store and an .npy of {args.n:,} samples in {workdir}")
        facts["build_seconds"] = build_data(store, npy, args.n, args.seed, args.synth)
        log(f"built in {facts['build_seconds']:.1f}s")
    else:
        store = args.store
        npy = args.npy or workdir / "samples.npy"
        if args.npy is None:
            log(f"exporting {store} to {npy} for the memmap baseline")
            export_npy(store, npy)
    with StoreReader(store) as r:
        args.n = len(r)
        facts["samples_per_value"] = r.meta.samples_per_value
        npy_shape = np.load(npy, mmap_mode="r").shape
        if npy_shape != (len(r), *r.shape):
            raise SystemExit(f"{npy} holds an array of shape {npy_shape}, not the samples of {store}")
    log("warming the page cache (one read of each copy)")
    warm_caches(store, npy)
    return store, npy, facts


def measure(args: argparse.Namespace, store: Path, npy: Path, spv: int) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every configured measurement: the memmap baseline (at the start and again at the end), then
    ``read_batch`` and the DataLoader per mode and worker count, then the trainer; rows and trainer rows."""
    batches = {m: mode_batches(m, args.n, spv, args.batch, args.sp_batches, args.seed) for m in args.mode_list}
    rand = random_batches(args.n, args.batch, args.sp_batches, args.seed)
    log("memmap baseline")
    mm_first = memmap_copy_rates(npy, rand, args.rounds)
    rows: list[Row] = []
    for mode in args.mode_list:
        log(f"read_batch, {mode}")
        res = bench_read_batch(store, batches[mode], args.rounds)
        rows.append(Row("read_batch", "StoreReader.read_batch (1 process)", mode, None, 1, **res))
    plan = LoaderPlan(args.batch, args.warmup_batches, args.timed_batches, args.window, args.prefetch, args.seed)
    for mode in args.mode_list:
        for w in args.worker_list:
            log(f"make_loader, {mode}, {w} reader(s)")
            res = bench_loader(store, mode, w, plan)
            rows.append(Row("loader", "make_loader (LmdbBatchDataset)", mode, w, 1, **res))
            if w > 0 and args.compare_dataloader:
                log(f"torch DataLoader workers, {mode}, {w} worker(s)")
                res = bench_loader(store, mode, w, plan, plain=True)
                rows.append(Row("loader", "torch DataLoader workers (LmdbBatchDataset)", mode, w, 1, **res))
    train_rows: list[dict[str, Any]] = []
    for w in args.train_list:
        log(f"trainer, {w} worker(s), {args.train_epochs} epoch(s) of {args.train_steps} steps")
        train_rows += bench_train(store, w, args.batch, args.train_steps, args.train_epochs, args.seed)
    log("memmap baseline again")
    mm_last = memmap_copy_rates(npy, rand, args.rounds)
    return memmap_rows(mm_first, mm_last) + rows, train_rows


def memmap_rows(first: dict[str, dict[str, Any]], last: dict[str, dict[str, Any]]) -> list[Row]:
    """The memmap rows, unsorted then sorted (the baseline): the better of the two runs of each, with the
    higher CPU rate and the windows of both."""
    out = []
    for variant in ("unsorted", "sorted"):
        a, b = first[variant], last[variant]
        best = a if a["rate"] >= b["rate"] else b
        merged = {**best, "cpu_rate": max(a["cpu_rate"], b["cpu_rate"]), "windows": a["windows"] + b["windows"]}
        label = f"memmap fancy-index, {variant} indices" + (" (baseline)" if variant == "sorted" else "")
        out.append(Row("memmap", label, "random", None, 1, **merged))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success (bad arguments exit with status 2 and a message)."""
    args = parse_args(argv)
    info = machine_info()
    log(describe_machine(info).replace("\n", "; "))
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lmdbstore-bench-loader-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        store, npy, facts = prepare_data(args, workdir)
        info.update(facts)
        rows, train_rows = measure(args, store, npy, facts["samples_per_value"])
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not args.keep:  # a given --workdir stays; what this run wrote into it goes
            if args.store is None:
                shutil.rmtree(workdir / "store", ignore_errors=True)
            if args.npy is None:
                (workdir / "samples.npy").unlink(missing_ok=True)
    baseline = rows[1]
    info["baseline"] = baseline.rate
    info["baseline_cpu"] = baseline.cpu_rate
    info["load_average_end"] = load_average()
    finish_rows(rows, baseline, info["usable_cores"])
    report = render(info, args, rows, train_rows)
    print()
    print(report, end="", flush=True)
    payload = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [asdict(r) for r in rows],
        "train": train_rows,
        "goals": goal_summary(rows, train_rows),
    }
    write_outputs(args.out, report, payload, rows)
    log(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
