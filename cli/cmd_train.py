"""``lmdbstore train``, ``lmdbstore eval`` and ``lmdbstore demo``: the CNN on a store
(see lmdbstore.training.trainer and lmdbstore.training.evaluate)."""

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer

from lmdbstore.config import (
    BUILTIN_MODEL,
    DEFAULT_DEMO_DIR,
    DEFAULT_PROGRESS,
    DEFAULT_RUN_PNG,
    DEFAULT_RUNS_DIR,
    DEFAULT_SYNTH_SAMPLES,
    OPTIMIZERS,
    SGD_MOMENTUM,
    LoaderConfig,
    TrainConfig,
)
from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.launch import launch
from lmdbstore.util.progress import progress_factory
from lmdbstore.util.runfiles import BEST_NAME
from lmdbstore.util.splits import check_val_limit

from .common import (
    CHECKPOINTS,
    DATA,
    DEVICES,
    LOADER,
    MODEL,
    OPTIMISATION,
    OUTPUT,
    TRAIN,
    VALIDATION,
    Command,
    JsonOption,
    ModelArgOption,
    ModelOption,
    Output,
    ProgressOption,
    cli_errors,
    or_list,
    parse_model_args,
    parse_weights,
    require_torch,
    stop_on_ctrl_c,
)

__all__ = ["TrainCommand", "demo", "eval_cmd", "train"]


class TrainCommand(Command):
    """``train``: its many options in panels."""

    panels: ClassVar[dict[str, tuple[str, ...]]] = {
        DATA: ("balanced", "shuffle", "window_mb", "block_buffer", "seed", "weights", "allow_disjoint_classes"),
        MODEL: ("width", "model", "model_arg", "compile_model"),
        OPTIMISATION: ("batch", "epochs", "lr", "optimizer", "weight_decay", "label_smoothing", "max_steps"),
        VALIDATION: ("val_fraction", "val_every", "val_limit"),
        CHECKPOINTS: ("out", "resume", "checkpoint_every", "overwrite"),
        DEVICES: ("workers", "device", "amp"),
        OUTPUT: ("progress", "as_json", "plot"),
    }  # fmt: skip


def train(
    stores: Annotated[list[Path], typer.Argument(help="Store directory (several: read as one set).")],
    batch: Annotated[int, typer.Option(help="Samples per batch (per process under torchrun).")] = LOADER.batch_size,
    epochs: Annotated[int, typer.Option(help="Epochs.")] = TRAIN.epochs,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, one-cycle schedule).")] = TRAIN.lr,
    workers: Annotated[int, typer.Option(help="Reader processes that read batches ahead.")] = LOADER.workers,
    val_fraction: Annotated[
        float,
        typer.Option(
            help="Share of every class held out for validation, or a number of samples (e.g. 20000, held out in "
            "proportion to the classes)."
        ),
    ] = TRAIN.val_fraction,
    balanced: Annotated[
        bool, typer.Option("--balanced", help="Draw classes equally (with replacement).")
    ] = LOADER.balanced,
    shuffle: Annotated[
        str,
        typer.Option(
            help="auto: random if the store fits in memory, else window; random: new permutation per epoch; "
            "block: shuffled packed values, fewer lookups; window: random batches from a window of large runs."
        ),
    ] = LOADER.order,
    window_mb: Annotated[
        int | None, typer.Option(help="Window shuffle: window size in MiB (default: 1/8 of available memory).")
    ] = LOADER.window_mb,
    block_buffer: Annotated[
        int,
        typer.Option(help="Block mode: spread each packed value over this many batches (1 fastest, more mixes more)."),
    ] = LOADER.block_buffer,
    seed: Annotated[int, typer.Option(help="Seed of the split, the order and the weights.")] = LOADER.seed,
    weights: Annotated[
        str | None,
        typer.Option(
            help="Several stores: each one's share of every epoch, e.g. 0.7,0.3 (exact per epoch, drawn without "
            "repeats until a store is used up; random order)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help=f"Directory for checkpoints and metrics (default {DEFAULT_RUNS_DIR}/<store name>)."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from OUT/checkpoint.pt (inside the epoch it was written in).")
    ] = False,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(help="Also write OUT/checkpoint.pt every N steps, so --resume continues inside the epoch."),
    ] = TRAIN.checkpoint_every,
    device: Annotated[str, typer.Option(help="auto (CUDA if available), cpu, cuda, cuda:N.")] = TRAIN.device,
    width: Annotated[int, typer.Option(help="Channels of the first CNN block (later blocks 2x, 4x).")] = TRAIN.width,
    amp: Annotated[bool, typer.Option(help="bfloat16 mixed precision on CUDA.")] = TRAIN.amp,
    max_steps: Annotated[
        int | None, typer.Option(help="Cut every epoch after this many steps.")
    ] = TRAIN.max_steps_per_epoch,
    val_every: Annotated[
        int | None,
        typer.Option(min=1, help="Also validate every N steps inside epochs (every epoch's end always validates)."),
    ] = TRAIN.val_every,
    val_limit: Annotated[
        str | None,
        typer.Option(
            help="What one validation reads: N batches a process (e.g. 50) or a share of the split (e.g. 0.25); "
            "a fixed stratified subset, the same each time (default: the whole split)."
        ),
    ] = None,
    progress: ProgressOption = DEFAULT_PROGRESS,
    as_json: JsonOption = False,
    plot: Annotated[
        bool, typer.Option("--plot", help=f"Draw OUT/{DEFAULT_RUN_PNG} (loss, accuracy, samples/s) at the end.")
    ] = False,
    model: ModelOption = None,
    model_arg: ModelArgOption = None,
    optimizer: Annotated[
        str, typer.Option(help=f"Optimizer: {or_list(OPTIMIZERS)} (sgd: momentum {SGD_MOMENTUM}).")
    ] = TRAIN.optimizer,
    weight_decay: Annotated[float, typer.Option(help="Weight decay of the optimizer.")] = TRAIN.weight_decay,
    label_smoothing: Annotated[
        float, typer.Option(help="Label smoothing of the training loss, in [0, 1).")
    ] = TRAIN.label_smoothing,
    compile_model: Annotated[
        bool, typer.Option("--compile", help="Run the steps through torch.compile (needs a C++ compiler on CPU).")
    ] = TRAIN.compile,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Start afresh in an --out holding an earlier run (its files removed).")
    ] = False,
    allow_disjoint_classes: Annotated[
        bool,
        typer.Option(
            "--allow-disjoint-classes",
            help="Train on a set in which a store of bare class ids (0, 1, ...) shares no class name with the others.",
        ),
    ] = TRAIN.allow_disjoint_classes,
) -> None:
    """Train the built-in CNN (or --model's) on STORE.

    Reader processes read whole batches ahead, lock-free; the GPU is used when there is one.  Each epoch prints
    train and validation loss and accuracy, samples/s and the share of time spent waiting for data; metrics,
    checkpoints and TensorBoard scalars go to --out.  Under `torchrun --nproc_per_node N` it trains with
    DistributedDataParallel.  Several stores are read as one set: one index space, classes mapped by name.
    Ctrl-C writes a checkpoint at the step reached; --resume continues from it.
    """
    with cli_errors(as_json=as_json, interrupted=TRAIN_INTERRUPTED):
        require_torch("train")
        if plot:
            from lmdbstore.tools.viz import require_pyplot

            require_pyplot()  # fail before training, not after, when matplotlib is missing
        from lmdbstore.training.trainer import train as run_train

        # a few fields a line (fmt: skip): one a line would be a long column of name=name
        tcfg = TrainConfig(
            epochs=epochs, lr=lr, val_fraction=val_fraction, width=width,
            device=device, amp=amp, max_steps_per_epoch=max_steps, checkpoint_every=checkpoint_every,
            model=model or BUILTIN_MODEL, model_args=parse_model_args(model_arg), optimizer=optimizer,
            weight_decay=weight_decay, label_smoothing=label_smoothing, compile=compile_model,
            allow_disjoint_classes=allow_disjoint_classes,
            val_every=val_every, val_limit=parse_val_limit(val_limit),
        )  # fmt: skip
        if model_arg and model is None:
            raise ValueError("--model-arg needs --model (the built-in CNN's one argument is --width)")
        lcfg = LoaderConfig(
            batch_size=batch, shuffle=shuffle,  # type: ignore[arg-type]  # LoaderConfig validates it
            block_buffer=block_buffer, window_mb=window_mb,
            workers=workers, seed=seed, balanced=balanced, weights=parse_weights(weights),
        )  # fmt: skip
        name = "+".join(s.resolve().name for s in stores)[:100]
        out_dir = out if out is not None else Path(DEFAULT_RUNS_DIR) / name
        store = stores[0] if len(stores) == 1 else stores
        said = Output(as_json)
        with stop_on_ctrl_c(said.say) as stop:
            result = run_train(
                store, out_dir, tcfg, lcfg, resume=resume, log=said.say, progress=progress, overwrite=overwrite,
                stop=stop,
            )  # fmt: skip
        if not launch().is_main:
            return  # under torchrun only rank 0 reports
        if result.out_dir is not None and result.epochs:
            said.say(f"checkpoints and metrics in {result.out_dir}")
        if plot and result.out_dir is not None and result.epochs:
            from lmdbstore.tools.viz import plot_runs

            said.say(f"wrote {plot_runs([result.out_dir], result.out_dir / DEFAULT_RUN_PNG).path}")
        said.result(_train_json(result))


#: What Ctrl-C says where ``train`` could not stop at a step (under torchrun, or a second Ctrl-C).
TRAIN_INTERRUPTED = (
    "interrupted; the last checkpoint written is --out's checkpoint.pt (each epoch's end, and every "
    "--checkpoint-every steps): continue with the same command and --resume"
)


def parse_val_limit(text: str | None) -> int | float | None:
    """``--val-limit``: a whole number is batches (``50``), a number with a point a share (``0.25``, ``1.0``);
    neither is a ``ValueError`` naming the option."""
    if text is None:
        return None
    try:
        value: int | float = int(text) if text.strip().lstrip("+").isdigit() else float(text)
        check_val_limit(value)
    except ValueError:
        raise ValueError(
            f"--val-limit must be a number of batches (e.g. 50) or a share in (0, 1] (e.g. 0.25), got {text!r}"
        ) from None
    return value


def _train_json(result: Any) -> dict[str, Any]:
    """``train --json``: every epoch's metrics (numbered from 1, as the lines say), the last one, the
    validation confusion matrix, the classes, the run directory and the model (factory and arguments)."""
    return {
        "model": result.model,
        "epochs": [asdict(m) for m in result.epochs],
        "final": asdict(result.final) if result.epochs else None,
        "confusion": result.confusion,
        "classes": result.classes,
        "out_dir": str(result.out_dir) if result.out_dir is not None else None,
    }


def eval_cmd(
    stores: Annotated[list[Path], typer.Argument(help="Store directory to score (several: scored as one set).")],
    checkpoint: Annotated[Path, typer.Argument(help="checkpoint.pt or best.pt from `lmdbstore train`.")],
    batch: Annotated[int, typer.Option(help="Samples per batch.")] = LOADER.batch_size,
    workers: Annotated[int, typer.Option(help="Reader processes that read batches ahead.")] = LOADER.workers,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = TRAIN.device,
    predictions: Annotated[Path | None, typer.Option(help="Save predicted class ids (.npy, index order).")] = None,
    as_json: JsonOption = False,
    model: ModelOption = None,
    model_arg: ModelArgOption = None,
    split: Annotated[
        str | None,
        typer.Option(
            help="Score only the train or val part of the split the checkpoint's run used (its --val-fraction "
            "and --seed)."
        ),
    ] = None,
) -> None:
    """Score every sample of STORE with CHECKPOINT: accuracy, per-class accuracy, confusion matrix.

    Several stores are scored as one set.  Classes are matched by name: the stores' classes may be any of
    the checkpoint's.  A checkpoint of your own model needs its --model (the factory is never imported on a
    checkpoint's word); its arguments come from the checkpoint.
    """
    with cli_errors(as_json=as_json):
        require_torch("eval")
        from lmdbstore.training.evaluate import evaluate, format_confusion

        store = stores[0] if len(stores) == 1 else stores
        if split is not None and split not in ("train", "val"):
            raise ValueError(f"--split must be train or val, got {split!r}")
        args = parse_model_args(model_arg) if model_arg else None
        if model_arg and model is None:
            raise ValueError("--model-arg needs --model")
        r = evaluate(
            store, checkpoint, batch_size=batch, workers=workers, device=device, predictions_out=predictions,
            model=model, model_args=dict(args) if args is not None else None, split=split,
        )  # fmt: skip
        said = Output(as_json)
        if not as_json:
            part = f" of the {split} split" if split else ""
            said.say(f"{r['samples']:,} samples{part}: loss {r['loss']:.4f}, accuracy {r['accuracy']:.4f}")
            for name, acc in r["per_class_accuracy"].items():
                said.say(f"  {name:<16} {'-' if acc is None else f'{acc:.4f}'}")
            said.say(format_confusion(r["confusion"], r["classes"]))
        said.result(r)


def demo(
    workdir: Annotated[Path, typer.Option("--dir", help="Where the store and the run go.")] = Path(DEFAULT_DEMO_DIR),
    n: Annotated[int, typer.Option("-n", "--samples", help="Synthetic samples.")] = DEFAULT_SYNTH_SAMPLES,
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = TRAIN.epochs,
    batch: Annotated[int, typer.Option(help="Batch size.")] = LOADER.batch_size,
    workers: Annotated[int, typer.Option(help="Reader processes that read batches ahead.")] = LOADER.workers,
    progress: ProgressOption = DEFAULT_PROGRESS,
    as_json: JsonOption = False,
) -> None:
    """The main job end to end on built-in data: synthesize+ingest -> stats -> train -> eval.

    Rerunning it with the same options gives the same store (nothing is appended twice) and a fresh run.
    """
    with cli_errors(as_json=as_json):
        require_torch("demo")
        from lmdbstore.ingestion.pipeline import ingest_synthetic
        from lmdbstore.tools.stats import format_stats, store_stats
        from lmdbstore.training.evaluate import evaluate
        from lmdbstore.training.trainer import train as run_train

        said = Output(as_json)
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LmdbStoreError(f"cannot make the directory ({exc.strerror})", path=workdir) from None
        store = workdir / "store"
        said.say(f"[1/4] synthesizing {n:,} samples of 5 classes straight into {store}")
        rep = ingest_synthetic(store, n, progress=progress_factory(progress), exclusive=True)
        note = " (already in the store)" if rep.sources[0].skipped == n else ""
        said.say(f"      +{rep.added:,} samples{note} ({rep.samples_per_s:,.0f} samples/s), {rep.total:,} in the store")
        said.say("[2/4] stats")
        said.say(format_stats(store_stats(store)))
        said.say(f"[3/4] training {epochs} epochs, batch {batch}")
        run_dir = workdir / "run"
        res = run_train(
            store, run_dir, TrainConfig(epochs=epochs), LoaderConfig(batch_size=batch, workers=workers),
            log=said.say, progress=progress, overwrite=True,
        )  # fmt: skip
        best = run_dir / BEST_NAME
        said.say(f"[4/4] scoring the whole store with {best}")
        r = evaluate(store, best, batch_size=batch, workers=workers)
        said.say(f"      accuracy {r['accuracy']:.4f} on {r['samples']:,} samples")
        said.say(
            f"done: validation accuracy {res.final.val_accuracy:.4f} after {len(res.epochs)} epochs; "
            f"checkpoints and metrics in {run_dir}"
        )
        said.result({"store": str(store), "run": _train_json(res), "eval": r})
