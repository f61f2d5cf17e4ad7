"""Validation at scale (issue 36): ``--val-limit`` (batches or a share), ``--val-every`` (steps inside epochs) and
``--val-fraction`` as a count; what is validated is in the metrics, and a run interrupted between validations
resumes to the weights of one never interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import load_checkpoint
from lmdbstore.training.trainer import train
from lmdbstore.training.validation import limit_validation
from lmdbstore.util.runfiles import CHECKPOINT_NAME, METRICS_NAME

N = 3000  # 300 validation samples at the default 10 %; batch 64: 43 training steps an epoch


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("val") / "store"
    ingest_synthetic(path, N, seed=4)
    return path


def _train(store: Path, out: Path | None, **cfg: object) -> object:
    tcfg = TrainConfig(**{"epochs": 2, "width": 8, "device": "cpu", **cfg})  # type: ignore[arg-type]
    return train(store, out, tcfg, LoaderConfig(batch_size=64, workers=0), log=None, progress=False)


def test_limit_validation_is_a_fixed_stratified_subset() -> None:
    labels = np.repeat(np.arange(4), [4000, 2000, 1000, 1000]).astype(np.uint8)
    _, val = stratified_split(labels, 0.25, 0)
    assert limit_validation(labels, val, None, 64, 2, 0) is val
    two = limit_validation(labels, val, 3, 64, 2, 0)  # 3 batches of 64 on each of 2 processes
    assert len(two) == 3 * 64 * 2 and np.all(np.diff(two) > 0) and np.isin(two, val).all()
    np.testing.assert_array_equal(two, limit_validation(labels, val, 3, 64, 2, 0))  # the same every time
    assert np.bincount(labels[two]).tolist() == [192, 96, 48, 48]  # the split's class shares
    quarter = limit_validation(labels, val, 0.25, 64, 1, 0)
    assert len(quarter) == round(0.25 * len(val))
    assert len(limit_validation(labels, val, 1000, 64, 1, 0)) == len(val)  # more than there is: all of it
    assert len(limit_validation(labels, val, 1.0, 64, 1, 0)) == len(val)


def test_val_fraction_as_a_count_and_bad_values() -> None:
    labels = np.repeat(np.arange(3), [5000, 3000, 2000]).astype(np.uint8)
    train_idx, val = stratified_split(labels, 1000, 0)
    assert len(val) == 1000 and len(train_idx) == 9000
    assert np.bincount(labels[val]).tolist() == [500, 300, 200]
    _, val_f = stratified_split(labels, 1000.0, 0)  # a whole float is a count too (the CLI's --val-fraction)
    np.testing.assert_array_equal(val, val_f)
    for bad in (1, 1.5, -0.1, 10_000, True):
        with pytest.raises(ValueError, match="val_fraction"):
            stratified_split(labels, bad, 0)  # type: ignore[arg-type]
    for field, value in (("val_every", 0), ("val_limit", 0), ("val_limit", 1.5), ("val_limit", True)):
        with pytest.raises(ValueError, match=field):
            TrainConfig(**{field: value})  # type: ignore[arg-type]


def test_val_limit_reads_no_more_than_asked_and_val_every_validates_inside_epochs(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _train(store, out, val_limit=2, val_every=10)
    _, val = stratified_split(StoreReader(store).labels(), 0.1, 0)
    assert len(val) > 128
    for m in result.epochs:  # type: ignore[attr-defined]
        assert (m.val_samples, m.val_batches) == (128, 2)  # 2 batches of 64: of 300
        assert [v["step"] for v in m.validations] == [s for s in range(10, 43 * m.epoch, 10) if s > 43 * (m.epoch - 1)]
        assert all((v["samples"], v["batches"]) == (128, 2) for v in m.validations)
    # what the validation loader delivered: the confusion matrix counts every sample it scored
    assert np.array(result.confusion).sum() == 128  # type: ignore[attr-defined]
    lines = [json.loads(x) for x in (out / METRICS_NAME).read_text().splitlines()]
    assert lines[0]["val_samples"] == 128 and lines[0]["validations"][0]["step"] == 10
    share = _train(store, None, epochs=1, val_limit=0.5)
    assert share.final.val_samples == round(0.5 * len(val))  # type: ignore[attr-defined]
    everything = _train(store, None, epochs=1)
    assert everything.final.val_samples == len(val) and everything.final.validations == []  # type: ignore[attr-defined]


class Interrupt(Exception):
    """Raised from the log to stop a run right after a given line (a Ctrl-C that lands there)."""


def test_resume_inside_an_epoch_with_val_every_is_exact(store: Path, tmp_path: Path) -> None:
    """Validations inside the epoch leave the training as it was: a run stopped after the validation at step 70
    (its last checkpoint at step 66, inside epoch 2, holding that epoch's validations at 50 and 60) and resumed
    ends with the uninterrupted run's weights and metrics, the validations of the epoch included."""
    cfg = {"val_limit": 2, "val_every": 10, "checkpoint_every": 6}
    full = _train(store, tmp_path / "full", **cfg)
    lcfg = LoaderConfig(batch_size=64, workers=0)
    tcfg = TrainConfig(epochs=2, width=8, device="cpu", **cfg)  # type: ignore[arg-type]

    def stop_after_step_70(line: str) -> None:
        if line.startswith("epoch 2 step 70:"):
            raise Interrupt

    out = tmp_path / "stopped"
    with pytest.raises(Interrupt):
        train(store, out, tcfg, lcfg, log=stop_after_step_70, progress=False)
    ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    assert (ckpt["epoch"], ckpt["step"]) == (0, 66 - 43)  # the checkpoint of step 66: 23 steps into epoch 2
    assert [v["step"] for v in json.loads(ckpt["validations"])] == [50, 60]
    resumed = train(store, out, tcfg, lcfg, resume=True, log=None, progress=False)
    a = load_checkpoint(tmp_path / "full" / CHECKPOINT_NAME)["model"]
    b = load_checkpoint(out / CHECKPOINT_NAME)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    for x, y in zip(full.epochs, resumed.epochs, strict=True):  # type: ignore[attr-defined]
        assert x.val_accuracy == y.val_accuracy and x.train_samples == y.train_samples
        assert [(v["step"], v["loss"]) for v in x.validations] == [(v["step"], v["loss"]) for v in y.validations]


def test_cli_options(store: Path, tmp_path: Path) -> None:
    r = run_cli("train", store, "--val-limit", "x", "--out", tmp_path / "r")
    assert r.exit_code == 1 and "--val-limit" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("train", store, "--val-every", "0", "--out", tmp_path / "r")
    assert r.exit_code == 2  # a usage error
    args = ["--batch", "64", "--epochs", "1", "--width", "8", "--workers", "0", "--device", "cpu", "--no-progress"]
    r = run_cli("train", store, *args, "--val-limit", "0.5", "--val-fraction", "400", "--out", tmp_path / "c",
                "--json")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "validates 200 of 400 samples (4 batch(es) a process) at every epoch's end" in r.stderr
    assert json.loads(r.stdout)["final"]["val_samples"] == 200
