"""The loader benchmark's measurements: ``StoreReader.read_batch`` alone, the real DataLoader per shuffle mode
and worker count, and the trainer's own data wait, each on a built store.

Not a benchmark itself: ``bench.loader`` (run as ``python scripts/bench/loader.py``) drives these.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import time_rounds
from lmdbstore.config import ShuffleMode
from lmdbstore.loader.samplers import block_order
from lmdbstore.store.reader import StoreReader

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the bench extra
    psutil = None

#: Shuffle modes: name -> (LoaderConfig.shuffle, block_buffer).
MODES: dict[str, tuple[ShuffleMode, int]] = {
    "random": ("random", 1),
    "block1": ("block", 1),
    "block2": ("block", 2),
    "block4": ("block", 4),
}


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


def bench_read_batch(store: Path, batches: Sequence[np.ndarray], rounds: int) -> dict[str, Any]:
    """``StoreReader.read_batch`` in this process over ``batches``."""
    with StoreReader(store) as r:
        r.read_batch(batches[0])  # open and fault in the first pages outside the timing
        return time_rounds(r.read_batch, batches, rounds)


@dataclass(frozen=True)
class LoaderPlan:
    """How each DataLoader configuration is driven."""

    batch: int
    warmup_batches: int  # -1: one whole epoch
    timed_batches: int
    window: int
    prefetch: int
    seed: int


def bench_loader(store: Path, mode: str, workers: int, plan: LoaderPlan, plain: bool = False) -> dict[str, Any]:
    """Samples/s of the real loader (``make_loader``: the feed's reader processes and slots) for one shuffle
    mode and worker count; ``plain``: torch's own ``DataLoader`` workers over the same dataset and sampler
    instead (a fresh shared-memory segment per batch, pickled to the main process).

    Epoch 0 is the warm-up (workers start, open the store, fault its pages in); epoch 1 is timed after
    its first ``workers * prefetch + 2`` batches (the prefetch pipeline filling), in windows of
    ``plan.window`` batches.
    """
    from lmdbstore.config import LoaderConfig
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
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
        prefetch=plan.prefetch,
        persistent_workers=workers > 0,
    )
    # More workers than cores is measured on purpose; PyTorch's warning about it would only add noise.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    if plain:
        from torch.utils.data import DataLoader

        loader: Any = DataLoader(
            dataset, sampler=sampler, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
            prefetch_factor=plan.prefetch if workers else None,
        )  # fmt: skip
    else:
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
