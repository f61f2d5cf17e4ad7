"""The measurements of whole jobs: verify, the single writer against ``np.save``, ``write_parallel`` on local workers
and a Dask cluster, a TFRecord ingest, the trainer's samplers' memory, training runs (data wait, memory, a kill and a
resume), the main job (``lmdbstore demo``) and the ways batches reach a GPU.  Public API and the CLI only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from .data import CLASSES
from .machine import REPO
from .spec import Ctx, Measure

SHAPE = (25, 25)
#: Samples of one ``write_parallel`` task of the producer below (10 MB of float32).
TASK = 4096


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmdbstore", *args]


def run_env() -> dict[str, str]:
    """The environment of a child process: this checkout first on its path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


# ============================================================================ verify
def verify() -> Measure:
    """``verify_store`` of the store, every core, its pages dropped first (as ``lmdbstore verify`` runs): samples/s;
    a problem found is an error."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        ctx.drop()
        t0 = time.perf_counter()
        report = lmdbstore.verify_store(ctx.path("store"))
        dt = time.perf_counter() - t0
        if not report.ok:
            raise RuntimeError(f"verify found problems in a store the benchmark built: {report.problems[:1]}")
        return {"rate": ctx.data.samples / dt}

    return Measure("verify_store, every core (cold)", fn)


# ============================================================================ writing
def augment(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A producer task ``(seed, rounds)``: :data:`TASK` samples of noise, ``rounds`` blur/shift/tanh passes over the
    whole batch (10 MB numpy temporaries, as an augmentation makes), z-scored.  Module level: workers import it."""
    seed, rounds = task
    rng = np.random.default_rng(seed)
    x = rng.random((TASK, *SHAPE), dtype=np.float32)
    for r in range(rounds):
        x = 0.5 * x + 0.25 * (np.roll(x, 1, axis=1) + np.roll(x, -1, axis=2))
        x = np.tanh(x * np.float32(1.0 + 0.1 * (r % 5)), out=x)
    flat = x.reshape(len(x), -1)
    flat -= flat.mean(axis=1, keepdims=True)
    flat /= flat.std(axis=1, keepdims=True) + np.float32(1e-6)
    return x, rng.integers(0, len(CLASSES), TASK)


@functools.lru_cache
def calibrate(cost_ms: float) -> int:
    """The rounds whose task costs about ``cost_ms`` in this process (from the cost of 0 and 8 rounds)."""

    def ms(rounds: int) -> float:
        augment((0, rounds))
        t0 = time.perf_counter()
        augment((1, rounds))
        return (time.perf_counter() - t0) * 1e3

    base, eight = ms(0), ms(8)
    return max(0, round((cost_ms - base) / max((eight - base) / 8, 1e-3)))


@contextlib.contextmanager
def engine(run: str) -> Iterator[dict[str, Any]]:
    """``write_parallel``'s runner options for ``run``: ``"N"`` local workers, ``"daskN"`` a Dask ``LocalCluster`` of N
    processes of one thread each, started (its workers importing the producer) before the timed call."""
    if not run.startswith("dask"):
        yield {"workers": int(run)}
        return
    from distributed import Client, LocalCluster

    saved = dict(os.environ)
    os.environ.update(PYTHONPATH=run_env()["PYTHONPATH"])  # the workers import this module
    try:
        with (
            LocalCluster(n_workers=int(run[4:]), threads_per_worker=1, processes=True, dashboard_address=":0") as c,
            Client(c) as client,
        ):
            client.run(augment, (0, 0))
            yield {"executor": client}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parallel(run: str, cost_ms: float = 50) -> Measure:
    """``write_parallel`` of tasks costing ``cost_ms`` each here (10 ms and 6 tasks under ``--quick``), on ``run``
    (:func:`engine`): samples/s of the whole call."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        cost = ctx.pick(cost_ms, 10)
        rounds, tasks = calibrate(cost), ctx.pick(int(min(160, max(12, 4000 / cost))), 6)
        with engine(run) as how:
            t0 = time.perf_counter()
            rep = lmdbstore.write_parallel(
                ctx.scratch / f"parallel-{run}",
                augment,
                [(s, rounds) for s in range(tasks)],
                shape=SHAPE,
                dtype="float32",
                classes=CLASSES,
                progress=False,
                **how,
            )
            dt = time.perf_counter() - t0
        return {"rate": rep.added / dt}

    who = f"a Dask LocalCluster of {run[4:]}" if run.startswith("dask") else f"{run} local worker(s)"
    return Measure(f"write_parallel, {who}, {cost_ms:g} ms tasks", fn, uses=())


def writer() -> Measure:
    """The single writer (``open_writer``, crc32, an fsync a commit) appending ready arrays: samples/s."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        x, y = augment((0, 0))
        k = ctx.pick(24, 6)
        t0 = time.perf_counter()
        with lmdbstore.open_writer(ctx.scratch / "writer", shape=SHAPE, dtype="float32", classes=CLASSES) as w:
            for _ in range(k):
                w.append(x, y)
        return {"rate": k * TASK / (time.perf_counter() - t0)}

    return Measure("single writer (open_writer, crc32, fsync)", fn, uses=())


def npsave() -> Measure:
    """The same bytes as :func:`writer` written by ``np.save`` to one file and fsynced: samples/s."""

    def fn(ctx: Ctx) -> dict[str, float]:
        x = np.concatenate([augment((0, 0))[0]] * ctx.pick(24, 6))
        t0 = time.perf_counter()
        with open(ctx.scratch / "same.npy", "wb") as f:
            np.save(f, x)
            f.flush()
            os.fsync(f.fileno())
        return {"rate": len(x) / (time.perf_counter() - t0)}

    return Measure("np.save + fsync of the same bytes", fn, uses=())


#: Writes TFRecord shards of ``tf.train.Example`` (the sample's bytes, an int64 label) as TensorFlow does.
TF_WRITE = """
import sys, numpy as np, tensorflow as tf
x, y = np.load(sys.argv[1]), np.load(sys.argv[2])
for k, part in enumerate(np.array_split(np.arange(len(x)), int(sys.argv[4]))):
    with tf.io.TFRecordWriter(f"{sys.argv[3]}/data.tfrecord-{k:05d}-of-{sys.argv[4]:0>5}") as w:
        for i in part:
            f = {"x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x[i].tobytes()])),
                 "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])]))}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
"""
#: The CLI with ``import tensorflow`` failing, as on a machine without it.
NO_TF = "import sys; sys.modules['tensorflow'] = None; from lmdbstore_cli.main import main; sys.argv[0] = 'lmdbstore'; main()"


def tfrecord() -> Measure:
    """TFRecord shards written by TensorFlow (150k samples in 16 shards; 3k in 4 under ``--quick``) ingested by
    ``lmdbstore ingest`` with TensorFlow unimportable: samples/s; a store that differs from the shards is an error."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import lmdbstore

        n, shards = ctx.pick(150_000, 3000), ctx.pick(16, 4)
        rng = np.random.default_rng(ctx.round)
        x, y = rng.standard_normal((n, *SHAPE), dtype=np.float32), rng.integers(0, 5, n)
        src, store = ctx.scratch / "shards", ctx.scratch / "store"
        src.mkdir()
        np.save(src / "x.npy", x)
        np.save(src / "y.npy", y)
        sh = src / "shards"
        sh.mkdir()
        subprocess.run(
            [sys.executable, "-c", TF_WRITE, str(src / "x.npy"), str(src / "y.npy"), str(sh), str(shards)],
            check=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            capture_output=True,
        )
        t0 = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                NO_TF,
                "ingest",
                str(store),
                str(sh),
                "--dtype",
                "float32",
                "--sample-shape",
                "25,25",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=run_env(),
        )
        dt = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"ingest failed: {done.stderr.strip().splitlines()[-1:]}")
        with lmdbstore.StoreReader(store) as r:
            if not (np.array_equal(r.read_range(0, n), x) and np.array_equal(r.labels(), y)):
                raise RuntimeError("the store differs from the TFRecord shards")
        return {"rate": n / dt}

    return Measure("TFRecord shards -> lmdbstore ingest (TensorFlow hidden)", fn, uses=())


# ============================================================================ the trainer's samplers' memory
def _status() -> dict[str, float]:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")
        }


def _sampler_memory(order: str, n: int, batch: int, batches: int) -> dict[str, float]:
    """In a fresh process: a label table of ``n`` samples, the stratified split and ``order``'s training sampler
    (its first ``batches``), as the trainer makes them: resident MiB at the end (steady) and at the peak."""
    import lmdbstore

    base = _status()["VmRSS"]
    labels = np.empty(n, np.uint8)
    for a in range(0, n, 1 << 20):
        labels[a : a + (1 << 20)] = np.arange(a, min(a + (1 << 20), n), dtype=np.int64) * 7919 % 5
    train, val = lmdbstore.stratified_split(labels, 0.1, 0)
    s: Any
    if order == "window":
        s = lmdbstore.WindowBatchSampler(train, batch, samples_per_value=36, sample_bytes=1250, window_bytes=2 << 30)
    elif order == "balanced":
        s = lmdbstore.BalancedBatchSampler([train[labels[train] == c] for c in range(5)], batch)
    else:
        s = lmdbstore.EpochBatchSampler(train, batch, shuffle=order, samples_per_value=36)
    for it in (iter(s), iter(lmdbstore.EpochBatchSampler(val, batch, shuffle="none"))):
        for _ in range(batches):
            next(it, None)
    now = _status()
    return {"peak": now["VmHWM"], "steady": now["VmRSS"], "bytes": (now["VmRSS"] - base) * 2**20 / n}


def sampler_memory(order: str) -> Measure:
    """:func:`_sampler_memory` of ``ctx.data.samples`` in a fresh (spawned) interpreter: its peak is its own."""

    def fn(ctx: Ctx) -> dict[str, float]:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
            return ex.submit(_sampler_memory, order, ctx.data.samples, ctx.batch, ctx.pick(50, 3)).result()

    return Measure(f"split and {order} sampler, main process", fn, uses=(), once=True)


# ============================================================================ training
def sample_memory(pid: int, into: dict[int, list[float]]) -> None:
    """Append the private resident MiB (resident less file-backed and shared pages) of ``pid`` and its children."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            m = p.memory_info()
            into.setdefault(p.pid, []).append((m.rss - getattr(m, "shared", 0)) / 2**20)


def run_train(cmd: list[str]) -> tuple[dict[str, Any], list[float]]:
    """Run ``lmdbstore train ... --json`` to its end, sampling its main process's private memory: the result and
    the samples (MiB).

    Raises:
        RuntimeError: it failed (its last stderr line).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(), cwd=REPO)
    mem: dict[int, list[float]] = {}
    while proc.poll() is None:
        sample_memory(proc.pid, mem)
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"train failed: {err.strip().splitlines()[-1:] or proc.returncode}")
    return json.loads(out), mem.get(proc.pid, [0.0])


def kill_at_checkpoint(cmd: list[str], ckpt: Path, timeout: float = 1800) -> int:
    """Start ``cmd`` and SIGKILL it once ``ckpt`` holds a checkpoint inside the epoch; its step (0: none came)."""
    import torch

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=run_env(), cwd=REPO)
    step, deadline = 0, time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline and not step:
            with contextlib.suppress(Exception):  # being written right now: look again
                step = int(torch.load(ckpt, weights_only=True).get("step", 0)) if ckpt.exists() else 0
            if step:
                proc.send_signal(signal.SIGKILL)
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    return step


def train(kill: bool = False, cold: bool = False, device: str = "cpu", width: int = 16, workers: int = 2) -> Measure:
    """``lmdbstore train`` of one epoch of 300 steps of 4096 (24 of 256 under ``--quick``) on the store, its pages
    dropped first (``cold``) or read into the page cache: samples/s, the data wait's share of the run, and the main
    process's private memory at its peak and steady (the 90th percentile of the second half of the run); ``kill``:
    the same run killed at a checkpoint inside the epoch and resumed, its weights against the unbroken run's
    (``identical``: 1 or 0)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import torch

        steps, batch = ctx.pick(300, 24), ctx.pick(ctx.batch, 256)
        full, broken = ctx.scratch / "full", ctx.scratch / "killed"

        def cmd(out: Path, *extra: str) -> list[str]:
            return cli(
                "train",
                str(ctx.path("store")),
                "--epochs",
                "1",
                "--max-steps",
                str(steps),
                "--batch",
                str(batch),
                "--workers",
                str(workers),
                "--val-limit",
                str(ctx.pick(20, 1)),
                "--width",
                str(width),
                "--device",
                device,
                "--out",
                str(out),
                "--no-progress",
                "--json",
                "--checkpoint-every",
                str(max(1, steps // 6)),
                *extra,
            )

        if cold:
            ctx.drop()
        result, mem = run_train(cmd(full))
        final = result["final"]
        steady = float(np.percentile(mem[len(mem) // 2 :], 90))
        out = {
            "rate": final["samples_per_s"],
            "data_wait": final["data_wait_share"],
            "peak": max(mem),
            "steady": steady,
        }
        if kill:
            step = kill_at_checkpoint(cmd(broken), broken / "checkpoint.pt")
            run_train(cmd(broken, "--resume"))
            a, b = (torch.load(d / "checkpoint.pt", weights_only=True)["model"] for d in (full, broken))
            out["identical"] = float(step > 0 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
        return out

    label = f"lmdbstore train, width {width}, {workers} readers, {device}, {'cold' if cold else 'warm'}"
    return Measure(label + (", killed and resumed" if kill else ""), fn, warm=not cold, once=True)


def demo() -> Measure:
    """``lmdbstore demo`` (synthesize 100k samples into a store, stats, train 3 epochs at batch 4096, eval; 3k, 1
    epoch at 512 under ``--quick``): seconds and the validation accuracy."""

    def fn(ctx: Ctx) -> dict[str, float]:
        n, e, b = ctx.pick(100_000, 3000), ctx.pick(3, 1), ctx.pick(4096, 512)
        t0 = time.perf_counter()
        done = subprocess.run(
            cli(
                "demo",
                "--dir",
                str(ctx.scratch / "demo"),
                "-n",
                str(n),
                "--epochs",
                str(e),
                "--batch",
                str(b),
                "--json",
                "--no-progress",
            ),
            capture_output=True,
            text=True,
            env=run_env(),
            cwd=REPO,
        )
        if done.returncode != 0:
            raise RuntimeError(f"demo failed: {done.stderr.strip().splitlines()[-1:]}")
        return {
            "seconds": time.perf_counter() - t0,
            "accuracy": json.loads(done.stdout)["run"]["final"]["val_accuracy"],
        }

    return Measure("lmdbstore demo", fn, uses=(), once=True)


# ============================================================================ the GPU
def gpu_way(mode: str) -> Measure:
    """Batches of ``make_loader`` (8 readers, random order) brought to the GPU, data only: ``pageable`` (``.to``),
    ``pinned`` (``pin_memory=True``: page-locked slots, ``non_blocking`` copies) or ``staged`` (``device="cuda"``:
    batch k+1 copied on a side stream while the loop takes batch k): samples/s."""

    def fn(ctx: Ctx) -> dict[str, float]:
        import torch

        import lmdbstore

        dev = torch.device("cuda")
        extra: dict[str, Any] = (
            {"pin_memory": True} if mode == "pinned" else {"device": "cuda"} if mode == "staged" else {}
        )
        loader = lmdbstore.make_loader(
            str(ctx.path("store")), batch_size=ctx.batch, workers=ctx.pick(8, 2), shuffle="random", **extra
        )

        def batches() -> Iterator[Any]:
            while True:
                yield from loader

        it = batches()
        try:
            for _ in range(3):  # readers started, slots registered
                next(it)
            n, t0 = 0, time.perf_counter()
            while n == 0 or time.perf_counter() - t0 < ctx.seconds:
                x, y = next(it)
                x.to(dev, non_blocking=mode == "pinned")
                n += len(y)
            torch.cuda.synchronize(dev)
            return {"rate": n / (time.perf_counter() - t0)}
        finally:
            loader.close()

    return Measure(f"make_loader batches to the GPU, {mode}", fn, warm=True)
