"""The loader benchmark's results: one :class:`Row` per measurement, per-core ratios against the memmap
baseline measured in the same run, the goals, the machine, and the Markdown / CSV / JSON outputs.

Not a benchmark itself: ``bench.loader`` (run as ``python scripts/bench/loader.py``) measures the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

import lmdbstore
from bench.common import write_json
from bench.loader_runs import MODES
from bench.machine import host_facts, load_average, usable_cores

#: Goal per mode from the issue: DataLoader samples/s per core at least this share of memmap's.
GOALS: dict[str, float] = {"random": 0.3, "block1": 0.8, "block2": 0.8, "block4": 0.8}
#: Goal for the trainer: data wait below this share of a CPU training step.
DATA_WAIT_GOAL = 0.05


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


def fmt_rate(v: float | None) -> str:
    """Samples/s as ``1.23M`` / ``456k`` (``-`` when missing)."""
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.0f}k"
    return f"{v:.0f}"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and library versions."""
    import torch

    info = host_facts()
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
    write_json(out_dir / "bench_loader.json", payload)
    fields = [f for f in asdict(rows[0]) if f != "windows"] if rows else []
    with open(out_dir / "bench_loader.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
