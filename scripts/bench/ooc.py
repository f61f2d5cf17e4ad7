#!/usr/bin/env python
"""Out-of-core benchmark: lmdbstore's reads against the disk's own limits, measured in the same run.

On a store whose pages were dropped from the page cache (``posix_fadvise(DONTNEED)`` before every cold
measurement), it measures:

* the disk's limits on the same file: random ``pread``s of one sample's bytes and of one packed value's
  bytes, at 1 and 16 in flight (a thread pool; ``--inflight`` for others, e.g. 1,16,64);
* ``StoreReader.read_batch`` in one process for ``random``, ``block`` and ``window`` orders (and the liblmdb
  path, ``positions=False``, in random order, for reference);
* the same through the DataLoader with ``--workers`` workers;
* warm (``--warm-samples`` of the store, all cached): ``read_batch`` random and block against a numpy
  memmap of the same samples;
* shuffle quality: distinct values per batch and the class mix of batches against the store's shares;
* the reader's own memory (anonymous RSS, not the file pages it maps) after building the position table;
* optionally (``--train-steps``) a CPU training loop with the ``window`` order, and its data wait;
* optionally (``--accuracy``) the validation accuracy each order reaches on a class-sorted store.

Each measurement runs for ``--seconds`` (at least one batch); rates are samples/s.  ``window`` is measured
after its first window is in the page cache (the load time of that window is reported separately).

Usage::

    python scripts/bench/ooc.py                      # 200k samples in a temporary directory (~minutes)
    python scripts/bench/ooc.py --samples 12000000   # larger than RAM (30 GB); needs the disk space
    python scripts/bench/ooc.py --store PATH         # an existing store (never modified)

Prints Markdown tables and writes them to ``--out`` (default ``./bench_ooc_out``) as ``bench_ooc.md``, with
every number in ``bench_ooc.json``.  A store it creates (self-identifying samples, ``bench.ooc_runs``) goes to
``--workdir`` (default a temporary directory) and is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import add_store_options, make_log, markdown_table, write_json
from bench.machine import host_facts, pread_rate
from bench.ooc_runs import accuracy, loader, make_store, memory, one_process, quality, train_wait, warm
from lmdbstore.loader.window import available_memory
from lmdbstore.store.reader import StoreReader

log = make_log("ooc")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; a bad value exits with status 2 and a message naming the option."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_options(ap, 200_000)
    ap.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window-mb", type=int, default=1024)
    ap.add_argument("--warm-samples", type=int, default=400_000)
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--accuracy", type=int, default=0, help="samples of a class-sorted store to train on per order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_ooc_out"))
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: disk,one,loader,warm,quality")
    ap.add_argument("--inflight", default="1,16", help="reads in flight for the disk limits (default 1,16)")
    args = ap.parse_args(argv)
    try:
        args.inflight_list = [int(q) for q in args.inflight.split(",") if q.strip()]
    except ValueError:
        ap.error(f"--inflight must be comma-separated integers, got {args.inflight!r}")
    if not args.inflight_list or min(args.inflight_list) < 1:
        ap.error(f"--inflight must be positive integers, got {args.inflight!r}")
    return args


def disk_limits(
    path: Path, sample_bytes: int, value_bytes: int, spv: int, args: argparse.Namespace
) -> dict[str, float]:
    """The disk's limits in samples/s: random preads of one sample's and of one value's bytes (``spv``
    samples each) at each ``--inflight`` count, on the store's own data file, its pages dropped first."""
    out: dict[str, float] = {}
    for label, nb, mult in (("sample", sample_bytes, 1), ("value", value_bytes, spv)):
        for q in args.inflight_list:
            rate = pread_rate(path / "data.mdb", nb, q, args.seconds / 2, args.seed + q)
            out[f"{label} x{q}"] = rate * mult
            log(f"  disk {label} pread x{q}: {rate:,.0f} reads/s = {rate * mult:,.0f} samples/s")
    return out


def measure(path: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every section not skipped, on the store at ``path``: the results by section."""
    skip = set(filter(None, args.skip.split(",")))
    res: dict[str, Any] = {"machine": machine(path)}
    with StoreReader(path) as r:
        n, spv, sb = len(r), r.meta.samples_per_value, r.meta.sample_bytes
        vb = spv * sb + r.meta.trailer_bytes
    res["store"] = {"samples": n, "bytes": os.path.getsize(path / "data.mdb"), "samples_per_value": spv}
    log(f"store: {n:,} samples, {res['store']['bytes'] / 2**30:.1f} GiB; RAM {res['machine']['ram_gib']} GiB")
    res["memory"] = memory(path)
    if "disk" not in skip:
        res["disk"] = disk_limits(path, sb, vb, spv, args)
    if "one" not in skip:
        res["one"] = one_process(path, n, args)
    if "loader" not in skip:
        res["loader"] = loader(path, n, args)
    if "warm" not in skip:
        res["warm"] = warm(path, n, args, workdir)
    if "quality" not in skip:
        res["quality"] = quality(path, n, args)
    if args.train_steps:
        res["train"] = train_wait(path, n, args)
    if args.accuracy:
        res["accuracy"] = accuracy(args, workdir)
    return res


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results written to ``bench_ooc.json``."""
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_ooc_"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = args.store or workdir / "store"
    created = args.store is None
    try:
        if created:
            log(f"writing {args.samples:,} samples to {path}")
            make_store(path, args.samples)
        res = measure(path, args, workdir)
        report(res, args)
    finally:
        if created and not args.keep:
            shutil.rmtree(workdir if args.workdir is None else path, ignore_errors=True)
    return res


def machine(path: Path) -> dict[str, Any]:
    """CPUs, RAM (all and available now), platform and Python, as the report and the JSON name them."""
    facts = host_facts()
    return {
        "cpus": facts["cores"],
        "ram_gib": facts.get("ram_gib"),
        "available_gib": round(available_memory() / 2**30, 1),
        "platform": facts["platform"],
        "python": facts["python"],
    }


def count(v: float | None) -> str:
    """A rate for a table cell: ``12,345`` (``-`` for missing)."""
    return "-" if v is None else f"{v:,.0f}"


def times(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x`` (``-`` when either is missing or zero)."""
    return "-" if not a or not b else f"{a / b:.2f}x"


def cold_lines(res: dict[str, Any], window_mb: int) -> list[str]:
    """The disk limits, then the cold reads per order with their ratio to the disk limit at 16 in flight."""
    lines: list[str] = []
    d = res.get("disk", {})
    if d:
        limits = [(f"{k.replace('x', 'x ', 1)} in flight", count(v)) for k, v in d.items()]
        lines += [*markdown_table(["disk limit (random pread, same file)", "samples/s"], "|---|---:|", limits), ""]
    one, ld = res.get("one", {}), res.get("loader", {})
    rows = []
    for mode in ("random", "block", "window", "lmdb-random"):
        base_key = "sample x16" if mode.endswith("random") else "value x16"
        ratio = f"{times(one.get(mode), d.get(base_key))} of {base_key}"
        rows.append((mode, count(one.get(mode)), count(ld.get(mode)), ratio))
    header = ["read (cold)", "one process", "DataLoader", "ratio (one process) to the disk limit"]
    lines += markdown_table(header, "|---|---:|---:|---|", rows)
    if "window first-window load s" in one:
        lines.append(f"\nwindow: first window ({window_mb} MiB) read in {one['window first-window load s']:.1f} s")
    return lines


def warm_and_quality_lines(res: dict[str, Any]) -> list[str]:
    """Warm reads against the memmap, and the shuffle quality per order (nothing for a skipped section)."""
    lines: list[str] = []
    w = res.get("warm")
    if w:
        rows = [(k, count(w[k]), count(w["memmap " + k]), times(w[k], w["memmap " + k])) for k in ("random", "block")]
        header = ["read (warm, CPU time)", "lmdbstore", "memmap", "ratio"]
        lines += ["", *markdown_table(header, "|---|---:|---:|---:|", rows)]
    q = res.get("quality")
    if q:
        shuffles = [(k, f"{v['distinct values per batch']:.0f}", f"{v['class-mix TVD']:.4f}") for k, v in q.items()]
        header = ["shuffle", "distinct values per batch", "class-mix TVD per batch"]
        lines += ["", *markdown_table(header, "|---|---:|---:|", shuffles)]
    return lines


def memory_and_training_lines(res: dict[str, Any], accuracy_samples: int) -> list[str]:
    """The reader's memory, the accuracy per order and the training loop's data wait (when measured)."""
    m = res["memory"]
    lines = [
        "",
        f"memory: position table {m['table MB']:.1f} MB (built in {m['table build s']:.1f} s), labels "
        f"{m['labels MB']:.1f} MB (not loaded here); the reader's anonymous RSS after open + one 4096-sample batch "
        f"{m['reader RssAnon MB']:.1f} MB, {m['reader RssAnon after trim MB']:.1f} MB after malloc_trim",
    ]
    a = res.get("accuracy")
    if a:
        header = [f"order (class-sorted store of {accuracy_samples:,} samples, 2 epochs)", "validation accuracy"]
        lines += ["", *markdown_table(header, "|---|---:|", [(k, f"{v:.3f}") for k, v in a.items()])]
    t = res.get("train")
    if t:
        lines.append(
            f"training ({t['shuffle']}, {t['steps']} steps): {t['samples/s']:,.0f} samples/s, data wait "
            f"{100 * t['data wait share']:.1f}% (second half {100 * t['data wait share, second half']:.1f}%), "
            f"first batch {t['first batch wait s']:.1f} s"
        )
    return lines


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the tables and write them to ``bench_ooc.md``, every number to ``bench_ooc.json``, in ``--out``."""
    st = res["store"]
    lines = [
        f"store: {st['samples']:,} samples, {st['bytes'] / 2**30:.1f} GiB; machine: {res['machine']['cpus']} CPUs, "
        f"{res['machine']['ram_gib']} GiB RAM; batch {args.batch}, window {args.window_mb} MiB, "
        f"{args.workers} workers",
        "",
        *cold_lines(res, args.window_mb),
        *warm_and_quality_lines(res),
        *memory_and_training_lines(res, args.accuracy),
    ]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ooc.md").write_text(text + "\n")
    write_json(args.out / "bench_ooc.json", res, indent=1)


if __name__ == "__main__":
    main()
