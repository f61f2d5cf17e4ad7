"""``python -m scripts.bench NAME [NAME ...] [--quick] [options]`` runs benchmarks; ``list`` names them; ``report``
writes docs/benchmarks.md and the README's headline table from the last results.

Exit status: 0 every row measured, 1 a row failed, 2 a benchmark refused (a missing extra, too little disk) or a bad
command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from .driver import BenchError, Options, run
from .machine import REPO
from .report import write
from .suites import SUITES


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", metavar="NAME", help=f"list, report, or benchmarks: {', '.join(SUITES)}")
    ap.add_argument("--quick", action="store_true", help="tiny data, one short round: a smoke run")
    ap.add_argument("--out", type=Path, default=Path("bench_out"), help="results directory (default bench_out)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of each row (default 3; 1 with --quick)")
    ap.add_argument("--seconds", type=float, help="seconds of each timed measurement (default 6; 0.3 with --quick)")
    ap.add_argument(
        "--store-dir",
        type=Path,
        help="build stores here and keep them for the next run (default: a temporary directory, removed)",
    )
    ap.add_argument("--samples", type=int, help="samples of the data, where the benchmark takes it")
    ap.add_argument("--dtype", choices=("float16", "float32"), help="the samples' dtype, where the benchmark takes it")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md", help="report: the document")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md", help="report: the README")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in SUITES and n not in ("list", "report")]
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(SUITES)}")
    if (a.rounds is not None and a.rounds < 1) or (a.seconds is not None and a.seconds <= 0):
        ap.error("--rounds and --seconds must be positive")
    if a.samples is not None and a.samples < 4096:
        ap.error("--samples must be at least 4096 (one batch)")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    options = argv[:]
    for name in a.names:
        options.remove(name)
    status = 0
    for name in a.names:
        if name == "list":
            print("\n".join(f"{n:<11} {b.title}" for n, b in SUITES.items()))
        elif name == "report":
            write(a.out, a.docs, a.readme, SUITES)
            print(f"wrote {a.docs} and the headline table of {a.readme} from {a.out}")
        else:
            cmd = shlex.join(["python", "-m", "scripts.bench", name, *options])
            opt = Options(a.out, a.quick, a.rounds, a.seconds, a.store_dir, a.samples, a.dtype, cmd)
            try:
                res = run(SUITES[name], opt)
            except (BenchError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                status = 2
                continue
            print(f"{name}: {res['status']}; results in {a.out / name}.json and .md")
            status = max(status, 0 if res["status"] == "complete" else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
