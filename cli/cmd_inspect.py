"""``lmdbstore stats`` and ``lmdbstore verify``: what is in a store, and whether it is intact
(see lmdbstore.tools.stats and lmdbstore.tools.verify)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lmdbstore.config import DEFAULT_MAX_PROBLEMS, DEFAULT_PROGRESS, DEFAULT_VERIFY_CHECKSUMS, DEFAULT_VERIFY_STRUCTURE
from lmdbstore.util.progress import bars_wanted, progress_bar

from .common import JsonOption, Output, ProgressOption, cli_errors

__all__ = ["stats", "verify"]


def stats(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    as_json: JsonOption = False,
    sample: Annotated[
        int | None, typer.Option(help="Recompute value statistics from this many random samples read back.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw class counts and a value histogram to this PNG.")] = None,
) -> None:
    """Describe STORE: samples per class, shape, dtype, packing, bytes on disk against raw, LMDB depth, values."""
    with cli_errors():
        from lmdbstore.tools.stats import format_stats, store_stats

        try:
            s = store_stats(store, sample=sample)
        except ValueError as exc:  # the only parameter store_stats checks is sample
            raise ValueError(f"--sample: {exc}") from None
        out = Output(as_json)
        if not as_json:
            out.say(format_stats(s))
        if plot is not None:
            from lmdbstore.tools.viz import plot_stats

            out.say(f"wrote {plot_stats(store, plot).path}")
        out.result(s)


def verify(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    as_json: JsonOption = False,
    checksums: Annotated[
        bool, typer.Option(help="Check per-value checksums (when the store has them).")
    ] = DEFAULT_VERIFY_CHECKSUMS,
    structure: Annotated[
        bool, typer.Option(help="Check LMDB's page structure first (without liblmdb).")
    ] = DEFAULT_VERIFY_STRUCTURE,
    max_problems: Annotated[int, typer.Option(help="Stop listing after this many problems.")] = DEFAULT_MAX_PROBLEMS,
    progress: ProgressOption = DEFAULT_PROGRESS,
) -> None:
    """Check STORE's contents against its metadata.

    Checks the LMDB page structure, that sample keys are contiguous and every value has the right length
    and checksum, that labels, class counts and the class-index table agree, and that nothing extra is
    stored.  Lists the first problems with their sample indices.  Exit status: 0 clean, 1 problems found,
    2 the store cannot be opened at all.
    """
    with cli_errors(code=2):
        from lmdbstore.tools.verify import verify_store

        bars: list[Any] = []  # created on the first progress call, so an unopenable store prints one line

        def advance(done: int) -> None:
            if not bars:
                bars.append(progress_bar("verify"))
            bars[0].update(done - bars[0].n)

        try:
            report = verify_store(
                store,
                checksums=checksums,
                max_problems=max_problems,
                structure=structure,
                progress=advance if bars_wanted(progress) else None,
            )
        finally:
            for bar in bars:
                bar.close()
        out = Output(as_json)
        for p in report.problems:
            where = f" at {p.index}" if p.index is not None else ""
            out.say(f"problem{where}: [{p.kind}] {p.message}")
        out.say(f"{store}: {'OK' if report.ok else f'{len(report.problems)} problem(s) found'}")
        out.result(report.to_dict())
    if not report.ok:
        raise typer.Exit(1)
