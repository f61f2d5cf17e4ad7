"""The ``lmdbstore`` command line: a thin Typer layer over the library.

Every command parses its options, calls one library function and prints.  Errors the library raises
on purpose (``LmdbStoreError``) and bad arguments (``ValueError``) become one line on stderr and exit
status 1; ``verify`` exits 1 when it finds problems.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from lmdbstore import LmdbStoreError, __version__
from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig
from lmdbstore.errors import clip, unwrap_worker_message
from lmdbstore.util.launch import launch
from lmdbstore.util.progress import progress_bar, progress_factory

app = typer.Typer(
    name="lmdbstore",
    help=(
        "Store tens of millions of small training samples in LMDB and train a PyTorch CNN on them.\n\n"
        "Typical flow: `lmdbstore ingest STORE data.npz`, `lmdbstore stats STORE`, "
        "`lmdbstore train STORE --batch 4096`.  `lmdbstore demo` runs all of it on built-in synthetic data."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

#: Longest error line the CLI prints (messages are short by construction; this is a backstop).
MAX_ERROR_CHARS = 1000


def _fail(msg: str, code: int = 1) -> None:
    typer.echo(f"error: {clip(unwrap_worker_message(str(msg)), MAX_ERROR_CHARS)}", err=True)  # one line
    raise typer.Exit(code)


@contextmanager
def _errors(code: int = 1) -> Iterator[None]:
    """Turn deliberate errors into one line on stderr and exit status ``code``."""
    try:
        yield
    except LmdbStoreError as exc:
        _fail(str(exc), code)
    except (ValueError, IndexError) as exc:
        _fail(str(exc), code)
    except KeyboardInterrupt:
        _fail("interrupted; committed batches are kept (rerun the same command to resume)", 130)


def _json(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as valid JSON: non-finite floats (a NaN loss, say) become ``null``."""
    from lmdbstore.util.jsonsafe import json_safe

    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def _shape_option(text: str) -> tuple[int, ...]:
    """``--sample-shape 25,25`` as a tuple."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sample-shape must be comma-separated sizes such as 25,25, got {text!r}") from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmdbstore {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    pass


# ---------------------------------------------------------------------------- ingest
@app.command()
def ingest(
    store: Annotated[Path, typer.Argument(help="Store directory (created if it does not exist).")],
    sources: Annotated[
        list[Path] | None, typer.Argument(help=".npy, .npz, .h5/.hdf5 files or ROOT/<class>/*.npy directories.")
    ] = None,
    label: Annotated[
        str | None, typer.Option(help="Class of every sample of the sources (needed for plain .npy files).")
    ] = None,
    classes: Annotated[
        str | None, typer.Option(help="Comma-separated class names of a new store (default: from the sources).")
    ] = None,
    x_key: Annotated[str, typer.Option(help="Sample array name in .npz / dataset name in HDF5.")] = "x",
    y_key: Annotated[str, typer.Option(help="Label array name in .npz / dataset name in HDF5.")] = "y",
    sample_shape: Annotated[
        str | None,
        typer.Option(
            help="Per-sample shape of directory sources, e.g. 25,25: whether their files are samples or stacks "
            "(default: the store's, else the shape most files share)."
        ),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="Sample dtype of a new store (default: the sources').")] = None,
    cast: Annotated[
        bool, typer.Option(help="Convert samples of another dtype of the same kind (e.g. float64 to float32).")
    ] = False,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Accept NaN and inf values.")] = False,
    checksum: Annotated[str, typer.Option(help="Per-value checksum of a new store: crc32, xxh64 or none.")] = "crc32",
    samples_per_value: Annotated[
        int | None,
        typer.Option(help="Samples packed per LMDB value in a new store (default: chosen to fill pages)."),
    ] = None,
    commit_mb: Annotated[int, typer.Option(help="Commit (and fsync) every this many MiB of samples.")] = 64,
    synthetic: Annotated[
        int | None,
        typer.Option(help="Instead of sources, generate this many samples of the built-in 5-class dataset."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of --synthetic.")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    workers: Annotated[int, typer.Option(min=0, help="Read and validate sources in N processes (order kept).")] = 0,
) -> None:
    """Validate SOURCES and append them to STORE.

    Every source is checked completely (shape, dtype, finite values, known labels) before anything is
    written, so a bad source leaves the store exactly as it was.  Samples are committed in bounded
    batches; if an ingest is interrupted, run the same command again: sources already in the store
    are skipped and a partly written one continues where its last commit ended.
    """
    with _errors():
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
            from lmdbstore.ingestion.pipeline import ingest_synthetic

            report = ingest_synthetic(store, synthetic, seed=seed, config=config, progress=bars)
        else:
            if not sources:
                raise ValueError("no SOURCES given (or use --synthetic N)")
            from lmdbstore.ingestion.pipeline import ingest as run_ingest
            from lmdbstore.ingestion.pipeline import store_layout
            from lmdbstore.ingestion.sources import open_sources

            layout = store_layout(store)
            srcs = open_sources(
                sources,
                label=label,
                x_key=x_key,
                y_key=y_key,
                h5_x=x_key,
                h5_y=y_key,
                sample_shape=_shape_option(sample_shape) if sample_shape else layout[0] if layout else None,
            )
            names = [c.strip() for c in classes.split(",")] if classes else None
            report = run_ingest(
                store, srcs, classes=names, dtype=dtype, config=config, cast=cast, progress=bars, workers=workers
            )
        for s in report.sources:
            note = f" ({s.skipped:,} already in the store)" if s.skipped else ""
            typer.echo(f"  {s.name}: {s.written:,} samples written{note}")
        typer.echo(
            f"{'created' if report.created else 'appended to'} {report.store}: +{report.added:,} samples "
            f"({report.samples_per_s:,.0f} samples/s), {report.total:,} in total"
        )


# ---------------------------------------------------------------------------- stats
@app.command()
def stats(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    sample: Annotated[
        int | None, typer.Option(help="Recompute value statistics from this many random samples read back.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw class counts and a value histogram to this PNG.")] = None,
) -> None:
    """Describe STORE: samples per class, shape, dtype, packing, bytes on disk against raw, LMDB depth, values."""
    with _errors():
        from lmdbstore.tools.stats import format_stats, store_stats

        try:
            s = store_stats(store, sample=sample)
        except ValueError as exc:  # the only parameter store_stats checks is sample
            raise ValueError(f"--sample: {exc}") from None
        typer.echo(_json(s) if as_json else format_stats(s))
        if plot is not None:
            from lmdbstore.tools.viz import plot_stats

            typer.echo(f"wrote {plot_stats(store, plot).path}", err=as_json)


# ---------------------------------------------------------------------------- verify
@app.command()
def verify(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    checksums: Annotated[bool, typer.Option(help="Check per-value checksums (when the store has them).")] = True,
    structure: Annotated[bool, typer.Option(help="Check LMDB's page structure first (without liblmdb).")] = True,
    max_problems: Annotated[int, typer.Option(help="Stop listing after this many problems.")] = 20,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Check STORE's contents against its metadata.

    Checks the LMDB page structure, that sample keys are contiguous and every value has the right length
    and checksum, that labels, class counts and the class-index table agree, and that nothing extra is
    stored.  Lists the first problems with their sample indices.  Exit status: 0 clean, 1 problems found,
    2 the store cannot be opened at all.
    """
    with _errors(code=2):
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
                progress=advance if progress else None,
            )
        finally:
            for bar in bars:
                bar.close()
        if as_json:
            typer.echo(_json(report.to_dict()))
        else:
            for p in report.problems:
                where = f" at {p.index}" if p.index is not None else ""
                typer.echo(f"problem{where}: [{p.kind}] {p.message}")
            typer.echo(f"{store}: {'OK' if report.ok else f'{len(report.problems)} problem(s) found'}")
    if not report.ok:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- synth
@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Output .npz (arrays x, y, class_names).")],
    n: Annotated[int, typer.Option("-n", "--samples", help="Number of samples.")] = 100_000,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write the built-in learnable 5-class dataset of z-scored 25x25 float32 arrays to an .npz."""
    with _errors():
        from lmdbstore.ingestion.synth import write_synth_npz

        write_synth_npz(out, n, seed=seed)
        typer.echo(f"wrote {n:,} samples to {out}")


# ---------------------------------------------------------------------------- train
@app.command()
def train(
    store: Annotated[Path, typer.Argument(help="Store directory.")],
    batch: Annotated[int, typer.Option(help="Samples per batch (per process under torchrun).")] = 4096,
    epochs: Annotated[int, typer.Option(help="Epochs.")] = 3,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, one-cycle schedule).")] = 3e-3,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes.")] = 2,
    val_fraction: Annotated[float, typer.Option(help="Share of every class held out for validation.")] = 0.1,
    balanced: Annotated[bool, typer.Option("--balanced", help="Draw classes equally (with replacement).")] = False,
    shuffle: Annotated[
        str,
        typer.Option(
            help="auto: random if the store fits in memory, else window; random: new permutation per epoch; "
            "block: shuffled packed values, fewer lookups; window: random batches from a window of large runs."
        ),
    ] = "auto",
    window_mb: Annotated[
        int | None, typer.Option(help="Window shuffle: window size in MiB (default: 1/8 of available memory).")
    ] = None,
    block_buffer: Annotated[
        int,
        typer.Option(help="Block mode: spread each packed value over this many batches (1 fastest, more mixes more)."),
    ] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the split, the order and the weights.")] = 0,
    out: Annotated[
        Path | None, typer.Option(help="Directory for checkpoints and metrics (default runs/<store name>).")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUT/checkpoint.pt.")] = False,
    device: Annotated[str, typer.Option(help="auto (CUDA if available), cpu, cuda, cuda:N.")] = "auto",
    width: Annotated[int, typer.Option(help="Channels of the first CNN block (later blocks 2x, 4x).")] = 16,
    amp: Annotated[bool, typer.Option(help="bfloat16 mixed precision on CUDA.")] = True,
    max_steps: Annotated[int | None, typer.Option(help="Cut every epoch after this many steps.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar per epoch.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the final metrics as JSON at the end.")] = False,
    plot: Annotated[
        bool, typer.Option("--plot", help="Draw OUT/run.png (loss, accuracy, samples/s) at the end.")
    ] = False,
) -> None:
    """Train the CNN on STORE.

    Reads batches with lock-free random reads from DataLoader workers; uses the GPU when there is one.
    Each epoch prints train loss, validation loss and accuracy, samples/s and the share of time spent
    waiting for data; metrics.jsonl, checkpoint.pt (every epoch) and best.pt go to --out.
    Under `torchrun --nproc_per_node N` it trains with DistributedDataParallel.
    """
    with _errors():
        if plot:
            from lmdbstore.tools.viz import require_pyplot

            require_pyplot()  # fail before training, not after, when matplotlib is missing
        from lmdbstore.training.trainer import train as run_train

        tcfg = TrainConfig(
            epochs=epochs,
            lr=lr,
            val_fraction=val_fraction,
            width=width,
            device=device,
            amp=amp,
            max_steps_per_epoch=max_steps,
        )
        lcfg = LoaderConfig(
            batch_size=batch,
            shuffle=shuffle,  # type: ignore[arg-type]  # LoaderConfig validates it
            block_buffer=block_buffer,
            window_mb=window_mb,
            workers=workers,
            seed=seed,
            balanced=balanced,
        )
        out_dir = out if out is not None else Path("runs") / store.resolve().name
        result = run_train(store, out_dir, tcfg, lcfg, resume=resume, log=typer.echo, progress=progress)
        if not launch().is_main:
            return  # under torchrun only rank 0 reports
        if result.out_dir is not None and result.epochs:
            typer.echo(f"checkpoints and metrics in {result.out_dir}")
        if plot and result.out_dir is not None and result.epochs:
            from lmdbstore.tools.viz import plot_runs

            typer.echo(f"wrote {plot_runs([result.out_dir], result.out_dir / 'run.png').path}", err=as_json)
        if as_json and result.epochs:
            typer.echo(
                _json({"final": asdict(result.final), "confusion": result.confusion, "classes": result.classes}, None)
            )


# ---------------------------------------------------------------------------- eval
@app.command("eval")
def eval_cmd(
    store: Annotated[Path, typer.Argument(help="Store directory to score.")],
    checkpoint: Annotated[Path, typer.Argument(help="checkpoint.pt or best.pt from `lmdbstore train`.")],
    batch: Annotated[int, typer.Option(help="Samples per batch.")] = 4096,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes.")] = 2,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = "auto",
    predictions: Annotated[Path | None, typer.Option(help="Save predicted class ids (.npy, index order).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Score every sample of STORE with CHECKPOINT: accuracy, per-class accuracy, confusion matrix."""
    with _errors():
        from lmdbstore.training.evaluate import evaluate, format_confusion

        r = evaluate(store, checkpoint, batch_size=batch, workers=workers, device=device, predictions_out=predictions)
        if as_json:
            typer.echo(_json(r))
            return
        typer.echo(f"{r['samples']:,} samples: loss {r['loss']:.4f}, accuracy {r['accuracy']:.4f}")
        for name, acc in r["per_class_accuracy"].items():
            typer.echo(f"  {name:<16} {'-' if acc is None else f'{acc:.4f}'}")
        typer.echo(format_confusion(r["confusion"], r["classes"]))


# ---------------------------------------------------------------------------- demo
@app.command()
def demo(
    workdir: Annotated[Path, typer.Option("--dir", help="Where the store and the run go.")] = Path("demo_out"),
    n: Annotated[int, typer.Option("-n", "--samples", help="Synthetic samples.")] = 100_000,
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 3,
    batch: Annotated[int, typer.Option(help="Batch size.")] = 4096,
    workers: Annotated[int, typer.Option(help="DataLoader workers.")] = 2,
) -> None:
    """The main job end to end on built-in data: synthesize+ingest -> stats -> train -> eval.

    Rerunning it with the same options gives the same store (nothing is appended twice) and a fresh run.
    """
    with _errors():
        from lmdbstore.ingestion.pipeline import ingest_synthetic
        from lmdbstore.tools.stats import format_stats, store_stats
        from lmdbstore.training.evaluate import evaluate
        from lmdbstore.training.trainer import train as run_train

        workdir.mkdir(parents=True, exist_ok=True)
        store = workdir / "store"
        typer.echo(f"[1/4] synthesizing {n:,} samples of 5 classes straight into {store}")
        rep = ingest_synthetic(store, n, progress=progress_factory(True), exclusive=True)
        note = " (already in the store)" if rep.sources[0].skipped == n else ""
        typer.echo(
            f"      +{rep.added:,} samples{note} ({rep.samples_per_s:,.0f} samples/s), {rep.total:,} in the store"
        )
        typer.echo("[2/4] stats")
        typer.echo(format_stats(store_stats(store)))
        typer.echo(f"[3/4] training {epochs} epochs, batch {batch}")
        res = run_train(
            store,
            workdir / "run",
            TrainConfig(epochs=epochs),
            LoaderConfig(batch_size=batch, workers=workers),
            log=typer.echo,
        )
        best = workdir / "run" / "best.pt"
        typer.echo(f"[4/4] scoring the whole store with {best}")
        r = evaluate(store, best, batch_size=batch, workers=workers)
        typer.echo(f"      accuracy {r['accuracy']:.4f} on {r['samples']:,} samples")
        typer.echo(
            f"done: validation accuracy {res.final.val_accuracy:.4f} after {len(res.epochs)} epochs; "
            f"checkpoints and metrics in {workdir / 'run'}"
        )


from . import cmd_export, cmd_viz  # noqa: E402  (commands kept in their own modules)

cmd_export.register(app)
cmd_viz.register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
