#!/usr/bin/env python
"""Scaling benchmark: lmdbstore stores of growing size, each read in a fresh process, against a numpy memmap
of the same size measured in the same run.

Per size (default 0.1M, 1M and 5M samples of 25x25 float32, the ``--n`` generated samples repeated): build
the store through ``open_writer`` (ingest samples/s, fsync included, and bytes on disk), read it into the page
cache, then in a fresh reader process time warm random batches through ``StoreReader.read_batch`` and record
the reader's peak and anonymous memory, its page faults and the samples B-tree's depth.  The same probe on a
plain ``.npy`` of the same size (``--no-scaling-memmap`` skips it) is the physical reference: ``xmemmap``.

Usage::

    python scripts/bench/scaling.py                      # 0.1M, 1M, 5M samples (12.5 GB at 5M), ./bench_out
    python scripts/bench/scaling.py --quick --out /tmp/b  # seconds; a smoke test
    python scripts/bench/scaling.py --scaling-sizes 1e5,1e6 --probe-batches 30

Outputs under ``--out``: ``bench_scaling.csv`` and ``bench_scaling.json`` (with the machine).  Data files go to
``--data-dir`` (default ``OUT/data``) and are deleted after each size unless ``--keep``.  A size the disk
cannot hold is shrunk to what fits (with a printed note).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import (
    WRITE_CHUNK,
    add_data_options,
    build_store,
    fmt_ratio,
    human,
    make_data,
    make_log,
    output_dirs,
    ratio,
    time_reads,
    write_csv,
    write_json,
)
from bench.machine import (
    allocated_bytes,
    describe_machine,
    files_under,
    machine_info,
    resident_fraction,
    rss_status,
    warm_page_cache,
)
from lmdbstore.store.reader import StoreReader

DEFAULT_SCALING = (100_000, 1_000_000, 5_000_000)

log = make_log("scaling")


@dataclass(frozen=True)
class Plan:
    """How each size is probed: batch size and count, seed, classes of the stores, what is kept."""

    batch: int
    probe_batches: int
    seed: int
    n_classes: int
    keep: bool
    with_memmap: bool


def scaling_probe(path: Path, kind: str, batches: int, batch: int, seed: int) -> dict[str, Any]:
    """Run in a fresh process: warm random-read samples/s and memory of one store (or memmap reference).

    ``kind`` is ``"lmdbstore"`` (a store directory, read with ``StoreReader.read_batch``) or
    ``"memmap"`` (a directory holding ``x.npy``, read by fancy indexing a ``np.load(mmap_mode="r")``).
    """
    base = rss_status()
    resident = resident_fraction(files_under(path))
    reader: StoreReader | None = None
    read: Callable[[np.ndarray], Any]
    if kind == "lmdbstore":
        reader = StoreReader(path)
        n, read = len(reader), reader.read_batch
    else:
        mm = np.load(path / "x.npy", mmap_mode="r")
        n, read = len(mm), mm.__getitem__  # fancy indexing copies the rows out of the map

    rng = np.random.default_rng([seed, 0x5CA1])  # no permutation of all n: the probe's memory stays flat
    bs = [rng.choice(n, min(batch, n), replace=False) for _ in range(batches + 1)]
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    rate = time_reads(read, bs, min_time=math.inf)  # every batch
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    n_read = (batches + 1) * batch
    mem = rss_status()
    out: dict[str, Any] = {
        "kind": kind,
        "n": n,
        "read_sps": rate,
        "samples_read": n_read,
        "resident_at_start": resident,
        "minflt_per_sample": (ru1.ru_minflt - ru0.ru_minflt) / n_read,
        "majflt_per_sample": (ru1.ru_majflt - ru0.ru_majflt) / n_read,
        # VmHWM is this process's own peak; ru_maxrss on Linux also carries the peak of the forking
        # parent across exec, so it is kept for reference only.
        "peak_rss_mib": mem.get("VmHWM"),
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_anon_mib": mem.get("RssAnon"),
        "rss_file_mib": mem.get("RssFile"),
        "rss_anon_at_start_mib": base.get("RssAnon"),
    }
    try:
        import psutil

        out["uss_mib"] = psutil.Process().memory_full_info().uss / 2**20
    except (ImportError, OSError, AttributeError):
        out["uss_mib"] = None
    if reader is not None:
        samples = reader.env_stats()["dbs"]["samples"]
        out.update({k: samples[k] for k in ("depth", "branch_pages", "leaf_pages", "overflow_pages")})
        reader.close()
    return out


def run_scaling(sizes: Sequence[int], x: np.ndarray, y: np.ndarray, root: Path, plan: Plan) -> list[dict[str, Any]]:
    """Per size: build an lmdbstore store (cycling the source data) and probe it in a fresh process;
    then the same for a plain ``.npy`` memmap of that size, the physical reference."""
    results = []
    for size in sizes:
        size = fit_to_disk(size, x[0].nbytes, root)
        if not size:
            continue
        path = root / f"scaling_{size}"
        shutil.rmtree(path, ignore_errors=True)
        log(f"scaling: building lmdbstore with {size:,} samples")
        t0 = time.perf_counter()
        build_store(path, cycled(x, y, size), classes=[f"c{i}" for i in range(plan.n_classes)])
        build_s = time.perf_counter() - t0
        res = probe(path, "lmdbstore", plan)
        res.update(build_s=build_s, ingest_sps=size / build_s, disk_bytes=allocated_bytes(path))
        if not plan.keep:
            shutil.rmtree(path, ignore_errors=True)
        if plan.with_memmap:
            mpath = root / f"scaling_memmap_{size}"
            t0 = time.perf_counter()
            build_npy(mpath, x, size)
            mm_build_s = time.perf_counter() - t0
            ref = probe(mpath, "memmap", plan)
            res.update({f"memmap_{k}": v for k, v in ref.items() if k not in ("kind", "n")})
            res["memmap_ingest_sps"] = size / mm_build_s
            res["read_vs_memmap"] = ratio(res["read_sps"], ref["read_sps"])
            if not plan.keep:
                shutil.rmtree(mpath, ignore_errors=True)
        log(
            f"scaling {size:,}: lmdbstore {human(res['read_sps'])} samples/s"
            + (f" (memmap {human(res.get('memmap_read_sps'))}/s)" if plan.with_memmap else "")
            + f", depth {res['depth']}, peak RSS {res['peak_rss_mib']:.0f} MiB (anon {res['rss_anon_mib']:.0f} MiB)"
        )
        results.append(res)
    return results


def fit_to_disk(size: int, sample_bytes: int, root: Path) -> int:
    """``size``, or fewer samples (with a printed note) when the disk cannot hold them; 0 to skip."""
    need = int(size * sample_bytes * 1.1) + (1 << 30)
    free = shutil.disk_usage(root).free
    if need <= free:
        return size
    fit = int((free - (1 << 30)) / (sample_bytes * 1.1))
    msg = f"NOTE: scaling size {size:,} needs ~{need / 2**30:.1f} GiB, only {free / 2**30:.1f} GiB free; "
    if fit < 1000:
        print(msg + "skipped")
        return 0
    print(msg + f"using {fit:,} samples instead")
    return fit


def build_npy(path: Path, x: np.ndarray, size: int) -> None:
    """A ``size``-sample ``x.npy`` (the source repeated), written sequentially and fsynced."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    with open(path / "x.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(x.dtype), "fortran_order": False, "shape": (size, *x.shape[1:])}
        )
        done = 0
        while done < size:
            k = min(len(x), size - done)
            for a in range(0, k, WRITE_CHUNK):
                f.write(x[a : min(a + WRITE_CHUNK, k)].tobytes())
            done += k
        f.flush()
        os.fsync(f.fileno())


def probe(path: Path, kind: str, plan: Plan) -> dict[str, Any]:
    """Warm the files' pages, then measure them in a fresh process (``--scaling-probe``)."""
    warm_s = warm_page_cache(files_under(path))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scaling-probe", str(path), "--probe-kind", kind]
    cmd += ["--probe-batches", str(plan.probe_batches), "--batch", str(plan.batch), "--seed", str(plan.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scaling probe failed for {path}: {proc.stderr.strip()[-2000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    res["prewarm_s"] = warm_s
    return res


def cycled(x: np.ndarray, y: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The source data repeated until ``size`` samples (contents do not matter for read speed)."""
    done = 0
    while done < size:
        k = min(len(x), size - done)
        yield x[:k], y[:k]
        done += k


def format_scaling(results: list[dict[str, Any]]) -> str:
    """The scaling table as fixed-width text."""
    head = (
        f"{'samples':>10} {'ingest/s':>9} {'B/sample':>8} {'depth':>5} {'branch':>6} {'leaf':>6} "
        f"{'read/s':>8} {'memmap/s':>8} {'xmemmap':>7} {'peak RSS':>8} {'anon':>6} {'file':>6} "
        f"{'majflt':>8} {'resident':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        res = r.get("resident_at_start")
        lines.append(
            f"{r['n']:>10,} {human(r['ingest_sps']):>9} {r['disk_bytes'] / r['n']:>8.0f} {r['depth']:>5} "
            f"{r['branch_pages']:>6} {r['leaf_pages']:>6} {human(r['read_sps']):>8} "
            f"{human(r.get('memmap_read_sps')):>8} {fmt_ratio(r.get('read_vs_memmap')):>7} "
            f"{r['peak_rss_mib'] or 0:>8.0f} {r['rss_anon_mib'] or 0:>6.0f} {r['rss_file_mib'] or 0:>6.0f} "
            f"{r['majflt_per_sample']:>8.3f} {'-' if res is None else f'{100 * res:.0f}%':>8}"
        )
    return "\n".join(lines)


NOTES = (
    "read/s = warm random batches through StoreReader.read_batch in a fresh process, after the store "
    "was read into the page cache; memmap/s = the same batches from a plain .npy memmap of the same "
    "size (physical reference); depth/branch/leaf = B-tree of the samples sub-database; peak RSS = "
    "VmHWM of the reader (MiB; it counts page-cache pages the reads mapped; ru_maxrss, in the JSON, "
    "inherits the forking parent's peak on Linux); anon = RssAnon (the process's own memory); file = "
    "RssFile (shared, reclaimable page-cache pages mapped); majflt = major page faults per sample "
    "read (disk reads: >0 means the store did not stay in the page cache); resident = share of the "
    "files in the page cache when the probe started. Every probe reads the same number of batches."
)


def parse_sizes(text: str) -> list[int]:
    """``"1e5,1000000"`` -> ``[100000, 1000000]``; ``""``, ``"none"`` or ``"0"`` -> no sizes."""
    if text.strip().lower() in ("", "none", "0"):
        return []
    return [int(float(t)) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--quick`` changes the defaults of the options left out)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--n", type=int, default=None, help="samples generated and repeated (default 1,000,000; --quick 20,000)"
    )
    p.add_argument("--scaling-sizes", default=None, help="store sizes (default 100000,1000000,5000000; --quick N/4,N)")
    p.add_argument("--probe-batches", type=int, default=None, help="random batches read per probe (default 60)")
    p.add_argument("--no-scaling-memmap", action="store_true", help="skip the memmap reference")
    add_data_options(p, "CSV, JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--scaling-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-kind", default="lmdbstore", choices=("lmdbstore", "memmap"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark (or, with the hidden ``--scaling-probe``, one probe); returns the result rows."""
    args = build_parser().parse_args(argv)
    if args.scaling_probe:
        res = scaling_probe(Path(args.scaling_probe), args.probe_kind, args.probe_batches or 60, args.batch, args.seed)
        print(json.dumps(res))
        return [res]
    n = args.n if args.n is not None else (20_000 if args.quick else 1_000_000)
    if n < 1 or args.batch < 1:
        raise ValueError("--n and --batch must be positive")
    sizes = parse_sizes(args.scaling_sizes) if args.scaling_sizes is not None else None
    if sizes is None:
        sizes = [max(1000, n // 4), n] if args.quick else list(DEFAULT_SCALING)
    plan = Plan(
        batch=args.batch,
        probe_batches=args.probe_batches if args.probe_batches is not None else (3 if args.quick else 60),
        seed=args.seed,
        n_classes=args.classes,
        keep=args.keep,
        with_memmap=not args.no_scaling_memmap,
    )
    shape = tuple(int(t) for t in args.shape.split(","))
    with output_dirs(args.out, args.data_dir, args.keep) as (out, data):
        return run(n, shape, sizes, plan, out, data)


def run(
    n: int, shape: tuple[int, ...], sizes: Sequence[int], plan: Plan, out: Path, data: Path
) -> list[dict[str, Any]]:
    """Describe the machine, probe every size from ``n`` generated samples of ``shape`` with data in ``data``,
    print the table and write it to ``out`` (CSV, and JSON with the machine)."""
    t_start = time.perf_counter()
    info = machine_info(data)
    print(describe_machine(info))
    print(f"Dataset: {n:,} samples of {'x'.join(map(str, shape))} float32 repeated, batch {plan.batch}\n", flush=True)
    log("generating data")
    x, y = make_data(n, shape, plan.n_classes, plan.seed)
    results = run_scaling(sizes, x, y, data, plan) if sizes else []
    elapsed = time.perf_counter() - t_start
    print("Scaling (lmdbstore, warm random reads in a fresh reader process):")
    print(format_scaling(results))
    print(NOTES)
    print(f"\nTotal time: {elapsed:.0f}s")
    csv_path, json_path = out / "bench_scaling.csv", out / "bench_scaling.json"
    write_csv(csv_path, results)
    write_json(json_path, {"machine": info, "plan": asdict(plan), "scaling": results, "elapsed_s": elapsed})
    print(f"\nWrote {csv_path}, {json_path}")
    return results


if __name__ == "__main__":
    main()
