#!/usr/bin/env python
"""Out-of-core benchmark: lmdbstore's reads against the disk's own limits, measured in the same run.

On a store whose pages were dropped from the page cache (``posix_fadvise(DONTNEED)`` before every cold
measurement), it measures:

* the disk's limits on the same file: random ``pread``s of one sample's bytes and of one packed value's
  bytes, at 1 and 16 in flight (a thread pool);
* ``StoreReader.read_batch`` in one process for ``random``, ``block`` and ``window`` orders (and the liblmdb
  path, ``positions=False``, in random order, for reference);
* the same through the DataLoader with ``--workers`` workers;
* warm (``--warm-samples`` of the store, all cached): ``read_batch`` random and block against a numpy
  memmap of the same samples;
* shuffle quality: distinct values per batch and the class mix of batches against the store's shares;
* the reader's own memory (anonymous RSS, not the file pages it maps) after building the position table;
* optionally (``--train-steps``) a CPU training loop with the ``window`` order, and its data wait.

Each measurement runs for ``--seconds`` (at least one batch); rates are samples/s.  ``window`` is measured
after its first window is in the page cache (the load time of that window is reported separately).

Usage::

    python scripts/bench_ooc.py                      # 200k samples in a temporary directory (~minutes)
    python scripts/bench_ooc.py --samples 12000000   # larger than RAM (30 GB); needs the disk space
    python scripts/bench_ooc.py --store PATH         # an existing store (never modified)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ooc_data import make_store

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler, available_memory, choose_shuffle
from lmdbstore.store.reader import StoreReader


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def drop_cache(path: Path) -> None:
    """Write back and drop the data file's cached pages (pages mapped by a live process stay)."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed(batches: Iterable[Any], seconds: float, consume: Callable[[Any], int]) -> float:
    """Samples/s over batches until ``seconds`` have passed (at least one batch)."""
    n, t0 = 0, time.perf_counter()
    for b in batches:
        n += consume(b)
        if time.perf_counter() - t0 >= seconds:
            break
    return n / (time.perf_counter() - t0)


def disk_limit(path: Path, nbytes: int, inflight: int, seconds: float, seed: int) -> float:
    """Random ``pread``s of ``nbytes`` at page-aligned offsets: reads/s."""
    drop_cache(path)
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    size = os.fstat(fd).st_size
    rng = np.random.default_rng(seed)
    offs = (rng.integers(0, (size - nbytes) // 4096, 1 << 20) * 4096).tolist()
    done = [0]
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        i = k
        while time.perf_counter() < stop and i < len(offs):
            os.pread(fd, nbytes, offs[i])
            done[0] += 1
            i += inflight

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as ex:
        list(ex.map(worker, range(inflight)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return done[0] / dt


def samplers(path: Path, n: int, batch: int, window_mb: int | None, seed: int, prefetch: Any) -> dict[str, Any]:
    with StoreReader(path) as r:
        spv, sb = r.meta.samples_per_value, r.meta.sample_bytes
    idx = np.arange(n)
    return {
        "random": EpochBatchSampler(idx, batch, shuffle="random", seed=seed),
        "block": EpochBatchSampler(idx, batch, shuffle="block", samples_per_value=spv, block_buffer=2, seed=seed),
        "window": WindowBatchSampler(
            idx,
            batch,
            samples_per_value=spv,
            sample_bytes=sb,
            window_bytes=None if window_mb is None else window_mb << 20,
            prefetch=prefetch,
            seed=seed,
        ),
    }


def first_window_load(reader: StoreReader, sampler: WindowBatchSampler) -> float:
    """Read the first window into the page cache (as the sampler's prefetch would) and time it."""
    plan = sampler.plan()
    t0 = time.perf_counter()
    reader.prefetch(plan.chunk_lo[0], plan.chunk_hi[0])
    h = reader._handle()
    assert h.engine is not None
    h.engine.pool().submit(lambda: None).result()  # the advice runs on the pool: wait for it
    # WILLNEED only starts the reads: touch every chunk's first and last bytes to wait for them
    reader.read_batch(np.r_[plan.chunk_lo[0], plan.chunk_hi[0] - 1])
    rate_probe = reader.read_batch(plan.order[: min(len(plan.order), 4096)])
    del rate_probe
    return time.perf_counter() - t0


def one_process(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    for mode in ("random", "block", "window", "lmdb-random"):
        drop_cache(path)
        reader = StoreReader(path, positions=mode != "lmdb-random")
        s = samplers(path, n, args.batch, args.window_mb, args.seed, reader.prefetch)[mode.replace("lmdb-", "")]
        reader.read_path  # build the table (its time is reported separately)  # noqa: B018
        if mode == "window":
            out["window first-window load s"] = first_window_load(reader, s)
        secs = args.seconds / 3 if mode == "lmdb-random" else args.seconds
        out[mode] = timed(iter(s), secs, lambda b, r=reader: len(r.read_batch(b)))
        reader.close()
        log(f"  one process {mode}: {out[mode]:,.0f} samples/s")
    return out


def loader(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader

    out: dict[str, float] = {}
    for mode in ("random", "block", "window"):
        drop_cache(path)
        pre = StoreReader(path)
        s = samplers(path, n, args.batch, args.window_mb, args.seed, pre.prefetch)[mode]
        if mode == "window":
            first_window_load(pre, s)
        ds = LmdbBatchDataset(path)
        dl = make_loader(ds, s, LoaderConfig(batch_size=args.batch, workers=args.workers, persistent_workers=False))
        it = iter(dl)
        next(it)  # workers started
        out[mode] = timed(it, args.seconds, lambda b: len(b[1]))
        del it, dl
        pre.close()
        log(f"  DataLoader x{args.workers} {mode}: {out[mode]:,.0f} samples/s")
    return out


def warm(path: Path, n: int, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    m = min(n, args.warm_samples)
    r = StoreReader(path)
    npy = workdir / "warm.npy"
    mm = np.lib.format.open_memmap(npy, "w+", np.float32, (m, *r.shape))
    for lo in range(0, m, 65536):
        mm[lo : lo + 65536] = r.read_range(lo, min(lo + 65536, m))
    mm.flush()
    del mm
    mm = np.load(npy, mmap_mode="r")
    np.asarray(mm).sum()  # every page cached and mapped
    rng = np.random.default_rng(args.seed)
    out: dict[str, float] = {}
    rand = [np.sort(rng.integers(0, m, args.batch)) for _ in range(64)]
    blocks = [b for b in samplers(path, m, args.batch, args.window_mb, args.seed, None)["block"]][:64]
    for name, bs in (("random", rand), ("block", blocks)):
        for _ in range(2):  # warm-up pass, then the measured ones
            for b in bs:
                r.read_batch(b)
        t0 = time.process_time()
        for b in bs:
            r.read_batch(b)
        out[name] = len(bs) * args.batch / (time.process_time() - t0)
        t0 = time.process_time()
        for b in bs:
            mm[b]
        out[f"memmap {name}"] = len(bs) * args.batch / (time.process_time() - t0)
        log(f"  warm {name}: {out[name]:,.0f} vs memmap {out[f'memmap {name}']:,.0f} samples/s (CPU time)")
    r.close()
    npy.unlink()
    return out


def quality(path: Path, n: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    with StoreReader(path) as r:
        labels, spv, k = r.labels(), r.meta.samples_per_value, len(r.classes)
    share = np.bincount(labels, minlength=k) / len(labels)
    out: dict[str, dict[str, float]] = {}
    for mode, s in samplers(path, n, args.batch, args.window_mb, args.seed, None).items():
        bs = s.batches()[:200]
        distinct = np.mean([len(np.unique(b // spv)) for b in bs])
        tvd = np.mean([0.5 * np.abs(np.bincount(labels[b], minlength=k) / len(b) - share).sum() for b in bs])
        out[mode] = {"distinct values per batch": float(distinct), "class-mix TVD": float(tvd)}
    return out


def memory(path: Path) -> dict[str, float]:
    before = rss_anon_mb()
    r = StoreReader(path)
    t0 = time.perf_counter()
    r.read_path  # noqa: B018
    h = r._handle()
    table_mb = 0.0 if h.table is None else h.table.offsets.nbytes / 2**20
    out = {"table build s": time.perf_counter() - t0, "table MB": table_mb}
    r.read_batch(np.random.default_rng(0).integers(0, len(r), 4096))
    out["reader RssAnon MB"] = rss_anon_mb() - before
    from lmdbstore.store.positions import _give_back_free_memory

    _give_back_free_memory()  # freed batch buffers that glibc kept: count only what the reader holds
    out["reader RssAnon after trim MB"] = rss_anon_mb() - before
    out["labels MB"] = r.labels().nbytes / 2**20
    r.close()
    return out


def train_wait(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
    from lmdbstore.training.model import build_model

    choice = choose_shuffle(os.path.getsize(path / "data.mdb"))
    log(f"  training: shuffle {choice.shuffle} ({choice.reason})")
    drop_cache(path)
    pre = StoreReader(path)
    s = samplers(path, n, args.batch, None, args.seed, pre.prefetch)[choice.shuffle]  # default window size
    ds = LmdbBatchDataset(path)
    model = build_model(ds.shape, 5).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    dl = make_loader(ds, s, LoaderConfig(batch_size=args.batch, workers=args.workers))
    wait = total = 0.0
    waits = []
    t_start = time.perf_counter()
    it = iter(dl)
    for _step in range(args.train_steps):
        t0 = time.perf_counter()
        x, y = next(it)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        waits.append(t1 - t0)
        wait += t1 - t0
    total = time.perf_counter() - t_start
    del it, dl
    pre.close()
    steady = sum(waits[len(waits) // 2 :]) / max(1e-9, total * (len(waits) - len(waits) // 2) / len(waits))
    return {
        "shuffle": choice.shuffle,  # type: ignore[dict-item]
        "steps": args.train_steps,
        "samples/s": args.train_steps * args.batch / total,
        "data wait share": wait / total,
        "data wait share, second half": steady,
        "first batch wait s": waits[0],
    }


def accuracy(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Validation accuracy of random, window and block order on a class-sorted store (one class after
    another, the way a generator writes them): same model, data, steps and seed; only the order differs."""
    import torch

    from lmdbstore import WriterConfig, open_writer
    from lmdbstore.ingestion.synth import SYNTH_CLASSES, synth_batches
    from lmdbstore.loader.dataset import LmdbBatchDataset
    from lmdbstore.loader.samplers import stratified_split
    from lmdbstore.training.model import build_model

    x, y = next(synth_batches(args.accuracy, seed=args.seed, batch=args.accuracy))
    order = np.argsort(y, kind="stable")
    path = workdir / "sorted"
    with open_writer(
        path, shape=x.shape[1:], dtype=x.dtype, classes=SYNTH_CLASSES, config=WriterConfig(sync=False)
    ) as w:
        w.append(x[order], y[order])
    ds = LmdbBatchDataset(path)
    with StoreReader(path) as r:
        spv, sb, labels = r.meta.samples_per_value, r.meta.sample_bytes, r.labels()
    tr, va = stratified_split(labels, 0.1, args.seed)
    window_bytes = len(tr) * sb // 8  # an eighth of the data per window, as out of core
    out: dict[str, float] = {}
    for mode in ("random", "window", "block"):
        torch.manual_seed(args.seed)
        model = build_model(ds.shape, len(SYNTH_CLASSES))
        opt = torch.optim.AdamW(model.parameters(), 3e-3)
        if mode == "window":
            s: Any = WindowBatchSampler(tr, 256, samples_per_value=spv, sample_bytes=sb, window_bytes=window_bytes)
        else:
            s = EpochBatchSampler(tr, 256, shuffle=mode, samples_per_value=spv, block_buffer=1, seed=args.seed)  # type: ignore[arg-type]
        for epoch in range(2):
            s.set_epoch(epoch)
            model.train()
            for b in s:
                xb, yb = ds[b]
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(ds[b][0]).argmax(1) == ds[b][1]).sum()) for b in np.array_split(va, 8))
        out[mode] = correct / len(va)
        log(f"  class-sorted store, {mode}: validation accuracy {out[mode]:.3f}")
    ds.reader.close()
    shutil.rmtree(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000, help="store size when creating one")
    ap.add_argument("--store", type=Path, help="use this existing store (read only)")
    ap.add_argument("--workdir", type=Path, help="where to create the store (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the created store")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window-mb", type=int, default=1024)
    ap.add_argument("--warm-samples", type=int, default=400_000)
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--accuracy", type=int, default=0, help="samples of a class-sorted store to train on per order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_ooc_out"))
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: disk,one,loader,warm,quality")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_ooc_"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = args.store or workdir / "store"
    created = args.store is None
    try:
        if created:
            log(f"writing {args.samples:,} samples to {path}")
            make_store(path, args.samples)
        res: dict[str, Any] = {"machine": machine(path)}
        with StoreReader(path) as r:
            n, spv, sb = len(r), r.meta.samples_per_value, r.meta.sample_bytes
            vb = spv * sb + r.meta.trailer_bytes
        res["store"] = {"samples": n, "bytes": os.path.getsize(path / "data.mdb"), "samples_per_value": spv}
        log(f"store: {n:,} samples, {res['store']['bytes'] / 2**30:.1f} GiB; RAM {res['machine']['ram_gib']} GiB")
        res["memory"] = memory(path)
        if "disk" not in skip:
            res["disk"] = {}
            for label, nb, mult in (("sample", sb, 1), ("value", vb, spv)):
                for q in (1, 16):
                    rate = disk_limit(path, nb, q, args.seconds / 2, args.seed + q)
                    res["disk"][f"{label} x{q}"] = rate * mult
                    log(f"  disk {label} pread x{q}: {rate:,.0f} reads/s = {rate * mult:,.0f} samples/s")
        if "one" not in skip:
            res["one"] = one_process(path, n, args)
        if "loader" not in skip:
            res["loader"] = loader(path, n, args)
        if "warm" not in skip:
            res["warm"] = warm(path, n, args, workdir)
        if "quality" not in skip:
            res["quality"] = quality(path, n, args)
        if args.train_steps:
            res["train"] = train_wait(path, n, args)
        if args.accuracy:
            res["accuracy"] = accuracy(args, workdir)
        report(res, args)
    finally:
        if created and not args.keep:
            shutil.rmtree(workdir if args.workdir is None else path, ignore_errors=True)


def machine(path: Path) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "available_gib": round(available_memory() / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    def r(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    st = res["store"]
    lines = [
        f"store: {st['samples']:,} samples, {st['bytes'] / 2**30:.1f} GiB; machine: {res['machine']['cpus']} CPUs, "
        f"{res['machine']['ram_gib']} GiB RAM; batch {args.batch}, window {args.window_mb} MiB, "
        f"{args.workers} workers",
        "",
    ]
    d = res.get("disk", {})
    if d:
        lines += ["| disk limit (random pread, same file) | samples/s |", "|---|---:|"]
        lines += [f"| {k.replace('x', 'x ', 1)} in flight | {f(v)} |" for k, v in d.items()]
        lines.append("")
    lines += [
        "| read (cold) | one process | DataLoader | ratio (one process) to the disk limit |",
        "|---|---:|---:|---|",
    ]
    one, ld = res.get("one", {}), res.get("loader", {})
    for mode in ("random", "block", "window", "lmdb-random"):
        base_key = "sample x16" if mode.endswith("random") else "value x16"
        lines.append(
            f"| {mode} | {f(one.get(mode))} | {f(ld.get(mode))} | {r(one.get(mode), d.get(base_key))} of {base_key} |"
        )
    if "window first-window load s" in one:
        lines.append(f"\nwindow: first window ({args.window_mb} MiB) read in {one['window first-window load s']:.1f} s")
    w = res.get("warm")
    if w:
        lines += ["", "| read (warm, CPU time) | lmdbstore | memmap | ratio |", "|---|---:|---:|---:|"]
        for k in ("random", "block"):
            lines.append(f"| {k} | {f(w[k])} | {f(w['memmap ' + k])} | {r(w[k], w['memmap ' + k])} |")
    q = res.get("quality")
    if q:
        lines += ["", "| shuffle | distinct values per batch | class-mix TVD per batch |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['distinct values per batch']:.0f} | {v['class-mix TVD']:.4f} |" for k, v in q.items()]
    m = res["memory"]
    lines += [
        "",
        f"memory: position table {m['table MB']:.1f} MB (built in {m['table build s']:.1f} s), labels "
        f"{m['labels MB']:.1f} MB (not loaded here); the reader's anonymous RSS after open + one 4096-sample batch "
        f"{m['reader RssAnon MB']:.1f} MB, {m['reader RssAnon after trim MB']:.1f} MB after malloc_trim",
    ]
    a = res.get("accuracy")
    if a:
        lines += ["", f"| order (class-sorted store of {args.accuracy:,} samples, 2 epochs) | validation accuracy |"]
        lines += ["|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in a.items()]
    t = res.get("train")
    if t:
        lines.append(
            f"training ({t['shuffle']}, {t['steps']} steps): {t['samples/s']:,.0f} samples/s, data wait "
            f"{100 * t['data wait share']:.1f}% (second half {100 * t['data wait share, second half']:.1f}%), "
            f"first batch {t['first batch wait s']:.1f} s"
        )
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ooc.md").write_text(text + "\n")
    (args.out / "bench_ooc.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
