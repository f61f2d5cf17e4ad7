"""The CLI's rough edges of issue 35, each through a subprocess (and CliRunner where cheaper): HDF5 with workers and
class names, per-class stacks, hints that name flags, eval --split, a second run into the same --out, Ctrl-C in
train, sets of stores with bare class ids, options that do not apply."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, default_sigint, make_data, one_error_line, run_cli
from lmdbstore_cli.common import PARAM_FLAGS, flag_names
from lmdbstore_cli.main import app

from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import load_checkpoint
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

h5py = pytest.importorskip("h5py")

TRAIN_FAST = ["--epochs", "1", "--batch", "200", "--workers", "0"]


@pytest.fixture
def synth(tmp_path: Path) -> Path:
    """2,000 samples of the learnable synthetic set."""
    ingest_synthetic(tmp_path / "synth", 2000, seed=5)
    return tmp_path / "synth"


def _h5(path: Path, n: int = 400, names: str | None = "attr") -> Path:
    x, y = make_data(n, 9)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y % 3
        if names == "attr":
            f.attrs["class_names"] = ["cat", "dog", "eel"]
        elif names == "dataset":
            f["classes"] = np.array([b"cat", b"dog", b"eel"])
        elif names == "y_attr":
            f["y"].attrs["class_names"] = np.array(["cat", "dog", "eel"], dtype=h5py.string_dtype())
    return path


# ---------------------------------------------------------------------------------------------- cases 3 and 4
def test_hdf5_ingests_with_two_workers(tmp_path: Path) -> None:
    src = _h5(tmp_path / "d.h5", 3000)
    done = run_cli("ingest", tmp_path / "s", src, "--workers", "2")
    assert done.exit_code == 0, done.output
    with StoreReader(tmp_path / "s") as r, h5py.File(src) as f:
        assert r.meta.count == 3000 and np.array_equal(r.read_range(0, 3000), f["x"][()])


@pytest.mark.parametrize("where", ["attr", "dataset", "y_attr"])
def test_hdf5_class_names_from_an_attribute_or_a_classes_dataset(tmp_path: Path, where: str) -> None:
    res = run_cli("ingest", tmp_path / "s", _h5(tmp_path / "d.h5", names=where))
    assert res.exit_code == 0, res.output
    with StoreReader(tmp_path / "s") as r, h5py.File(tmp_path / "d.h5") as f:
        assert list(r.meta.classes) == ["cat", "dog", "eel"] and np.array_equal(r.labels(), f["y"][()])


# ---------------------------------------------------------------------------------------------- case 5
def test_per_class_stacks_one_at_a_time_say_to_name_the_classes(tmp_path: Path) -> None:
    for k in (0, 36):
        np.save(tmp_path / f"wave{k}.npy", make_data(50, k)[0])
    assert run_cli("ingest", tmp_path / "s", tmp_path / "wave0.npy", "--label", "wave0").exit_code == 0
    done = run_cli("ingest", tmp_path / "s", tmp_path / "wave36.npy", "--label", "wave36")
    line = one_error_line(done)
    assert done.exit_code == 1 and "unknown class label 'wave36'" in line
    assert "hint: a store's classes are fixed when it is created: name them all with --classes" in line
    # what the hint says works
    res = run_cli("ingest", tmp_path / "t", tmp_path / "wave0.npy", "--label", "wave0", "--classes", "wave0,wave36")
    assert res.exit_code == 0
    assert run_cli("ingest", tmp_path / "t", tmp_path / "wave36.npy", "--label", "wave36").exit_code == 0


# ---------------------------------------------------------------------------------------------- case 7
def test_eval_split_val_scores_the_runs_held_out_part(synth: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("train", synth, "--out", out, *TRAIN_FAST, "--val-fraction", "0.2", "--seed", "3", "--json")
    assert done.exit_code == 0, done.output
    final = json.loads(done.stdout)["final"]
    ev = run_cli("eval", synth, out / CHECKPOINT_NAME, "--split", "val", "--workers", "0", "--json")
    assert ev.exit_code == 0, ev.output
    r = json.loads(ev.stdout)
    # the checkpoint's own split (--val-fraction 0.2, --seed 3): the samples and the accuracy the run validated on
    with StoreReader(synth) as reader:
        _, val_idx = stratified_split(reader.labels(), 0.2, 3)
    assert (
        r["samples"] == len(val_idx) and r["split"] == "val" and r["accuracy"] == pytest.approx(final["val_accuracy"])
    )
    train_part = json.loads(
        run_cli("eval", synth, out / CHECKPOINT_NAME, "--split", "train", "--workers", "0", "--json").stdout
    )
    assert train_part["samples"] == 2000 - len(val_idx)
    assert "--split must be train or val" in one_error_line(
        run_cli("eval", synth, out / CHECKPOINT_NAME, "--split", "test")
    )


# ---------------------------------------------------------------------------------------------- case 8
def test_a_second_run_into_the_same_out_never_replaces_best_silently(synth: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run_cli("train", synth, "--out", out, *TRAIN_FAST).exit_code == 0
    best = (out / BEST_NAME).read_bytes()
    again = run_cli("train", synth, "--out", out, *TRAIN_FAST, "--lr", "1e-6")
    line = one_error_line(again)
    assert again.exit_code == 1 and "holds an earlier training run" in line
    assert "--resume" in line and "--overwrite" in line and "--out" in line
    assert (out / BEST_NAME).read_bytes() == best  # untouched
    both = run_cli("train", synth, "--out", out, *TRAIN_FAST, "--resume", "--overwrite")
    assert "resume and overwrite exclude each other" in one_error_line(both)
    fresh = run_cli("train", synth, "--out", out, *TRAIN_FAST, "--lr", "1e-6", "--overwrite", "--val-fraction", "0")
    assert fresh.exit_code == 0, fresh.output
    assert not (out / BEST_NAME).exists()  # the earlier run's best.pt went with it (no validation: no new best)


# ---------------------------------------------------------------------------------------------- case 9
def test_ctrl_c_in_train_writes_a_checkpoint_and_says_how_to_resume(synth: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", str(synth), "--out", str(out), "--epochs", "30", "--batch", "50", "--workers", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmdbstore", *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("training on"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Traceback" not in err, err
    m = re.search(r"training stopped (?:after step (\d+) of epoch (\d+)|after epoch (\d+)); checkpoint written", last)
    assert m is not None and str(out / CHECKPOINT_NAME) in last and "--resume" in last, last
    ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    epochs = int(m.group(2)) if m.group(1) else int(m.group(3)) + 1
    if m.group(1):
        assert (ckpt["epoch"], ckpt["step"]) == (epochs - 2, int(m.group(1)))
    # what it says works: the same command with --resume (up to the end of the epoch it stopped in)
    done = run_cli(*args[:-6], "--epochs", str(epochs), "--batch", "50", "--workers", "0", "--resume")
    assert done.exit_code == 0, done.output
    assert load_checkpoint(out / CHECKPOINT_NAME)["epoch"] == epochs - 1


# ---------------------------------------------------------------------------------------------- case 10
def test_a_set_with_a_store_of_bare_class_ids_is_refused_unless_asked(synth: Path, tmp_path: Path) -> None:
    x, y = make_data(600, 11)
    with h5py.File(tmp_path / "ids.h5", "w") as f:
        f["x"], f["y"] = x, y  # ids 0..4, no names
    assert run_cli("ingest", tmp_path / "ids", tmp_path / "ids.h5").exit_code == 0
    done = run_cli("train", synth, tmp_path / "ids", "--out", tmp_path / "run", *TRAIN_FAST)
    line = one_error_line(done)
    assert done.exit_code == 1 and "are the bare ids [0, 1, 2, 3, 4]" in line
    assert "train 10 separate classes" in line and "--allow-disjoint-classes" in line and "--classes" in line
    ok = run_cli(
        "train", synth, tmp_path / "ids", "--out", tmp_path / "run", *TRAIN_FAST, "--allow-disjoint-classes", "--json"
    )
    assert ok.exit_code == 0, ok.output
    assert len(json.loads(ok.stdout)["classes"]) == 10


# ---------------------------------------------------------------------------------------------- case 12
def test_synthetic_in_float16_and_options_that_do_not_apply(tmp_path: Path) -> None:
    done = run_cli("ingest", tmp_path / "s", "--synthetic", "1000", "--dtype", "float16")
    assert done.exit_code == 0, done.output
    with StoreReader(tmp_path / "s") as r:
        assert r.meta.dtype == "<f2" and r.read_range(0, 10).dtype == np.float16
    np.save(tmp_path / "x.npy", make_data(10, 1)[0])
    cases = [
        (["--synthetic", "10", "--label", "a"], "--label does not apply with --synthetic"),
        (["--synthetic", "10", "--classes", "a,b"], "--classes does not apply with --synthetic"),
        (["--synthetic", "10", "--dtype", "int16"], "must be a float dtype"),
        ([tmp_path / "x.npy", "--label", "a", "--x-key", "v"], "--x-key does not apply to these sources"),
        (
            [tmp_path / "x.npy", "--label", "a", "--sample-shape", "25,25"],
            "--sample-shape does not apply to these sources",
        ),
        ([tmp_path / "x.npy", "--label", "a", "--seed", "1"], "--seed does not apply without --synthetic"),
    ]
    for extra, words in cases:
        assert words in one_error_line(run_cli("ingest", tmp_path / "t", *extra)), extra
    assert not (tmp_path / "t").exists()
    assert (
        "--dtype does not apply"
        not in run_cli(
            "ingest", tmp_path / "u", tmp_path / "x.npy", "--label", "a", "--dtype", "float16", "--cast"
        ).stderr
    )


# ---------------------------------------------------------------------------------------------- case 6: hints
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
    _h5(tmp / "d.h5")
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
