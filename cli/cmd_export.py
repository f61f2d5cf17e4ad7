"""``lmdbstore export`` and ``lmdbstore copy``: getting data back out of a store
(see lmdbstore.tools.export and lmdbstore.tools.copy)."""

from pathlib import Path
from typing import Annotated

import typer

from lmdbstore.config import DEFAULT_COMPRESS, DEFAULT_PROGRESS
from lmdbstore.tools.export_formats import EXPORT_FORMATS
from lmdbstore.util.progress import progress_bar

from .common import LOADER, TRAIN, JsonOption, Output, ProgressOption, cli_errors, or_list, parse_names, report_dict

__all__ = ["copy", "export"]


def export(
    stores: Annotated[list[Path], typer.Argument(help="Store directory (several: exported as one set).")],
    out: Annotated[Path, typer.Argument(help="Output file: .npy (+ .labels.npy, .classes.json), .npz or .h5/.hdf5.")],
    fmt: Annotated[
        str | None, typer.Option("--format", help=f"{or_list(list(EXPORT_FORMATS))} (default: from OUT's suffix).")
    ] = None,
    classes: Annotated[str | None, typer.Option(help="Comma-separated classes to export (default: all).")] = None,
    split: Annotated[
        str | None, typer.Option(help="train or val: that part of the split `lmdbstore train` uses.")
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option(
            help=f"Validation share of every class (or a count), for --split [default: {TRAIN.val_fraction}]."
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help=f"Seed of the split, for --split [default: {LOADER.seed}].")] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="For --split: the split of this training run (its checkpoint.pt), exactly its samples."),
    ] = None,
    indices: Annotated[
        Path | None, typer.Option(help="Export only these sample indices (.npy, or text with one per line).")
    ] = None,
    compress: Annotated[bool, typer.Option(help="Deflate .npz members / gzip HDF5 samples.")] = DEFAULT_COMPRESS,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")] = False,
    progress: ProgressOption = DEFAULT_PROGRESS,
    as_json: JsonOption = False,
) -> None:
    """Write samples and labels of STORE to OUT, streamed (memory stays flat), ready to ingest again.

    Several stores are exported as one set: one index space, classes mapped by name."""
    with cli_errors(as_json=as_json, flags={"overwrite": "--force"}):
        from lmdbstore.tools.export import export_store, load_indices

        idx = load_indices(indices) if indices is not None else None
        recorded = None
        if checkpoint is not None:
            if split is None or val_fraction is not None or seed is not None:
                raise ValueError(
                    "--checkpoint takes the run's split: give it with --split, without --val-fraction or --seed"
                )
            from .common import require_torch

            require_torch("export --checkpoint")
            from lmdbstore.loader.choose import recorded_splits
            from lmdbstore.training.checkpoint import load_checkpoint

            recorded = recorded_splits(load_checkpoint(checkpoint), checkpoint)
        bar = progress_bar("export", enabled=progress)
        try:
            rep = export_store(
                stores[0] if len(stores) == 1 else stores,
                out,
                fmt=fmt,
                classes=parse_names(classes),
                split=split,
                val_fraction=TRAIN.val_fraction if val_fraction is None else val_fraction,
                seed=LOADER.seed if seed is None else seed,
                indices=idx,
                recorded=recorded,
                compress=compress,
                overwrite=force,
                progress=bar.update,
            )
        finally:
            bar.close()
        said = Output(as_json)
        said.say(
            f"exported {rep.samples:,} samples of {len(rep.classes)} classes ({', '.join(rep.classes)}) "
            f"to {', '.join(rep.files)} ({rep.bytes:,} bytes, {rep.samples_per_s:,.0f} samples/s)"
        )
        said.result(report_dict(rep))


def copy(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    dest: Annotated[Path, typer.Argument(help="New directory for the copy.")],
    compact: Annotated[bool, typer.Option("--compact", help="Leave out free pages (smaller; slower).")] = False,
    as_json: JsonOption = False,
) -> None:
    """Copy STORE to DEST with LMDB's consistent copy: safe while readers and a writer run."""
    with cli_errors(as_json=as_json):
        from lmdbstore.tools.copy import copy_store

        rep = copy_store(store, dest, compact=compact)
        out = Output(as_json)
        out.say(
            f"copied {rep.samples:,} samples to {rep.dest}{' (compacted)' if rep.compact else ''}: "
            f"{rep.source_bytes:,} -> {rep.dest_bytes:,} bytes in {rep.seconds:.1f} s"
        )
        out.result(report_dict(rep))
