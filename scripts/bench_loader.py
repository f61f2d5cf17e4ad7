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

    python scripts/bench_loader.py                        # default run (a few minutes)
    python scripts/bench_loader.py --quick --out /tmp/bl  # seconds; a smoke test
    python scripts/bench_loader.py --store PATH --npy PATH.npy --workers 0,2   # reuse existing data

Outputs under ``--out`` (default ``./bench_loader_out``): ``bench_loader.md`` (the printed tables),
``bench_loader.csv`` (one row per measurement) and ``bench_loader.json`` (everything, with the machine).
The data goes to ``--workdir`` (default a temporary directory), removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the bench extra
    psutil = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # shared helpers (imported after the path is set)

import lmdbstore
from lmdbstore import WriterConfig, open_writer
from lmdbstore.config import ShuffleMode
from lmdbstore.ingestion.synth import SYNTH_CLASSES, SYNTH_SHAPE, synth_batches
from lmdbstore.loader.samplers import block_order
from lmdbstore.store.reader import StoreReader

#: Shuffle modes: name -> (LoaderConfig.shuffle, block_buffer).
MODES: dict[str, tuple[ShuffleMode, int]] = {
    "random": ("random", 1),
    "block1": ("block", 1),
    "block2": ("block", 2),
    "block4": ("block", 4),
}
#: Goal per mode from the issue: DataLoader samples/s per core at least this share of memmap's.
GOALS: dict[str, float] = {"random": 0.3, "block1": 0.8, "block2": 0.8, "block4": 0.8}
#: Goal for the trainer: data wait below this share of a CPU training step.
DATA_WAIT_GOAL = 0.05
WRITE_CHUNK = 65536
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


# ============================================================================ small helpers
def log(msg: str) -> None:
    """Progress line on stderr (the tables go to stdout)."""
    print(f"[bench_loader {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt_rate(v: float | None) -> str:
    """Samples/s as ``1.23M`` / ``456k`` (``-`` when missing)."""
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.0f}k"
    return f"{v:.0f}"


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


def usable_cores() -> int:
    """CPU cores this process may run on (affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class CpuClock:
    """CPU seconds (user + system) used so far by this process and by the given worker processes.

    A DataLoader's cost in CPU time is what "per core" means, and unlike wall-clock time it is barely
    disturbed by other processes on a shared machine.  ``None`` without psutil.
    """

    def __init__(self, pids: Sequence[int]):
        self.procs = [psutil.Process(p) for p in pids] if psutil is not None else None

    def now(self) -> float | None:
        if self.procs is None:
            return None
        total = time.process_time()
        for proc in self.procs:
            t = proc.cpu_times()
            total += t.user + t.system
        return total


def load_average() -> str:
    """The 1/5/15-minute load averages as text (``?`` where unknown)."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


# ============================================================================ machine
def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and library versions."""
    import torch

    info = bench.host_facts()
    info["logical_cpus"] = info.pop("cores")
    info["usable_cores"] = usable_cores()
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                info["ram_available_gib"] = round(int(line.split()[1]) / 2**20, 1)
    info["versions"] = {
        "lmdbstore": lmdbstore.__version__,
        "numpy": np.__version__,
        "torch": torch.__version__,
        "py-lmdb": lmdb.__version__,
        "liblmdb": ".".join(map(str, lmdb.version())),
    }
    info["torch_threads"] = torch.get_num_threads()
    info["load_average_start"] = load_average()
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """Three lines: CPU/cores/RAM, OS and load, versions."""
    v = info["versions"]
    return "\n".join(
        [
            f"Machine: {info['cpu']}, {info['logical_cpus']} logical CPUs ({info['usable_cores']} usable), "
            f"{info.get('ram_gib', '?')} GiB RAM ({info.get('ram_available_gib', '?')} GiB available)",
            f"OS: {info['platform']}; load average at start {info['load_average_start']}"
            + (f", at end {info['load_average_end']}" if "load_average_end" in info else ""),
            "Versions: "
            + ", ".join(f"{k} {val}" for k, val in v.items())
            + f", python {info['python']}, torch threads {info['torch_threads']}",
        ]
    )


# ============================================================================ data
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


def build_data(store: Path, npy: Path, n: int, seed: int, synth: bool) -> float:
    """Write the same ``n`` samples into a new store and an ``.npy`` file in one pass; return seconds.

    The store uses the default layout (``WriterConfig()``) but skips fsync: durability is not measured here.
    """
    t0 = time.perf_counter()
    arr = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(n, *SYNTH_SHAPE))
    config = WriterConfig(sync=False)
    with open_writer(store, shape=SYNTH_SHAPE, dtype="float32", classes=list(SYNTH_CLASSES), config=config) as w:
        pos = 0
        for x, y in sample_batches(n, seed, synth):
            w.append(x, y)
            arr[pos : pos + len(x)] = x
            pos += len(x)
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


def random_batches(n: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of distinct random indices (slices of successive permutations)."""
    rng = np.random.default_rng([seed, 0xB0])
    out: list[np.ndarray] = []
    while len(out) < count:
        perm = rng.permutation(n)
        out.extend(perm[i : i + batch] for i in range(0, n - batch + 1, batch))
        if n < batch:
            out.append(perm)
    return out[:count]


def mode_batches(mode: str, n: int, spv: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches in the order the ``EpochBatchSampler`` of ``mode`` would draw them."""
    shuffle, bb = MODES[mode]
    if shuffle == "random":
        return random_batches(n, batch, count, seed)
    order = block_order(np.arange(n), spv, batch, bb, np.random.default_rng([seed, 0xB1]))
    out = [order[i : i + batch] for i in range(0, n, batch)]
    return (out * (-(-count // len(out))))[:count]


# ============================================================================ measurements
@dataclass
class Row:
    """One measurement of the results table."""

    kind: str  # memmap | read_batch | loader
    label: str
    mode: str
    workers: int | None
    cores: int
    rate: float  # best window, samples/s (wall clock)
    mean_rate: float  # all windows together
    cpu_rate: float | None = None  # samples per CPU second (all processes involved)
    per_core: float = 0.0
    ratio: float | None = None  # per_core / memmap baseline
    cpu_ratio: float | None = None  # cpu_rate / memmap baseline's cpu_rate
    goal: float | None = None
    met: bool | None = None
    windows: list[float] = field(default_factory=list)  # samples/s of each timing window or round
    warmup_seconds: float | None = None  # loader rows: the untimed warm-up epoch


def time_rounds(fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], rounds: int) -> dict[str, Any]:
    """Run ``fn`` over all ``batches`` ``rounds`` times; wall and CPU samples/s (best and overall)."""
    samples = sum(len(b) for b in batches)
    walls, cpus = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for b in batches:
            fn(b)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "rate": samples / min(walls),
        "mean_rate": samples * rounds / sum(walls),
        "cpu_rate": samples / max(min(cpus), 1e-9),
        "windows": [samples / w for w in walls],
    }


def bench_memmap(npy: Path, batches: Sequence[np.ndarray], rounds: int) -> dict[str, dict[str, Any]]:
    """Fancy-index the memmap with each batch: unsorted (as drawn) and sorted indices."""
    mm = np.load(npy, mmap_mode="r")
    float(mm[np.sort(batches[0])].sum())  # map the file and fault its first pages in outside the timing
    return {
        "unsorted": time_rounds(lambda b: mm[b], batches, rounds),
        "sorted": time_rounds(lambda b: mm[np.sort(b)], batches, rounds),
    }


def bench_read_batch(store: Path, batches: Sequence[np.ndarray], rounds: int) -> dict[str, Any]:
    """``StoreReader.read_batch`` in this process over ``batches``."""
    with StoreReader(store) as r:
        r.read_batch(batches[0])  # open and fault in the first pages outside the timing
        return time_rounds(r.read_batch, batches, rounds)


@dataclass
class LoaderPlan:
    """How each DataLoader configuration is driven."""

    batch: int
    warmup_batches: int  # -1: one whole epoch
    timed_batches: int
    window: int
    prefetch: int
    seed: int


def bench_loader(store: Path, mode: str, workers: int, plan: LoaderPlan, reuse: bool = True) -> dict[str, Any]:
    """Samples/s of the real loader for one shuffle mode and worker count (``reuse``: the workers' reusable
    shared-memory batch buffers, ``LoaderConfig.reuse_buffers``).

    Epoch 0 is the warm-up (workers start, open the store, fault its pages in); epoch 1 is timed after
    its first ``workers * prefetch + 2`` batches (the prefetch pipeline filling), in windows of
    ``plan.window`` batches.
    """
    from lmdbstore.config import LoaderConfig
    from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
    from lmdbstore.loader.samplers import EpochBatchSampler

    shuffle, bb = MODES[mode]
    reader = StoreReader(store)
    n, spv = len(reader), reader.meta.samples_per_value
    dataset = LmdbBatchDataset(reader)
    sampler = EpochBatchSampler(
        np.arange(n),
        plan.batch,
        shuffle=shuffle,
        samples_per_value=spv,
        block_buffer=bb,
        seed=plan.seed,
    )
    config = LoaderConfig(
        batch_size=plan.batch,
        shuffle=shuffle,
        block_buffer=bb,
        workers=workers,
        prefetch_factor=plan.prefetch,
        persistent_workers=workers > 0,
        reuse_buffers=reuse,
    )
    # More workers than cores is measured on purpose; PyTorch's warning about it would only add noise.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    loader = make_loader(dataset, sampler, config)
    per_epoch = len(sampler)
    skip = min(workers * plan.prefetch + 2 if workers else 1, per_epoch - 1)
    timed = max(1, min(plan.timed_batches, per_epoch - skip))
    window = max(1, min(plan.window, timed))
    try:
        sampler.set_epoch(0)
        warm = per_epoch if plan.warmup_batches < 0 else min(plan.warmup_batches, per_epoch)
        t0 = time.perf_counter()
        for _, _batch in zip(range(warm), loader, strict=False):
            pass
        warm_s = time.perf_counter() - t0
        sampler.set_epoch(1)
        it = iter(loader)
        for _ in range(skip):
            next(it)
        procs = getattr(it, "_workers", None) or getattr(getattr(loader, "_iterator", None), "_workers", [])
        clock = CpuClock([w.pid for w in procs])
        cpu0 = clock.now()
        rates, samples_all, seconds_all = [], 0, 0.0
        done = 0
        while done < timed:
            k = min(window, timed - done)
            samples = 0
            t0 = time.perf_counter()
            for _ in range(k):
                _x, y = next(it)
                samples += len(y)
            dt = time.perf_counter() - t0
            rates.append(samples / dt)
            samples_all += samples
            seconds_all += dt
            done += k
        cpu1 = clock.now()
        del it
    finally:
        del loader
        gc.collect()
    cpu_rate = samples_all / (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None and cpu1 > cpu0 else None
    return {
        "rate": max(rates),
        "mean_rate": samples_all / seconds_all,
        "cpu_rate": cpu_rate,
        "windows": rates,
        "warmup_seconds": warm_s,
    }


def bench_train(store: Path, workers: int, batch: int, steps: int, epochs: int, seed: int) -> list[dict[str, Any]]:
    """Run the real trainer on CPU for ``epochs`` short epochs; its per-epoch metrics as dicts."""
    from lmdbstore.config import LoaderConfig, TrainConfig
    from lmdbstore.training.trainer import train

    cfg = TrainConfig(epochs=epochs, max_steps_per_epoch=steps, device="cpu", val_fraction=0.0, log_every=10**6)
    lcfg = LoaderConfig(batch_size=batch, workers=workers, shuffle="random", seed=seed, persistent_workers=True)
    result = train(store, None, cfg, lcfg, log=None, progress=False)
    gc.collect()
    return [
        {
            "workers": workers,
            "epoch": m.epoch,
            "steps": min(steps, -(-m.train_samples // batch)),
            "samples_per_s": m.samples_per_s,
            "step_time_ms": m.step_time_ms,
            "data_wait_share": m.data_wait_share,
            "seconds": m.seconds,
        }
        for m in result.epochs
    ]


# ============================================================================ the run
def finish_rows(rows: list[Row], baseline: Row, cores: int) -> None:
    """Fill each row's cores, per-core rate, ratios to the baseline and goal verdict."""
    for r in rows:
        r.cores = 1 if not r.workers else min(r.workers, cores)
        r.per_core = r.rate / r.cores
        r.ratio = r.per_core / baseline.rate if baseline.rate > 0 else None
        if r.cpu_rate is not None and baseline.cpu_rate:
            r.cpu_ratio = r.cpu_rate / baseline.cpu_rate
        if r.kind == "loader":
            r.goal = GOALS[r.mode]
            r.met = r.ratio is not None and r.ratio >= r.goal


def goal_summary(rows: list[Row], train_rows: list[dict[str, Any]]) -> list[str]:
    """One line per goal: the best loader ratio per mode, and the trainer's data wait, with met / not met."""
    lines = []
    for mode in MODES:
        cand = [r for r in rows if r.kind == "loader" and r.mode == mode and r.ratio is not None]
        if not cand:
            continue
        best = max(cand, key=lambda r: r.ratio or 0.0)
        best_cpu = max(cand, key=lambda r: r.cpu_ratio or 0.0)
        cpu = (
            f"; in CPU time {best_cpu.cpu_ratio:.2f}x at {best_cpu.workers} worker(s)"
            if best_cpu.cpu_ratio is not None
            else ""
        )
        lines.append(
            f"- {mode}: best DataLoader rate per core {fmt_rate(best.per_core)}/s at {best.workers} worker(s) "
            f"= {best.ratio:.2f}x memmap per core{cpu} (goal >= {GOALS[mode]:.1f}x): "
            f"**{'met' if best.met else 'not met'}**"
        )
    warm = [t for t in train_rows if t["epoch"] > 0] or train_rows
    if warm:
        worst = max(warm, key=lambda t: t["data_wait_share"])
        best_t = min(warm, key=lambda t: t["data_wait_share"])
        verdict = "met" if best_t["data_wait_share"] < DATA_WAIT_GOAL else "not met"
        lines.append(
            f"- trainer data wait ({'warm epochs' if warm is not train_rows else 'first epoch'}): "
            f"{100 * best_t['data_wait_share']:.1f}% at {best_t['workers']} worker(s), worst "
            f"{100 * worst['data_wait_share']:.1f}% at {worst['workers']} (goal < {100 * DATA_WAIT_GOAL:.0f}% "
            f"of a CPU training step): **{verdict}**"
        )
    return lines


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(info: dict[str, Any], args: argparse.Namespace, rows: list[Row], train_rows: list[dict[str, Any]]) -> str:
    """The markdown report: machine, loader table, trainer table, goals."""
    out = [describe_machine(info), ""]
    out.append(
        f"Store: {args.n:,} samples of 25x25 float32 ({info.get('samples_per_value', '?')} per LMDB value), "
        f"batch {args.batch}.  samples/s: wall clock, best window (mean of all windows).  per core: samples/s / "
        f"min(workers, {info['usable_cores']} cores), 0 workers = 1 core.  x memmap/core: per core / memmap sorted "
        f"({fmt_rate(info.get('baseline'))}/s).  CPU samples/s: samples per CPU-second of all processes involved "
        f"(main + workers); x memmap (CPU): that / memmap sorted's ({fmt_rate(info.get('baseline_cpu'))}/CPU-s)."
    )
    out.append("")
    out.append(
        "| measurement | mode | workers | samples/s | per core | x memmap/core | CPU samples/s | x memmap (CPU) | goal |"
    )
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        goal = "-" if r.goal is None else f">= {r.goal:.1f}: {'met' if r.met else 'not met'}"
        out.append(
            f"| {r.label} | {r.mode} | {'-' if r.workers is None else r.workers} | "
            f"{fmt_rate(r.rate)} ({fmt_rate(r.mean_rate)}) | {fmt_rate(r.per_core)} | {_ratio(r.ratio)} | "
            f"{fmt_rate(r.cpu_rate)} | {_ratio(r.cpu_ratio)} | {goal} |"
        )
    if train_rows:
        out += ["", "| trainer (CPU, random order) | workers | epoch | steps | samples/s | step ms | data wait |"]
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for t in train_rows:
            out.append(
                f"| lmdbstore.training.trainer.train | {t['workers']} | {t['epoch'] + 1} | {t['steps']} | "
                f"{fmt_rate(t['samples_per_s'])} | {t['step_time_ms']:.0f} | {100 * t['data_wait_share']:.1f}% |"
            )
    out += ["", "Goals:", *goal_summary(rows, train_rows)]
    return "\n".join(out) + "\n"


def write_outputs(out_dir: Path, report: str, payload: dict[str, Any], rows: list[Row]) -> None:
    """``bench_loader.md``, ``bench_loader.csv`` and ``bench_loader.json`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_loader.md").write_text(report)
    (out_dir / "bench_loader.json").write_text(json.dumps(payload, indent=2))
    fields = [f for f in asdict(rows[0]) if f != "windows"] if rows else []
    with open(out_dir / "bench_loader.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
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
    p.add_argument("--workers", default="0,1,2,3", help="DataLoader worker counts (default 0,1,2,3)")
    p.add_argument("--modes", default=",".join(MODES), help=f"shuffle modes (default {','.join(MODES)})")
    p.add_argument("--rounds", type=int, default=3, help="repeats of each single-process measurement")
    p.add_argument("--sp-batches", type=int, default=24, help="batches per single-process round")
    p.add_argument("--warmup-batches", type=int, default=-1, help="loader warm-up batches (-1: a whole epoch)")
    p.add_argument("--timed-batches", type=int, default=48, help="timed loader batches per configuration")
    p.add_argument("--window", type=int, default=8, help="loader batches per timing window")
    p.add_argument("--prefetch", type=int, default=2, help="DataLoader prefetch_factor (default 2)")
    p.add_argument(
        "--compare-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each worker count with reuse_buffers=False (default: on)",
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info()
    log(describe_machine(info).replace("\n", "; "))
    cores = info["usable_cores"]
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lmdbstore-bench-loader-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        store, npy, facts = prepare_data(args, workdir)
        info.update(facts)
        spv = facts["samples_per_value"]
        batches = {m: mode_batches(m, args.n, spv, args.batch, args.sp_batches, args.seed) for m in args.mode_list}
        rand = random_batches(args.n, args.batch, args.sp_batches, args.seed)

        log("memmap baseline")
        mm_first = bench_memmap(npy, rand, args.rounds)
        rows: list[Row] = []
        for mode in args.mode_list:
            log(f"read_batch, {mode}")
            res = bench_read_batch(store, batches[mode], args.rounds)
            rows.append(Row("read_batch", "StoreReader.read_batch (1 process)", mode, None, 1, **res))
        plan = LoaderPlan(args.batch, args.warmup_batches, args.timed_batches, args.window, args.prefetch, args.seed)
        for mode in args.mode_list:
            for w in args.worker_list:
                log(f"DataLoader, {mode}, {w} worker(s)")
                res = bench_loader(store, mode, w, plan)
                rows.append(Row("loader", "DataLoader (LmdbBatchDataset)", mode, w, 1, **res))
                if w > 0 and args.compare_reuse:
                    log(f"DataLoader, {mode}, {w} worker(s), a fresh shared-memory segment per batch")
                    res = bench_loader(store, mode, w, plan, reuse=False)
                    rows.append(Row("loader", "DataLoader, reuse_buffers=False", mode, w, 1, **res))
        train_rows: list[dict[str, Any]] = []
        for w in args.train_list:
            log(f"trainer, {w} worker(s), {args.train_epochs} epoch(s) of {args.train_steps} steps")
            train_rows += bench_train(store, w, args.batch, args.train_steps, args.train_epochs, args.seed)
        log("memmap baseline again")
        mm_last = bench_memmap(npy, rand, args.rounds)
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not args.keep:  # a given --workdir stays; what this run wrote into it goes
            if args.store is None:
                shutil.rmtree(workdir / "store", ignore_errors=True)
            if args.npy is None:
                (workdir / "samples.npy").unlink(missing_ok=True)

    mm_rows = []
    for variant in ("unsorted", "sorted"):
        a, b = mm_first[variant], mm_last[variant]
        best = a if a["rate"] >= b["rate"] else b
        merged = {**best, "cpu_rate": max(a["cpu_rate"], b["cpu_rate"]), "windows": a["windows"] + b["windows"]}
        label = f"memmap fancy-index, {variant} indices" + (" (baseline)" if variant == "sorted" else "")
        mm_rows.append(Row("memmap", label, "random", None, 1, **merged))
    rows = mm_rows + rows
    baseline = mm_rows[1]
    info["baseline"] = baseline.rate
    info["baseline_cpu"] = baseline.cpu_rate
    info["load_average_end"] = load_average()
    finish_rows(rows, baseline, cores)
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
