#!/usr/bin/env python
"""write_parallel benchmark: producer scaling against one worker, and the single writer against np.save.

What it measures, on tasks of 4,096 z-scored 25x25 float32 samples (``BENCH_PARALLEL_TASK_SAMPLES``):

* ``produce``      the producer alone in this process: milliseconds of numpy work per task (one
                   augmentation round, ``--rounds``, takes about 50 ms on a 2-core x86-64 VM).
* ``workers=N``    ``write_parallel`` with N spawned workers (``--workers``), wall clock of the whole call
                   (spawn start-up included) and the rate after the first task (steady state), and the
                   ratio against 1 worker (the mean of the 1-worker runs).
* ``executor=``    ``write_parallel(..., executor=...)`` on an engine started before the call, as one a user
                   already runs: ``daskN`` a Dask ``LocalCluster`` of N worker processes (goal: 2 of them
                   >= 1.4x one local worker on this producer), ``ppeN`` a ``ProcessPoolExecutor``.  The
                   default runs are ``1,2,dask2,1,2,dask2`` (``1,2,1,2`` without Dask installed).
* ``writer``       the writer alone: ``StoreWriter.append`` + commits (crc32, fsync per 64 MiB commit) of
                   ready arrays, in this process; MB/s of sample bytes.
* ``np.save``      the same bytes written with ``np.save`` to one file and fsynced, same run: the baseline
                   the writer's rate is stated against.
* ``pipe``         results crossing from a worker to this process (pickled arrays through a pipe, what
                   ``write_parallel`` uses) with no writing: is the transport a limit?

Usage::

    python scripts/bench/parallel.py                 # a few minutes
    python scripts/bench/parallel.py --quick         # seconds; a smoke test

Prints a Markdown table; ``--out DIR`` also writes ``bench_parallel.md`` and ``bench_parallel.json``.
Data goes to a temporary directory (``--workdir``), removed at the end.  Commits are timed by replacing
``lmdbstore.ingestion.parallel.progress_bar`` (which ``write_parallel`` calls once per committed task)
for the duration of each call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# scripts/, so that bench.* imports when run as a file (spawned workers import this file as their __main__)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import markdown_table, write_json
from lmdbstore import WriterConfig, open_writer, write_parallel
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.ingestion.pool import OrderedPool

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]
ROUNDS = int(os.environ.get("BENCH_PARALLEL_ROUNDS", "1"))  # --rounds; the environment reaches the workers
TASK_SAMPLES = int(os.environ.get("BENCH_PARALLEL_TASK_SAMPLES", "4096"))
_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def augment(task: int) -> tuple[np.ndarray, np.ndarray]:
    """A producer whose numpy compute dominates: noise, ``ROUNDS`` blur/shift/nonlinearity passes, z-score."""
    rng = np.random.default_rng(task)
    x = rng.standard_normal((TASK_SAMPLES, *SHAPE), dtype=np.float32)
    for r in range(ROUNDS):
        x = 0.5 * x + 0.25 * (np.roll(x, 1, axis=1) + np.roll(x, -1, axis=2))
        x = np.tanh(x * (1.0 + 0.1 * r), out=x)
    x -= x.mean(axis=(1, 2), keepdims=True)
    x /= x.std(axis=(1, 2), keepdims=True) + 1e-6
    return x, rng.integers(0, len(CLASSES), TASK_SAMPLES)


def cached(task: int) -> tuple[np.ndarray, np.ndarray]:
    """Ready arrays of the same size (no compute): the transport or the writer alone."""
    if not _CACHE:
        _CACHE[0] = augment(0)
    return _CACHE[0]


def _time(fn: Any) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class CommitStamps:
    """Stands in for ``write_parallel``'s progress bar, which it updates once per committed task: records when."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def update(self, n: int) -> None:
        self.stamps.append(time.perf_counter())

    def set_postfix_str(self, *a: Any, **k: Any) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def runner(spec: str) -> Iterator[tuple[int | None, Any]]:
    """``(workers, executor)`` for a run spec: ``N`` the local pool of N workers, ``daskN`` a Dask LocalCluster
    of N worker processes (one thread each) through its Client, ``ppeN`` a spawn ``ProcessPoolExecutor``.
    The engine starts (and its workers import numpy) before the timed call, as one a user already runs."""
    if spec.isdigit():
        yield int(spec), None
    elif spec.startswith("dask"):
        from distributed import Client, LocalCluster

        n = int(spec[4:])
        with (
            LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            client.run(augment, 0)  # every worker imported the producer
            yield None, client
    elif spec.startswith("ppe"):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, wait

        n = int(spec[3:])
        with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
            wait([ex.submit(augment, i) for i in range(n)])
            yield None, ex
    else:
        raise ValueError(f"--workers: unknown run {spec!r} (N, daskN or ppeN)")


def run_label(spec: str) -> str:
    """The table's name of a run spec."""
    if spec.startswith("dask"):
        return f"executor=Dask LocalCluster, {spec[4:]} worker processes"
    if spec.startswith("ppe"):
        return f"executor=ProcessPoolExecutor({spec[3:]})"
    return f"workers={spec}"


def bench_workers(work: Path, tasks: int, spec: str) -> dict[str, Any]:
    """``write_parallel`` of ``tasks`` tasks on the run ``spec`` (see :func:`runner`): the whole call's rate, the
    steady rate between the first and the last commit, and CPU milliseconds per task in the writer and the
    (local) workers."""
    import lmdbstore.ingestion.parallel as par

    path = work / f"w{spec}_{time.monotonic_ns()}"
    clock = CommitStamps()
    orig = par.progress_bar
    with runner(spec) as (workers, executor):
        par.progress_bar = lambda *a, **k: clock  # type: ignore[assignment]
        try:
            c0, t0 = os.times(), time.perf_counter()
            rep = write_parallel(
                path,
                augment,
                range(tasks),
                workers=workers,
                executor=executor,
                shape=SHAPE,
                dtype="float32",
                classes=CLASSES,
                config=WriterConfig(),
            )
            wall, c1 = time.perf_counter() - t0, os.times()
        finally:
            par.progress_bar = orig
    shutil.rmtree(path)
    stamps = clock.stamps
    steady = (len(stamps) - 1) * TASK_SAMPLES / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {
        "run": spec,
        "workers": workers,
        "samples": rep.added,
        "wall_s": wall,
        "rate": rep.added / wall,
        "steady_rate": steady,
        # CPU seconds per task: the writer's process (with a LocalCluster: its scheduler too), and the reaped
        # local worker processes together (engines' workers are not reaped during the call: not counted)
        "writer_cpu_ms": ((c1.user - c0.user) + (c1.system - c0.system)) / tasks * 1e3,
        "workers_cpu_ms": ((c1.children_user - c0.children_user) + (c1.children_system - c0.children_system))
        / tasks
        * 1e3,
    }


def bench_writer(work: Path, tasks: int) -> dict[str, Any]:
    """The writer alone on ready arrays (as write_parallel drives it: statistics come precomputed), the
    writer computing the statistics itself (a plain append loop), and np.save of the same bytes."""
    x, y = cached(0)
    stats = ValueStats()
    stats.update(x)
    nbytes = x.nbytes * tasks
    out: dict[str, Any] = {"bytes": nbytes}
    for label, given in (("writer_mb_s", stats), ("writer_own_stats_mb_s", None)):
        path = work / "writer"
        with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES) as w:
            t0 = time.perf_counter()
            for i in range(tasks):
                w.append(x, y, progress=("bench", i + 1), stats=given)
            w.commit()
            out[label] = nbytes / (time.perf_counter() - t0) / 1e6
        shutil.rmtree(path)
    big = np.concatenate([x] * tasks)
    npy = work / "same.npy"
    t0 = time.perf_counter()
    with open(npy, "wb") as f:
        np.save(f, big)
        f.flush()
        os.fsync(f.fileno())
    out["npsave_mb_s"] = nbytes / (time.perf_counter() - t0) / 1e6
    npy.unlink()
    return out


def bench_pipe(tasks: int) -> dict[str, Any]:
    """MB/s of ready results crossing from one worker to this process (``OrderedPool``), nothing written."""
    pool = OrderedPool(cached, workers=1, limit=2)
    got = 0
    it = pool.results(range(tasks + 1))
    next(it)  # start-up and the first result are not timed
    t0 = time.perf_counter()
    for _, (x, _y) in it:
        got += x.nbytes
    return {"pipe_mb_s": got / (time.perf_counter() - t0) / 1e6}


def default_runs() -> str:
    """Local 1 and 2 workers, then a Dask LocalCluster of 2 processes when Dask is installed; twice."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        return "1,2,1,2"
    return "1,2,dask2,1,2,dask2"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``--quick``: 6 tasks)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=60, help="tasks per write_parallel run (default 60)")
    ap.add_argument(
        "--workers",
        default=None,
        help="runs, in this order: N local workers, daskN (a Dask LocalCluster of N processes), ppeN "
        "(ProcessPoolExecutor); default 1,2,dask2,1,2,dask2 (twice, as load drifts; no dask without Dask)",
    )
    ap.add_argument("--quick", action="store_true", help="few tasks: a smoke test")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="augmentation passes per task (default 1: ~50 ms)")
    return ap.parse_args(argv)


def measure(tasks: int, runs: Sequence[str], workdir: Path | None) -> dict[str, Any]:
    """The producer alone, ``write_parallel`` on each run, the writer and np.save, and the pipe; the data goes
    to a temporary directory under ``workdir`` (removed)."""
    work = Path(tempfile.mkdtemp(prefix="bench_parallel_", dir=workdir))
    try:
        per_task = min(_time(lambda: augment(1)) for _ in range(3))
        rows = [bench_workers(work, tasks, spec) for spec in runs]
        writer = bench_writer(work, tasks)
        pipe = bench_pipe(min(tasks, 30))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"per_task_s": per_task, "rows": rows, "writer": writer, "pipe": pipe, "tasks": tasks}


def render(data: dict[str, Any]) -> str:
    """The machine line and the two tables; ratios against the mean of the 1-worker runs (the first run if
    there is none) and against np.save; the goal of a Dask row: >= 1.4x one local worker."""
    tasks, rows, writer, pipe = data["tasks"], data["rows"], data["writer"], data["pipe"]
    mb_task = TASK_SAMPLES * int(np.prod(SHAPE)) * 4 / 1e6
    ones = [r for r in rows if r["run"] == "1"] or rows[:1]
    base_rate = float(np.mean([r["rate"] for r in ones]))
    base_steady = float(np.mean([r["steady_rate"] for r in ones]))
    load = os.getloadavg()[0]
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load:.1f} at the end; {tasks} tasks x {TASK_SAMPLES} samples 25x25 float32 "
        f"({mb_task:.1f} MB per task); produce: {data['per_task_s'] * 1e3:.0f} ms per task in one process; "
        f"ratios against the mean of the {'workers=1 runs' if rows and rows[0]['run'] == '1' else 'first run'}",
        "",
    ]
    header = [
        "run",
        "samples/s (whole call)",
        "ratio",
        "samples/s (steady)",
        "ratio",
        "goal",
        "CPU ms/task: writer",
        "workers",
    ]
    cells = [
        [
            run_label(r["run"]),
            f"{r['rate']:,.0f}",
            f"{r['rate'] / base_rate:.2f}x",
            f"{r['steady_rate']:,.0f}",
            f"{r['steady_rate'] / base_steady:.2f}x",
            (">= 1.4x: " + ("met" if r["rate"] / base_rate >= 1.4 else "not met"))
            if r["run"].startswith("dask")
            else "",
            f"{r['writer_cpu_ms']:.0f}",
            f"{r['workers_cpu_ms']:.0f}" if r["workers"] else "-",
        ]
        for r in rows
    ]
    lines += markdown_table(header, "|---|---:|---:|---:|---:|---|---:|---:|", cells)
    sps = 1e6 / (int(np.prod(SHAPE)) * 4)
    npsave = writer["npsave_mb_s"]
    rates = [
        ("np.save + fsync", npsave),
        ("single writer as write_parallel drives it (crc32, fsync)", writer["writer_mb_s"]),
        ("plain append loop (value statistics in the writer)", writer["writer_own_stats_mb_s"]),
        ("worker -> writer pipe (pickled arrays, no write)", pipe["pipe_mb_s"]),
    ]
    cells = [[label, f"{mb_s:,.0f}", f"{mb_s * sps:,.0f}", f"{mb_s / npsave:.2f}x"] for label, mb_s in rates]
    header = ["single writer vs baselines (same bytes, same run)", "MB/s", "samples/s", "vs np.save"]
    lines += ["", *markdown_table(header, "|---|---:|---:|---:|", cells)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    args = parse_args(argv)
    globals()["ROUNDS"] = args.rounds
    os.environ["BENCH_PARALLEL_ROUNDS"] = str(args.rounds)
    tasks = 6 if args.quick else args.tasks
    runs = [w.strip() for w in (args.workers or default_runs()).split(",") if w.strip()]
    data = measure(tasks, runs, args.workdir)
    text = render(data)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_parallel.md").write_text(text + "\n")
        write_json(args.out / "bench_parallel.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
