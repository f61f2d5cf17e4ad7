#!/usr/bin/env python
"""The main process's memory while the trainer builds its split and sampler (issue 36): peak against steady.

numpy only, no store: a synthetic label table of ``--samples`` samples (``i * 7919 % 5``: five classes, well
mixed) goes through what :func:`lmdbstore.training.placement.rank_data` and the first epoch do -- the stratified
train/validation split, the training sampler of each order (``random``, ``block``, ``window``, ``balanced``), its
first ``--batches`` batches, and the validation sampler's first batches -- each order in a fresh process.  Per
order it reports, from ``/proc/self/status``:

* **steady**: the resident size once the first batches were drawn (what the process keeps during the epoch),
* **peak**: the highest resident size since the labels were made (``VmHWM``), and their ratio (goal <= 1.2),
* the bytes per sample that the labels, the split and the sampler hold in the steady state (above the interpreter
  with numpy and lmdbstore imported).

Usage::

    python scripts/bench/sampler_memory.py --samples 40000000       # about 2 GB of memory in all, a minute
    python scripts/bench/sampler_memory.py --samples 200000 --quick  # a smoke test

Prints a Markdown table; ``--out DIR`` also writes ``bench_sampler_memory.json`` there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import Goal, make_log, markdown_table, write_json

log = make_log("sampler_memory")
ORDERS = ("random", "block", "window", "balanced")
#: The goal of issue 36: the main process's peak resident size against its steady one.
PEAK_GOAL = 1.2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40_000_000)
    ap.add_argument("--orders", default=",".join(ORDERS), help=f"comma-separated, of {', '.join(ORDERS)}")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=50, help="training batches drawn before the steady size")
    ap.add_argument("--spv", type=int, default=36, help="samples per value (36: 25x25 float16)")
    ap.add_argument("--sample-bytes", type=int, default=1250)
    ap.add_argument("--window-mb", type=int, default=2048, help="window order: the window (the trainer: 1/8 of RAM)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true", help="few batches: a smoke test")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.order_list = [o for o in args.orders.split(",") if o]
    bad = [o for o in args.order_list if o not in ORDERS]
    if bad or not args.order_list:
        ap.error(f"--orders: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(ORDERS)}")
    if args.samples < 10 or args.batch < 1:
        ap.error("--samples must be at least 10 and --batch positive")
    if args.quick:
        args.batches = 3
    return args


def status() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB."""
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


def measure(order: str, args: argparse.Namespace) -> dict[str, Any]:
    """In this (fresh) process: the split and ``order``'s sampler, as the trainer makes them; sizes in MiB."""
    import numpy as np

    from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
    from lmdbstore.loader.window import WindowBatchSampler

    interpreter = status()["VmRSS"]
    n = args.samples
    labels = np.empty(n, np.uint8)  # as the reader's table: one byte a sample, made a chunk at a time
    for a in range(0, n, 1 << 20):
        labels[a : a + (1 << 20)] = np.arange(a, min(a + (1 << 20), n), dtype=np.int64) * 7919 % 5
    with_labels = status()["VmRSS"]
    train, val = stratified_split(labels, args.val_fraction, 0)
    after_split = status()
    kw: dict[str, Any] = {"seed": 0, "rank": 0, "world_size": 1}
    sampler: Any
    if order == "window":
        sampler = WindowBatchSampler(
            train, args.batch, samples_per_value=args.spv, sample_bytes=args.sample_bytes,
            window_bytes=args.window_mb << 20, **kw,
        )  # fmt: skip
    elif order == "balanced":
        of = labels[train]
        sampler = BalancedBatchSampler([train[of == c] for c in range(5)], args.batch, **kw)
        del of
    else:
        sampler = EpochBatchSampler(train, args.batch, shuffle=order, samples_per_value=args.spv, **kw)
    it = iter(sampler)
    for _ in range(args.batches):
        next(it, None)
    val_it = iter(EpochBatchSampler(val, args.batch, shuffle="none", **kw))
    for _ in range(args.batches):
        next(val_it, None)
    now = status()
    held = now["VmRSS"] - interpreter
    return {
        "order": order,
        "samples": n,
        "interpreter_mib": interpreter,
        "labels_mib": with_labels - interpreter,
        "split_mib": after_split["VmRSS"] - with_labels,
        "split_peak_mib": after_split["VmHWM"] - with_labels,
        "steady_mib": now["VmRSS"],
        "peak_mib": now["VmHWM"],
        "peak_over_steady": now["VmHWM"] / now["VmRSS"],
        "bytes_per_sample": held * 2**20 / n,
    }


def run_one(order: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter (its peak is its own)."""
    argv = [sys.executable, __file__, "--one", order, "--samples", str(args.samples), "--batch", str(args.batch),
            "--batches", str(args.batches), "--spv", str(args.spv), "--sample-bytes", str(args.sample_bytes),
            "--window-mb", str(args.window_mb), "--val-fraction", str(args.val_fraction)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"sampler_memory: {order} failed: {done.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table of the results."""
    cells = [
        [
            r["order"],
            f"{r['samples']:,}",
            f"{r['steady_mib']:,.0f}",
            f"{r['peak_mib']:,.0f}",
            f"{r['peak_over_steady']:.2f}",
            f"<= {PEAK_GOAL}",
            f"{r['bytes_per_sample']:.1f}",
            f"{r['split_mib']:,.0f} / {r['split_peak_mib']:,.0f}",
        ]
        for r in rows
    ]
    header = ["order", "samples", "steady MiB", "peak MiB", "peak / steady", "goal", "B/sample held",
              "split kept / peak MiB"]  # fmt: skip
    return markdown_table(header, "|---|---:|---:|---:|---:|---|---:|---:|", cells)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--one"]:
        order, rest = raw[1], raw[2:]
        print(json.dumps(measure(order, parse_args(rest))))
        return 0
    args = parse_args(raw)
    rows = []
    for order in args.order_list:
        log(f"{order}: split and sampler of {args.samples:,} samples in a fresh process")
        rows.append(run_one(order, args))
    lines = table(rows)
    print("\n".join(lines))
    for r in rows:
        print(Goal(f"{r['order']}: main-process peak / steady RSS", r["peak_over_steady"], PEAK_GOAL, False).line())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench_sampler_memory.json", {"rows": rows, "table": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
