"""Resuming inside an epoch: ``lmdbstore train --checkpoint-every`` killed with SIGKILL at a random moment (a child
process) and resumed (through CliRunner) ends with exactly the weights of a run never interrupted (same seed, CPU),
every epoch's metrics count every training sample once, and a checkpoint written inside an epoch that does not fit
the resumed run (another batch size, a malformed position) is refused in one line."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, one_error_line, run_cli

from lmdbstore import LmdbStoreError
from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import atomic_save, load_checkpoint
from lmdbstore.training.trainer import train
from lmdbstore.util.runfiles import CHECKPOINT_NAME, METRICS_NAME

#: 1,350 training samples in batches of 100: 14 steps an epoch, a checkpoint every 2 of them.
ARGS = ["--batch", "100", "--epochs", "2", "--workers", "2", "--width", "8", "--device", "cpu", "--no-progress"]
EVERY = "2"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "store"
    ingest_synthetic(path, 1500, seed=5)
    return path


@pytest.fixture(scope="module")
def one_epoch(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory after one epoch (batch 100, width 8, CPU)."""
    out = tmp_path_factory.mktemp("one") / "run"
    train(store, out, TrainConfig(epochs=1, width=8, device="cpu"), LoaderConfig(batch_size=100, workers=0),
          log=None, progress=False)  # fmt: skip
    return out


def _metrics(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / METRICS_NAME).read_text().splitlines()]


def _killed_inside_an_epoch(store: Path, out: Path) -> dict[str, object]:
    """Start ``train --checkpoint-every`` as a child and SIGKILL it at a random moment after its first
    checkpoint, before it finishes; the checkpoint it left (retried until that is one inside an epoch)."""
    for _ in range(10):
        shutil.rmtree(out, ignore_errors=True)  # else the wait below sees the last try's checkpoint at once
        cmd = [sys.executable, "-m", "lmdbstore", "train", str(store), *ARGS, "--checkpoint-every", EVERY]
        child = subprocess.Popen(
            [*cmd, "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        while not (out / CHECKPOINT_NAME).exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
        time.sleep(random.uniform(0.0, 0.3))  # an epoch takes ~0.3 s on an idle 2-core machine
        child.send_signal(signal.SIGKILL)
        child.wait()
        ckpt = load_checkpoint(out / CHECKPOINT_NAME)
        if child.returncode == -signal.SIGKILL and ckpt.get("step"):
            return ckpt
    pytest.fail("the run never stopped inside an epoch")


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(store: Path, tmp_path: Path) -> None:
    full, killed = tmp_path / "full", tmp_path / "killed"
    done = run_cli("train", store, *ARGS, "--checkpoint-every", EVERY, "--out", full)  # in this process
    assert done.exit_code == 0, done.stderr
    ckpt = _killed_inside_an_epoch(store, killed)
    step, epoch = ckpt["step"], ckpt["epoch"]
    assert isinstance(step, int) and isinstance(epoch, int) and 0 < step < 14
    totals = ckpt["epoch_totals"]
    assert totals[1] == 100 * step  # type: ignore[index]  # the samples of the steps trained so far
    position = json.loads(ckpt["sampler"])  # type: ignore[arg-type]
    assert (position["epoch"], position["position"]) == (epoch + 1, step)
    resumed = run_cli("train", store, *ARGS, "--checkpoint-every", EVERY, "--out", killed, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert f"resuming epoch {epoch + 2} after its step {step}" in resumed.stdout
    a = load_checkpoint(full / CHECKPOINT_NAME)["model"]
    b = load_checkpoint(killed / CHECKPOINT_NAME)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    n_train = len(stratified_split(StoreReader(store).labels(), 0.1, 0)[0])
    m_full, m_killed = _metrics(full), _metrics(killed)
    assert [m["epoch"] for m in m_killed] == [1, 2]
    for x, y in zip(m_full, m_killed, strict=True):
        assert x["train_samples"] == y["train_samples"] == n_train  # every training sample once per epoch
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-9)
        assert x["val_accuracy"] == y["val_accuracy"]


def _checkpoint_inside(run: Path, out: Path, **change: object) -> Path:
    """A copy of the run ``run`` whose checkpoint is turned into one written after 3 steps of its second
    epoch (then ``change``)."""
    shutil.copytree(run, out)
    path = out / CHECKPOINT_NAME
    ckpt = load_checkpoint(path)
    position = {"epoch": 1, "position": 3, "kind": "random", "seed": 0, "batch_size": 100, "samples": 1350}
    ckpt.update(step=3, epoch_totals=[3.0, 300, 0.1, 1.0], sampler=json.dumps({**position, "world_size": 1}))
    ckpt.update(change)
    atomic_save(ckpt, path)
    return out


def test_resuming_inside_an_epoch_with_another_batch_size_is_one_line(
    store: Path, one_epoch: Path, tmp_path: Path
) -> None:
    out = _checkpoint_inside(one_epoch, tmp_path / "run")
    ok = train(store, out, TrainConfig(epochs=2, width=8, device="cpu"), LoaderConfig(batch_size=100, workers=0),
               resume=True, log=None, progress=False)  # fmt: skip
    assert ok.epochs[-1].train_samples == 1350  # 300 restored + 1050 trained
    out = _checkpoint_inside(one_epoch, tmp_path / "other")
    r = run_cli("train", store, "--batch", "50", "--epochs", "2", "--width", "8", "--workers", "0", "--out", out,
                "--resume", "--device", "cpu", "--no-progress")  # fmt: skip
    assert r.exit_code == 1
    assert "another sampler" in one_error_line(r) and "batch_size" in r.stderr


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"step": -1}, "step"),
        ({"epoch_totals": [1.0, 2.0]}, "epoch_totals"),
        ({"sampler": "not json"}, "checkpoint cannot be resumed"),
        ({"sampler": json.dumps([1])}, "sampler state"),
        ({"step": 400}, "steps into an epoch"),
        ({"rng": torch.zeros(3)}, "rng"),
    ],
)
def test_a_malformed_position_inside_an_epoch_is_one_line(
    store: Path, one_epoch: Path, tmp_path: Path, change: dict[str, object], words: str
) -> None:
    out = _checkpoint_inside(one_epoch, tmp_path / "run", **change)
    with pytest.raises(LmdbStoreError, match=words) as err:
        train(store, out, TrainConfig(epochs=2, width=8, device="cpu"), LoaderConfig(batch_size=100, workers=0),
              resume=True, log=None, progress=False)  # fmt: skip
    assert "\n" not in str(err.value)
