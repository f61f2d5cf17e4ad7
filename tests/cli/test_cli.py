"""The `lmdbstore` CLI through typer's CliRunner and as a real subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CLASSES,
    DAMAGES,
    REPO,
    TESTS,
    StoreInfo,
    build_store,
    damage_store,
    make_data,
    one_error_line,
    run_cli,
    snapshot_store,
    strict_json,
)

from lmdbstore import WriterConfig, open_reader


def test_ingest_npy_npz_and_directory_then_stats_json(tmp_path: Path) -> None:
    store = tmp_path / "s"
    x1, y1 = make_data(300, 1)
    np.savez(tmp_path / "a.npz", x=x1, y=np.array(CLASSES)[y1])
    r = run_cli("ingest", store, tmp_path / "a.npz", "--classes", ",".join(CLASSES), "--no-progress")
    assert r.exit_code == 0, r.output
    assert "created" in r.stdout and "+300 samples" in r.stdout
    x2, _ = make_data(40, 2)
    np.save(tmp_path / "b.npy", x2)
    r = run_cli("ingest", store, tmp_path / "b.npy", "--label", "d", "--no-progress")
    assert r.exit_code == 0 and "appended to" in r.stdout
    root = tmp_path / "root"
    for i, name in enumerate(("a", "e")):
        (root / name).mkdir(parents=True)
        np.save(root / name / "stack.npy", make_data(5, 10 + i)[0])
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 0, r.output
    r = run_cli("stats", store, "--json")
    assert r.exit_code == 0
    s = json.loads(r.stdout)
    assert s["samples"] == 350
    counts = dict((c["name"], c["count"]) for c in s["classes"])
    assert counts["d"] == int((y1 == 3).sum()) + 40
    assert counts["e"] == int((y1 == 4).sum()) + 5
    assert s["bytes"]["ratio_samples_to_raw"] <= 1.05
    with open_reader(store) as rd:
        got = rd.read_range(0, 350)
    assert np.array_equal(got[:300], x1) and np.array_equal(got[300:340], x2)
    table = run_cli("stats", store)
    assert "18 samples per value" in table.stdout and "exact" in table.stdout


def test_rerunning_the_same_ingest_adds_nothing(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=make_data(100, 1)[0], y=make_data(100, 1)[1])
    args = ("ingest", tmp_path / "s", tmp_path / "a.npz", "--no-progress")
    assert run_cli(*args).exit_code == 0
    r = run_cli(*args)
    assert r.exit_code == 0 and "+0 samples" in r.stdout and "already in the store" in r.stdout


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_bytes(np.lib.format.magic(1, 0) + b"garbage"), ""),
    ],
)
def test_bad_files_give_one_line_and_leave_the_store(tmp_path: Path, setup, words) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "s"
    np.savez(tmp_path / "ok.npz", x=make_data(50, 1)[0], y=make_data(50, 1)[1])
    assert run_cli("ingest", store, tmp_path / "ok.npz", "--no-progress").exit_code == 0
    before = snapshot_store(store)
    bad = tmp_path / "bad.npy"
    setup(bad)
    r = run_cli("ingest", store, bad, "--label", "a", "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "bad.npy" in line and words in line.lower()
    assert snapshot_store(store) == before


def test_nonfinite_is_refused_unless_allowed(tmp_path: Path) -> None:
    x, y = make_data(30, 3)
    x[7, 0, 1] = np.inf
    np.savez(tmp_path / "d.npz", x=x, y=y)
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--no-progress")
    assert r.exit_code == 1 and "non-finite" in one_error_line(r)
    assert not (tmp_path / "s").exists()
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--allow-nonfinite", "--no-progress")
    assert r.exit_code == 0
    s = json.loads(run_cli("stats", tmp_path / "s", "--json").stdout)
    assert s["values"]["nonfinite"] == 1


def _class_dir(root: Path, odd: int) -> Path:
    """``root/{a,b}/*.npy``: 12 (25, 25) samples and ``odd`` (24, 25) files (in ``b``); the first odd one."""
    x, _ = make_data(12 + odd, 7)
    for i in range(12 + odd):
        (root / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        np.save(root / "ab"[i % 2] / f"{i:03d}.npy", x[i] if i < 12 else x[i, 1:])
    return root / "ab"[12 % 2] / "012.npy"


def test_a_malformed_directory_file_is_named_not_read_as_stacks(tmp_path: Path) -> None:
    root, store = tmp_path / "root", tmp_path / "s"
    odd = _class_dir(root, 1)
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 1 and not store.exists()
    line = one_error_line(r)
    assert str(odd) in line and "(24, 25)" in line and "--sample-shape" in line
    r = run_cli("ingest", store, root, "--sample-shape", "25,25", "--no-progress")
    assert r.exit_code == 1 and str(odd) in one_error_line(r) and not store.exists()
    r = run_cli("ingest", store, root, "--sample-shape", "25x25", "--no-progress")
    assert r.exit_code == 1 and "--sample-shape" in one_error_line(r)
    # appending to a store of (25, 25) samples: its shape decides, the store is left as it was
    build_store(store, *make_data(20, 1))
    before = snapshot_store(store)
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 1 and str(odd) in one_error_line(r)
    assert snapshot_store(store) == before
    odd.unlink()
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 0 and "+12 samples" in r.stdout, r.output


def test_a_malformed_directory_as_subprocess(tmp_path: Path) -> None:
    root, store = tmp_path / "root", tmp_path / "s"
    _class_dir(root, 1)
    p = subprocess.run(
        [sys.executable, "-m", "lmdbstore", "ingest", str(store), str(root), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr and not store.exists()
    line = p.stderr.strip()
    assert line.startswith("error: ") and line.count("\n") == 0 and "012.npy" in line, p.stderr


def test_missing_and_foreign_stores(tmp_path: Path) -> None:
    for cmd, code in (("stats", 1), ("verify", 2)):
        r = run_cli(cmd, tmp_path / "nope")
        assert r.exit_code == code and "no such store" in one_error_line(r)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text("hello")
    r = run_cli("stats", tmp_path / "dir")
    assert r.exit_code == 1 and "not a store" in one_error_line(r)
    r = run_cli("train", tmp_path / "dir", "--no-progress")
    assert r.exit_code == 1 and "not a store" in one_error_line(r)


def test_synth_ingest_train_eval_verify(tmp_path: Path) -> None:
    npz, store, out = tmp_path / "d.npz", tmp_path / "s", tmp_path / "run"
    assert run_cli("synth", npz, "-n", "3000").exit_code == 0
    assert run_cli("ingest", store, npz, "--no-progress").exit_code == 0
    r = run_cli("verify", store)
    assert r.exit_code == 0, r.output
    r = run_cli(
        "train", store, "--batch", "256", "--epochs", "2", "--workers", "1", "--out", out, "--no-progress", "--json"
    )
    assert r.exit_code == 0, r.output
    # --json: stdout is one JSON document, the human lines are on stderr, and the epochs agree
    assert "epoch 2:" in r.stderr and "confusion matrix" in r.stderr
    assert "shuffle: random (store" in r.stderr  # the default (auto) says what it chose
    report = json.loads(r.stdout)
    assert report["final"]["val_accuracy"] > 0.5
    assert [m["epoch"] for m in report["epochs"]] == [1, 2] and report["final"]["epoch"] == 2
    r = run_cli(
        "train",
        store,
        "--shuffle",
        "window",
        "--window-mb",
        "1",
        "--batch",
        "256",
        "--epochs",
        "1",
        "--no-progress",
        "--out",
        out,
        "--overwrite",
    )
    assert r.exit_code == 0, r.output
    r = run_cli("train", store, "--batch", "100000", "--no-progress", "--out", tmp_path / "r2")
    assert r.exit_code == 1 and "larger than the training split" in one_error_line(r)
    r = run_cli("eval", store, out / "best.pt", "--json", "--predictions", tmp_path / "p.npy", "--workers", "0")
    assert r.exit_code == 0, r.output
    ev = json.loads(r.stdout)
    assert ev["samples"] == 3000 and np.load(tmp_path / "p.npy").shape == (3000,)
    r = run_cli("eval", store, tmp_path / "missing.pt")
    assert r.exit_code == 1 and "no such checkpoint" in one_error_line(r)


def test_eval_split_takes_the_count_form_of_val_fraction(tmp_path: Path) -> None:
    """Issue 39: ``eval --split val`` refused a run trained with ``--val-fraction 200`` (the documented count
    form) as a malformed checkpoint, while ``export`` took it."""
    x, y = make_data(400, shape=(4, 4))
    store, out = build_store(tmp_path / "s", x, y), tmp_path / "run"
    fast = ("--epochs", "1", "--batch", "100", "--workers", "0", "--no-progress")
    assert run_cli("train", store, "--out", out, "--val-fraction", "40", *fast).exit_code == 0
    r = run_cli("eval", store, out / "checkpoint.pt", "--split", "val", "--workers", "0", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["samples"] == 40


def test_help_explains_commands() -> None:
    r = run_cli("--help")
    assert r.exit_code == 0
    for cmd in ("ingest", "stats", "verify", "train", "eval", "synth", "demo"):
        assert cmd in r.stdout
    r = run_cli("ingest", "--help")
    assert "--allow-nonfinite" in r.stdout and "interrupted" in r.stdout
    assert "--no-allow-nonfinite" not in r.stdout


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


def test_console_script_as_subprocess(tmp_path: Path) -> None:
    exe = shutil.which("lmdbstore", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "lmdbstore"]
    store = tmp_path / "s"
    p = subprocess.run(
        [*cmd, "ingest", str(store), "--synthetic", "500", "--no-progress"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    p = subprocess.run([*cmd, "stats", str(store), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["samples"] == 500
    p = subprocess.run([*cmd, "stats", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("error: ") and p.stderr.strip().count("\n") == 0
    p = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("lmdbstore ")


def test_train_and_eval_other_dtypes_and_shapes(tmp_path: Path) -> None:
    """float64 and (C, H, W) stores train and score; a shape the CNN cannot take is one line, no traceback."""
    small = ("--batch", "64", "--epochs", "1", "--max-steps", "2", "--workers", "0", "--no-progress")
    for name, shape, dtype in (("f64", (25, 25), np.float64), ("rgb", (3, 16, 16), np.float32)):
        store = build_store(tmp_path / name, *make_data(256, 3, shape=shape, dtype=dtype))
        r = run_cli("train", store, *small, "--out", tmp_path / f"run_{name}")
        assert r.exit_code == 0 and r.exception is None, r.output
        assert "epoch 1:" in r.stdout and "Traceback" not in r.stderr
        r = run_cli("eval", store, tmp_path / f"run_{name}" / "checkpoint.pt", "--workers", "0", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["samples"] == 256
    # a 1-channel checkpoint against the 3-channel store (the refusals in this process: the CLI's one line)
    r = run_cli("eval", tmp_path / "rgb", tmp_path / "run_f64" / "checkpoint.pt", "--workers", "0")
    line = one_error_line(r)
    assert r.exit_code == 1 and "1-channel" in line and "3-channel" in line
    for name, shape in (("tiny", (2, 2)), ("flat", (64,))):
        store = build_store(tmp_path / name, *make_data(256, 4, shape=shape))
        r = run_cli("train", store, *small, "--out", tmp_path / f"run_{name}")
        line = one_error_line(r)
        assert r.exit_code == 1 and str(shape) in line and not (tmp_path / f"run_{name}").exists()


@pytest.mark.parametrize(("classes", "words"), [("a,,b", "blank"), ("a, ,b", "blank"), ("a,b,a", "repeated: 'a'")])
def test_bad_classes_option_gives_one_line(tmp_path: Path, classes: str, words: str) -> None:
    x, y = make_data(30)
    np.savez(tmp_path / "d.npz", x=x, y=y % 3)
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--classes", classes, "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "classes" in line and words in line, line
    assert not (tmp_path / "s").exists()


def test_huge_label_gives_a_short_line(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=make_data(3)[0], y=np.array([0, 1, 10**7]))
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "10000000" in line and "d.npz" in line and len(line) < 500
    assert not (tmp_path / "s").exists()


def test_running_the_demo_twice_gives_the_same_store(tmp_path: Path) -> None:
    # the demo used to rewrite synthetic.npz, whose new mtime made the second ingest append a copy
    work = tmp_path / "demo"
    args = ("demo", "--dir", work, "-n", "600", "--epochs", "1", "--batch", "64", "--workers", "0")
    first = run_cli(*args)
    assert first.exit_code == 0, first.output
    before = snapshot_store(work / "store")
    second = run_cli(*args)
    assert second.exit_code == 0, second.output
    assert "+0 samples (already in the store)" in second.stdout
    assert snapshot_store(work / "store") == before
    with open_reader(work / "store") as r:
        assert len(r) == 600
    assert len((work / "run" / "metrics.jsonl").read_text().splitlines()) == 1  # a fresh run, not appended
    # a demo directory whose store holds other data is refused, untouched
    third = run_cli("demo", "--dir", work, "-n", "500", "--epochs", "1", "--batch", "64", "--workers", "0")
    assert third.exit_code == 1 and "other data" in one_error_line(third)
    assert snapshot_store(work / "store") == before


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


# ---------------------------------------------------------------------------- damaged stores, output paths


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


def test_writer_lock_that_is_a_directory(tmp_path: Path, small_store: StoreInfo) -> None:
    before = snapshot_store(small_store.path)
    (small_store.path / "writer.lock").unlink()
    (small_store.path / "writer.lock").mkdir()
    r = run_cli("ingest", small_store.path, "--synthetic", "10", "--no-progress")
    assert r.exit_code == 1 and "writer.lock" in one_error_line(r)
    assert snapshot_store(small_store.path) == before
    assert run_cli("stats", small_store.path).exit_code == 0


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
