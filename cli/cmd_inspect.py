"""``lmdbstore stats`` and ``lmdbstore verify``: what is in a store, and whether it is intact
(see lmdbstore.tools.stats and lmdbstore.tools.verify)."""

from pathlib import Path
from typing import Annotated, Any

import typer

from lmdbstore.config import (
    DEFAULT_MAX_PROBLEMS,
    DEFAULT_PROGRESS,
    DEFAULT_VERIFY_CHECKSUMS,
    DEFAULT_VERIFY_STRUCTURE,
    DEFAULT_VERIFY_WORKERS,
)
from lmdbstore.util.progress import bars_wanted, progress_bar

from .common import JsonOption, Output, ProgressOption, cli_errors

__all__ = ["stats", "verify"]


def stats(
    stores: Annotated[list[Path], typer.Argument(help="Store directory (several: each, and the set read as one).")],
    as_json: JsonOption = False,
    sample: Annotated[
        int | None, typer.Option(help="Recompute value statistics from this many random samples read back.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw class counts and a value histogram to this PNG.")] = None,
) -> None:
    """Describe STORE: samples per class, shape, dtype, packing, bytes on disk against raw, LMDB depth, values.

    Several stores: each, then the set they make read as one (classes mapped by name, merged values)."""
    with cli_errors(as_json=as_json):
        from lmdbstore.tools.set_tools import format_set_stats, set_stats
        from lmdbstore.tools.stats import format_stats, store_stats

        one = len(stores) == 1
        try:
            s = store_stats(stores[0], sample=sample) if one else set_stats(stores, sample=sample)
        except ValueError as exc:  # the only parameter store_stats checks is sample (a set: also the stores)
            raise ValueError(f"--sample: {exc}" if str(exc).startswith("sample") else str(exc)) from None
        out = Output(as_json)
        if not as_json:
            out.say(format_stats(s) if one else format_set_stats(s))
        if plot is not None:
            from lmdbstore.tools.viz import plot_stats

            out.say(f"wrote {plot_stats(stores[0], plot).path}")
        out.result(s)


def verify(
    stores: Annotated[list[Path], typer.Argument(help="Store directory (several: each, as one set).")],
    as_json: JsonOption = False,
    checksums: Annotated[
        bool, typer.Option(help="Check per-value checksums (when the store has them).")
    ] = DEFAULT_VERIFY_CHECKSUMS,
    structure: Annotated[
        bool, typer.Option(help="Check LMDB's page structure first (without liblmdb).")
    ] = DEFAULT_VERIFY_STRUCTURE,
    max_problems: Annotated[int, typer.Option(help="Stop listing after this many problems.")] = DEFAULT_MAX_PROBLEMS,
    progress: ProgressOption = DEFAULT_PROGRESS,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Processes reading the values and computing their checksums (default: the cores, one per "
            "512 MiB of values at most; 1: this process).  The report is the same for any number.",
        ),
    ] = DEFAULT_VERIFY_WORKERS,
) -> None:
    """Check STORE's contents against its metadata.

    Checks the LMDB page structure, that sample keys are contiguous and every value has the right length
    and checksum, that labels, class counts and the class-index table agree, and that nothing extra is
    stored.  Lists the first problems with their sample indices.  Exit status: 0 clean, 1 problems found,
    2 the store cannot be opened at all.  Several stores: each is checked, and that they make one set.

    The values are read in large sequential runs by --workers processes while the page structure is walked
    beside them, so a large store verifies at about the disk's sequential read rate.
    """
    with cli_errors(code=2, as_json=as_json):
        from lmdbstore.tools.set_tools import verify_set

        bars: list[Any] = []  # created when the first store's size is known, so an unopenable store prints one line

        def bar(total: int | None = None) -> Any:
            if not bars:
                bars.append(progress_bar("verify", total=total))
            return bars[0]

        def advance(done: int) -> None:
            bar().update(done - bar().n)

        def expect(total: int) -> None:  # the samples of the stores begun so far: rate and time left
            bar(total).total = total
            bar().refresh()

        shown = bars_wanted(progress)
        try:
            report = verify_set(
                stores,
                checksums=checksums,
                max_problems=max_problems,
                structure=structure,
                progress=advance if shown else None,
                workers=workers,
                total=expect if shown else None,
            )
        finally:
            for b in bars:
                b.close()
        out = Output(as_json)
        for r in report.reports:
            of = f" of {r.path}" if len(stores) > 1 else ""
            for p in r.problems:
                where = f" at {p.index}" if p.index is not None else ""
                out.say(f"problem{where}{of}: [{p.kind}] {p.message}")
            out.say(f"{r.path}: {'OK' if r.ok else f'{len(r.problems)} problem(s) found'}")
        out.result(report.reports[0].to_dict() if len(stores) == 1 else report.to_dict())  # several: the set's
    if not report.ok:
        raise typer.Exit(1)
