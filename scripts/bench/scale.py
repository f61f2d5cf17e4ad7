#!/usr/bin/env python
"""Seed-scale benchmark (issue 36): every command at 40-50M samples, each figure beside its limit measured in the
same run.

One run, on a store it builds in ``--workdir`` and deletes at the end (``--keep`` keeps it):

* **the disk's limits**: sequential write (a probe file, fsynced) and read (``dd``-style, pages dropped), random
  ``pread`` of one sample at 16 and 64 in flight; the sequential read is measured again between every two disk
  rows (at a new offset of the store's file), so each row stands between a limit taken just before and one just
  after it (disk limits here swing 2x within minutes);
* **build**: ``write_parallel`` of ``--samples`` samples of 25x25 ``--dtype`` (the default writer: an fsync every
  64 MiB), against the sequential write; bytes on disk against the raw samples;
* **stats** and **verify** (every core), cold; verify against the sequential read (goal >= 0.5x);
* **a cold data-only epoch slice** (``--seconds``) in every order -- random against the 16-in-flight limit (goal
  >= 0.8x), block, window and auto against the sequential read (goal >= 0.8x) -- through ``make_loader`` with
  ``--workers`` processes, and each one's first batch (goal < 0.3 s);
* **warm**: random order over a slice that fits the page cache (the same samples in both), one store;
* **a set of 4 stores of the same samples** (4 stores of a quarter each: no 4x copy): the warm slice against one
  store (goal >= 0.9x) and a cold window slice against one store's (goal >= 0.8x: a cold set larger than RAM);
* **train** ``--train-steps`` steps (``lmdbstore train`` as a user runs it, ``--val-limit`` batches of
  validation): samples/s and data wait; the peak and steady resident size of its main process (goal: peak <=
  1.2x steady) and of each reader process; then the same run killed (SIGKILL) after a checkpoint inside the
  epoch and resumed: its final weights against the unbroken run's (goal: bit-identical).

When the disk holds the store and the four quarters at once they are built together; otherwise one after the
other (the one store deleted first).  A run that cannot fit is refused before anything is written.

Usage::

    python scripts/bench/scale.py --samples 40000000 --dtype float16 --workdir /data/scratch   # ~50 GB, ~25 min
    python scripts/bench/scale.py --samples 20000 --quick                                       # a smoke test

Prints the table (Markdown) and writes ``bench_scale.md`` and ``bench_scale.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, so that bench.* imports when run as a file
from bench.common import fmt_ratio, human, make_log, markdown_table, write_json
from bench.machine import describe_machine, machine_info, seq_read_rate, seq_write_rate
from bench.scale_runs import (
    SHAPE,
    Limits,
    build,
    drop,
    kill_inside_epoch,
    open_loader,
    pread_limits,
    read_rate,
    run_train,
    same_weights,
    train_cmd,
)

log = make_log("scale")
ORDERS = ("random", "block", "window", "auto")
#: Bytes of a store per byte of samples, at most (1.009x measured at 40M float16), and the room kept free.
STORE_OVERHEAD = 1.03
MARGIN = 1 << 30


@dataclass
class Row:
    """One line of the table: a figure, the limit it is held against (measured in this run), their ratio, the goal."""

    name: str
    figure: str
    limit: str = "-"
    ratio: float | None = None
    goal: str = "-"
    met: bool | None = None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40_000_000, help="samples of the store (default 40M)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--workdir", type=Path, default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=Path("bench_scale_out"))
    ap.add_argument("--seconds", type=float, default=20.0, help="each cold or warm read row")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2, help="reader processes of make_loader")
    ap.add_argument("--build-workers", type=int, default=2, help="write_parallel producers")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--val-limit", type=int, default=20, help="validation batches a process")
    ap.add_argument("--bracket-mb", type=int, default=2048, help="bytes of each sequential-read limit measurement")
    ap.add_argument("--pread-seconds", type=float, default=5.0)
    ap.add_argument("--keep", action="store_true", help="keep what was built")
    ap.add_argument("--quick", action="store_true", help="tiny timings and runs: a smoke test (with --samples 20000)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.batch, args.train_steps, args.checkpoint_every = 0.3, 64, 60, 2
        args.val_limit, args.bracket_mb, args.pread_seconds, args.build_workers = 1, 8, 0.2, 0
    if args.samples < 4 * args.batch or args.train_steps < 2 or args.checkpoint_every >= args.train_steps:
        ap.error("--samples must hold 4 batches, --train-steps 2 or more and --checkpoint-every fewer steps")
    args.sample_bytes = int(np.prod(SHAPE)) * np.dtype(args.dtype).itemsize
    return args


def room(args: argparse.Namespace) -> tuple[int, int]:
    """Bytes one store needs and the probe file's size."""
    store = int(args.samples * args.sample_bytes * STORE_OVERHEAD) + (64 << 20)
    return store, min(4 << 30, max(16 << 20, store // 8))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    store, probe = room(args)
    free = shutil.disk_usage(base).free
    if free < store + probe + MARGIN:
        print(
            f"scale: {args.samples:,} samples of {args.dtype} need {(store + probe + MARGIN) / 2**30:.1f} GiB in "
            f"{base}, which has {free / 2**30:.1f} GiB free: give --workdir on a larger disk or fewer --samples",
            file=sys.stderr,
        )
        return 2
    together = free >= 2 * store + probe + MARGIN
    root = Path(tempfile.mkdtemp(prefix="lmdbstore-scale-", dir=base))
    try:
        rows, facts = run(root, args, probe, together)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    lines = report(rows, facts, args)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scale.md").write_text("\n".join(lines) + "\n")
    write_json(args.out / "bench_scale.json", {"rows": [asdict(r) for r in rows], "facts": facts})
    return 0


def report(rows: list[Row], facts: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The Markdown: the machine, the sizes, then the table."""
    head = [
        f"Seed scale: {args.samples:,} samples of 25x25 {args.dtype} ({facts['store_gib']:.1f} GiB, "
        f"{facts['store_over_ram']:.2f}x RAM); batch {args.batch}, {args.workers} readers",
        "```",
        facts["machine"],
        "```",
    ]
    cells = [
        [r.name, r.figure, r.limit, fmt_ratio(r.ratio), r.goal, {True: "met", False: "NOT MET", None: "-"}[r.met]]
        for r in rows
    ]
    return head + markdown_table(
        ["row", "figure", "limit (same run)", "ratio", "goal", ""], "|---|---:|---:|---:|---|---|", cells
    )


def _mbs(rate: float) -> str:
    return f"{rate / 1e6:,.0f} MB/s"


def _goal(rows: list[Row], name: str, figure: str, limit: str, ratio: float | None, goal: float, higher: bool) -> None:
    met = None if ratio is None else (ratio >= goal if higher else ratio <= goal)
    rows.append(Row(name, figure, limit, ratio, f"{'>=' if higher else '<='} {goal:g}", met))


def run(root: Path, args: argparse.Namespace, probe_bytes: int, together: bool) -> tuple[list[Row], dict[str, Any]]:
    """Every row, in order (see the module docstring)."""
    from lmdbstore.tools.stats import store_stats
    from lmdbstore.tools.verify import verify_store

    rows: list[Row] = []
    info = machine_info(root)
    n, sb = args.samples, args.sample_bytes
    probe = root / "probe.bin"
    log(f"disk: sequential write and read of {probe_bytes / 2**20:.0f} MiB")
    write = seq_write_rate(probe, probe_bytes)
    first_read = seq_read_rate(probe)
    probe.unlink()
    rows.append(Row("disk: sequential write (dd, fsync)", _mbs(write)))
    rows.append(Row("disk: sequential read (dd, pages dropped)", _mbs(first_read)))

    one = root / "one"
    quarters = [root / f"q{k}" for k in range(4)]
    log(f"build: {n:,} samples with write_parallel ({args.build_workers} producers)")
    secs = build(one, 0, n, args.dtype, args.build_workers)
    raw, size = n * sb, (one / "data.mdb").stat().st_size
    rows.append(
        Row("build: write_parallel (sample bytes)", _mbs(raw / secs), f"write {_mbs(write)}", raw / secs / write)
    )
    _goal(rows, "store on disk / raw samples", f"{size / 2**30:.2f} GiB", f"raw {raw / 2**30:.2f} GiB", size / raw,
          1.02, False)  # fmt: skip
    if together:
        log("build: the same samples as 4 stores of a quarter each")
        for k, q in enumerate(quarters):
            build(q, k * n // 4, (k + 1) * n // 4, args.dtype, args.build_workers)
    lim = Limits(one / "data.mdb", min(args.bracket_mb << 20, size))
    facts: dict[str, Any] = {"machine": describe_machine(info), "store_gib": size / 2**30,
                             "store_over_ram": size / (info.get("ram_gib") or 1) / 2**30}  # fmt: skip

    def cold(name: str, fn: Callable[[], Any], paths: Sequence[Path]) -> tuple[Any, float]:
        drop(paths)
        out, before, after = lim.around(fn)
        return out, (before + after) / 2

    t, seq = cold("stats", lambda: _timed(lambda: store_stats(one)), [one])
    rows.append(Row("stats (cold)", f"{t:.2f} s", f"read {_mbs(seq)}"))
    t, seq = cold("verify", lambda: _timed(lambda: verify_store(one)), [one])
    _goal(rows, "verify, every core (cold)", _mbs(size / t), f"read {_mbs(seq)}", size / t / seq, 0.5, True)
    t, seq = cold("verify 1", lambda: _timed(lambda: verify_store(one, workers=1)), [one])
    rows.append(Row("  verify --workers 1 (cold)", _mbs(size / t), f"read {_mbs(seq)}", size / t / seq))
    pread = pread_limits(one / "data.mdb", sb, args.pread_seconds, 0)
    one_window = 0.0
    for order in ORDERS:
        log(f"cold {order} slice of {args.seconds:g} s")
        chose: list[str] = []

        def epoch(o: str = order, said: list[str] = chose) -> dict[str, float]:
            return read_rate(open_loader([one], o, args.batch, args.workers, say=said.append), args.seconds)

        got, seq = cold(order, epoch, [one])
        name = f"cold {order}" + (f" ({chose[0].split(':')[1].split('(')[0].strip()})" if chose else "")
        if order == "random":
            after = pread_limits(one / "data.mdb", sb, args.pread_seconds, 1)
            limit = (pread["x16"] + after["x16"]) / 2
            _goal(rows, f"{name}: samples/s", human(got["rate"]), f"pread x16 {human(limit)}/s", got["rate"] / limit,
                  0.8, True)  # fmt: skip
            rows.append(Row("  pread x64 (same run)", f"{human((pread['x64'] + after['x64']) / 2)}/s"))
            lim.measure()
        else:
            _goal(rows, f"{name}: MB/s", _mbs(got["rate"] * sb), f"read {_mbs(seq)}", got["rate"] * sb / seq, 0.8, True)
        if order == "window":
            one_window = got["rate"]
        _goal(rows, f"  first batch, cold {order}", f"{got['first_batch_s']:.2f} s", "-", got["first_batch_s"], 0.3,
              False)  # fmt: skip
    warm = _warm_slice(n, sb)
    one_warm = _warm_rate([one], warm, args)
    rows.append(Row(f"warm random, {len(warm):,} samples: samples/s", human(one_warm)))
    _train_rows(rows, one, root, args, n)
    if not together:
        shutil.rmtree(one)
        log("build: the same samples as 4 stores of a quarter each (after the one store was deleted)")
        for k, q in enumerate(quarters):
            build(q, k * n // 4, (k + 1) * n // 4, args.dtype, args.build_workers)
        lim = Limits(quarters[0] / "data.mdb", min(args.bracket_mb << 20, (quarters[0] / "data.mdb").stat().st_size))
    set_warm = _warm_rate(quarters, warm, args)
    _goal(rows, "set of 4 stores, warm random: vs one store", human(set_warm), f"one store {human(one_warm)}",
          set_warm / one_warm if one_warm else None, 0.9, True)  # fmt: skip
    got, seq = cold("set window", lambda: read_rate(open_loader(quarters, "window", args.batch, args.workers),
                                                      args.seconds), quarters)  # fmt: skip
    _goal(rows, "set of 4 stores, cold window: vs one store", human(got["rate"]), f"one store {human(one_window)}",
          got["rate"] / one_window if one_window else None, 0.8, True)  # fmt: skip
    rows.append(Row("  (set, cold window: MB/s)", _mbs(got["rate"] * sb), f"read {_mbs(seq)}", got["rate"] * sb / seq))
    facts["limits_read"] = lim.taken
    return rows, facts


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _warm_slice(n: int, sb: int) -> np.ndarray:
    """Samples spread over the four quarters (``n // 4`` apart) that fit a share of the page cache: the same set
    indices and store indices."""
    from lmdbstore.loader.window import available_memory

    w = max(4, min(n, int(available_memory() * 0.25) // sb, 2_000_000)) // 4
    return np.concatenate([np.arange(k * (n // 4), k * (n // 4) + min(w, n // 4)) for k in range(4)]).astype(np.int64)


def _warm_rate(paths: Sequence[Path], warm: np.ndarray, args: argparse.Namespace) -> float:
    """Random order over the warm slice: one pass to fill the page cache, then the median of three timed slices."""
    loader = open_loader(paths, "random", args.batch, args.workers, indices=warm)
    for _ in loader:
        pass
    rounds = (1,) if args.quick else (1, 2, 3)
    rates = [read_rate(open_loader(paths, "random", args.batch, args.workers, seed=s, indices=warm), args.seconds)["rate"]
             for s in rounds]  # fmt: skip
    return statistics.median(rates)


def _train_rows(rows: list[Row], store: Path, root: Path, args: argparse.Namespace, n: int) -> None:
    """The training run with its data wait and memory, then the killed and resumed one against it."""
    full, killed = root / "run-full", root / "run-killed"
    log(f"train: {args.train_steps} steps")
    result, mem, _secs = run_train(train_cmd(store, full, args))
    final = result["final"]
    rows.append(Row("train: samples/s", human(final["samples_per_s"])))
    _goal(rows, "train: data wait", f"{100 * final['data_wait_share']:.1f} %", "-", final["data_wait_share"], 0.05,
          False)  # fmt: skip
    m = mem.summary()
    main = m["main"]
    _goal(rows, "train: main process private RSS, peak / steady",
          f"{main['private_peak']:,.0f} / {main['private_steady']:,.0f} MiB", "-",
          main["private_peak"] / main["private_steady"] if main["private_steady"] else None, 1.2, False)  # fmt: skip
    rows.append(Row("  main process RSS with shared pages, peak / steady",
                    f"{main['peak']:,.0f} / {main['steady']:,.0f} MiB"))  # fmt: skip
    rows.append(Row("  main process, private steady bytes/sample", f"{main['private_steady'] * 2**20 / n:.1f}"))
    for k, w in enumerate(m["workers"]):
        rows.append(Row(f"  child process {k + 1} (reader) private / RSS, peak",
                        f"{w['private_peak']:,.0f} / {w['peak']:,.0f} MiB"))  # fmt: skip
    log("train: the same run killed inside the epoch, then resumed")
    step = kill_inside_epoch(train_cmd(store, killed, args), killed)
    with contextlib.suppress(RuntimeError):
        run_train(train_cmd(store, killed, args, "--resume"))
    same = step > 0 and same_weights(full / "checkpoint.pt", killed / "checkpoint.pt")
    rows.append(Row(f"kill at step {step}, resume: weights bit-identical", "yes" if same else "NO", "-", None,
                    "yes", same))  # fmt: skip
    for d in (full, killed):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
