#!/usr/bin/env python
"""GPU benchmark: how batches reach the GPU from ``make_loader`` at batch 4096, and what the training loop waits.

Two tables, in one run of a few minutes on one GPU:

1. **The way to the GPU** (issue 33), data from a warm synthetic store, ``--workers`` readers, each row with and
   without a training step of the CNN (width 16):

   * ``pageable``          ``make_loader()``; the loop copies each batch with ``x.to("cuda")`` (synchronous);
   * ``copy into pinned``  the same; the loop copies each batch into a fresh pinned tensor first, then
     ``to("cuda", non_blocking=True)`` (what ``DataLoader(pin_memory=True)`` does per batch);
   * ``registered``        ``make_loader(pin_memory=True)``: slots page-locked once, ``non_blocking`` copies
     straight from them (a CUDA event fences each slot until its copy is done);
   * ``device-staged``     ``make_loader(device="cuda")``: batch ``k + 1`` copied on a side stream while the
     loop computes on batch ``k``.

   Reported: samples/s into the GPU (data only: copy and synchronize; and with the step), and the share of the
   loop's time spent waiting for the next batch, against the model stepping on one batch already on the GPU.
2. **``lmdbstore.train``** end to end (what the CLI runs: registered and staged on CUDA) at widths 16 and 64 and
   ``--train-workers`` readers: samples/s, data wait, step time, and the ratio to the model alone.

Usage::

    python scripts/bench/gpu.py                            # one GPU: a 300k-sample store, under 5 minutes
    python scripts/bench/gpu.py --store PATH               # an existing store
    python scripts/bench/gpu.py --device cpu --quick       # a dry run on the CPU: proves it runs

Prints Markdown tables; writes ``bench_gpu.md`` and ``bench_gpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file

from bench.common import fmt_ratio, human, make_log, markdown_table, ratio, write_json
from bench.machine import describe_machine, machine_info

log = make_log("gpu")

#: The ways to the GPU of table 1, in order.
MODES = ("pageable", "copy into pinned", "registered", "device-staged")


def stepper(shape: tuple[int, ...], width: int, device: Any) -> Callable[[Any, Any], None]:
    """One training step of the CNN (AdamW, bfloat16 autocast on CUDA) on a batch already on ``device``."""
    import torch

    from lmdbstore.training.batches import autocast, place_model, to_device
    from lmdbstore.training.model import build_model

    model = place_model(build_model(shape, 5, width), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x: Any, y: Any) -> None:
        x, y = to_device(x, y, device)
        with autocast(device, True):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_rate(shape: tuple[int, ...], width: int, batch: int, device: Any, steps: int) -> float:
    """Samples/s of the training step alone: one batch already on ``device``, ``steps`` timed steps."""
    import torch

    step = stepper(shape, width, device)
    x = torch.randn(batch, 1, *shape, device=device)
    y = torch.randint(0, 5, (batch,), device=device)
    for _ in range(max(2, steps // 5)):
        step(x, y)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return batch * steps / (time.perf_counter() - t0)


def loader_for(store: Path, mode: str, a: argparse.Namespace) -> Any:
    import lmdbstore

    kw: dict[str, Any] = {"batch_size": a.batch, "workers": a.workers, "shuffle": "random"}
    if mode == "registered":
        kw["pin_memory"] = True
    if mode == "device-staged":
        kw["device"] = a.device
    return lmdbstore.make_loader(store, **kw)


def to_gpu(mode: str, device: Any) -> Callable[[Any], Any]:
    """What the loop does with a batch to have it on ``device`` in each mode."""
    cuda = device.type == "cuda"
    if mode == "copy into pinned":
        return lambda t: t.pin_memory().to(device, non_blocking=True) if cuda else t.to(device)
    if mode == "pageable":
        return lambda t: t.to(device)
    return lambda t: t.to(device, non_blocking=cuda)  # registered (non-blocking), staged (already there)


def way_row(store: Path, mode: str, shape: tuple[int, ...], a: argparse.Namespace) -> dict[str, Any]:
    """``--steps`` batches of ``mode`` after a warm-up pass of a few: data only, then with the step."""
    loader = loader_for(store, mode, a)
    move = to_gpu(mode, a.dev)
    step = stepper(shape, 16, a.dev)
    out: dict[str, Any] = {"mode": mode}
    for with_step in (False, True):
        it = iter(loader)
        for _ in range(3):  # readers started, slots registered, cuDNN tuned
            x, y = next(it)
            if with_step:
                step(move(x), move(y))
        sync(a.dev)
        n, wait, t0 = 0, 0.0, time.perf_counter()
        for _ in range(a.steps):
            w0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            wait += time.perf_counter() - w0
            gx, gy = move(x), move(y)
            del x, y
            if with_step:
                step(gx, gy)
            n += len(gy)
        sync(a.dev)
        elapsed = time.perf_counter() - t0
        key = "step" if with_step else "data"
        out[f"{key}_rate"], out[f"{key}_wait"] = n / elapsed, wait / elapsed
        del it
    loader.close()
    return out


def train_row(store: Path, width: int, workers: int, a: argparse.Namespace) -> dict[str, Any]:
    """The second of two epochs of ``--steps`` steps of ``lmdbstore.train``, no output files."""
    from lmdbstore.config import LoaderConfig, TrainConfig
    from lmdbstore.training.trainer import train

    tcfg = TrainConfig(epochs=2, width=width, device=a.device, max_steps_per_epoch=a.steps, val_fraction=0.01)
    lcfg = LoaderConfig(batch_size=a.batch, workers=workers, shuffle="random")
    m = train(store, None, tcfg, lcfg, log=None, progress=False).final
    return {"width": width, "workers": workers, "samples_per_s": m.samples_per_s, "data_wait": m.data_wait_share,
            "step_ms": m.step_time_ms}  # fmt: skip


def tables(ways: list[dict[str, Any]], base16: float, trains: list[dict[str, Any]]) -> list[str]:
    one = markdown_table(
        ["way to the GPU", "data only, samples/s", "loop wait", "with the step, samples/s", "loop wait",
         "x model alone"],
        "|---|---:|---:|---:|---:|---:|",
        (
            [r["mode"], human(r["data_rate"]), f"{100 * r['data_wait']:.1f} %", human(r["step_rate"]),
             f"{100 * r['step_wait']:.1f} %", fmt_ratio(ratio(r["step_rate"], base16))]
            for r in ways
        ),
    )  # fmt: skip
    two = markdown_table(
        ["train: width", "workers", "samples/s", "data wait", "step ms", "x model alone"],
        "|---:|---:|---:|---:|---:|---:|",
        (
            [str(r["width"]), str(r["workers"]), human(r["samples_per_s"]), f"{100 * r['data_wait']:.1f} %",
             f"{r['step_ms']:.1f}", fmt_ratio(ratio(r["samples_per_s"], r["compute_only"]))]
            for r in trains
        ),
    )  # fmt: skip
    return [*one, "", *two]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, help="an existing store (default: a new synthetic one)")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("-n", type=int, help="samples of the synthetic store (default 300k; --quick 20k)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    p.add_argument("--batch", type=int, help="batch size (default 4096; --quick 512)")
    p.add_argument("--workers", type=int, help="readers of table 1 (default 8; --quick 2)")
    p.add_argument("--widths", default=[16, 64], type=ints, help="model widths of table 2 (default 16,64)")
    p.add_argument("--train-workers", type=ints, help="readers of table 2 (default 4,8; --quick 0,2)")
    p.add_argument("--steps", type=int, help="timed steps of each row (default 40; --quick 3)")
    p.add_argument("--quick", action="store_true", help="small defaults: a dry run")
    p.add_argument("--out", type=Path, default=Path("bench_gpu_out"))
    a = p.parse_args(argv)
    for name, full, quick in (
        ("n", 300_000, 20_000),
        ("batch", 4096, 512),
        ("steps", 40, 3),
        ("workers", 8, 2),
        ("train_workers", [4, 8], [0, 2]),
    ):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here (use --device cpu --quick for a dry run)", file=sys.stderr)
        return 1
    a.dev = torch.device(a.device)
    modes = MODES if a.dev.type == "cuda" else ("pageable", "registered")  # the others need CUDA
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        store = a.store
        if store is None:
            from lmdbstore.ingestion.pipeline import ingest_synthetic

            store = Path(tmp) / "store"
            log(f"building a store of {a.n:,} synthetic samples")
            ingest_synthetic(store, a.n)
        import lmdbstore

        with lmdbstore.open_reader(store) as r:
            shape = tuple(r.shape)
        base = {w: compute_rate(shape, w, a.batch, a.dev, a.steps) for w in sorted({16, *a.widths})}
        log(f"the model alone: {', '.join(f'width {w} {human(v)}/s' for w, v in base.items())}")
        ways = []
        for mode in modes:
            log(f"way to the device: {mode}")
            ways.append(way_row(store, mode, shape, a))
        trains = []
        for width in a.widths:
            for workers in a.train_workers:
                log(f"train: width {width}, {workers} workers")
                trains.append({**train_row(store, width, workers, a), "compute_only": base[width]})
        info = machine_info(store)
    gpu = torch.cuda.get_device_name(a.dev) if a.dev.type == "cuda" else "none (CPU dry run)"
    text = "\n".join(
        [
            f"machine: {describe_machine(info)}",
            f"GPU: {gpu}; torch {torch.__version__}; batch {a.batch}; {a.workers} readers in table 1; {a.steps} timed "
            f"steps per row; {time.perf_counter() - t_start:.0f} s in all",
            "",
            *tables(ways, base[16], trains),
        ]
    )
    print(text)
    (a.out / "bench_gpu.md").write_text(text + "\n")
    args = {k: v for k, v in vars(a).items() if k != "dev"}
    write_json(a.out / "bench_gpu.json", {"machine": info, "gpu": gpu, "args": args, "ways": ways, "rows": trains})
    return 0


if __name__ == "__main__":
    sys.exit(main())
