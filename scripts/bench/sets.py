#!/usr/bin/env python
"""A set of stores read as one against one store of the same total size, and against the disk's own limit.

Builds one store of ``--samples`` self-identifying 25x25 float32 samples and a set of ``--stores`` stores
holding the same number in equal parts (4 by default), then measures ``read_batch`` in one process, batches of
``--batch``:

* ``warm random``  random batches, every page cached: the set's batches grouped by store (as the trainer's set
                   samplers deliver them, each store's part read straight into place) and, for reference, in
                   drawn order (the set's one gather copy); goal: the set >= 0.9x one store.
* ``warm block``   block order (``block_buffer`` 2; the set's drawn over its padded space so no value is cut);
                   goal >= 0.9x one store.
* ``cold random``  random batches with the data files' pages dropped (``posix_fadvise(DONTNEED)``) first,
                   against the disk's limit measured in the same run: random ``pread``\\s of one sample's bytes,
                   16 in flight, on the one store's file; goal: the set >= 0.5x that limit (as for one store).

Every warm row is measured twice, alternating one store and the set, as load drifts; the table shows each
pair and the ratio of their medians.

Usage::

    python scripts/bench/sets.py                  # 400k samples (1 GB per copy), a few minutes
    python scripts/bench/sets.py --quick          # 40k samples, short timings: a smoke test

Prints a Markdown table; ``--out DIR`` also writes ``bench_sets.md`` and ``bench_sets.json``.  The stores go to
a temporary directory under ``--workdir`` and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import make_log, markdown_table, random_batches, time_reads, timed, write_json
from bench.machine import drop_page_cache, pread_rate, warm_page_cache
from bench.ooc_runs import make_store
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.sets import SetBatches, set_space
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import Reader

log = make_log("sets")
#: Reads in flight of the disk's limit the cold rows are stated against.
INFLIGHT = 16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``--quick``: 40k samples, short timings)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=400_000, help="samples in the one store and in the set")
    ap.add_argument("--stores", type=int, default=4, help="stores in the set (equal parts)")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=4.0, help="per cold measurement and per warm one at least")
    ap.add_argument("--quick", action="store_true", help="40k samples, short timings: a smoke test")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.seconds = 40_000, 0.5
    if args.stores < 2 or args.samples < args.stores * args.batch:
        ap.error("--stores must be >= 2 and --samples at least --stores x --batch")
    return args


def build(work: Path, n: int, k: int, seed: int) -> tuple[Path, list[Path]]:
    """One store of ``n`` samples and ``k`` stores of ``n / k`` each (the last one takes the rest)."""
    one = work / "one"
    make_store(one, n, seed=seed)
    parts, sizes = [], [n // k] * (k - 1) + [n - (k - 1) * (n // k)]
    for i, m in enumerate(sizes):
        parts.append(work / f"part{i}")
        make_store(parts[-1], m, seed=seed + 1 + i)
    return one, parts


def data_files(reader: Reader) -> list[Path]:
    """The data file(s) behind a store or a set."""
    paths = reader.paths if isinstance(reader, StoreSet) else [reader.path]
    return [Path(p) / "data.mdb" for p in paths]


def block_batches(reader: Reader, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` block-order batches (``block_buffer`` 2) as the trainer draws them: over the padded space and
    grouped by store for a set."""
    n, spv = len(reader), reader.meta.samples_per_value
    space = set_space(reader)
    idx = space.to_padded(np.arange(n)) if space is not None else np.arange(n)
    sampler: Any = EpochBatchSampler(idx, batch, shuffle="block", samples_per_value=spv, block_buffer=2, seed=seed)
    if isinstance(reader, StoreSet):
        sampler = SetBatches(sampler, reader, space)
    return list(sampler)[:count]


def grouped(reader: Reader, batches: list[np.ndarray]) -> list[np.ndarray]:
    """The batches grouped by store (what the trainer's set samplers deliver); unchanged for one store."""
    if not isinstance(reader, StoreSet):
        return batches
    return [b[np.argsort(reader.store_of(b), kind="stable")] for b in batches]


def warm_rate(reader: Reader, batches: list[np.ndarray], seconds: float) -> float:
    """Median samples/s of ``read_batch`` over ``batches`` with the data files cached."""
    warm_page_cache(data_files(reader))
    return time_reads(reader.read_batch, batches, seconds)


def cold_rate(reader: Reader, batches: list[np.ndarray], seconds: float) -> float:
    """Samples/s of ``read_batch`` over ``batches`` right after the data files' pages were dropped."""
    reader.close()
    drop_page_cache(data_files(reader), sync=True)
    reader.read_path  # the position tables (read before the clock starts)  # noqa: B018
    return timed(batches, seconds, lambda b: len(reader.read_batch(b)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the stores, then every row; the stores are removed at the end."""
    if args.workdir is not None:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_sets_", dir=args.workdir))
    try:
        log(f"building one store of {args.samples:,} samples and {args.stores} stores of the same total")
        one_path, part_paths = build(work, args.samples, args.stores, args.seed)
        one, whole = StoreReader(one_path).open(), StoreSet(part_paths).open()
        n, count = args.samples, max(8, int(args.seconds * 400_000 / args.batch) + 2)
        rnd = random_batches(n, args.batch, count, args.seed)
        rows: dict[str, Any] = {}
        cases: list[tuple[str, Callable[[Reader], list[np.ndarray]]]] = [
            ("warm random, set grouped by store", lambda r: grouped(r, rnd)),
            ("warm random, set in drawn order", lambda r: rnd),
            ("warm block", lambda r: block_batches(r, args.batch, count, args.seed)),
        ]
        for label, batches_of in cases:
            pairs = [(warm_rate(one, batches_of(one), args.seconds), warm_rate(whole, batches_of(whole), args.seconds))]
            pairs.append(
                (warm_rate(one, batches_of(one), args.seconds), warm_rate(whole, batches_of(whole), args.seconds))
            )
            rows[label] = pairs
            log(f"  {label}: " + ", ".join(f"one {a:,.0f} / set {b:,.0f}" for a, b in pairs))
        cold_n = max(4, int(args.seconds * 40_000 / args.batch) + 2)
        cold = random_batches(n, args.batch, cold_n, args.seed + 1)
        limit = pread_rate(one_path / "data.mdb", one.meta.sample_bytes, INFLIGHT, args.seconds, args.seed)
        rows["cold random"] = {
            "one": cold_rate(one, cold, args.seconds),
            "set": cold_rate(whole, grouped(whole, cold), args.seconds),
            "limit": limit,
        }
        log(f"  cold random: {rows['cold random']}")
        one.close()
        whole.close()
        return {"samples": n, "stores": args.stores, "batch": args.batch, "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def render(data: dict[str, Any]) -> str:
    """The machine line and the table: per row the rates and the set's ratio with its goal."""
    rows = data["rows"]
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[0]:.1f} at the end; {data['samples']:,} samples 25x25 float32 as one store and as a set "
        f"of {data['stores']} stores; batches of {data['batch']}; read_batch in one process",
        "",
    ]
    header = ["measurement", "one store, samples/s", "set, samples/s", "set / one", "goal"]
    cells = []
    for label, pairs in rows.items():
        if label == "cold random":
            continue
        ratio = float(np.median([b for _, b in pairs]) / np.median([a for a, _ in pairs]))
        goal = "" if "drawn order" in label else (">= 0.9x: " + ("met" if ratio >= 0.9 else "not met"))
        cells.append(
            [
                label,
                " / ".join(f"{a:,.0f}" for a, _ in pairs),
                " / ".join(f"{b:,.0f}" for _, b in pairs),
                f"{ratio:.2f}x",
                goal,
            ]
        )
    cold = rows["cold random"]
    lim = cold["limit"]
    cells.append(["disk limit: random 2.5 KB preads, 16 in flight", f"{lim:,.0f}", "", "", ""])
    cells.append(
        [
            "cold random (x the disk limit)",
            f"{cold['one']:,.0f} ({cold['one'] / lim:.2f}x)",
            f"{cold['set']:,.0f} ({cold['set'] / lim:.2f}x)",
            f"{cold['set'] / cold['one']:.2f}x",
            ">= 0.5x the limit: " + ("met" if cold["set"] / lim >= 0.5 else "not met"),
        ]
    )
    lines += markdown_table(header, "|---|---:|---:|---:|---|", cells)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    args = parse_args(argv)
    data = measure(args)
    text = render(data)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_sets.md").write_text(text + "\n")
        write_json(args.out / "bench_sets.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
