#!/usr/bin/env python
"""lmdbstore side by side with the loaders people pick today: MosaicML streaming (MDS), Lightning
litdata and webdataset, on the same data (default 1M z-scored 25x25 float32 samples, 5 classes).

For each library, with its own recommended writer and reader:

* ingest samples/s (write everything, then flush to disk),
* bytes on disk per sample, against the raw 2,500 bytes,
* warm random batches in one process through the library's own random-access API (batches of 4,096
  distinct random indices, page cache warm),
* a shuffled epoch through the library's recommended loader, 2 workers, batch 4,096,
* cold random reads: the same random-access API right after the files' pages were dropped from the
  page cache (``posix_fadvise(DONTNEED)``; handles closed first, so mapped pages go too).

Ratios are lmdbstore's rate over each peer's, measured in the same run (a numpy memmap row is the
raw-copy baseline).  The peers are an optional extra (``pip install 'lmdbstore[peers]'``); a library
that is missing or fails keeps its row with the reason.  Not part of the tests or CI.

    python scripts/bench/peers.py [-n 1000000] [--dir /tmp/bench_peers] [--min-time 15] [--out DIR]

Notes on fairness: MDS and litdata shuffle shards/chunks and then samples within a window (their
design for streaming from object stores), not a full permutation; lmdbstore's loader draws a fresh
full permutation each epoch.  webdataset has no random access (``n/a``): its loader streams shuffled
shards through a 5,000-sample shuffle buffer.  Warm rates are medians over batches.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import make_data, make_log, random_batches, time_loader, time_reads, write_json
from bench.machine import (
    allocated_bytes,
    describe_machine,
    flush_to_disk,
    machine_info,
    time_cold,
    warm_page_cache,
)
from bench.peer_formats import PEER_CLASSES, RAW_SHAPE, Peer

N_CLASSES = 5
BATCH = 4096
WORKERS = 2
COLD_BATCH = 256
PEERS = ("memmap", "lmdbstore", "mds", "litdata", "webdataset")
DISTS = {"mds": "mosaicml-streaming", "litdata": "litdata", "webdataset": "webdataset", "lmdbstore": "lmdbstore",
         "memmap": "numpy"}  # fmt: skip


log = make_log("peers")


def version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``not installed``."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


@dataclass
class Result:
    """One library's row: rates in samples/s, bytes on disk per sample; ``None`` where not measured."""

    name: str
    version: str
    ingest_sps: float | None = None
    bytes_per_sample: float | None = None
    warm_random_sps: float | None = None
    epoch_sps: float | None = None
    cold_random_sps: float | None = None
    cold_resident_after_drop: float | None = None
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def measure(peer: Peer, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> Result:
    """Every measurement of one peer; a failure keeps the row, with its reason in ``error``."""
    res = Result(peer.name, version(DISTS[peer.name]), note=peer.note)
    try:
        peer.prepare()
        log(f"{peer.name}: writing {len(x):,} samples")
        t0 = time.perf_counter()
        peer.build(x, y)
        flush_to_disk(peer.dir)
        secs = getattr(peer, "build_seconds_without_source", None) or (time.perf_counter() - t0)
        res.ingest_sps = len(x) / secs
        res.bytes_per_sample = allocated_bytes(peer.dir) / len(x)
        if peer.random_access:
            batches = random_batches(len(x), BATCH, 64, seed=11)
            warm_page_cache(peer.files())
            peer.open()
            sample = batches[0][:16]
            gx, gy = peer.read(sample)
            if not (np.array_equal(gx.view(np.uint32), x[sample].view(np.uint32)) and np.array_equal(gy, y[sample])):
                raise RuntimeError("random reads returned the wrong samples")
            log(f"{peer.name}: warm random batches")
            res.warm_random_sps = time_reads(peer.read, batches, args.min_time)
            log(f"{peer.name}: cold random reads")
            cold = random_batches(len(x), COLD_BATCH, 400, seed=12)
            res.cold_random_sps, _, res.cold_resident_after_drop = time_cold(peer, peer.read, cold, args.cold_time)
            peer.close()
        warm_page_cache(peer.files())
        log(f"{peer.name}: shuffled epoch, {WORKERS} workers, batch {BATCH}")
        res.epoch_sps = time_loader(peer.loader(BATCH, WORKERS), WORKERS, args.min_time)
    except Exception as exc:  # keep the row, with the reason
        res.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        log(f"{peer.name}: FAILED {res.error}")
    finally:
        peer.close()
    if peer.name == "mds" and "streaming" in sys.modules:
        note = getattr(sys.modules["streaming"], "_lmdbstore_note", None)
        if note:
            res.extra["import"] = note
    return res


def _r(a: float | None, b: float | None) -> str:
    """`` (a/b x)`` after a peer's rate: lmdbstore's rate over it (empty when either is missing)."""
    return "" if a is None or b is None or b <= 0 else f" ({a / b:.1f}x)"


def _v(v: float | None, fmt: str = "{:,.0f}") -> str:
    """A table cell: ``v`` formatted, or ``n/a``."""
    return "n/a" if v is None else fmt.format(v)


def format_table(results: list[Result], n: int) -> str:
    """Markdown table; ``(Nx)`` after a peer's rate is lmdbstore's rate divided by it."""
    ref = next((r for r in results if r.name == "lmdbstore"), None)
    raw = int(np.prod(RAW_SHAPE)) * 4
    lines = [
        f"| library | version | ingest samples/s | bytes/sample (x raw) | warm random batches, 1 process, samples/s "
        f"(lmdbstore / it) | shuffled epoch, {WORKERS} workers, batch {BATCH}, samples/s (lmdbstore / it) "
        "| cold random samples/s (lmdbstore / it) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error and r.ingest_sps is None:
            lines.append(f"| {r.name} | {r.version} | failed: {r.error} | | | | |")
            continue
        cells = [
            r.name,
            r.version,
            _v(r.ingest_sps),
            "n/a" if r.bytes_per_sample is None else f"{r.bytes_per_sample:,.0f} ({r.bytes_per_sample / raw:.2f}x)",
        ]
        for key in ("warm_random_sps", "epoch_sps", "cold_random_sps"):
            v = getattr(r, key)
            other = getattr(ref, key) if ref is not None and r.name != "lmdbstore" else None
            cells.append(_v(v) + _r(other, v))
        if r.error:
            cells[-1] += f" (failed later: {r.error})"
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{n:,} samples of {RAW_SHAPE[0]}x{RAW_SHAPE[1]} float32 ({raw:,} B raw), {N_CLASSES} classes.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Run the benchmark; returns one result per peer (bad options exit with status 2 and a message)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-n", "--samples", type=int, default=1_000_000)
    p.add_argument("--dir", type=Path, default=Path("/tmp/lmdbstore_bench_peers"), help="scratch directory")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--min-time", type=float, default=15.0, help="seconds per timed read / loader measurement")
    p.add_argument("--cold-time", type=float, default=10.0, help="seconds of cold random reads")
    p.add_argument("--out", type=Path, default=None, help="write peers.md and peers.json here")
    p.add_argument("--keep", action="store_true", help="keep the written data")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in names if s not in PEER_CLASSES]
    if unknown or args.samples < BATCH:
        p.error(f"unknown peers {unknown}" if unknown else f"--samples must be at least {BATCH}")

    args.dir.mkdir(parents=True, exist_ok=True)
    x, y = make_data(args.samples, RAW_SHAPE, N_CLASSES, seed=0)
    results = []
    for name in names:
        peer = PEER_CLASSES[name](args.dir, args.samples)
        results.append(measure(peer, x, y, args))
        if not args.keep:
            shutil.rmtree(peer.dir, ignore_errors=True)
    table = format_table(results, args.samples)
    machine = describe_machine(machine_info(args.dir))
    print(table)
    print(f"\nmachine: {machine}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peers.md").write_text(table + f"\n\nmachine: {machine}\n")
        write_json(
            args.out / "peers.json",
            {"samples": args.samples, "machine": machine, "results": [asdict(r) for r in results]},
        )
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
