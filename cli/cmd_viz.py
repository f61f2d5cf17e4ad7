"""``lmdbstore show`` and ``lmdbstore plot``: pictures of samples and of training runs (see lmdbstore.tools.viz)."""

from pathlib import Path
from typing import Annotated, Any

import typer

from lmdbstore.config import DEFAULT_DPI, DEFAULT_PER_CLASS, DEFAULT_RUN_PNG, DEFAULT_SAMPLE_SEED, DEFAULT_SAMPLES_PNG

from .common import JsonOption, Output, cli_errors, report_dict

__all__ = ["plot", "show"]


def show(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="PNG to write.")] = Path(DEFAULT_SAMPLES_PNG),
    per_class: Annotated[int, typer.Option(help="Samples drawn per class (seeded).")] = DEFAULT_PER_CLASS,
    indices: Annotated[
        str | None, typer.Option(help="Show these sample indices instead (comma-separated, or a .npy/.txt file).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the samples drawn.")] = DEFAULT_SAMPLE_SEED,
    dpi: Annotated[int, typer.Option(help="Pixels per inch of the PNG.")] = DEFAULT_DPI,
    as_json: JsonOption = False,
) -> None:
    """Draw a grid of samples of STORE, one row per class, titled with class names and sample indices."""
    with cli_errors(as_json=as_json):
        from lmdbstore.tools.viz import show_samples

        idx = _parse_indices(indices) if indices is not None else None
        pic = show_samples(store, out, per_class=per_class, indices=idx, seed=seed, dpi=dpi)
        _wrote(pic, as_json)


def plot(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (`train --out`) or metrics.jsonl files.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="PNG to write.")] = Path(DEFAULT_RUN_PNG),
    dpi: Annotated[int, typer.Option(help="Pixels per inch of the PNG.")] = DEFAULT_DPI,
    as_json: JsonOption = False,
) -> None:
    """Plot loss, validation accuracy and samples/s per epoch of one or more training runs (overlaid)."""
    with cli_errors(as_json=as_json):
        from lmdbstore.tools.viz import plot_runs

        pic = plot_runs(runs, out, dpi=dpi)
        _wrote(pic, as_json)


def _wrote(pic: Any, as_json: bool) -> None:
    """Say which picture was written (or print it as JSON)."""
    out = Output(as_json)
    out.say(f"wrote {pic.path} ({pic.width}x{pic.height} px)")
    out.result(report_dict(pic))


def _parse_indices(text: str) -> list[int] | object:
    """``--indices``: a comma-separated list, or a file (see lmdbstore.tools.export.load_indices)."""
    if Path(text).is_file():
        from lmdbstore.tools.export import load_indices

        return load_indices(text)
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"indices: expected comma-separated integers or a file, got {text!r}") from None
