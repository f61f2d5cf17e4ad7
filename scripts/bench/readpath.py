#!/usr/bin/env python
"""Read-path benchmark (issues 21 and 27): every read path against its limit, measured in the same run.

Every row is measured ``--rounds`` times (default 3) in turn with its baseline; the table gives median rates and
the median (min-max) of the per-round ratios (a cold round's ratio: its rate over the mean of the limits taken
just before and just after it).

Rows (samples/s; ratios against baselines measured in this run):

* **cold** ``read_batch`` in random, block and window order (the store's pages dropped before each) against
  the disk's limits taken *before and after* each measurement on the same file: random ``pread``\\s of one
  sample's bytes at 1, 16 and 64 in flight, and of one value's bytes (x samples per value) at 16;
* **warm** (all cached) random against numpy memmap ``mm[np.sort(idx)]`` and block against memmap contiguous
  slices ``np.array(mm[a:b])``, CPU time;
* **cached batches sent to the I/O threads** (goal 0), warm, with ``--buffers`` batches held alive and one
  busy-loop process per core;
* **DataLoader** with 2 workers, warm, per core used, against the in-process ``read_batch`` rate of the same
  order (goal >= 0.5x).

The trainer's data wait on a store larger than RAM is ``ooc.py --samples 12000000 --train-steps N`` (it builds
the 28 GiB store and removes it afterwards).

Usage::

    python scripts/bench/readpath.py            # 400k samples (1 GB) in a temporary directory, a few minutes
    python scripts/bench/readpath.py --quick    # 40k samples, short timings: a smoke test
    python scripts/bench/readpath.py --store PATH

Prints a Markdown table and writes ``bench_readpath.md`` and ``bench_readpath.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import add_store_options, make_log, markdown_table, timed, write_json
from bench.machine import pread_rate
from bench.ooc_runs import drop_cache, make_store, samplers, warm_memmap
from lmdbstore.store.reader import StoreReader

log = make_log("readpath")
ORDERS = ("random", "block", "window")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_options(ap, 400_000, keep=False)
    ap.add_argument("--seconds", type=float, default=6.0, help="per measurement")
    ap.add_argument("--window-mb", type=int, default=256)
    ap.add_argument("--buffers", type=int, default=64, help="batches held alive in the cached-batches row")
    ap.add_argument(
        "--warm-samples", type=int, default=400_000, help="the first samples the warm and DataLoader rows read"
    )
    ap.add_argument("--quick", action="store_true", help="40k samples, short timings: a smoke test")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every row (median and spread)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_readpath_out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.seconds, args.window_mb, args.buffers, args.rounds = 40_000, 0.4, 16, 16, 1
    if args.batch < 1 or args.seconds <= 0 or args.rounds < 1:
        ap.error("--batch, --seconds and --rounds must be positive")
    return args


def limits(path: Path, sb: int, vb: int, spv: int, seconds: float, seed: int) -> dict[str, float]:
    """The disk's limits in samples/s on the store's data file (pages dropped first)."""
    data = path / "data.mdb"
    out = {f"sample x{q}": pread_rate(data, sb, q, seconds, seed + q) for q in (1, 16, 64)}
    out["value x16"] = pread_rate(data, vb, 16, seconds, seed) * spv
    return out


def engine_stats(r: StoreReader) -> dict[str, int]:
    h = r._handle()
    return dict(h.engine.stats) if h.engine is not None else {}


def cold(path: Path, n: int, args: argparse.Namespace, sb: int, vb: int, spv: int) -> dict[str, Any]:
    """Cold ``read_batch`` per order, with the disk limits before and after each, ``--rounds`` times in turn:
    per order the median rate, first batch and limits, and every round's figures (``rounds``)."""
    per: dict[str, list[dict[str, Any]]] = {mode: [] for mode in ORDERS}
    for k in range(args.rounds):
        for mode in ORDERS:
            per[mode].append(cold_once(path, n, args, sb, vb, spv, mode))
            log(f"  cold {mode}, round {k + 1}/{args.rounds}: {per[mode][-1]['rate']:,.0f} samples/s")
    out: dict[str, Any] = {}
    for mode, runs in per.items():
        out[mode] = {
            "rate": statistics.median(r["rate"] for r in runs),
            "first batch s": statistics.median(r["first batch s"] for r in runs),
            "first": runs[0]["first"],
            "before": {q: statistics.median(r["before"][q] for r in runs) for q in runs[0]["before"]},
            "after": {q: statistics.median(r["after"][q] for r in runs) for q in runs[0]["after"]},
            "rounds": runs,
        }
    return out


def cold_once(path: Path, n: int, args: argparse.Namespace, sb: int, vb: int, spv: int, mode: str) -> dict[str, Any]:
    """One cold measurement of ``mode`` between the disk's limits before and after it."""
    before = limits(path, sb, vb, spv, args.seconds / 4, args.seed)
    drop_cache(path)
    r = StoreReader(path)
    s = samplers(path, n, args.batch, args.window_mb, args.seed, r.prefetch)[mode]
    r.read_path  # noqa: B018  # the table (built once per snapshot) is not what is measured
    it = iter(s)
    t0 = time.perf_counter()
    first = len(r.read_batch(next(it)))
    first_s = time.perf_counter() - t0
    rate = timed(it, args.seconds, lambda b, r=r: len(r.read_batch(b)))  # type: ignore[misc]
    r.close()
    after = limits(path, sb, vb, spv, args.seconds / 4, args.seed + 1)
    return {"rate": rate, "first batch s": first_s, "first": first, "before": before, "after": after}


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def warm(path: Path, n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Warm random and block against a memmap of the same samples; then the cached batches the reader sent to
    its I/O threads with many buffers alive and every core busy."""
    r = StoreReader(path)
    npy = work / "warm.npy"
    mm = warm_memmap(r, n, npy)
    rng = np.random.default_rng(args.seed)
    rand = [np.sort(rng.integers(0, n, args.batch)) for _ in range(64)]
    starts = rng.integers(0, max(n - args.batch, 1), 64).tolist()
    blocks = [np.arange(a, min(a + args.batch, n)) for a in starts]
    out: dict[str, Any] = {}
    for name, bs in (("random", rand), ("block", blocks)):
        ours, theirs = [], []
        for _ in range(args.rounds):  # in turn: per round one of each
            t0 = time.process_time()
            for b in bs:
                r.read_batch(b)
            ours.append(sum(map(len, bs)) / (time.process_time() - t0))
            t0 = time.process_time()
            for b in bs:  # the memmap's own best: a fancy index of sorted indices, a slice copy of a range
                mm[b] if name == "random" else np.array(mm[int(b[0]) : int(b[-1]) + 1])
            theirs.append(sum(map(len, bs)) / (time.process_time() - t0))
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        out[name] = {"rate": statistics.median(ours), "memmap": statistics.median(theirs), "ratios": ratios}
        log(f"  warm {name}: {statistics.median(ours):,.0f} vs memmap {statistics.median(theirs):,.0f} samples/s")
    out["loaded"] = loaded(r, rand, blocks, args.buffers)
    r.close()
    del mm
    npy.unlink()
    return out


def loaded(r: StoreReader, rand: list[np.ndarray], blocks: list[np.ndarray], buffers: int) -> dict[str, int]:
    """Cached batches sent to the I/O threads (all are cached) with ``buffers`` batches alive, cores busy."""
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spin = [ctx.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 1)]
    for p in spin:
        p.start()
    try:
        before = engine_stats(r)
        held: list[np.ndarray] = []
        for b in [*rand, *blocks] * 2:
            held.append(r.read_batch(b))
            del held[:-buffers]
        after = engine_stats(r)
    finally:
        stop.set()
        for p in spin:
            p.join(10)
    return {k: after[k] - before.get(k, 0) for k in after}


def loader_rows(path: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm: DataLoader with 2 workers against ``read_batch`` in this process, random and block."""
    from lmdbstore.config import LoaderConfig
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader

    out: dict[str, Any] = {}
    cores = min(2, os.cpu_count() or 1)
    for mode in ("random", "block"):
        s = samplers(path, n, args.batch, args.window_mb, args.seed, None)[mode]
        dl = make_loader(LmdbBatchDataset(path), s, LoaderConfig(batch_size=args.batch, workers=2))
        rates, inprocs = [], []
        with StoreReader(path) as r:
            for b in s.batches(0)[:4]:
                r.read_batch(b)
            for _ in range(args.rounds):  # in turn: this process, then the loader (its workers kept)
                inprocs.append(timed(iter(s.batches(0) * 4), args.seconds, lambda b, r=r: len(r.read_batch(b))))  # type: ignore[misc]
                it = iter(dl)
                next(it)  # workers started (the first round) or woken
                rates.append(timed(it, args.seconds, lambda b: len(b[1])))
                del it
        del dl
        rate, inproc = statistics.median(rates), statistics.median(inprocs)
        ratios = [a / cores / b for a, b in zip(rates, inprocs, strict=True)]
        out[mode] = {"loader": rate, "per core": rate / cores, "in process": inproc, "ratios": ratios}
        log(f"  DataLoader x2 {mode}: {rate:,.0f} samples/s ({rate / cores:,.0f} per core) vs {inproc:,.0f}")
    return out


def render(res: dict[str, Any]) -> str:
    """The Markdown report: one row per measure, its baseline(s), the ratio and the goal."""
    rows: list[list[str]] = []
    for mode, c in res["cold"].items():
        if mode == "random":
            for q in (16, 64):
                lim = [c["before"][f"sample x{q}"], c["after"][f"sample x{q}"]]
                rows.append(
                    [
                        f"cold random vs pread 2.5 KB x{q}",
                        f"{c['rate']:,.0f}",
                        _pair(lim),
                        _spread(c, f"sample x{q}"),
                        ">= 0.8x",
                    ]
                )
        else:
            lim = [c["before"]["value x16"], c["after"]["value x16"]]
            rows.append(
                [
                    f"cold {mode} vs pread value x16 (x spv)",
                    f"{c['rate']:,.0f}",
                    _pair(lim),
                    _spread(c, "value x16"),
                    ">= 0.8x",
                ]
            )
            firsts = [r["first batch s"] for r in c["rounds"]]
            rows.append(
                [
                    f"cold {mode}: first batch",
                    f"{c['first batch s']:.2f} s ({min(firsts):.2f}-{max(firsts):.2f})",
                    "",
                    "",
                    "< 0.3 s",
                ]
            )
    w = res["warm"]
    rows.append(
        [
            "warm random vs memmap mm[sort(idx)]",
            f"{w['random']['rate']:,.0f}",
            f"{w['random']['memmap']:,.0f}",
            _med(w["random"]["ratios"]),
            ">= 0.8x",
        ]
    )
    rows.append(
        [
            "warm block vs memmap contiguous slices",
            f"{w['block']['rate']:,.0f}",
            f"{w['block']['memmap']:,.0f}",
            _med(w["block"]["ratios"]),
            ">= 0.9x",
        ]
    )
    ld = w["loaded"]
    rows.append(
        [
            "cached batches sent to I/O threads (loaded)",
            f"{ld.get('pread_batches', 0)} of {ld.get('batches', 0)}",
            "",
            "",
            "0",
        ]
    )
    for mode, d in res["loader"].items():
        rows.append(
            [
                f"DataLoader x2 {mode}, per core vs in-process",
                f"{d['per core']:,.0f}",
                f"{d['in process']:,.0f}",
                _med(d["ratios"]),
                ">= 0.5x",
            ]
        )
    head = (
        f"store: {res['samples']:,} samples, {res['bytes'] / 2**30:.2f} GiB; batch {res['batch']}; "
        f"{res['rounds']} interleaved rounds: rates are medians, ratios the median (min-max) of per-round ratios\n\n"
    )
    table = markdown_table(
        ["row", "lmdbstore", "baseline (before, after)", "ratio", "goal"], "|---|---:|---:|---:|---:|", rows
    )
    return head + "\n".join(table) + "\n"


def _pair(v: list[float]) -> str:
    return f"{v[0]:,.0f}, {v[1]:,.0f}"


def _med(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "n/a"


def _spread(c: dict[str, Any], key: str) -> str:
    """Per round: the rate over the mean of that round's limits before and after it."""
    limits = [((r["before"][key] + r["after"][key]) / 2, r["rate"]) for r in c["rounds"]]
    return _med([rate / lim for lim, rate in limits if lim > 0])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_readpath_"))
    work.mkdir(parents=True, exist_ok=True)
    path = args.store or work / "store"
    try:
        if args.store is None:
            make_store(path, args.samples)
        with StoreReader(path) as r:
            n, spv, sb = len(r), r.meta.samples_per_value, r.meta.sample_bytes
            vb = spv * sb + r.meta.trailer_bytes
        res: dict[str, Any] = {
            "samples": n,
            "bytes": os.path.getsize(path / "data.mdb"),
            "batch": args.batch,
            "rounds": args.rounds,
        }
        res["cold"] = cold(path, n, args, sb, vb, spv)
        nw = min(n, args.warm_samples)  # warm rows: a part that fits the page cache (and the memmap copy the disk)
        res["warm_samples"] = nw
        res["warm"] = warm(path, nw, args, work)
        res["loader"] = loader_rows(path, nw, args)
        text = render(res)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_readpath.md").write_text(text)
        write_json(args.out / "bench_readpath.json", res)
        return res
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif args.store is None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
