"""cli/cmd_train.py: ``train``, ``eval`` and ``demo``: synth to ingest to train to eval, other dtypes and shapes,
``eval --split`` of the run's own split, a second run into the same ``--out`` (``--resume``/``--overwrite``),
Ctrl-C writing a checkpoint and saying how to resume (a real child and SIGINT), sets of stores (with weights, with
bare class ids), bad devices, the demo run twice."""

from __future__ import annotations

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
from conftest import (
    REPO,
    SET_CLASSES,
    SetInfo,
    StoreInfo,
    build_store,
    default_sigint,
    h5py,
    make_data,
    needs_h5py,
    one_error_line,
    run_cli,
    snapshot_store,
)

from lmdbstore import open_reader
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import load_checkpoint
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

TRAIN_FAST = ["--epochs", "1", "--batch", "200", "--workers", "0"]


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


@needs_h5py
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


@pytest.mark.parametrize("device", ["cuda:x", "tpu", "cuda", "cuda:3", ""])
def test_bad_devices_are_one_line(small_store: StoreInfo, tmp_path: Path, device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available() and device != "cuda:x":
        pytest.skip("this machine has CUDA")
    r = run_cli("train", small_store.path, "--device", device, "--epochs", "1", "--out", tmp_path / "run")
    assert r.exit_code == 1 and "device" in one_error_line(r)


def test_train_on_a_set(three: SetInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--batch", "128", "--epochs", "1", "--workers", "1", "--no-progress", "--out", out, "--device", "cpu"]
    r = run_cli("train", *three.paths, *args, "--shuffle", "block")
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_idx, _ = stratified_split(np.searchsorted(SET_CLASSES, three.names), 0.1, 0)
    assert metrics[0]["train_samples"] == len(train_idx)  # the whole set's training split, once
    assert json.loads((out / "summary.json").read_text())["classes"] == SET_CLASSES


def test_train_on_a_set_with_weights(three: SetInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--batch", "128", "--epochs", "1", "--workers", "0", "--no-progress", "--out", out, "--device", "cpu"]
    r = run_cli("train", *three.paths, *args, "--weights", "0.2,0.3,0.5", "--max-steps", "2", "--width", "4")
    assert r.exit_code == 0, r.output
    # finite weights whose sum overflows: every training sample once per epoch, not 1 per store (issue 34 #2)
    big = tmp_path / "big"
    r = run_cli("train", *three.paths, *args[:-4], "--out", big, "--weights", "1e308,1e308,1e308", "--width", "4")
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (big / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train_samples"] == len(stratified_split(np.searchsorted(SET_CLASSES, three.names), 0.1, 0)[0])
    for bad, msg in ((["--weights", "1,x"], "--weights must be comma-separated numbers"),
                     (["--weights", "1,1"], "weights: 2 numbers for 3 stores"),
                     (["--weights", "1,1,1", "--shuffle", "block"], "shuffle must be 'random' or 'auto'")):  # fmt: skip
        r = run_cli("train", *three.paths, *args, *bad, "--overwrite")
        assert r.exit_code == 1 and msg in one_error_line(r)
        assert (out / "checkpoint.pt").exists()  # refused before --overwrite removed the earlier run
