"""The seed-scale benchmark's measurements (``bench.scale``): the stores it builds, the loaders it reads them
through, the disk's limits around every row, the training runs (with a kill and a resume) and their memory.

Every loader this benchmark makes comes from :func:`open_loader`, the one place that knows the loader API
(today ``make_loader(LmdbBatchDataset(reader), sampler, LoaderConfig(...))``; the one-call
``make_loader(path_or_list, batch_size=..., workers=..., shuffle=...)`` replaces its body when it lands).

Not a benchmark itself: ``bench.scale`` (run as ``python scripts/bench/scale.py``) drives these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import drop_page_cache, pread_rate, seq_read_rate

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]
#: Samples a producer task of the build makes (82 MB of float16).
TASK_SAMPLES = 1 << 16
REPO = Path(__file__).resolve().parents[2]


# ============================================================================ stores
def produce(task: tuple[int, int, str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``lo..hi-1`` of the benchmark's data set: standard-normal noise (seeded by ``(seed, lo)``), element
    ``[0, 0]`` the index modulo 1,024 (exact in float16), labels ``i * 7919 mod 5``.  Module level: spawned
    ``write_parallel`` workers import it."""
    lo, hi, dtype, seed = task
    x = np.random.default_rng([seed, lo]).standard_normal((hi - lo, *SHAPE), dtype=np.float32)
    i = np.arange(lo, hi, dtype=np.int64)
    x[:, 0, 0] = i % 1024
    return x.astype(dtype, copy=False), (i * 7919 % len(CLASSES)).astype(np.uint8)


def build(path: Path, lo: int, hi: int, dtype: str, workers: int, seed: int = 0) -> float:
    """Write samples ``lo..hi-1`` to a new store at ``path`` with ``write_parallel`` (the default writer config:
    an fsync every 64 MiB commit); returns seconds."""
    from lmdbstore import write_parallel

    tasks = [(a, min(a + TASK_SAMPLES, hi), dtype, seed) for a in range(lo, hi, TASK_SAMPLES)]
    t0 = time.perf_counter()
    write_parallel(path, produce, tasks, workers=workers, shape=SHAPE, dtype=dtype, classes=CLASSES,
                   name="scale", progress=False)  # fmt: skip
    return time.perf_counter() - t0


def data_files(paths: Sequence[Path]) -> list[Path]:
    return [p / "data.mdb" for p in paths]


def drop(paths: Sequence[Path]) -> None:
    """Write back and drop the stores' data files from the page cache (cold reads follow)."""
    drop_page_cache(data_files(paths), sync=True)


# ============================================================================ the disk's limits
@dataclass
class Limits:
    """The disk's sequential read limit, measured between rows: ``before``/``after`` a row, bytes/s."""

    path: Path
    nbytes: int
    taken: list[float] = field(default_factory=list)
    _turn: int = 0

    def measure(self) -> float:
        """One ``dd``-style read of ``nbytes`` of the file, at a new offset each time (cold, pages dropped)."""
        size = self.path.stat().st_size
        span = max(1, size - self.nbytes)
        offset = (self._turn * 7919 * (1 << 20)) % span
        offset -= offset % 4096
        self._turn += 1
        rate = seq_read_rate(self.path, self.nbytes, offset)
        self.taken.append(rate)
        return rate

    def around(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """``fn()`` between two limits (the first reused when the last row just took one): result, before, after."""
        before = self.taken[-1] if self.taken else self.measure()
        out = fn()
        return out, before, self.measure()


def pread_limits(path: Path, sample_bytes: int, seconds: float, seed: int) -> dict[str, float]:
    """Random reads of one sample's bytes at 16 and 64 in flight, pages dropped: samples/s."""
    return {f"x{q}": pread_rate(path, sample_bytes, q, seconds, seed + q) for q in (16, 64)}


# ============================================================================ loaders
def open_loader(
    paths: Sequence[Path],
    order: str,
    batch_size: int,
    workers: int,
    seed: int = 0,
    indices: np.ndarray | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> Iterator[Any]:
    """Batches ``(x, y)`` of the store (one path) or the set (several) in ``order`` (``random``, ``block``,
    ``window``, ``auto``), through ``make_loader`` with ``workers`` reader processes, the sampler built from its
    options: the one place this benchmark makes a loader.  ``indices``: only those samples (default: all)."""
    import lmdbstore

    store = [str(p) for p in paths] if len(paths) > 1 else str(paths[0])
    loader = lmdbstore.make_loader(
        store, batch_size=batch_size, workers=workers, shuffle=order, seed=seed, indices=indices, say=say
    )
    return iter(loader)


def read_rate(loader: Iterator[Any], seconds: float, limit_batches: int | None = None) -> dict[str, float]:
    """Samples/s through ``loader`` after its first batch, for ``seconds`` (or ``limit_batches``); the first
    batch's wait."""
    t0 = time.perf_counter()
    first = next(loader)
    t_first = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    for k, (x, _y) in enumerate(loader, 1):
        n += len(x)
        if time.perf_counter() - t1 >= seconds or (limit_batches is not None and k >= limit_batches):
            break
    dt = time.perf_counter() - t1
    del first
    return {"rate": n / dt if dt > 0 else 0.0, "first_batch_s": t_first, "samples": n}


# ============================================================================ training, its memory, a kill
def train_cmd(store: Path, out: Path, args: Any, *extra: str) -> list[str]:
    """``lmdbstore train`` of this checkout, a few hundred steps of one epoch, checkpoints inside it."""
    return [
        sys.executable, "-m", "lmdbstore", "train", str(store), "--epochs", "1", "--max-steps", str(args.train_steps),
        "--batch", str(args.batch), "--workers", str(args.workers), "--checkpoint-every", str(args.checkpoint_every),
        "--val-limit", str(args.val_limit), "--width", "16", "--device", "cpu", "--out", str(out), "--no-progress",
        "--json", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@dataclass
class Memory:
    """Resident sizes of a process tree sampled while it ran: per pid, every sample (MiB) of its whole resident
    size and of its private part (resident less file-backed and shared-memory pages: the data file's pages and
    the loader's shared batch buffers count in every process that maps them), and which pid is the root."""

    root: int
    samples: dict[int, list[float]] = field(default_factory=dict)
    private: dict[int, list[float]] = field(default_factory=dict)

    def take(self) -> None:
        import psutil

        try:
            procs = [psutil.Process(self.root)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                info = p.memory_info()
            except psutil.NoSuchProcess:
                continue
            self.samples.setdefault(p.pid, []).append(info.rss / 2**20)
            self.private.setdefault(p.pid, []).append((info.rss - getattr(info, "shared", 0)) / 2**20)

    def summary(self) -> dict[str, Any]:
        """Peak and steady MiB of the root and of each other process, resident (``peak``, ``steady``) and private
        (``private_peak``, ``private_steady``).  Steady is the level the process keeps coming back to once it
        trains, each step's activations included: the 90th percentile of the second half of the samples (a
        median would sit between steps and call every step's activations a peak)."""

        def level(values: list[float]) -> float:
            return float(np.percentile(values[len(values) // 2 :], 90))

        def one(pid: int) -> dict[str, float]:
            rss, own = self.samples.get(pid, [0.0]), self.private.get(pid, [0.0])
            return {"peak": max(rss), "steady": level(rss), "private_peak": max(own), "private_steady": level(own)}

        others = [one(pid) for pid, v in self.samples.items() if pid != self.root and len(v) >= 2]
        return {"main": one(self.root), "workers": others}


def run_train(cmd: list[str], poll: float = 0.2) -> tuple[dict[str, Any], Memory, float]:
    """Run a training command to its end, sampling its processes' memory; its ``--json`` result, the memory and
    seconds.

    Raises:
        RuntimeError: it failed (its last stderr line).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    mem = Memory(proc.pid)
    while proc.poll() is None:
        mem.take()
        time.sleep(poll)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"train failed: {err.strip().splitlines()[-1:] or proc.returncode}")
    return json.loads(out), mem, time.perf_counter() - t0


def kill_inside_epoch(cmd: list[str], out: Path, timeout: float = 1800) -> int:
    """Start ``cmd`` and SIGKILL it once ``out/checkpoint.pt`` was written inside the epoch (its step > 0) and
    before the run ends; returns the checkpoint's step (0: the run ended first)."""
    import torch

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=REPO)
    ckpt, deadline, step = out / "checkpoint.pt", time.monotonic() + timeout, 0
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ckpt.exists():
                try:
                    step = int(torch.load(ckpt, weights_only=True).get("step", 0))
                except Exception:  # being replaced right now: look again
                    step = 0
                if step:
                    proc.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return step


def same_weights(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold bit-identical model weights."""
    import torch

    x = torch.load(a, weights_only=True)["model"]
    y = torch.load(b, weights_only=True)["model"]
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
