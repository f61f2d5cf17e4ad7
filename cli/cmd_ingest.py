"""``lmdbstore ingest`` and ``lmdbstore synth``: data into a store (see lmdbstore.ingestion)."""

from pathlib import Path
from typing import Annotated, Any

import typer

from lmdbstore.config import (
    DEFAULT_CAST,
    DEFAULT_INGEST_WORKERS,
    DEFAULT_PROGRESS,
    DEFAULT_SYNTH_SAMPLES,
    DEFAULT_SYNTH_SEED,
    DEFAULT_X_KEY,
    DEFAULT_Y_KEY,
    WriterConfig,
)
from lmdbstore.format.checksums import CHECKSUM_KINDS
from lmdbstore.util.progress import progress_factory

from .common import (
    WRITER,
    JsonOption,
    Output,
    ProgressOption,
    cli_errors,
    or_list,
    parse_names,
    parse_shape,
    refuse_given,
    report_dict,
)

__all__ = ["ingest", "synth"]


def _key_option(what: str) -> Any:
    """``--x-key``/``--y-key``: one name for the member of every kind of source that has keys."""
    return typer.Option(help=f"{what} array name in .npz / dataset name in HDF5 / feature name in TFRecord.")


def ingest(
    ctx: typer.Context,
    store: Annotated[Path, typer.Argument(help="Store directory (created if it does not exist).")],
    sources: Annotated[
        list[Path] | None,
        typer.Argument(
            help=".npy, .npz, .h5/.hdf5, .tfrecord files, ROOT/<class>/*.npy directories, directories of TFRecord "
            "shards, other stores."
        ),
    ] = None,
    label: Annotated[
        str | None, typer.Option(help="Class of every sample of the sources (needed for plain .npy files).")
    ] = None,
    classes: Annotated[
        str | None, typer.Option(help="Comma-separated class names of a new store (default: from the sources).")
    ] = None,
    x_key: Annotated[str, _key_option("Sample")] = DEFAULT_X_KEY,
    y_key: Annotated[str, _key_option("Label")] = DEFAULT_Y_KEY,
    sample_shape: Annotated[
        str | None,
        typer.Option(
            help="Per-sample shape of directory sources, e.g. 25,25: whether their files are samples or stacks "
            "(default: the store's, else the shape most files share); of TFRecord samples (default: 1-D)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Sample dtype of a new store (default: the sources'); of TFRecord samples stored as bytes, byte "
            "order included ('>f4': big-endian, stored little-endian); of --synthetic samples (a float dtype)."
        ),
    ] = None,
    compression: Annotated[
        str | None, typer.Option(metavar="none|gzip|zlib", help="TFRecord files' compression (default: by content).")
    ] = None,
    cast: Annotated[
        bool, typer.Option(help="Convert samples of another dtype of the same kind (e.g. float64 to float32).")
    ] = DEFAULT_CAST,
    allow_nonfinite: Annotated[
        bool, typer.Option("--allow-nonfinite", help="Accept NaN and inf values.")
    ] = WRITER.allow_nonfinite,
    checksum: Annotated[
        str, typer.Option(help=f"Per-value checksum of a new store: {or_list(CHECKSUM_KINDS)}.")
    ] = WRITER.checksum,
    samples_per_value: Annotated[
        int | None,
        typer.Option(help="Samples packed per LMDB value in a new store (default: chosen to fill pages)."),
    ] = WRITER.samples_per_value,
    commit_mb: Annotated[
        int, typer.Option(help="Commit (and fsync) every this many MiB of samples.")
    ] = WRITER.commit_bytes >> 20,
    synthetic: Annotated[
        int | None,
        typer.Option(help="Instead of sources, generate this many samples of the built-in 5-class dataset."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of --synthetic.")] = DEFAULT_SYNTH_SEED,
    progress: ProgressOption = DEFAULT_PROGRESS,
    workers: Annotated[
        int, typer.Option(min=0, help="Read and validate sources in N processes (order kept).")
    ] = DEFAULT_INGEST_WORKERS,
    as_json: JsonOption = False,
) -> None:
    """Validate SOURCES and append them to STORE.

    Every source is checked completely (shape, dtype, finite values, known labels) before anything is
    written, so a bad source leaves the store exactly as it was.  Samples are committed in bounded
    batches; if an ingest is interrupted, run the same command again: sources already in the store
    are skipped and a partly written one continues where its last commit ended.
    """
    with cli_errors(as_json=as_json):
        config = WriterConfig(
            samples_per_value=samples_per_value,
            checksum=checksum,  # type: ignore[arg-type]
            commit_bytes=commit_mb << 20,
            allow_nonfinite=allow_nonfinite,
        )
        bars = progress_factory(progress)
        if synthetic is not None:
            if sources:
                raise ValueError("give either SOURCES or --synthetic, not both")
            refuse_given(ctx, SYNTHETIC_IGNORES, "with --synthetic (it makes the built-in 5-class dataset)")
            from lmdbstore.ingestion.pipeline import ingest_synthetic

            report = ingest_synthetic(store, synthetic, seed=seed, config=config, progress=bars, dtype=dtype)
        else:
            if not sources:
                raise ValueError("no SOURCES given (or use --synthetic N)")
            refuse_given(ctx, ("seed",), "without --synthetic")
            from lmdbstore.ingestion.pipeline import ingest as run_ingest
            from lmdbstore.ingestion.plan import store_layout
            from lmdbstore.ingestion.sources.opening import open_sources

            layout = store_layout(store)
            srcs = open_sources(
                sources,
                label=label,
                x_key=x_key,
                y_key=y_key,
                sample_shape=parse_shape(sample_shape) if sample_shape else layout[0] if layout else None,
                dtype=dtype,
                compression=compression,
            )
            _refuse_unused_keys(ctx, srcs)
            names = parse_names(classes)
            report = run_ingest(
                store, srcs, classes=names, dtype=dtype, config=config, cast=cast, progress=bars, workers=workers
            )
        out = Output(as_json)
        for s in report.sources:
            note = f" ({s.skipped:,} already in the store)" if s.skipped else ""
            out.say(f"  {s.name}: {s.written:,} samples written{note}")
        out.say(
            f"{'created' if report.created else 'appended to'} {report.store}: +{report.added:,} samples "
            f"({report.samples_per_s:,.0f} samples/s), {report.total:,} in total"
        )
        out.result(report_dict(report))


#: Options ``ingest --synthetic`` has no use for (its dataset has its own shape, classes and labels).
SYNTHETIC_IGNORES = ("label", "classes", "x_key", "y_key", "sample_shape", "compression", "cast", "workers")


def _refuse_unused_keys(ctx: typer.Context, srcs: list[Any]) -> None:
    """Refuse --x-key/--y-key and --sample-shape given for sources none of which reads them."""
    kinds = {src.kind for src in srcs}
    if not kinds & {"npz", "h5", "tfrecord"}:
        refuse_given(ctx, ("x_key", "y_key"), "to these sources (only .npz, HDF5 and TFRecord sources have keys)")
    if not kinds & {"dir", "tfrecord"}:
        refuse_given(ctx, ("sample_shape",), "to these sources (only directory and TFRecord sources read it)")
    if "tfrecord" not in kinds:
        refuse_given(ctx, ("compression",), "to these sources (only TFRecord files are compressed)")


def synth(
    out: Annotated[Path, typer.Argument(help="Output .npz (arrays x, y, class_names).")],
    n: Annotated[int, typer.Option("-n", "--samples", help="Number of samples.")] = DEFAULT_SYNTH_SAMPLES,
    seed: Annotated[int, typer.Option(help="Random seed.")] = DEFAULT_SYNTH_SEED,
    as_json: JsonOption = False,
) -> None:
    """Write the built-in learnable 5-class dataset of z-scored 25x25 float32 arrays to an .npz."""
    with cli_errors(as_json=as_json):
        from lmdbstore.ingestion.synth import write_synth_npz

        write_synth_npz(out, n, seed=seed)
        said = Output(as_json)
        said.say(f"wrote {n:,} samples to {out}")
        said.result({"out": str(out), "samples": n, "seed": seed})
