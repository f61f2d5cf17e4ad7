#!/usr/bin/env python
"""What the fast path's safety checks cost: read rates with the checks on and off, and the baselines, in one run.

Issue 18 made the offset read path trust the file no more than liblmdb does.  Its checks, measured here:

* the snapshot rule before and after every read (a 152-byte ``pread`` of a meta page for a lock-free reader,
  a method call for a registered one) and the file-size check before liblmdb touches the map;
* each value's overflow-page header, checked before the value's first read in a process (lazily: checking
  all of them when the table is built is measured too, cold, per value);
* the checksum of values read whole (block and window orders), which is off by default.

Rates are ``read_batch`` samples/s in one process: warm in CPU time against a numpy memmap of the same
samples; cold (``posix_fadvise(DONTNEED)`` before each run, wall time) against the disk's own random
``pread`` rate at 16 in flight on the same file, of one sample (2.5 KB) and of one packed value (45 KB).

Usage::

    python scripts/bench/checks.py                    # 200k samples in a temporary directory (~2 minutes)
    python scripts/bench/checks.py --store PATH       # an existing store (only read)

Prints Markdown tables and writes them to ``--out`` (default ``./bench_checks_out``) as ``bench_checks.md``,
every number to ``bench_checks.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.checks_runs import cold, costs, warm
from bench.common import Goal, add_store_options, make_log, markdown_table, write_json
from bench.machine import host_facts, pread_rate
from bench.ooc_runs import make_store
from lmdbstore.store.reader import StoreReader

log = make_log("checks")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; a bad value exits with status 2 and a message naming the option."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_options(ap, 200_000)
    ap.add_argument("--batches", type=int, default=48, help="batches per warm measurement")
    ap.add_argument("--cold-batches", type=int, default=12, help="batches per cold measurement")
    ap.add_argument("--repeats", type=int, default=3, help="cold runs per measurement (the median is reported)")
    ap.add_argument("--warm-samples", type=int, default=200_000)
    ap.add_argument("--seconds", type=float, default=3.0, help="per disk-limit measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_checks_out"))
    args = ap.parse_args(argv)
    for name in ("samples", "batch", "batches", "cold_batches", "repeats", "warm_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def report(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The Markdown report: warm and cold rates with each check on and off, their ratios, the costs, goals."""
    w, c, d, k = res["warm"], res["cold"], res["disk"], res["costs"]
    st = res["store"]
    lines = [
        f"store: {st['samples']:,} samples of {st['sample_bytes']} bytes, {st['spv']} per value; batch {args.batch}",
        "",
    ]
    rows = []
    for order in ("random", "block"):
        on, mm = w[f"{order} checks on"], w[f"{order} memmap"]
        rows.append((f"warm {order}, every check", fmt(on), fmt(mm), fmt(ratio(on, mm), ".2f"), "1.00"))
        for variant in ("snapshot rule off", "no lease (kernel copy)", "+ whole-value crc"):
            v = w[f"{order} {variant}"]
            rows.append(
                (f"warm {order}, {variant}", fmt(v), fmt(mm), fmt(ratio(v, mm), ".2f"), fmt(ratio(v, on), ".2f"))
            )
    lim_s, lim_v = d["sample x16"], d["value x16"]
    for name, v in c.items():
        lim = lim_s if name.startswith("random") else lim_v
        base = c["random checks on"] if name.startswith("random") else c["block checks on"]
        rows.append((f"cold {name}", fmt(v), fmt(lim), fmt(ratio(v, lim), ".2f"), fmt(ratio(v, base), ".2f")))
    header = ["read_batch (one process)", "samples/s", "baseline", "ratio to baseline", "ratio to every check"]
    lines += markdown_table(header, "|---|---:|---:|---:|---:|", rows)
    lines += [
        "",
        "baselines: warm, a numpy memmap of the same samples (sorted batches, CPU time); cold, the disk's random "
        "pread rate at 16 in flight on the same file (2.5 KB samples for random, 45 KB values for block, in samples/s)",
        "",
        *markdown_table(["cost", "value"], "|---|---:|", [(name, fmt(v, ",.3f")) for name, v in k.items()]),
        "",
        "goals:",
    ]
    goals = [
        Goal("cold random >= 0.5x the 16-in-flight 2.5 KB pread rate", ratio(c["random checks on"], lim_s), 0.5),
        Goal("warm random >= 0.5x numpy memmap", ratio(w["random checks on"], w["random memmap"]), 0.5),
        Goal("cold block >= 0.5x the 16-in-flight 45 KB pread rate", ratio(c["block checks on"], lim_v), 0.5),
    ]
    return lines + [g.line() for g in goals]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results written to ``bench_checks.json``."""
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_checks_"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = args.store or workdir / "store"
    try:
        if args.store is None:
            log(f"writing {args.samples:,} samples to {path}")
            make_store(path, args.samples)
        with StoreReader(path) as r:
            n, spv, sb = len(r), r.meta.samples_per_value, r.meta.sample_bytes
            vb = spv * sb + r.meta.trailer_bytes
        res: dict[str, Any] = {"machine": host_facts(), "store": {"samples": n, "spv": spv, "sample_bytes": sb}}
        res["disk"] = {
            "sample x16": pread_rate(path / "data.mdb", sb, 16, args.seconds, args.seed),
            "value x16": pread_rate(path / "data.mdb", vb, 16, args.seconds, args.seed + 1) * spv,
        }
        log("  disk: " + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in res["disk"].items()))
        res["warm"] = warm(path, n, args, workdir)
        res["cold"] = cold(path, n, args)
        res["costs"] = costs(path, args)
        lines = report(res, args)
        print("\n".join(lines))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_checks.md").write_text("\n".join(lines) + "\n")
        write_json(args.out / "bench_checks.json", res)
    finally:
        if args.store is None and not args.keep:
            shutil.rmtree(workdir if args.workdir is None else path, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
