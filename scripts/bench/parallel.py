#!/usr/bin/env python
"""write_parallel benchmark: a sweep of task costs on local workers and engines, where each CPU-millisecond goes,
and the single writer against np.save.

The producer makes tasks of 4,096 25x25 float32 samples (``BENCH_PARALLEL_TASK_SAMPLES``; 10.2 MB of results per
task): uniform noise, ``rounds`` blur/shift/tanh passes over the whole batch (numpy temporaries of 10 MB, as an
augmentation makes), z-scored per sample.  A task is ``(seed, rounds)``; ``rounds`` is calibrated in this process
for each task cost of the sweep (``--costs``, default 10, 50 and 200 ms).

* ``sweep``        for each task cost, ``--rounds`` interleaved rounds (default 3): in each round every run of
                   ``--workers`` once, in order -- ``N`` the local pool of N spawned workers (spawn start-up
                   included), ``daskN`` a Dask ``LocalCluster(n_workers=N, threads_per_worker=1, processes=True)``
                   as a user makes it, ``daskNt`` the same tuned for numpy producers (the workers'
                   ``MALLOC_TRIM_THRESHOLD_`` unset, their statistical profiler off; see docs/cluster.md), ``ppeN``
                   a spawn ``ProcessPoolExecutor``.  An engine is started (and its workers import the producer)
                   before each timed call, as one a user already runs, and closed after it.  Reported: the median
                   and the spread (min-max) of the whole call's samples/s and of its ratio to the 1-worker run
                   *of the same round*, the steady ratio (first to last commit), and CPU milliseconds per task:
                   the writer's thread, the other threads of the writer's process (a Dask client's IO loop
                   with its LocalCluster's scheduler; the pool's feeders), and the workers (local: the reaped
                   processes, spawn start-up included; Dask: the worker processes, all threads).
                   Goal of a ``dask2`` row at >= 50 ms per task: >= 1.4x one local worker.
* ``writer``       the writer alone: ``StoreWriter.append`` + commits (crc32, fsync per 64 MiB commit) of
                   ready arrays, in this process; MB/s of sample bytes.
* ``np.save``      the same bytes written with ``np.save`` to one file and fsynced, same run: the baseline
                   the writer's rate is stated against.
* ``pipe``         results crossing from a worker to this process (pickled arrays through a pipe, what
                   the local pool uses) with no writing: is the transport a limit?

Usage::

    python scripts/bench/parallel.py                 # the sweep: about 6 minutes on 2 cores
    python scripts/bench/parallel.py --quick         # seconds; a smoke test

Prints Markdown tables; ``--out DIR`` also writes ``bench_parallel.md`` and ``bench_parallel.json``.  Data goes
to a temporary directory (``--workdir``), removed at the end.  Commits are timed by replacing
``lmdbstore.ingestion.parallel.progress_bar`` (which ``write_parallel`` calls once per committed task) for the
duration of each call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
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
from lmdbstore.util.pool import OrderedPool

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]
TASK_SAMPLES = int(os.environ.get("BENCH_PARALLEL_TASK_SAMPLES", "4096"))
#: Task costs of the sweep (ms of the producer in one process) and the produce-seconds a run aims at.
COSTS_MS = (10, 50, 200)
RUN_SECONDS = 4.0
#: A Dask cluster tuned for numpy producers (the ``daskNt`` runs): glibc's own malloc thresholds in the workers
#: (Dask sets ``MALLOC_TRIM_THRESHOLD_=65536``, which makes every large numpy temporary fault its pages in afresh)
#: and no statistical profiler sampling the workers' stacks every 10 ms.
DASK_TUNED = {
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    "distributed.worker.profile.enabled": False,
}
_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def augment(task: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Task ``(seed, rounds[, block])``: noise, ``rounds`` blur/shift/tanh passes over the whole batch (or over
    ``block`` samples at a time, whose temporaries stay in cache), z-scored samples."""
    seed, rounds, block = (*task, 0)[:3]
    rng = np.random.default_rng(seed)
    x = rng.random((TASK_SAMPLES, *SHAPE), dtype=np.float32)
    for lo in range(0, TASK_SAMPLES, block or TASK_SAMPLES):
        part = x[lo : lo + (block or TASK_SAMPLES)]
        for r in range(rounds):
            part = 0.5 * part + 0.25 * (np.roll(part, 1, axis=1) + np.roll(part, -1, axis=2))
            part = np.tanh(part * np.float32(1.0 + 0.1 * (r % 5)), out=part)
        x[lo : lo + len(part)] = part
    flat = x.reshape(len(x), -1)
    flat -= flat.mean(axis=1, keepdims=True)
    flat /= flat.std(axis=1, keepdims=True) + np.float32(1e-6)
    return x, rng.integers(0, len(CLASSES), TASK_SAMPLES)


def cached(task: Any) -> tuple[np.ndarray, np.ndarray]:
    """Ready arrays of the same size (no compute): the transport or the writer alone."""
    if not _CACHE:
        _CACHE[0] = augment((0, 0))
    return _CACHE[0]


def produce_ms(rounds: int, block: int = 0, reps: int = 3) -> float:
    """Milliseconds of one task of ``rounds`` (passes over ``block`` samples at a time) in this process (the best
    of ``reps``)."""
    augment((0, rounds, block))
    best = float("inf")
    for i in range(reps):
        t0 = time.perf_counter()
        augment((i + 1, rounds, block))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def calibrate(cost_ms: float, block: int = 0) -> tuple[int, float]:
    """The rounds whose task costs about ``cost_ms`` here (at least 0), and that task's measured milliseconds: a
    first guess from the cost of 0 and 8 rounds, then corrected twice from the cost measured at the guess (the
    cost per round grows with the allocator's page faults, not quite linearly)."""
    base = produce_ms(0, block)
    rounds, ms = 8, produce_ms(8, block)
    for _ in range(3):
        per_round = max((ms - base) / max(rounds, 1), 1e-3)
        guess = max(0, round((cost_ms - base) / per_round))
        if guess == rounds:
            break
        rounds, ms = guess, produce_ms(guess, block)
    return rounds, ms


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
def runner(spec: str) -> Iterator[tuple[int | None, Any, list[int]]]:
    """``(workers, executor, engine worker pids)`` for a run spec: ``N`` the local pool of N workers, ``daskN`` a
    Dask LocalCluster of N worker processes (one thread each) through its Client (``daskNt``: tuned, see
    :data:`DASK_TUNED`), ``ppeN`` a spawn ``ProcessPoolExecutor``.  The engine starts (and its workers import the
    producer) before the timed call, as one a user already runs."""
    if spec.isdigit():
        yield int(spec), None, []
    elif spec.startswith("dask"):
        import dask
        from distributed import Client, LocalCluster

        tuned = spec.endswith("t")
        n = int(spec[4:].rstrip("t"))
        environ = dict(os.environ)  # a Nanny sets its pre-spawn-environ in this process's own environment too
        try:
            with (
                dask.config.set(DASK_TUNED if tuned else {}),
                LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
                Client(cluster) as client,
            ):
                client.run(augment, (0, 0))  # every worker imported the producer
                yield None, client, sorted(client.run(os.getpid).values())
        finally:  # else later local workers (and tuned clusters) inherit MALLOC_TRIM_THRESHOLD_=65536
            os.environ.clear()
            os.environ.update(environ)
    elif spec.startswith("ppe"):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, wait

        n = int(spec[3:])
        with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as ex:
            wait([ex.submit(augment, (i, 0)) for i in range(n)])
            yield None, ex, []  # its workers are reaped at shutdown, after the call: not counted
    else:
        raise ValueError(f"--workers: unknown run {spec!r} (N, daskN, daskNt or ppeN)")


def run_label(spec: str) -> str:
    """The table's name of a run spec."""
    if spec.startswith("dask"):
        tuned = ", tuned" if spec.endswith("t") else ""
        return f"Dask LocalCluster({spec[4:].rstrip('t')}){tuned}"
    if spec.startswith("ppe"):
        return f"ProcessPoolExecutor({spec[3:]})"
    return f"workers={spec}"


class CpuClock:
    """CPU seconds of this process's main thread, of its other threads, of its reaped children, and of the
    processes ``pids`` (an engine's workers), between :meth:`start` and :meth:`stop`.  Without psutil (the
    ``[bench]`` extra) the threads are not told apart (all count as the writer's) and engines are not counted."""

    def __init__(self, pids: Sequence[int]) -> None:
        try:
            import psutil
        except ImportError:
            self._me, self._procs = None, []
        else:
            self._me, self._procs = psutil.Process(), [psutil.Process(p) for p in pids]
        self._main = threading.main_thread().native_id

    def _read(self) -> tuple[float, float, float, float]:
        c = os.times()
        if self._me is None:
            return c.user + c.system, 0.0, c.children_user + c.children_system, 0.0
        threads = [(t.id, t.user_time + t.system_time) for t in self._me.threads()]
        main = sum(s for tid, s in threads if tid == self._main)
        other = sum(s for tid, s in threads if tid != self._main)
        engine = sum(sum(p.cpu_times()[:2]) for p in self._procs)
        return main, other, c.children_user + c.children_system, engine

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> dict[str, float]:
        main, other, children, engine = (b - a for a, b in zip(self._t0, self._read(), strict=True))
        return {"writer_thread_s": main, "writer_other_s": other, "workers_s": children + engine}


def bench_run(work: Path, tasks: int, rounds: int, spec: str, block: int = 0) -> dict[str, Any]:
    """``write_parallel`` of ``tasks`` tasks of ``rounds`` (over ``block`` samples at a time) on the run ``spec`` (see :func:`runner`): the whole
    call's rate, the steady rate between the first and the last commit, and CPU milliseconds per task."""
    import lmdbstore.ingestion.parallel as par

    path = work / f"w{spec}_{time.monotonic_ns()}"
    clock = CommitStamps()
    orig = par.progress_bar
    with runner(spec) as (workers, executor, pids):
        cpu = CpuClock(pids)
        par.progress_bar = lambda *a, **k: clock  # type: ignore[assignment]
        try:
            cpu.start()
            t0 = time.perf_counter()
            rep = write_parallel(
                path,
                augment,
                [(seed, rounds, block) for seed in range(tasks)],
                workers=workers,
                executor=executor,
                shape=SHAPE,
                dtype="float32",
                classes=CLASSES,
                config=WriterConfig(),
            )
            wall = time.perf_counter() - t0
            used = cpu.stop()
        finally:
            par.progress_bar = orig
    shutil.rmtree(path)
    stamps = clock.stamps
    steady = (len(stamps) - 1) * TASK_SAMPLES / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {
        "run": spec,
        "samples": rep.added,
        "wall_s": wall,
        "rate": rep.added / wall,
        "steady_rate": steady,
        **{k.replace("_s", "_ms"): v / tasks * 1e3 for k, v in used.items()},
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
    """Local 1 and 2 workers, then a Dask LocalCluster of 2 processes (as made, and tuned) when Dask is installed."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        return "1,2"
    return "1,2,dask2,dask2t"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``--quick``: one 10 ms cost, 6 tasks, one round)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--costs", default=",".join(map(str, COSTS_MS)), help="task costs in ms, in this process (default 10,50,200)"
    )
    ap.add_argument(
        "--tasks", type=int, default=None, help=f"tasks per run (default: about {RUN_SECONDS:g} s of produce, 12-160)"
    )
    ap.add_argument(
        "--workers",
        default=None,
        help="runs of each round, in order: N local workers, daskN (a Dask LocalCluster of N processes), daskNt "
        "(the same, tuned), ppeN (ProcessPoolExecutor); default 1,2,dask2,dask2t (1,2 without Dask)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run (default 3)")
    ap.add_argument(
        "--block",
        type=int,
        default=0,
        help="the producer's passes over this many samples at a time (cache-sized temporaries: a producer that "
        "scales with cores rather than with memory bandwidth); default 0: over the whole 10 MB batch",
    )
    ap.add_argument("--quick", action="store_true", help="one 10 ms cost, 6 tasks, one round: a smoke test")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def tasks_for(cost_ms: float, tasks: int | None) -> int:
    """Tasks per run: ``tasks`` if given, else about :data:`RUN_SECONDS` of produce (12 to 160)."""
    return tasks or int(min(160, max(12, RUN_SECONDS * 1e3 / max(cost_ms, 1.0))))


def measure(
    costs: Sequence[float], runs: Sequence[str], rounds: int, tasks: int | None, workdir: Path | None, block: int = 0
) -> dict:
    """The sweep (each cost: calibration, then ``rounds`` rounds of every run), the writer and np.save, and the
    pipe; the data goes to a temporary directory under ``workdir`` (removed)."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_parallel_", dir=workdir))
    load0 = os.getloadavg()[0]
    sweep = []
    try:
        for cost in costs:
            n_rounds, ms = calibrate(cost, block)
            n = tasks_for(cost, tasks)
            rows = [{"round": i, **bench_run(work, n, n_rounds, spec, block)} for i in range(rounds) for spec in runs]
            sweep.append({"cost_ms": cost, "rounds_per_task": n_rounds, "produce_ms": ms, "tasks": n, "rows": rows})
        ready = max(6, min(tasks or 24, 24))
        writer = bench_writer(work, ready)
        pipe = bench_pipe(ready)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [r for s in sweep for r in s["rows"]]
    load = [load0, os.getloadavg()[0]]
    return {"sweep": sweep, "rows": rows, "writer": writer, "pipe": pipe, "load": load, "block": block}


def summarize(entry: dict[str, Any], runs: Sequence[str]) -> list[dict[str, Any]]:
    """Per run of one cost: median and min-max of the rates, of the ratios to the same round's first run
    (``1`` when there is one), and the median CPU ms per task."""
    rows = entry["rows"]
    base = "1" if "1" in runs else runs[0]
    by_round = {r["round"]: r for r in rows if r["run"] == base}
    out = []
    for spec in runs:
        mine = [r for r in rows if r["run"] == spec]
        ratios = [r["rate"] / by_round[r["round"]]["rate"] for r in mine]
        steady = [r["steady_rate"] / by_round[r["round"]]["steady_rate"] for r in mine]
        out.append(
            {
                "run": spec,
                "rate": [
                    statistics.median(r["rate"] for r in mine),
                    min(r["rate"] for r in mine),
                    max(r["rate"] for r in mine),
                ],
                "ratio": [statistics.median(ratios), min(ratios), max(ratios)],
                "steady_ratio": statistics.median(steady),
                **{
                    k: statistics.median(r[k] for r in mine)
                    for k in ("writer_thread_ms", "writer_other_ms", "workers_ms")
                },
            }
        )
    return out


def render(data: dict[str, Any], runs: Sequence[str]) -> str:
    """The machine line, the sweep table and the writer's table; the goal of a ``daskN`` row (defaults) at
    >= 50 ms per task: >= 1.4x one local worker."""
    writer, pipe, (load0, load1) = data["writer"], data["pipe"], data["load"]
    mb_task = TASK_SAMPLES * int(np.prod(SHAPE)) * 4 / 1e6
    rounds = max((r["round"] for r in data["rows"]), default=0) + 1
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load average "
        f"{load0:.1f} before, {load1:.1f} at the end; tasks of {TASK_SAMPLES} samples 25x25 float32 ({mb_task:.1f} MB), "
        f"passes over {data['block'] or 'all'} samples at a time; "
        f"{rounds} interleaved round(s): median (min-max); ratios to the workers=1 run of the same round",
        "",
    ]
    header = [
        "task cost (here)",
        "run",
        "samples/s",
        "ratio",
        "steady ratio",
        "CPU ms/task: writer thread",
        "writer's other threads",
        "workers",
        "goal",
    ]
    cells = []
    for entry in data["sweep"]:
        cost = f"{entry['cost_ms']:g} ms ({entry['produce_ms']:.0f} ms, {entry['tasks']} tasks)"
        for s in summarize(entry, runs):
            rate, ratio = s["rate"], s["ratio"]
            goal = ""
            if s["run"].startswith("dask") and not s["run"].endswith("t") and entry["cost_ms"] >= 50:
                goal = ">= 1.4x: " + ("met" if ratio[0] >= 1.4 else "not met")
            cells.append(
                [
                    cost,
                    run_label(s["run"]),
                    f"{rate[0]:,.0f} ({rate[1]:,.0f}-{rate[2]:,.0f})",
                    f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f})",
                    f"{s['steady_ratio']:.2f}x",
                    f"{s['writer_thread_ms']:.1f}",
                    f"{s['writer_other_ms']:.1f}",
                    f"{s['workers_ms']:.1f}",
                    goal,
                ]
            )
    lines += markdown_table(header, "|---|---|---:|---:|---:|---:|---:|---:|---|", cells)
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
    costs = [10.0] if args.quick else [float(c) for c in args.costs.split(",") if c.strip()]
    tasks = 6 if args.quick else args.tasks
    rounds = 1 if args.quick else args.rounds
    runs = [w.strip() for w in (args.workers or default_runs()).split(",") if w.strip()]
    data = measure(costs, runs, rounds, tasks, args.workdir, args.block)
    text = render(data, runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_parallel.md").write_text(text + "\n")
        write_json(args.out / "bench_parallel.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
