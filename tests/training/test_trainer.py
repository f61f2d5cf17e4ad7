"""Training, checkpoints, resume and evaluation on real stores (CPU)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import StoreInfo, make_data

from lmdbstore import LmdbStoreError, NotAStoreError, StoreNotFoundError, ValidationError, open_writer
from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.batches import to_device
from lmdbstore.training.checkpoint import load_checkpoint
from lmdbstore.training.evaluate import evaluate
from lmdbstore.training.model import build_cnn
from lmdbstore.training.trainer import train
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME, METRICS_NAME


@pytest.fixture(scope="module")
def synth_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6,000 samples of the built-in learnable 5-class dataset."""
    path = tmp_path_factory.mktemp("synth") / "store"
    ingest_synthetic(path, 6000, seed=3)
    return path


def _quiet_train(store: Path, out: Path | None, epochs: int = 2, **loader: object) -> object:
    lcfg = LoaderConfig(**{"batch_size": 256, "workers": 0, **loader})  # type: ignore[arg-type]
    return train(store, out, TrainConfig(epochs=epochs, lr=5e-3), lcfg, log=None, progress=False)


@pytest.fixture(scope="module")
def three_epochs(synth_store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A run of 3 epochs (batch 256, one reader process) on ``synth_store``: its directory and result."""
    out = tmp_path_factory.mktemp("three") / "run"
    return out, _quiet_train(synth_store, out, epochs=3, workers=1)


def test_train_learns_and_writes_checkpoints(synth_store: Path, three_epochs: tuple[Path, object]) -> None:
    out, result = three_epochs
    final = result.final  # type: ignore[attr-defined]
    assert final.val_accuracy is not None and final.val_accuracy > 0.85
    assert result.epochs[0].train_loss > final.train_loss  # type: ignore[attr-defined]
    assert 0.0 <= final.data_wait_share < 1.0
    assert final.samples_per_s > 0
    # every training sample was seen exactly once per epoch
    train_idx, val_idx = stratified_split(StoreReader(synth_store).labels(), 0.1, 0)
    assert final.train_samples == len(train_idx)
    assert set(final.per_class_accuracy) == {"blob", "ring", "hstripes", "vstripes", "checker"}
    lines = (out / METRICS_NAME).read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]  # as the lines say: from 1
    conf = np.array(result.confusion)  # type: ignore[attr-defined]
    assert conf.sum() == len(val_idx)
    assert json.loads((out / "summary.json").read_text())["confusion"] == conf.tolist()
    # checkpoints hold only tensors and primitives: safe loading works
    for name in (CHECKPOINT_NAME, BEST_NAME):
        ckpt = torch.load(out / name, weights_only=True)
        model = build_cnn(tuple(ckpt["sample_shape"]), len(ckpt["classes"]), ckpt["width"])
        model.load_state_dict(ckpt["model"])
    assert load_checkpoint(out / CHECKPOINT_NAME)["epoch"] == 2


def test_resume_continues_where_it_stopped(synth_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _quiet_train(synth_store, out, epochs=1)
    first = load_checkpoint(out / CHECKPOINT_NAME)
    assert first["epoch"] == 0
    lcfg = LoaderConfig(batch_size=256, workers=0)
    result = train(synth_store, out, TrainConfig(epochs=2, lr=5e-3), lcfg, resume=True, log=None, progress=False)
    assert [m.epoch for m in result.epochs] == [1, 2]
    assert load_checkpoint(out / CHECKPOINT_NAME)["epoch"] == 1  # the index of the last finished epoch
    assert len((out / METRICS_NAME).read_text().splitlines()) == 2
    # the resumed model started from the saved weights, not from scratch
    assert result.epochs[1].train_loss < result.epochs[0].train_loss


def test_resume_without_checkpoint_fails(synth_store: Path, tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="no such checkpoint"):
        train(
            synth_store,
            tmp_path / "empty",
            TrainConfig(epochs=1),
            LoaderConfig(batch_size=256, workers=0),
            resume=True,
            log=None,
            progress=False,
        )


@pytest.mark.parametrize(
    "loader",
    [
        {"shuffle": "block", "workers": 2},
        {"balanced": True, "workers": 0},
        {"shuffle": "window", "window_mb": 1, "workers": 2},
    ],
)
def test_block_and_balanced_modes_train(synth_store: Path, loader: dict[str, object]) -> None:
    result = _quiet_train(synth_store, None, epochs=1, **loader)
    assert result.final.val_accuracy is not None  # type: ignore[attr-defined]
    assert result.final.train_samples > 0  # type: ignore[attr-defined]


def test_evaluate_scores_the_store(synth_store: Path, three_epochs: tuple[Path, object], tmp_path: Path) -> None:
    out, _ = three_epochs
    preds = tmp_path / "pred.npy"
    r = evaluate(synth_store, out / BEST_NAME, batch_size=1000, workers=1, predictions_out=preds)
    assert r["samples"] == 6000
    p = np.load(preds)
    labels = StoreReader(synth_store).labels()
    assert p.shape == (6000,)
    assert r["accuracy"] == pytest.approx(float((p == labels).mean()))
    assert np.array(r["confusion"]).sum() == 6000
    _evaluate_subsets_and_sets(synth_store, out / BEST_NAME, p, tmp_path)


def _evaluate_subsets_and_sets(store: Path, ckpt: Path, preds: np.ndarray, tmp_path: Path) -> None:
    """Classes matched by name (issue 26): a store holding some of the checkpoint's classes in another order, and
    a set of stores, score the samples as the whole store did; a class the checkpoint never saw is one line."""
    from lmdbstore_cli.main import app
    from typer.testing import CliRunner

    from lmdbstore import open_writer

    reader = StoreReader(store)
    names, labels = list(reader.classes), reader.labels()
    keep = np.flatnonzero((labels == 2) | (labels == 0))
    with open_writer(tmp_path / "sub", shape=(25, 25), dtype="float32", classes=[names[2], names[0]]) as w:
        w.append(reader.read_batch(keep), np.where(labels[keep] == 2, 0, 1))
    r = evaluate(tmp_path / "sub", ckpt, workers=0, predictions_out=tmp_path / "sub.npy")
    assert r["classes"] == names and r["samples"] == len(keep)
    np.testing.assert_array_equal(np.load(tmp_path / "sub.npy"), preds[keep])
    assert r["accuracy"] == pytest.approx(float((preds[keep] == labels[keep]).mean()))
    assert [r["per_class_accuracy"][names[c]] is None for c in range(5)] == [False, True, False, True, True]
    both = evaluate([store, tmp_path / "sub"], ckpt, workers=2, predictions_out=tmp_path / "both.npy")
    assert both["samples"] == 6000 + len(keep) and both["stores"] == [str(store), str(tmp_path / "sub")]
    np.testing.assert_array_equal(np.load(tmp_path / "both.npy"), np.r_[preds, preds[keep]])
    cli = CliRunner().invoke(app, ["eval", str(store), str(tmp_path / "sub"), str(ckpt), "--workers", "0", "--json"])
    assert cli.exit_code == 0 and json.loads(cli.stdout)["samples"] == 6000 + len(keep)
    with open_writer(tmp_path / "other", shape=(25, 25), dtype="float32", classes=[names[0], "zzz"]) as w:
        w.append(reader.read_batch(keep[:10]), np.zeros(10, np.int64))
    reader.close()
    with pytest.raises(LmdbStoreError, match=r"classes the checkpoint was not trained on: \[zzz\]"):
        evaluate(tmp_path / "other", ckpt, workers=0)


def test_batch_larger_than_split_is_refused(synth_store: Path) -> None:
    with pytest.raises(ValidationError, match="larger than the training split"):
        _quiet_train(synth_store, None, epochs=1, batch_size=100_000)


def test_balanced_with_an_empty_class_is_refused(tmp_path: Path) -> None:
    from lmdbstore import open_writer

    with open_writer(tmp_path / "s", shape=(8, 8), dtype="float32", classes=["x", "y", "never"]) as w:
        rng = np.random.default_rng(0)
        w.append(rng.standard_normal((300, 8, 8), dtype=np.float32), rng.integers(0, 2, 300))
    with pytest.raises(ValidationError, match="'never' has none"):
        _quiet_train(tmp_path / "s", None, epochs=1, batch_size=32, balanced=True)


def test_missing_and_foreign_stores(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError):
        _quiet_train(tmp_path / "nope", None)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    with pytest.raises(NotAStoreError):
        _quiet_train(tmp_path / "plain", None)


def test_hostile_checkpoint_is_refused(synth_store: Path, tmp_path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    bad = tmp_path / "evil.pt"
    bad.write_bytes(pickle.dumps({"format": 1, "model": Evil()}))
    with pytest.raises(LmdbStoreError, match="cannot load checkpoint"):
        evaluate(synth_store, bad)


# ---------------------------------------------------------------------- every shape and dtype ingest accepts
def _one_epoch(
    store: Path, out: Path | None, workers: int = 0, resume: bool = False, overwrite: bool = False
) -> object:
    cfg = TrainConfig(epochs=1, lr=5e-3, max_steps_per_epoch=3)
    lcfg = LoaderConfig(batch_size=64, workers=workers, persistent_workers=False)
    return train(store, out, cfg, lcfg, resume=resume, log=None, progress=False, overwrite=overwrite)


@pytest.mark.parametrize(
    ("shape", "dtype", "workers"),
    [
        ((25, 25), np.float16, 0),
        ((25, 25), np.float64, 0),
        ((25, 25), np.int16, 0),
        ((25, 25), np.uint16, 0),
        ((3, 16, 16), np.float32, 2),
    ],
)
def test_train_and_evaluate_other_dtypes_and_channels(
    store_factory: Callable[..., StoreInfo], tmp_path: Path, shape: tuple[int, ...], dtype: type, workers: int
) -> None:
    info = store_factory(320, seed=7, shape=shape, dtype=dtype)
    out = tmp_path / "run"
    result = _one_epoch(info.path, out, workers=workers)
    final = result.final  # type: ignore[attr-defined]
    assert final.train_samples == 3 * 64
    assert math.isfinite(final.train_loss) and final.val_loss is not None and math.isfinite(final.val_loss)
    ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    assert ckpt["in_channels"] == (shape[0] if len(shape) == 3 else 1)
    r = evaluate(info.path, out / CHECKPOINT_NAME, batch_size=64, workers=workers)
    assert r["samples"] == 320 and math.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0


def test_batches_move_in_the_store_dtype_and_convert_on_the_device() -> None:
    """float32 images pass without a copy on the CPU; other dtypes become float32 channels-last there."""
    x = torch.randn(8, 1, 25, 25)
    xd, _ = to_device(x, torch.zeros(8, dtype=torch.int64), torch.device("cpu"))
    assert xd.data_ptr() == x.data_ptr()
    for dt in (torch.float16, torch.float64, torch.int16, torch.uint8):
        x3 = torch.ones(8, 3, 16, 16, dtype=dt)
        xd, _ = to_device(x3, torch.zeros(8, dtype=torch.int64), torch.device("cpu"))
        assert xd.dtype == torch.float32 and xd.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xd, x3.float())


def test_checkpoint_of_other_channels_is_refused(store_factory: Callable[..., StoreInfo], tmp_path: Path) -> None:
    gray = store_factory(256, seed=8, name="gray", shape=(16, 16))
    rgb = store_factory(256, seed=9, name="rgb", shape=(3, 16, 16))
    out = tmp_path / "run"
    _one_epoch(gray.path, out)
    with pytest.raises(LmdbStoreError, match=r"1-channel samples of shape \(16, 16\).*3-channel") as err:
        evaluate(rgb.path, out / CHECKPOINT_NAME, workers=0)
    assert "\n" not in str(err.value)
    with pytest.raises(LmdbStoreError, match=r"1-channel.*3-channel") as err:
        _one_epoch(rgb.path, out, resume=True)
    assert "\n" not in str(err.value)


def test_checkpoint_whose_weights_do_not_fit_is_refused(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _one_epoch(small_store.path, out)
    ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    ckpt["width"] = 8  # the weights are of width 16
    torch.save(ckpt, tmp_path / "bad.pt")
    with pytest.raises(LmdbStoreError, match="weights do not fit") as err:
        evaluate(small_store.path, tmp_path / "bad.pt", workers=0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("shape", "words"),
    [((2, 2), "at least 4x4"), ((3, 3, 2), "at least 4x4"), ((64,), "1-D samples"), ((2, 2, 4, 4), "4-D samples")],
)
def test_shapes_the_cnn_cannot_take_are_refused_up_front(
    store_factory: Callable[..., StoreInfo], tmp_path: Path, shape: tuple[int, ...], words: str
) -> None:
    info = store_factory(256, seed=10, shape=shape)
    out = tmp_path / "run"
    with pytest.raises(ValidationError, match=words) as err:
        _one_epoch(info.path, out)
    assert "\n" not in str(err.value) and str(shape) in str(err.value)
    assert not out.exists()  # refused before anything was set up or written
    with pytest.raises(ValidationError, match=words):
        evaluate(info.path, tmp_path / "any.pt", workers=0)


# ---------------------------------------------------------------------- hostile checkpoints, reruns
def _tampered_run(store: Path, out: Path, edit: Callable[[dict[str, object]], object]) -> Path:
    """A one-epoch run in ``out`` whose ``checkpoint.pt`` was then changed by ``edit``."""
    _one_epoch(store, out)
    ckpt = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    edit(ckpt)
    torch.save(ckpt, out / CHECKPOINT_NAME)
    return out


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"width": 10**9}, "width 1000000000 is not in"),
        ({"width": 4096}, "weights do not fit"),  # allowed width, but not the weights' one
        ({"sample_shape": [10**9, 25]}, "sample_shape must be"),
        ({"classes": [str(i) for i in range(70_000)]}, "classes must be"),
        ({"in_channels": 10**9}, "in_channels"),
        ({"width": "16"}, "width '16'"),
        ({"model": [1, 2]}, "model must be a state dict"),
    ],
    ids=lambda c: str(c)[:30],
)
def test_checkpoint_claiming_a_huge_or_odd_model_is_refused_before_building(
    small_store: StoreInfo, tmp_path: Path, change: dict[str, object], words: str
) -> None:
    out = _tampered_run(small_store.path, tmp_path / "run", lambda ckpt: ckpt.update(change))
    with pytest.raises(LmdbStoreError, match=words) as err:
        evaluate(small_store.path, out / CHECKPOINT_NAME, workers=0)
    assert "\n" not in str(err.value)
    with pytest.raises(LmdbStoreError, match=words):
        _one_epoch(small_store.path, out, resume=True)


@pytest.mark.parametrize("key", ["model", "classes", "sample_shape", "width", "optimizer", "epoch", "history"])
def test_checkpoint_missing_a_key_is_one_line(small_store: StoreInfo, tmp_path: Path, key: str) -> None:
    out = _tampered_run(small_store.path, tmp_path / "run", lambda ckpt: ckpt.pop(key))
    with pytest.raises(LmdbStoreError, match=f"no {key}") as err:
        _one_epoch(small_store.path, out, resume=True)
    assert "\n" not in str(err.value)


def test_fresh_run_in_an_old_directory_starts_its_metrics_afresh(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _one_epoch(small_store.path, out)
    with pytest.raises(LmdbStoreError, match="holds an earlier training run"):  # never replaced unasked (issue 35)
        _one_epoch(small_store.path, out)
    _one_epoch(small_store.path, out, overwrite=True)  # not --resume: a new run, not more epochs of the old one
    assert [json.loads(line)["epoch"] for line in (out / METRICS_NAME).read_text().splitlines()] == [1]


def test_resuming_a_finished_run_keeps_its_summary(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _one_epoch(small_store.path, out)
    summary = (out / "summary.json").read_text()
    again = _one_epoch(small_store.path, out, resume=True)  # nothing left to do
    assert (out / "summary.json").read_text() == summary
    assert again.confusion == first.confusion and np.array(again.confusion).sum() > 0  # type: ignore[attr-defined]
    assert len((out / METRICS_NAME).read_text().splitlines()) == 1


class _Started(Exception):
    """Raised from a run's log at its start line."""


@pytest.mark.parametrize(("shuffle", "said"), [("auto", "shuffle random (auto)"), ("window", "shuffle window")])
def test_the_start_line_names_the_shuffle_used(synth_store: Path, shuffle: str, said: str) -> None:
    """``auto`` says what it chose on the start line (issue 21: it said "shuffle auto" after picking window).  The
    run is stopped there: what it trains after that line is other tests' concern."""
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("training on"):
            raise _Started

    cfg = TrainConfig(epochs=1, max_steps_per_epoch=2)
    with pytest.raises(_Started):
        train(synth_store, None, cfg, LoaderConfig(shuffle=shuffle, workers=0), log=log, progress=False)  # type: ignore[arg-type]
    start = lines[-1]
    assert start.endswith(f"{said}, model the built-in CNN(width={cfg.width})")  # and which model (issue 40)


def test_eval_and_resume_keep_the_runs_split_after_the_store_grew(
    store_factory: Callable[..., StoreInfo], tmp_path: Path
) -> None:
    """Issue 39: ``eval --split val`` after the store grew scored trained samples (the split drawn again over the
    grown store), and so did a run resumed at an epoch boundary.  The checkpoint records what its split was
    drawn from: both take exactly the run's samples; another store is one line."""
    info = store_factory(400, shape=(4, 4))
    out, ckpt = tmp_path / "run", tmp_path / "run" / CHECKPOINT_NAME
    lcfg = LoaderConfig(batch_size=100, workers=0)
    train(info.path, out, TrainConfig(epochs=1, val_fraction=40), lcfg, log=None, progress=False)
    train_idx, val_idx = stratified_split(info.y, 40, 0)
    x, y = make_data(400, seed=9, shape=(4, 4))
    with open_writer(info.path) as w:
        w.append(x, y)
    r = evaluate(info.path, ckpt, workers=0, split="val")
    assert r["samples"] == 40 and r["confusion"] == evaluate(info.path, ckpt, workers=0, indices=val_idx)["confusion"]
    assert evaluate(info.path, ckpt, workers=0, split="train")["samples"] == len(train_idx) == 360
    lines: list[str] = []
    resumed = train(info.path, out, TrainConfig(epochs=2, val_fraction=40), lcfg, resume=True, log=lines.append)
    assert (resumed.epochs[-1].train_samples, resumed.epochs[-1].val_samples) == (360, 40)
    assert any("the store grew since the run split its first 400 samples" in line for line in lines)
    with pytest.raises(LmdbStoreError, match=r"held out val_fraction 40 with seed 0, not 0\.1 with seed 0"):
        train(info.path, out, TrainConfig(epochs=3), lcfg, resume=True, log=None, progress=False)
    other = store_factory(800, seed=5, name="other", shape=(4, 4))
    with pytest.raises(LmdbStoreError, match="the store changed since the run split its first 400 samples"):
        evaluate(other.path, ckpt, workers=0, split="val")
