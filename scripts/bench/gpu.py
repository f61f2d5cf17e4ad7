#!/usr/bin/env python
"""GPU benchmark: end-to-end training samples/s and data wait of ``lmdbstore.train`` at batch 4096, model
width 16 and 64, DataLoader workers 0/4/8/16, with pinned reused buffers and without (fresh shared segments,
no pinning), against the model's own speed on the same GPU in the same run.

For each configuration: two epochs cut to ``--steps`` steps; the first warms up (worker start, cuDNN
autotuning, the page cache) and is not reported; the second's samples/s, data-wait share and step time are.
The baseline, per width: the same model, optimizer and mixed precision stepping on one batch already on the
device (no data loading at all) -- the rate no loader can beat; the ratio says how much of it a
configuration keeps.

Usage::

    python scripts/bench/gpu.py                            # one GPU: 500k-sample store, a few minutes
    python scripts/bench/gpu.py --store PATH               # an existing store
    python scripts/bench/gpu.py --device cpu --quick       # a dry run on the CPU: proves it runs

Prints a Markdown table; writes ``bench_gpu.md`` and ``bench_gpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file

from bench.common import fmt_ratio, human, make_log, markdown_table, ratio, write_json
from bench.machine import describe_machine, machine_info

log = make_log("gpu")


def compute_rate(shape: tuple[int, ...], width: int, batch: int, device: str, steps: int) -> float:
    """Samples/s of the training step alone: one batch already on ``device``, ``steps`` timed steps."""
    import torch

    from lmdbstore.training.batches import autocast, place_model
    from lmdbstore.training.model import build_model

    dev = torch.device(device)
    model = place_model(build_model(shape, 5, width), dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 1, *shape, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (batch,), device=dev)

    def step() -> None:
        with autocast(dev, True):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(max(2, steps // 5)):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return batch * steps / (time.perf_counter() - t0)


def end_to_end(store: Path, width: int, workers: int, pinned: bool, a: argparse.Namespace) -> dict[str, Any]:
    """The second of two epochs of ``--steps`` steps of ``lmdbstore.train``, no output files."""
    from lmdbstore.config import LoaderConfig, TrainConfig
    from lmdbstore.training.trainer import train

    tcfg = TrainConfig(epochs=2, width=width, device=a.device, max_steps_per_epoch=a.steps, val_fraction=0.01)
    lcfg = LoaderConfig(batch_size=a.batch, workers=workers, shuffle="random", pin_memory=pinned, reuse_buffers=pinned)
    m = train(store, None, tcfg, lcfg, log=None, progress=False).final
    return {"samples_per_s": m.samples_per_s, "data_wait": m.data_wait_share, "step_ms": m.step_time_ms}


def run(store: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration, then the compute-only baseline per width."""
    from lmdbstore.store.reader import StoreReader

    with StoreReader(store) as r:
        shape = tuple(r.shape)
    rows = []
    for width in a.widths:
        base = compute_rate(shape, width, a.batch, a.device, a.steps)
        log(f"width {width}: the model alone steps {human(base)} samples/s")
        for workers in a.workers:
            for pinned in (True, False):
                log(f"width {width}, workers {workers}, pinned reused buffers {'on' if pinned else 'off'}")
                got = end_to_end(store, width, workers, pinned, a)
                rows.append({"width": width, "workers": workers, "pinned_reused": pinned, "compute_only": base, **got})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    return markdown_table(
        ["width", "workers", "pinned reused buffers", "samples/s", "data wait", "step ms", "x model alone"],
        "|---:|---:|---|---:|---:|---:|---:|",
        (
            [
                str(r["width"]),
                str(r["workers"]),
                "on" if r["pinned_reused"] else "off",
                human(r["samples_per_s"]),
                f"{100 * r['data_wait']:.1f} %",
                f"{r['step_ms']:.1f}",
                fmt_ratio(ratio(r["samples_per_s"], r["compute_only"])),
            ]
            for r in rows
        ),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, help="an existing store (default: a new synthetic one)")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("-n", type=int, help="samples of the synthetic store (default 500k; --quick 20k)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    p.add_argument("--batch", type=int, help="batch size (default 4096; --quick 512)")
    p.add_argument("--widths", default=[16, 64], type=ints, help="model widths (default 16,64)")
    p.add_argument("--workers", type=ints, help="DataLoader workers (default 0,4,8,16; --quick 0,2)")
    p.add_argument("--steps", type=int, help="steps of each timed epoch (default 40; --quick 3)")
    p.add_argument("--quick", action="store_true", help="small defaults: a dry run")
    p.add_argument("--out", type=Path, default=Path("bench_gpu_out"))
    a = p.parse_args(argv)
    for name, full, quick in (
        ("n", 500_000, 20_000),
        ("batch", 4096, 512),
        ("steps", 40, 3),
        ("workers", [0, 4, 8, 16], [0, 2]),
    ):
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here (use --device cpu --quick for a dry run)", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        store = a.store
        if store is None:
            from lmdbstore.ingestion.pipeline import ingest_synthetic

            store = Path(tmp) / "store"
            log(f"building a store of {a.n:,} synthetic samples")
            ingest_synthetic(store, a.n)
        rows = run(store, a)
        info = machine_info(store)
    gpu = torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else "none (CPU dry run)"
    text = "\n".join(
        [
            f"machine: {describe_machine(info)}",
            f"GPU: {gpu}; torch {torch.__version__}; batch {a.batch}; {a.steps} timed steps per configuration",
            "",
            *table(rows),
        ]
    )
    print(text)
    (a.out / "bench_gpu.md").write_text(text + "\n")
    write_json(a.out / "bench_gpu.json", {"machine": info, "gpu": gpu, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
