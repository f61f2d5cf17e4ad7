"""The run's order is fixed once (lmdbstore/training/order.py): ``shuffle="auto"``'s choice and the window's
size depend on the memory free when they are made, so a run killed and resumed on a machine whose free memory
moved on must still draw the killed run's epochs (found at 40M samples: the resumed run refused its own
checkpoint, "written inside an epoch by another sampler").  Free memory is stood in for by replacing what
lmdbstore reads it through; the store, the loaders and the training are real."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from lmdbstore import LmdbStoreError
from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.errors import TrainingInterrupted
from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader import window
from lmdbstore.loader.window import default_window_bytes
from lmdbstore.training import order as order_module
from lmdbstore.training.checkpoint import atomic_save, load_checkpoint
from lmdbstore.training.order import Order
from lmdbstore.training.trainer import train
from lmdbstore.util.runfiles import CHECKPOINT_NAME

CFG = TrainConfig(epochs=2, width=4, device="cpu", checkpoint_every=2)
LCFG = LoaderConfig(batch_size=100, workers=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("order") / "store"
    ingest_synthetic(path, 1200, seed=7)  # 3 MB of samples: a window of 0.2-0.3 MB makes ~10-15 windows
    return path


def _machine(monkeypatch: pytest.MonkeyPatch, free: int, window_bytes: int) -> None:
    """This process's view of the machine: ``free`` bytes available (auto picks window below the store's size)
    and ``window_bytes`` as the default window (an eighth of ``free`` on a real machine, at least 64 MiB)."""
    monkeypatch.setattr(window, "available_memory", lambda: free)
    monkeypatch.setattr(order_module, "default_window_bytes", lambda: window_bytes)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / CHECKPOINT_NAME)["model"]


def test_a_resumed_run_keeps_the_order_auto_chose_and_the_window_size(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _machine(monkeypatch, 1 << 20, 250_000)  # 1 MiB free: the 3 MB store exceeds the page cache: window
    full = train(store, tmp_path / "full", CFG, LCFG, log=None, progress=False)
    recorded = Order.from_json(load_checkpoint(tmp_path / "full" / CHECKPOINT_NAME)["order"])
    assert recorded == Order("window", 250_000)
    steps = itertools.count(1)
    with pytest.raises(TrainingInterrupted):
        train(store, tmp_path / "cut", CFG, LCFG, log=None, progress=False, stop=lambda: next(steps) == 5)
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)["step"] == 5  # inside the first epoch
    _machine(monkeypatch, 1 << 40, 310_000)  # free memory moved on: auto would pick random, another window
    said: list[str] = []
    resumed = train(store, tmp_path / "cut", CFG, LCFG, log=said.append, progress=False, resume=True)
    assert "shuffle: window (the order the checkpoint's run chose)" in said
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the epochs the killed run would have drawn
    assert [m.train_samples for m in resumed.epochs] == [m.train_samples for m in full.epochs]


def test_a_checkpoint_without_the_order_is_refused_inside_an_epoch_not_resumed_in_another(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of an earlier version (no ``order``): the window made again from today's memory is another
    sampler, and the resume says so in one line rather than draw other batches."""
    _machine(monkeypatch, 1 << 20, 250_000)
    steps = itertools.count(1)
    with pytest.raises(TrainingInterrupted):
        train(store, tmp_path / "cut", CFG, LCFG, log=None, progress=False, stop=lambda: next(steps) == 3)
    ckpt = load_checkpoint(tmp_path / "cut" / CHECKPOINT_NAME)
    del ckpt["order"]
    atomic_save(ckpt, tmp_path / "cut" / CHECKPOINT_NAME)
    _machine(monkeypatch, 1 << 20, 310_000)
    with pytest.raises(LmdbStoreError, match=r"written inside an epoch by another sampler.*window_samples"):
        train(store, tmp_path / "cut", CFG, LCFG, log=None, progress=False, resume=True)


def test_what_the_user_names_wins_over_the_record(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 1 << 20, 250_000)
    train(store, tmp_path / "run", TrainConfig(epochs=1, width=4, device="cpu"), LCFG, log=None, progress=False)
    again = TrainConfig(epochs=2, width=4, device="cpu")
    train(store, tmp_path / "run", again, LoaderConfig(batch_size=100, workers=0, shuffle="block"), log=None,
          progress=False, resume=True)  # fmt: skip
    assert json.loads(load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)["order"]) == {
        "shuffle": "block", "window_bytes": None,
    }  # fmt: skip


def test_the_default_window_is_a_power_of_two_of_an_eighth_of_free_memory() -> None:
    gib = 1 << 30
    assert default_window_bytes(16 * gib) == 2 * gib
    assert default_window_bytes(23 * gib) == default_window_bytes(22 * gib + 12_345) == 2 * gib  # one size
    assert default_window_bytes(0) == 64 << 20


@pytest.mark.parametrize("text", ['{"shuffle": "sideways"}', '{"shuffle": "window", "window_bytes": -1}', "[]"])
def test_a_malformed_order_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Order.from_json(text)
