"""The one driver: runs a :class:`~.spec.Benchmark` and writes its results.

In order: the extras the benchmark needs are checked and the disk's room for what it builds, before anything is built
(a refusal is one :class:`BenchError` line); the machine's header; then each row, its artifacts built (or reused from
``--store-dir`` when a marker beside them says they hold this data and the store agrees) as it first needs them, and
written to ``OUT/NAME.json`` as soon as it ends -- a run killed at its tenth row keeps nine.  A row runs its
measurement in ``--rounds`` interleaved rounds: a ``bracket`` baseline (the disk's limits) is measured right before
and right after each round, a ``round`` baseline once a round next to the row's own measurement (before it in even
rounds, after it in odd ones); the figure is the median (min-max) of the rounds, each ratio the median (min-max) of
the rounds' ratios.  A measurement already made in this run for an earlier row is not made again (one definition, one
measurement; e.g. a first-batch row reads the cold epoch's numbers).  A row that fails records its error and the run
goes on; ``OUT/NAME.md`` is the table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import data as data_mod
from . import formats, machine
from .spec import Benchmark, Ctx, Data, Measure, Row

BUILDERS = {**data_mod.BUILDERS, **formats.BUILDERS}
#: Room kept free on the disk beyond what an artifact takes.
MARGIN = 1 << 30
#: What installs a missing extra.
INSTALL = {
    "streaming": "lmdbstore[peers]",
    "litdata": "lmdbstore[peers]",
    "webdataset": "lmdbstore[peers]",
    "distributed": "lmdbstore[dask]",
    "tensorflow": "lmdbstore[tensorflow]",
    "keras": "lmdbstore[keras]",
    "torch": "lmdbstore[torch]",
    "google_crc32c": "lmdbstore[tfrecord]",
}


class BenchError(Exception):
    """A benchmark that cannot run here (one line: what is missing and how to get it)."""


@dataclass
class Options:
    """What the command line decides: where results go, ``--quick``, rounds and seconds (``None``: 3 and 6 s, or 1
    and 0.3 s under ``--quick``), where artifacts are built and kept (``None``: a temporary directory, removed), the
    data overrides, and the command as typed (for the results)."""

    out: Path = Path("bench_out")
    quick: bool = False
    rounds: int | None = None
    seconds: float | None = None
    store_dir: Path | None = None
    samples: int | None = None
    dtype: str | None = None
    command: str = ""


def missing(needs: tuple[str, ...]) -> list[str]:
    """The ``needs`` not met here: modules not importable, ``"cuda"`` without a CUDA device."""
    out = []
    for name in needs:
        if name == "cuda":
            try:
                import torch

                if not torch.cuda.is_available():
                    out.append("a CUDA device")
            except ImportError:
                out.append("torch (with a CUDA device)")
        elif importlib.util.find_spec(name) is None:
            out.append(f"{name} (pip install '{INSTALL.get(name, 'lmdbstore[bench]')}')")
    return out


def run(bench: Benchmark, opt: Options) -> dict[str, Any]:
    """Run every row of ``bench``; the results, also in ``opt.out/NAME.json`` and ``.md``.

    Raises:
        BenchError: a module it needs is missing, or the disk cannot hold what it builds (nothing was built).
        ValueError: an override the benchmark does not take.
    """
    data = bench.resolved(opt.quick, opt.samples, opt.dtype)
    lacking = missing(bench.needs)
    if lacking:
        raise BenchError(f"{bench.name} needs what this machine lacks: {', '.join(lacking)}")
    own = opt.store_dir is None
    store_dir = Path(tempfile.mkdtemp(prefix="lmdbstore-bench-")) if own else opt.store_dir
    assert store_dir is not None
    store_dir.mkdir(parents=True, exist_ok=True)
    try:
        runner = Runner(bench, data, opt, store_dir)
        runner.check_room()
        return runner.run_all()
    finally:
        if own:
            shutil.rmtree(store_dir, ignore_errors=True)


class Runner:
    """One run of one benchmark: its context, what it built, what it measured."""

    def __init__(self, bench: Benchmark, data: Data, opt: Options, store_dir: Path):
        self.bench, self.data, self.opt, self.dir = bench, data, opt, store_dir
        self.rounds = opt.rounds or (1 if opt.quick else 3)
        self.scratch = store_dir / f"scratch-{os.getpid()}"  # made by run_all, removed at its end
        seconds = opt.seconds or (0.3 if opt.quick else 6.0)
        self.ctx = Ctx(data=data, paths={}, seconds=seconds, quick=opt.quick, scratch=self.scratch)
        self.recorded: dict[str, list[dict[str, float]]] = {}
        self.last: tuple[str, dict[str, float]] | None = None  # the measurement made last, for a bracket to reuse
        self.warmed: set[str] = set()  # artifacts read into the page cache and not dropped since
        self.json = opt.out / f"{bench.name}.json"

    # ------------------------------------------------------------------ artifacts
    def where(self, kind: str) -> Path:
        return self.dir / f"{kind}-{self.data.samples}-{self.data.dtype}"

    def cached(self, kind: str) -> bool:
        """Whether ``kind`` is built at :meth:`where` for this data: its marker says so and a store agrees."""
        path, marker = self.where(kind), self.where(kind).with_suffix(".json")
        try:
            m = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        if not path.exists() or m.get("data") != asdict(self.data) | {"shape": list(self.data.shape)}:
            return False
        if kind in ("store", "set4"):
            import lmdbstore

            parts = sorted(q for q in path.iterdir() if q.is_dir()) if kind == "set4" else path
            with lmdbstore.open_reader(parts) as r:
                return len(r) == self.data.samples and r.dtype == self.data.dtype and r.shape == self.data.shape
        return True

    def check_room(self) -> None:
        """Refuse before building anything when the disk cannot hold the largest artifact not yet built (counting
        as free the artifacts already built, which :meth:`ensure` removes when no later row reads them)."""
        have = {k: self.cached(k) for k in self.bench.artifacts}
        need = [BUILDERS[k][1](self.data) for k, ok in have.items() if not ok]
        free = shutil.disk_usage(self.dir).free + sum(BUILDERS[k][1](self.data) for k, ok in have.items() if ok)
        if need and max(need) + MARGIN > free:
            raise BenchError(
                f"{self.bench.name} at {self.data.describe()} needs {(max(need) + MARGIN) / 2**30:.1f} "
                f"GiB free in {self.dir}, which has {free / 2**30:.1f} GiB: give --store-dir on a larger "
                "disk, or fewer --samples"
            )

    def ensure(self, row: Row, later: tuple[Row, ...]) -> None:
        """Build (or find) every artifact ``row`` reads; remove this run's artifacts no later row reads when the
        disk is short."""
        for kind in self.reads(row):
            path = self.where(kind)
            self.ctx.paths[kind] = path
            if kind in self.ctx.built or self.cached(kind):
                self.ctx.built.setdefault(kind, json.loads(path.with_suffix(".json").read_text())["seconds"])
                continue
            shutil.rmtree(path, ignore_errors=True)
            build, size = BUILDERS[kind]
            if shutil.disk_usage(self.dir).free < size(self.data) + MARGIN:
                keep = {k for r in (row, *later) for k in self.reads(r)}
                for old in [k for k in self.ctx.built if k not in keep]:
                    log(f"removing {old} (no later row reads it) to make room for {kind}")
                    shutil.rmtree(self.ctx.paths.pop(old), ignore_errors=True)
                    self.where(old).with_suffix(".json").unlink(missing_ok=True)
                    del self.ctx.built[old]
            log(f"building {kind}: {self.data.describe()}")
            t0 = time.perf_counter()
            build(path, self.data)
            self.ctx.built[kind] = time.perf_counter() - t0
            marker = {"data": asdict(self.data) | {"shape": list(self.data.shape)}, "seconds": self.ctx.built[kind]}
            path.with_suffix(".json").write_text(json.dumps(marker))

    def reads(self, row: Row) -> list[str]:
        """The artifacts ``row`` still has to read (a recorded measurement reads nothing again)."""
        ms = [row.measure, *(b.measure for b in row.baselines)]
        return [k for m in ms if m.label not in self.recorded for k in m.uses]

    # ------------------------------------------------------------------ measuring
    def measure(self, m: Measure, reuse: bool = False) -> dict[str, float]:
        """One measurement now (``reuse``: the last one, when it was this same measurement)."""
        if reuse and self.last is not None and self.last[0] == m.label:
            return self.last[1]
        self.last = None
        stores = [p for k in m.uses for p in (self.ctx.stores(k) if k == "set4" else [self.ctx.paths[k]])]
        self.ctx.drop = lambda: machine.drop(stores)
        if not m.warm:  # it may drop pages (the disk's limits do, cold reads do)
            self.warmed -= set(m.uses)
        elif not set(m.uses) <= self.warmed and machine.warm(stores):
            self.warmed |= set(m.uses)
        self.ctx.scratch = Path(tempfile.mkdtemp(dir=self.scratch))  # each measurement writes in a new one
        try:
            got = m.fn(self.ctx)
        finally:
            shutil.rmtree(self.ctx.scratch, ignore_errors=True)
        self.last = (m.label, got)
        return got

    def rounds_of(self, row: Row) -> tuple[list[dict[str, float]], dict[str, list[Any]]]:
        """The row's measurement per round, and per baseline its numbers per round (a pair for a bracket)."""
        m = row.measure
        live = [b for b in row.baselines if b.when != "recorded"]
        if m.label in self.recorded and not live:
            return self.recorded[m.label], {}
        figs: list[dict[str, float]] = []
        base: dict[str, list[Any]] = {b.measure.label: [] for b in live}
        for r in range(1 if m.once else self.rounds):
            self.ctx.round = r
            before = {b.measure.label: self.measure(b.measure, reuse=True) for b in live if b.when == "bracket"}
            if r % 2:  # odd rounds measure the row first, its round baselines after: drift cancels in the median
                figs.append(self.measure(m))
            for b in live:
                if b.when == "round":
                    base[b.measure.label].append(self.measure(b.measure))
            if not r % 2:
                figs.append(self.measure(m))
            for b in live:
                if b.when == "bracket":
                    base[b.measure.label].append((before[b.measure.label], self.measure(b.measure)))
            log(f"  {row.name}, round {r + 1}: " + ", ".join(f"{k} {v:,.4g}" for k, v in figs[-1].items()))
        self.recorded[m.label] = figs
        return figs, base

    def row(self, row: Row) -> dict[str, Any]:
        """One row's results (its error, if it failed)."""
        out: dict[str, Any] = {"name": row.name, "unit": row.unit, "goal": asdict(row.goal) if row.goal else None}
        t0 = time.perf_counter()
        try:
            figs, base = self.rounds_of(row)
            values = [f[row.key] for f in figs]
            out["figure"] = machine.spread(values)
            out["baselines"] = []
            for b in row.baselines:
                key = b.key or row.key
                if b.when == "bracket":
                    pairs = [[x[key], y[key]] for x, y in base[b.measure.label]]
                    vals = [(x + y) / 2 for x, y in pairs]
                elif b.when == "round":
                    pairs, vals = [], [d[key] for d in base[b.measure.label]]
                else:
                    rec = self.recorded.get(b.measure.label) or self.rounds_of(Row(b.measure.label, b.measure))[0]
                    pairs, vals = [], [machine.spread([d[key] for d in rec])["median"]] * len(values)
                ratios = [f / v for f, v in zip(values, vals, strict=True) if v]
                out["baselines"].append(
                    {
                        "name": b.measure.label + (f", {key}" if key != row.key else ""),
                        "when": b.when,
                        "value": machine.spread(vals),
                        "ratio": machine.spread(ratios),
                        "before_after": pairs,
                    }
                )
            if row.goal is not None:
                judged = out["baselines"][0]["ratio"] if row.goal.on == "ratio" else out["figure"]
                out["met"] = row.goal.met(judged["median"])
        except Exception as exc:  # the row fails, the run goes on
            text = " ".join(str(exc).split())[:400]
            out["error"] = f"{type(exc).__name__}: {text}"
            log(f"  {row.name}: FAILED {out['error']}")
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out

    def run_all(self) -> dict[str, Any]:
        """Every row, the results written after each."""
        from . import report

        res: dict[str, Any] = {
            "benchmark": self.bench.name,
            "title": self.bench.title,
            "command": self.opt.command,
            "quick": self.opt.quick,
            "rounds": self.rounds,
            "seconds": self.ctx.seconds,
            "data": self.data.describe() if self.data.samples else "",
            "header": machine.header(self.dir),
            "rows": [],
            "status": "running",
        }
        self.opt.out.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(exist_ok=True)
        self.write(res)
        try:
            for i, row in enumerate(self.bench.rows):
                log(f"{self.bench.name}: {row.name}")
                try:
                    self.ensure(row, self.bench.rows[i + 1 :])
                except Exception as exc:
                    res["rows"].append({"name": row.name, "unit": row.unit, "error": f"{type(exc).__name__}: {exc}"})
                else:
                    res["rows"].append(self.row(row))
                self.write(res)
            failed = [r["name"] for r in res["rows"] if "error" in r]
            res["status"] = f"failed: {', '.join(failed)}" if failed else "complete"
        except BaseException as exc:
            res["status"] = f"interrupted ({type(exc).__name__}) after {len(res['rows'])} rows"
            raise
        finally:
            res["header"]["load_end"] = machine.load()
            res["built"] = {k: round(v, 1) for k, v in self.ctx.built.items()}
            self.write(res)
            (self.opt.out / f"{self.bench.name}.md").write_text(report.section(res, self.bench) + "\n")
            shutil.rmtree(self.scratch, ignore_errors=True)
        return res

    def write(self, res: dict[str, Any]) -> None:
        """The results so far to ``OUT/NAME.json``, replaced whole (never half written)."""
        tmp = self.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, self.json)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
