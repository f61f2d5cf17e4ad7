#!/usr/bin/env python
"""Side-by-side storage benchmark: lmdbstore against the usual ways of storing many small samples.

The same synthetic dataset (default 1M samples of 25x25 float32, 5 classes) is written in each format
and read back the way a training loop reads it: random batches of 4096.  Formats (``bench.formats`` and
``bench.other_formats``):

* ``memmap``       one ``.npy`` file written by ``np.save`` and read through ``np.load(mmap_mode="r")``:
                   the raw sequential write rate and the physical in-cache read baseline.
* ``lmdbstore``    this library (``open_writer`` / ``StoreReader.read_batch``), random and block order.
* ``lmdb_naive``   one LMDB key per sample holding ``pickle.dumps((x, y))``, read with one ``txn.get`` per
                   sample: how most tutorials do it (the baseline only; lmdbstore never pickles).
* ``h5py_contig``  HDF5 contiguous dataset; per-sample reads (``dset[i]``) and sorted fancy-index batches.
* ``h5py_chunked`` HDF5 chunked dataset (16 samples per chunk, close to lmdbstore's packing), same reads.
* ``sqlite``       one BLOB per row (default page size); per-row SELECTs and one ``IN (...)`` query per batch.
* ``npy_files``    a directory with one ``.npy`` file per sample, at a smaller size (default 50k).

Measured for each: ingest samples/s (including the final fsync), bytes on disk (allocated blocks) per
sample against the raw 2,500 bytes, warm random-batch read samples/s in one process and through a
DataLoader with 2 workers, and cold-cache reads after ``posix_fadvise(DONTNEED)`` on the format's files.
Ratios are against numpy memmap and HDF5 contiguous measured in the same run; the goals are checked on them.
How lmdbstore scales with store size is ``scripts/bench/scaling.py``.

Usage::

    python scripts/bench/storage.py                      # full run (a few minutes), results in ./bench_out
    python scripts/bench/storage.py --quick --out /tmp/b  # seconds; a smoke test
    python scripts/bench/storage.py --n 200000 --formats memmap,lmdbstore,h5py_contig

Outputs under ``--out``: ``bench_results.csv``, ``bench_results.json`` and ``bench_read_throughput.png``
(when matplotlib is installed).  Data files go to ``--data-dir`` (default ``OUT/data``) and are deleted at
the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import (
    add_data_options,
    human,
    make_data,
    make_log,
    output_dirs,
    random_batches,
    time_loader,
    time_reads,
    write_csv,
    write_json,
)
from bench.formats import BuildStats, Format, LmdbstoreFormat
from bench.machine import describe_machine, machine_info, time_cold, warm_page_cache
from bench.other_formats import FORMAT_ORDER, FORMATS, make_format
from bench.storage_report import Row, add_ratios, evaluate_goals, plot, render_report, row_record
from lmdbstore.loader.samplers import block_order

log = make_log("storage")


def block_batches(n: int, spv: int, batch: int, block_buffer: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches in lmdbstore's block order (``samplers.block_order``), epoch after epoch."""
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < count:
        order = block_order(np.arange(n), spv, batch, block_buffer, np.random.default_rng([seed, epoch]))
        out.extend(order[i : i + batch] for i in range(0, n, batch))
        epoch += 1
    return out[:count]


@dataclass(frozen=True)
class Settings:
    """What one run measures: sizes, batch, worker count and how long each measurement runs."""

    n: int
    npy_n: int
    shape: tuple[int, ...]
    n_classes: int
    batch: int
    workers: int
    min_time: float
    cold_batches: int
    cold_max_time: float
    seed: int
    cold: bool


def measure_format(fmt: Format, x: np.ndarray, y: np.ndarray, s: Settings) -> tuple[list[Row], BuildStats]:
    """Build one format and measure every (read method, order) it offers: all warm reads first, then
    the cold-cache reads (so the page cache is filled once)."""
    log(f"{fmt.name}: building {len(x):,} samples")
    stats = fmt.build(x, y)
    raw = len(x) * x[0].nbytes
    log(f"{fmt.name}: built in {stats.seconds:.1f}s ({human(stats.n / stats.seconds)} samples/s)")
    runs: list[tuple[Row, Callable[[np.ndarray], Any], list[np.ndarray]]] = []
    for order in fmt.orders:
        warm, cold = batches_for(fmt, order, s)
        for mode in fmt.modes:
            row = Row(fmt.name, fmt.title, mode, order, stats.n, note=fmt.note)
            row.ingest_s, row.ingest_sps = stats.seconds, stats.n / stats.seconds
            row.disk_bytes, row.disk_per_sample = stats.disk_bytes, stats.disk_bytes / stats.n
            row.disk_vs_raw = stats.disk_bytes / raw
            if stats.used_bytes is not None:
                row.used_per_sample = stats.used_bytes / stats.n
            warm_s = warm_page_cache(fmt.files())
            if warm_s:
                log(f"{fmt.name}: pre-read files into the page cache in {warm_s:.1f}s")

            fn: Callable[[np.ndarray], Any] = functools.partial(fmt.read_xy, mode=mode)
            row.read_1p = time_reads(fn, warm, s.min_time)
            if s.workers:
                row.read_2w = time_loader(
                    fmt.loader(warm, mode, order, s.workers), warmup=s.workers, min_time=s.min_time * 1.5
                )
            fmt.close()
            log(
                f"{fmt.name} [{mode}, {order}]: 1 proc {human(row.read_1p)}/s, {s.workers} workers {human(row.read_2w)}/s"
            )
            runs.append((row, fn, cold))
    if s.cold:
        for row, fn, cold in runs:
            row.cold_1p, row.cold_resident_before, row.cold_resident_after = time_cold(fmt, fn, cold, s.cold_max_time)
            fmt.close()
            log(f"{fmt.name} [{row.mode}, {row.order}]: cold {human(row.cold_1p)}/s")
    return [r for r, _, _ in runs], stats


def batches_for(fmt: Format, order: str, s: Settings) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Warm and cold batches (distinct seeds) in ``order``: random, or lmdbstore's block order."""
    n_batches = 400
    if order == "block":
        assert isinstance(fmt, LmdbstoreFormat)
        spv = fmt.spv()
        fmt.close()
        warm = block_batches(fmt.n, spv, s.batch, fmt.block_buffer, n_batches, s.seed)
        cold = block_batches(fmt.n, spv, s.batch, fmt.block_buffer, s.cold_batches, s.seed + 7)
        return warm, cold
    return random_batches(fmt.n, s.batch, n_batches, s.seed), random_batches(fmt.n, s.batch, s.cold_batches, s.seed + 7)


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--quick`` changes the defaults of the options left out)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="samples per format (default 1,000,000; --quick 20,000)")
    p.add_argument("--npy-n", type=int, default=None, help="samples for per-sample .npy files (default 50,000)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2; 0 skips)")
    p.add_argument("--formats", default=",".join(FORMAT_ORDER), help="comma-separated formats (default all)")
    p.add_argument("--min-time", type=float, default=None, help="seconds per warm measurement (default 1.5)")
    p.add_argument("--cold-batches", type=int, default=None, help="batches per cold-cache measurement (default 2)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache measurement")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    add_data_options(p, "CSV, JSON, PNG")
    p.add_argument("--quick", action="store_true", help="tiny sizes and short timings (seconds)")
    return p


def resolve(args: argparse.Namespace) -> tuple[Settings, list[str]]:
    """Settings and formats from the arguments (``--quick`` changes the defaults); ValueError names a bad one."""
    q = args.quick
    n = args.n if args.n is not None else (20_000 if q else 1_000_000)
    npy_n = args.npy_n if args.npy_n is not None else min(n, 5_000 if q else 50_000)
    shape = tuple(int(t) for t in args.shape.split(","))
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--formats: unknown format {f!r}; choose from {', '.join(FORMATS)}")
    formats = [f for f in FORMAT_ORDER if f in formats]
    if n < 1 or npy_n < 1:
        raise ValueError("--n and --npy-n must be positive")
    if args.batch < 1:
        raise ValueError("--batch must be positive")
    s = Settings(
        n=n,
        npy_n=min(npy_n, n),
        shape=shape,
        n_classes=args.classes,
        batch=args.batch,
        workers=args.workers,
        min_time=args.min_time if args.min_time is not None else (0.2 if q else 1.5),
        cold_batches=args.cold_batches if args.cold_batches is not None else (1 if q else 2),
        cold_max_time=2.0 if q else 5.0,
        seed=args.seed,
        cold=not args.no_cold,
    )
    return s, formats


def dataset_line(s: Settings) -> str:
    """``N samples of HxW float32, K classes, batch B``: the dataset, as the header and the plot name it."""
    return f"{s.n:,} samples of {'x'.join(map(str, s.shape))} float32, {s.n_classes} classes, batch {s.batch}"


def measure_formats(
    formats: Sequence[str], x: np.ndarray, y: np.ndarray, s: Settings, data: Path, keep: bool
) -> tuple[list[Row], dict[str, Any]]:
    """Build and measure each format in turn (skipping one the disk cannot hold); the rows and each
    format's build facts.  The files go unless ``keep`` (the many small ones of ``npy_files`` last, in the
    background)."""
    rows: list[Row] = []
    builds: dict[str, Any] = {}
    fmts: list[Format] = []
    try:
        for name in formats:
            fmt = make_format(name, data)
            fmts.append(fmt)
            n_f = s.npy_n if name == "npy_files" else s.n
            need = int(n_f * x[0].nbytes * 2.0) + (1 << 30)
            if shutil.disk_usage(data).free < need:
                print(f"NOTE: skipped {name}: needs ~{need / 2**30:.1f} GiB free")
                continue
            f_rows, stats = measure_format(fmt, x[:n_f], y[:n_f], s)
            if name == "npy_files" and n_f < s.n:
                for r in f_rows:
                    r.note += f"; at {n_f:,} samples (one file per sample is too slow to build at {s.n:,})"
            rows.extend(f_rows)
            builds[name] = asdict(stats)
            if isinstance(fmt, LmdbstoreFormat):
                builds[name]["env_stats"] = _jsonable(fmt.env_stats())
            if not keep and name != "npy_files":  # its many files are deleted last, in the background
                fmt.remove()
    finally:
        if not keep:
            for fmt in fmts:
                fmt.remove()
    add_ratios(rows)
    return rows, builds


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns everything that was written to the JSON file.  A bad option value raises
    ``ValueError`` naming it."""
    args = build_parser().parse_args(argv)
    s, formats = resolve(args)
    with output_dirs(args.out, args.data_dir, args.keep) as (out, data):
        return run(s, formats, out, data, args)


def run(s: Settings, formats: Sequence[str], out: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Describe the machine, measure every format with data in ``data``, print the report and write the
    results (CSV, JSON, plot) to ``out``."""
    t_start = time.perf_counter()
    info = machine_info(data)
    print(describe_machine(info))
    print(f"Dataset: {dataset_line(s)}; per-sample .npy files at {s.npy_n:,} samples\n", flush=True)
    log("generating data")
    x, y = make_data(s.n, s.shape, s.n_classes, s.seed)
    rows, builds = measure_formats(formats, x, y, s, data, args.keep)
    goals = evaluate_goals(rows)
    elapsed = time.perf_counter() - t_start
    print(render_report(rows, goals, s.workers, s.shape, s.batch, elapsed))
    csv_path = out / "bench_results.csv"
    write_csv(csv_path, [row_record(r) for r in rows])
    png = (
        None
        if args.no_plot or not rows
        else plot(rows, out / "bench_read_throughput.png", s.workers, s.batch, dataset_line(s))
    )
    result = {
        "machine": info,
        "settings": asdict(s),
        "rows": [row_record(r) for r in rows],
        "builds": builds,
        "goals": [{**asdict(g), "met": g.met} for g in goals],
        "elapsed_s": elapsed,
        "csv": str(csv_path),
        "png": str(png) if png else None,
    }
    write_json(out / "bench_results.json", result)
    print(f"\nWrote {csv_path}, {out / 'bench_results.json'}" + (f", {png}" if png else ""))
    return result


def _jsonable(d: Any) -> Any:
    """``d`` with every dict key a string (LMDB's statistics are keyed by bytes)."""
    if isinstance(d, dict):
        return {str(k): _jsonable(v) for k, v in d.items()}
    return d


if __name__ == "__main__":
    main()
