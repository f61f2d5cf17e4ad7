"""cli/common.py: what every command shares.  The defaults the options show are lmdbstore.config's; options
grouped in help panels; ``--json`` (stdout exactly one JSON document, human lines on stderr, errors as one JSON
object) and ``--progress`` (bars only on a terminal unless asked); error lines that name the flags, never the
library's parameters; errors as one line with a documented exit status, also on damaged stores, unreadable or
unwritable paths and outputs that would replace a source."""

from __future__ import annotations

import ast
import fcntl
import inspect
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    DAMAGES,
    REPO,
    TESTS,
    StoreInfo,
    build_store,
    damage_store,
    make_data,
    needs_h5py,
    one_error_line,
    run_cli,
    strict_json,
    write_h5,
)
from lmdbstore_cli import cmd_ingest, cmd_train
from lmdbstore_cli.common import PARAM_FLAGS, flag_names
from lmdbstore_cli.main import app
from typer.testing import CliRunner

from lmdbstore import LmdbStoreError, WriterConfig, config
from lmdbstore.format.checksums import CHECKSUM_KINDS
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.tools.copy import copy_store
from lmdbstore.tools.export import export_store, select_indices
from lmdbstore.tools.export_formats import EXPORT_FORMATS
from lmdbstore.tools.stats import store_stats
from lmdbstore.tools.viz import plot_runs, plot_stats, show_samples

# ------------------------------------------------------------------------------- defaults: lmdbstore.config's


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

    assert default(select_indices, "val_fraction") == T.val_fraction and default(select_indices, "seed") == L.seed
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


# ------------------------------------------------------------------------------------------------ help panels


COMMANDS = ("ingest", "stats", "verify", "synth", "train", "eval", "demo", "export", "copy", "show", "plot")


def test_help_groups_options_and_shows_no_python_types() -> None:
    """Issue 40: `train --help` was 95 lines of 33 options in one flat list, spoke of "DataLoader workers" and
    showed `<list[Path]>`; its options are now in panels, and no command's help shows a Python type."""
    r = run_cli("train", "--help")
    sections = [ln[:-1] for ln in r.stdout.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert sections == ["Arguments", "Data", "Model", "Optimisation", "Validation", "Checkpoints",
                        "Workers and devices", "Output", "Options"]  # fmt: skip
    options = r.stdout[r.stdout.index("\nOptions:") :]
    assert options.count("\n  --") == 1 and "--help" in options  # every option of train has its panel
    assert r.stdout.startswith("Usage: lmdbstore train [OPTIONS] STORES...") and "built-in CNN" in r.stdout
    for cmd in COMMANDS:
        text = run_cli(cmd, "--help").stdout
        assert not re.search(r"<list|\{\w+\}|DataLoader", text), (cmd, text)
    assert "--model-arg NAME=VALUE" in run_cli("eval", "--help").stdout


# -------------------------------------------------------------------------------------- --json and --progress


TRAIN = ["--epochs", "2", "--batch", "256", "--workers", "0", "--width", "4", "--device", "cpu"]


def _json(*args: object) -> tuple[object, str]:
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    return strict_json(r.stdout), r.stderr


def test_every_command_prints_only_json_on_stdout(small_store: StoreInfo, tmp_path: Path) -> None:
    store = small_store.path
    doc, err = _json("synth", tmp_path / "d.npz", "-n", "500")
    assert doc == {"out": str(tmp_path / "d.npz"), "samples": 500, "seed": 0} and "wrote 500" in err  # type: ignore[comparison-overlap]
    doc, err = _json("ingest", tmp_path / "s2", tmp_path / "d.npz")
    assert doc["added"] == doc["total"] == 500 and doc["created"] and "created" in err  # type: ignore[index]
    doc, _ = _json("stats", store)
    assert doc["samples"] == 2000  # type: ignore[index]
    doc, err = _json("verify", store)
    assert doc["ok"] is True and "OK" in err  # type: ignore[index]
    doc, err = _json("export", store, tmp_path / "e.npz")
    assert doc["samples"] == 2000 and doc["samples_per_s"] > 0 and "exported" in err  # type: ignore[index]
    doc, err = _json("copy", store, tmp_path / "copy")
    assert doc["samples"] == 2000 and "copied" in err  # type: ignore[index]
    pytest.importorskip("matplotlib")
    doc, err = _json("show", store, "-o", tmp_path / "s.png", "--per-class", "2", "--dpi", "30")
    assert doc["path"] == str(tmp_path / "s.png") and doc["width"] > 0 and "wrote" in err  # type: ignore[index]


def test_train_eval_and_plot_json_agree_with_their_lines(small_store: StoreInfo, tmp_path: Path) -> None:
    run = tmp_path / "run"
    doc, err = _json("train", small_store.path, *TRAIN, "--out", run)
    assert [m["epoch"] for m in doc["epochs"]] == [1, 2] and doc["final"]["epoch"] == 2  # type: ignore[index]
    assert "epoch 1: train loss" in err and "epoch 2: train loss" in err and "confusion matrix" in err
    assert doc["out_dir"] == str(run) and len(doc["confusion"]) == 5  # type: ignore[index]
    # which model it trained (issue 40): in the plan line and the JSON
    assert doc["model"] == {"factory": "lmdbstore.training.model:build_cnn", "args": {"width": 4}}  # type: ignore[index]
    assert "shuffle random (auto), model the built-in CNN(width=4)" in err
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]
    doc, err = _json("eval", small_store.path, run / "best.pt", "--workers", "0")
    assert doc["samples"] == 2000 and err == ""  # type: ignore[index]
    if sys.modules.get("matplotlib") is not None or _has("matplotlib"):
        doc, err = _json("plot", run, "-o", tmp_path / "p.png", "--dpi", "30")
        assert doc["path"] == str(tmp_path / "p.png") and "wrote" in err  # type: ignore[index]


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _ingest_stderr(tmp_path: Path, *extra: str, terminal: bool) -> str:
    """stderr of ``python -m lmdbstore ingest --synthetic`` written to a pipe, or to a terminal (a pty)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    cmd = [sys.executable, "-m", "lmdbstore", "ingest", str(tmp_path / f"s{len(extra)}{terminal}"),
           "--synthetic", "3000", *extra]  # fmt: skip
    if not terminal:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300).stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=follower, env=env, cwd=REPO)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


#: What a tqdm bar line shows (percent, then the bar).
BAR = "%|"


def test_progress_bars_only_on_a_terminal_unless_asked(tmp_path: Path) -> None:
    assert BAR not in _ingest_stderr(tmp_path, terminal=False)  # a pipe or a log file: no bar redraws
    assert BAR in _ingest_stderr(tmp_path, "--progress", terminal=False)  # asked for
    assert BAR in _ingest_stderr(tmp_path, terminal=True)  # a terminal: bars by default
    assert BAR not in _ingest_stderr(tmp_path, "--no-progress", terminal=True)


#: A failing call of every command ({m}: a path that does not exist, {f}: a regular file, {t}: a new path).
FAILING = {
    "ingest": ["ingest", "{t}", "{m}.npz"],
    "synth": ["synth", "{t}.npz", "-n", "-5"],
    "stats": ["stats", "{m}"],
    "verify": ["verify", "{m}"],
    "train": ["train", "{m}"],
    "eval": ["eval", "{m}", "{m}.pt"],
    "demo": ["demo", "--dir", "{f}", "-n", "10"],
    "export": ["export", "{m}", "{t}.npz"],
    "copy": ["copy", "{m}", "{t}"],
    "show": ["show", "{m}", "-o", "{t}.png"],
    "plot": ["plot", "{m}", "-o", "{t}.png"],
}


@pytest.mark.parametrize("command", list(FAILING))
def test_an_error_under_json_is_one_json_object_on_stdout(tmp_path: Path, command: str) -> None:
    (tmp_path / "file").write_text("x")
    args = [a.format(m=tmp_path / "missing", f=tmp_path / "file", t=tmp_path / "new") for a in FAILING[command]]
    plain = run_cli(*args)
    r = run_cli(*args, "--json")
    assert r.exit_code == plain.exit_code != 0  # the exit status is unchanged
    assert r.stderr == plain.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    doc = strict_json(r.stdout)
    assert set(doc) == {"error", "path", "hint", "kind", "exit_code"} and doc["exit_code"] == r.exit_code
    assert doc["error"] and doc["error"] in r.stderr
    if doc["path"] is not None:
        assert doc["path"] in r.stderr


def test_json_outputs_stay_valid_json_with_nan_values(tmp_path: Path) -> None:
    x, y = make_data(300, seed=31, shape=(8, 8))
    x[::7, 2, 2] = np.nan  # allowed by allow_nonfinite; the losses become NaN
    store = build_store(tmp_path / "s", x, y, config=WriterConfig(allow_nonfinite=True, sync=False))
    out = tmp_path / "run"
    common = ("--batch", "64", "--workers", "0")
    result = run_cli(
        "train", store, "--epochs", "1", "--max-steps", "2", "--out", out, "--no-progress", "--json", *common
    )
    assert result.exit_code == 0, result.output
    final = strict_json(result.stdout)["final"]
    assert final["train_loss"] is None
    for line in (out / "metrics.jsonl").read_text().splitlines():
        strict_json(line)
    strict_json((out / "summary.json").read_text())
    scored = run_cli("eval", store, out / "checkpoint.pt", "--json", *common)
    assert scored.exit_code == 0, scored.output
    assert strict_json(scored.stdout)["loss"] is None
    for cmd in (("stats", store, "--json"), ("verify", store, "--json", "--no-progress")):
        shown = run_cli(*cmd)
        assert shown.exit_code == 0, shown.output
        strict_json(shown.stdout)


# --------------------------------------------------------------------------------------- flags in error lines


def _help_flags(command: str) -> set[str]:
    from typer.main import get_command

    cmd = get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


def _error_paths(tmp: Path, synth: Path) -> list[tuple[str, list[object]]]:
    """(command, arguments) that end in an error: every kind of mistake a user makes with each command."""
    np.save(tmp / "x.npy", make_data(20, 1)[0])
    np.save(tmp / "nan.npy", np.full((3, 25, 25), np.nan, np.float32))
    np.save(tmp / "f64.npy", make_data(20, 1)[0].astype(np.float64))
    np.savez(tmp / "p.npz", x=make_data(20, 1)[0], y=np.zeros(20, np.int64))
    write_h5(tmp / "d.h5")
    (tmp / "EMPTY").mkdir()
    (tmp / "f.tfrecord").write_bytes(b"")
    out = tmp / "run"
    return [
        ("ingest", [tmp / "s1", tmp / "x.npy"]),
        ("ingest", [tmp / "s2", tmp / "nan.npy", "--label", "a"]),
        ("ingest", [synth, tmp / "f64.npy", "--label", "blob"]),
        ("ingest", [synth, tmp / "x.npy", "--label", "zzz"]),
        ("ingest", [synth, tmp / "x.npy", "--label", "blob", "--dtype", "float16"]),
        ("ingest", [synth, tmp / "x.npy", "--label", "blob", "--classes", "a,b"]),
        ("ingest", [tmp / "s3", tmp / "p.npz", "--x-key", "nope"]),
        ("ingest", [tmp / "s3", tmp / "p.npz", "--y-key", "nope"]),
        ("ingest", [tmp / "s3", tmp / "d.h5", "--x-key", "nope"]),
        ("ingest", [tmp / "s3", tmp / "d.h5", "--y-key", "nope"]),
        ("ingest", [tmp / "s3", tmp / "EMPTY"]),
        ("ingest", [tmp / "s3", tmp / "f.tfrecord"]),
        ("ingest", [tmp / "s3", tmp / "nothing.npy", "--label", "a"]),
        ("ingest", [tmp / "s3", tmp / "x.npy", "--label", "a", "--x-key", "v"]),
        ("ingest", [tmp / "s3", "--synthetic", "5", "--workers", "2"]),
        ("train", [synth, "--out", out, "--batch", "5000"]),
        ("train", [synth, "--out", out, "--val-fraction", "0.9999"]),
        ("train", [synth, "--out", out, "--resume"]),
        ("train", [synth, "--out", out, "--model", "nomod:build"]),
        ("train", [synth, "--out", out, "--model-arg", "a=1"]),
        ("train", [synth, "--out", out, "--optimizer", "x"]),
        ("eval", [synth, tmp / "none.pt"]),
        ("eval", [synth, tmp / "none.pt", "--split", "x"]),
        ("export", [synth, tmp / "x.npy"]),
        ("stats", [tmp / "nostore"]),
        ("verify", [tmp / "nostore"]),
        ("copy", [synth, synth]),
        ("plot", [tmp / "norun"]),
    ]


@needs_h5py
def test_every_hint_names_only_flags_the_command_lists(synth: Path, tmp_path: Path) -> None:
    """Issue 35 case 6: the CLI's error lines name flags its --help lists, never the library's parameters."""
    for command, args in _error_paths(tmp_path, synth):
        res = run_cli(command, *args)
        assert res.exit_code != 0, (command, args)
        line = res.stderr.strip().splitlines()[-1]
        flags = set(
            re.findall(
                r"(?<![\w-])--[a-z][a-z0-9-]*", line.split(" -- hint: ", 1)[0] + " " + line.partition(" -- hint: ")[2]
            )
        )
        unknown = flags - _help_flags(command)
        assert not unknown, f"{command} {args}: {line}"
        params = [p for p in PARAM_FLAGS if re.search(rf"(?<![\w./-]){p}=", line)]
        assert not params, f"{command} {args}: a library parameter in {line}"


def _library_messages() -> list[tuple[Path, int, str]]:
    """Every string constant in an error's message or hint in the library's source (f-strings' literal parts)."""
    out = []
    for path in sorted((REPO / "lmdbstore").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.Call)
                or not isinstance(node.func, ast.Name)
                or not node.func.id.endswith("Error")
            ):
                continue
            parts = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "hint")]
            for part in parts:
                shown = {id(v) for j in ast.walk(part) if isinstance(j, ast.JoinedStr) for v in j.values}
                for c in ast.walk(part):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        # ``f"rank={rank}"`` shows a value: a name= right before a {field} names no parameter
                        text = re.sub(r"\w+=$", "", c.value) if id(c) in shown else c.value
                        out.append((path, c.lineno, text))
    return out


def test_the_library_names_parameters_that_the_cli_maps_to_flags() -> None:
    """The library knows nothing of flag names: its messages name parameters (``name=``), each one the CLI maps."""
    texts = _library_messages()
    assert len(texts) > 200
    flagged = [(p.name, n, t) for p, n, t in texts if re.search(r"(?<![\w-])--[a-z]", t)]
    assert not flagged, flagged
    named = {m for _, _, t in texts for m in re.findall(r"(?<![\w./-])([a-z][a-z0-9_]*)=(?!=)", t)}
    unmapped = sorted(n for n in named - set(PARAM_FLAGS) if "_" in n or n in {"label", "classes", "model"})
    assert not unmapped, unmapped
    assert flag_names("give sample_shape=25,25 or label=CLASS, allow_nonfinite=True") == (
        "give --sample-shape 25,25 or --label CLASS, --allow-nonfinite"
    )


# -------------------------------------------------------------------------------------- paths and permissions


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
def test_permission_denied_gives_one_line(tmp_path: Path, small_store: StoreInfo) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    try:
        locked.chmod(0o500)
        r = run_cli("synth", locked / "s.npz", "-n", "10")
        assert r.exit_code == 1 and "permission denied" in one_error_line(r)
        r = run_cli("train", small_store.path, "--out", locked / "run", "--epochs", "1", "--device", "cpu")
        assert r.exit_code == 1 and one_error_line(r)
        small_store.path.chmod(0o000)
        for args in (["stats", small_store.path], ["verify", small_store.path]):
            r = run_cli(*args)
            assert r.exit_code in (1, 2) and one_error_line(r), args
    finally:
        small_store.path.chmod(0o755)
        locked.chmod(0o755)


def test_output_paths_are_refused_up_front(tmp_path: Path, small_store: StoreInfo) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    cases = [
        (["synth", tmp_path / "missing" / "s.npz", "-n", "10"], "does not exist"),
        (["synth", a_file / "s.npz", "-n", "10"], "not a directory"),
        (["synth", tmp_path, "-n", "10"], "is a directory"),
        (["train", small_store.path, "--out", a_file, "--epochs", "1", "--device", "cpu"], "not a directory"),
        (["train", small_store.path, "--out", a_file / "sub", "--epochs", "1", "--device", "cpu"], "Not a directory"),
        # checked before the checkpoint is even loaded (it does not exist): before any scoring
        (
            ["eval", small_store.path, tmp_path / "no.pt", "--predictions", tmp_path / "missing" / "p.npy"],
            "predictions",
        ),
        (["eval", small_store.path, tmp_path / "no.pt", "--predictions", a_file / "p.npy"], "predictions"),
    ]
    for args, words in cases:
        r = run_cli(*args)
        assert r.exit_code == 1, (args, r.output)
        assert words in one_error_line(r), (args, r.stderr)
    assert a_file.read_text() == "keep" and not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "argv", [["copy", "{store}", "/proc/lmdbstore-x"], ["export", "{store}", "/proc/x.npz", "--no-progress"]]
)
def test_unwritable_destinations_are_one_line(small_store: StoreInfo, argv: list[str]) -> None:
    r = run_cli(*[a.format(store=small_store.path) for a in argv])
    assert r.exit_code == 1 and "/proc" in one_error_line(r)


def _special(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p)
    else:  # a character device of our own (/dev/null's numbers), never the system's
        try:
            os.mknod(p, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        except (PermissionError, AttributeError):
            pytest.skip("cannot make a character device here")
    return p


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("cmd", ["synth", "export"])
def test_an_output_that_is_a_device_or_fifo_is_refused_not_replaced(
    small_store: StoreInfo, tmp_path: Path, kind: str, cmd: str
) -> None:
    out = _special(tmp_path, kind)
    argv = (
        ["synth", out, "-n", "10"]
        if cmd == "synth"
        else ["export", small_store.path, out, "--force", "--format", "npz"]
    )
    r = run_cli(*argv)
    assert r.exit_code == 1 and "not a regular file" in one_error_line(r)
    mode = out.lstat().st_mode
    assert not __import__("stat").S_ISREG(mode)  # still the FIFO / device
    assert not list(tmp_path.glob(f".{out.name}.*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{s}", "{s}/data.mdb", "--force", "--format", "npy"],
        ["export", "{s}", "{s}/lock.mdb", "--force", "--format", "npz"],
        ["copy", "{s}", "{s}/sub"],
        ["copy", "{s}", "{s}"],
        ["ingest", "{s}/inner", "{s}"],
        ["show", "{s}", "-o", "{s}/data.mdb"],
        ["stats", "{s}", "--plot", "{s}/x.png"],
    ],
)
def test_an_output_inside_or_equal_to_a_source_is_refused(small_store: StoreInfo, argv: list[str]) -> None:
    before = {p.name: p.read_bytes() for p in small_store.path.iterdir()}
    r = run_cli(*[a.format(s=small_store.path) for a in argv])
    assert r.exit_code == 1, r.output
    line = one_error_line(r)
    assert "source" in line or "exists" in line or "a directory" in line, line
    assert {p.name: p.read_bytes() for p in small_store.path.iterdir()} == before  # the store untouched


def test_the_output_rule_in_the_library(small_store: StoreInfo, tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        export_store(small_store.path, small_store.path / "data.mdb", fmt="npy", overwrite=True)
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        copy_store(small_store.path, small_store.path / "sub")
    src = tmp_path / "src.npy"
    np.save(src, np.zeros((4, 3), np.float32))
    with pytest.raises(LmdbStoreError, match="is the source"):
        ingest(src, open_sources([src], label="a"))
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    np.save(root / "a" / "0.npy", np.zeros((3,), np.float32))
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        ingest(root / "a" / "store", open_sources([root]))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "images", "images/a", "images/a/0.npy", "src.npy", "store", *sorted(
            str(p.relative_to(tmp_path)) for p in small_store.path.iterdir())
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------- damaged stores


#: One quick training step on the CPU (``--workers`` added by each caller).
TINY_TRAIN = ["--epochs", "1", "--max-steps", "1", "--batch", "64", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny healthy store and a checkpoint trained on it (one step)."""
    base = tmp_path_factory.mktemp("tiny")
    x, y = make_data(300, 3)
    store = build_store(base / "store", x, y)
    r = run_cli("train", store, *TINY_TRAIN, "--workers", "0", "--out", base / "run")
    assert r.exit_code == 0, r.output
    return store, base / "run" / "checkpoint.pt"


@pytest.fixture(scope="module")
def damaged_runs(tiny_run: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every reading command on a copy of the tiny store under each damage, run as the console script runs them,
    all in one child process (tests/cli_runs.py: each command's stdout and stderr, its reader processes' included,
    in files ``HOW-NAME.out``/``.err``, its exit status in ``HOW-NAME.code``): a crash is that child's death, not
    the test process's.  The directory of those files."""
    good, ckpt = tiny_run
    base = tmp_path_factory.mktemp("damaged")
    plan = []
    for how in DAMAGES:
        store = damage_store(Path(shutil.copytree(good, base / how / "store")), how)
        commands = {
            "stats": ["stats", store, "--sample", "100"],
            "train": ["train", store, *TINY_TRAIN, "--workers", "1", "--out", base / how / "run"],
            "eval": ["eval", store, ckpt, "--workers", "1", "--device", "cpu", "--batch", "64"],
            "verify": ["verify", store, "--no-progress"],
        }
        plan += [(f"{how}-{name}", [str(a) for a in args]) for name, args in commands.items()]
    (base / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    p = subprocess.run([sys.executable, str(TESTS / "cli_runs.py"), str(base / "plan.json")], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=600)  # fmt: skip
    died = [name for name, _ in plan if not (base / f"{name}.code").exists()]
    assert p.returncode == 0 and not died, (p.returncode, died[:1], p.stderr[-3000:])  # no signal, no crash
    return base


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_store_gives_one_line_from_every_reading_command(damaged_runs: Path, how: str) -> None:
    store = damaged_runs / how / "store"
    for name in ("stats", "train", "eval", "verify"):
        code = int((damaged_runs / f"{how}-{name}.code").read_text())
        stdout, stderr = ((damaged_runs / f"{how}-{name}.{k}").read_text() for k in ("out", "err"))
        assert code > 0, (name, code, stderr)  # an error, not success or a signal
        assert "Traceback" not in stderr + stdout, (name, stderr)
        if name == "verify" and code == 1:  # damage found and listed on stdout
            assert stderr == "" and "problem" in stdout, (name, stdout, stderr)
            continue
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
        assert str(store) in lines[0] and "DataLoader" not in lines[0], (name, lines[0])
        if name == "verify":
            assert code == 2, stderr  # cannot be opened at all


FLIPS = 100


SEED = 18


WORKER = Path(__file__).with_name("cli_flip_worker.py")


#: Exit statuses each command may end with (docs/cli.md): verify 2 when the store cannot be opened at all.
ALLOWED = {"stats": {0, 1}, "verify": {0, 1, 2}, "export": {0, 1}, "copy": {0, 1}}


def _plan(size: int, psize: int, rng: np.random.Generator) -> np.ndarray:
    """Flips anywhere, with a third of them in the first pages (meta pages and the small B-trees)."""
    rows = []
    for _ in range(FLIPS):
        hi = 8 * psize if rng.random() < 1 / 3 else size
        xor = 1 << int(rng.integers(8)) if rng.random() < 0.5 else int(rng.integers(1, 256))
        rows.append((int(rng.integers(0, hi)), xor))
    return np.asarray(rows, np.int64)


@pytest.mark.slow
def test_cli_on_damaged_stores(tmp_path: Path) -> None:
    x, y = make_data(3000, seed=5)
    store = build_store(tmp_path / "s", x, y, config=WriterConfig(sync=False), batch=1000)
    plan_file, out = tmp_path / "plan.npy", tmp_path / "out"
    out.mkdir()
    np.save(plan_file, _plan(os.path.getsize(store / "data.mdb"), 4096, np.random.default_rng(SEED)))
    pristine = tmp_path / "pristine.mdb"
    shutil.copyfile(store / "data.mdb", pristine)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    records, deaths, start = [], [], 0
    while start < FLIPS:
        p = subprocess.run(
            [sys.executable, str(WORKER), str(store), str(plan_file), str(start), str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        lines = [json.loads(ln) for ln in p.stdout.splitlines()]
        records += [r for r in lines if "code" in r]
        if p.returncode == 0:
            break
        last = lines[-1] if lines else {"i": start, "cmd": "?"}
        deaths.append((last["i"], last["cmd"], p.returncode, p.stderr[-300:]))
        shutil.copyfile(pristine, store / "data.mdb")
        start = last["i"] + 1
    codes = Counter((r["cmd"].split()[0], r["code"]) for r in records)
    print(dict(codes))
    assert not deaths, f"a CLI command died: {deaths[:5]}"
    assert len(records) == FLIPS * 5
    bad = [r for r in records if r["traceback"] or not r["one"] or r["code"] not in ALLOWED[r["cmd"].split()[0]]]
    assert not bad, bad[:5]
    assert codes[("verify", 1)] > 0 and codes[("stats", 0)] > 0  # the damage was found, and some was harmless
