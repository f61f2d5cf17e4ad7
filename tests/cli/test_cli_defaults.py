"""The CLI defines no defaults of its own: every default ``--help`` shows is lmdbstore.config's, and so are
the unset (``None``) and off-switch defaults that have a configuration counterpart."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
from lmdbstore_cli import cmd_ingest, cmd_train
from lmdbstore_cli.main import app
from typer.testing import CliRunner

from lmdbstore import config
from lmdbstore.format.checksums import CHECKSUM_KINDS
from lmdbstore.tools.export import export_store, select_indices
from lmdbstore.tools.export_formats import EXPORT_FORMATS
from lmdbstore.tools.stats import store_stats
from lmdbstore.tools.viz import plot_runs, plot_stats, show_samples

W, L, T = config.WriterConfig(), config.LoaderConfig(), config.TrainConfig()

#: command -> option -> the config value its shown default must be (every option that shows one)
SHOWN: dict[str, dict[str, Any]] = {
    "ingest": {
        "--x-key": config.DEFAULT_X_KEY,
        "--y-key": config.DEFAULT_Y_KEY,
        "--cast": config.DEFAULT_CAST,
        "--checksum": W.checksum,
        "--commit-mb": W.commit_bytes >> 20,
        "--seed": config.DEFAULT_SYNTH_SEED,
        "--workers": config.DEFAULT_INGEST_WORKERS,
    },
    "stats": {},
    "verify": {
        "--checksums": config.DEFAULT_VERIFY_CHECKSUMS,
        "--structure": config.DEFAULT_VERIFY_STRUCTURE,
        "--max-problems": config.DEFAULT_MAX_PROBLEMS,
    },
    "synth": {"--samples": config.DEFAULT_SYNTH_SAMPLES, "--seed": config.DEFAULT_SYNTH_SEED},
    "train": {
        "--batch": L.batch_size,
        "--epochs": T.epochs,
        "--lr": T.lr,
        "--workers": L.workers,
        "--val-fraction": T.val_fraction,
        "--shuffle": L.order,
        "--block-buffer": L.block_buffer,
        "--seed": L.seed,
        "--device": T.device,
        "--width": T.width,
        "--amp": T.amp,
        "--optimizer": T.optimizer,
        "--weight-decay": T.weight_decay,
        "--label-smoothing": T.label_smoothing,
    },
    "eval": {"--batch": L.batch_size, "--workers": L.workers, "--device": T.device},
    "demo": {
        "--dir": config.DEFAULT_DEMO_DIR,
        "--samples": config.DEFAULT_SYNTH_SAMPLES,
        "--epochs": T.epochs,
        "--batch": L.batch_size,
        "--workers": L.workers,
    },
    "export": {
        "--val-fraction": T.val_fraction,
        "--seed": L.seed,
        "--compress": config.DEFAULT_COMPRESS,
    },
    "copy": {},
    "show": {
        "--out": config.DEFAULT_SAMPLES_PNG,
        "--per-class": config.DEFAULT_PER_CLASS,
        "--seed": config.DEFAULT_SAMPLE_SEED,
        "--dpi": config.DEFAULT_DPI,
    },
    "plot": {"--out": config.DEFAULT_RUN_PNG, "--dpi": config.DEFAULT_DPI},
}

DEFAULT_RE = re.compile(r"\[default: ([^;\]]*)")


def _help(command: str) -> str:
    r = CliRunner().invoke(app, [command, "--help"], terminal_width=1000)  # one line per option
    assert r.exit_code == 0, r.output
    return r.stdout


def _shown_defaults(command: str) -> dict[str, str]:
    """Option (its first long name) -> the default its help line shows."""
    shown = {}
    for line in _help(command).splitlines():
        if m := DEFAULT_RE.search(line):
            opt = next(t for t in re.split(r"[\s,]+", line) if t.startswith("--"))
            shown[opt] = m.group(1)
    return shown


def _rendered(opt: str, value: Any) -> str:
    """How the help shows ``value``: a boolean as the switch's name (``progress`` / ``no-progress``)."""
    if isinstance(value, bool):
        return opt[2:] if value else f"no-{opt[2:]}"
    return str(value)


def test_every_command_is_covered() -> None:
    r = CliRunner().invoke(app, ["--help"], terminal_width=1000)
    listed = {line.split()[0] for line in r.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(SHOWN)


@pytest.mark.parametrize("command", sorted(SHOWN))
def test_shown_defaults_are_the_config_values(command: str) -> None:
    shown = _shown_defaults(command)
    expected = {opt: _rendered(opt, v) for opt, v in SHOWN[command].items()}
    assert shown == expected


def test_unset_and_switch_defaults_are_the_config_values() -> None:
    def default(fn: Callable[..., Any], name: str) -> Any:
        return inspect.signature(fn).parameters[name].default

    assert default(cmd_ingest.ingest, "samples_per_value") == W.samples_per_value
    assert default(cmd_ingest.ingest, "allow_nonfinite") == W.allow_nonfinite
    assert default(cmd_train.train, "window_mb") == L.window_mb
    assert default(cmd_train.train, "max_steps") == T.max_steps_per_epoch
    assert default(cmd_train.train, "balanced") == L.balanced
    assert default(cmd_train.train, "checkpoint_every") == T.checkpoint_every
    # --progress/--no-progress: unset (bars when stderr is a terminal) for every command that has it
    from lmdbstore_cli import cmd_export, cmd_inspect

    for fn in (cmd_ingest.ingest, cmd_inspect.verify, cmd_train.train, cmd_train.demo, cmd_export.export):
        assert default(fn, "progress") is config.DEFAULT_PROGRESS is None


def test_help_texts_name_the_config_choices() -> None:
    ingest_help = " ".join(_help("ingest").split())
    assert all(kind in ingest_help.split("--checksum")[1].split("--")[0] for kind in CHECKSUM_KINDS)
    assert f"(default {config.DEFAULT_RUNS_DIR}/<store name>)" in " ".join(_help("train").split())
    export_help = " ".join(_help("export").split()).split("--format")[1].split("--")[0]
    assert all(fmt in export_help for fmt in EXPORT_FORMATS)


def test_library_functions_default_to_the_same_constants() -> None:
    def default(fn: Callable[..., Any], name: str) -> Any:
        return inspect.signature(fn).parameters[name].default

    for fn in (select_indices, export_store):
        assert default(fn, "val_fraction") == T.val_fraction and default(fn, "seed") == L.seed
    assert default(export_store, "compress") == config.DEFAULT_COMPRESS
    assert default(export_store, "chunk") == config.DEFAULT_EXPORT_CHUNK
    assert default(store_stats, "seed") == config.DEFAULT_SAMPLE_SEED
    for fn in (show_samples, plot_runs, plot_stats):
        assert default(fn, "dpi") == config.DEFAULT_DPI
    assert default(show_samples, "per_class") == config.DEFAULT_PER_CLASS
    assert (default(plot_stats, "sample"), default(plot_stats, "bins")) == (
        config.DEFAULT_HIST_SAMPLES,
        config.DEFAULT_HIST_BINS,
    )
