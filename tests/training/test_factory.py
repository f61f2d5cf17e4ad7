"""The user's own model (issue 35): ``train --model FILE.py:FUNC`` / ``module:FUNC`` with ``--model-arg``, the same
weights as a hand-written loop, resume inside an epoch, eval, mismatches, failing models, optimizers, compile (and
under torchrun: test_distributed.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO, StoreInfo, one_error_line, run_cli

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.errors import TrainingInterrupted
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import EpochBatchSampler, stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.checkpoint import load_checkpoint
from lmdbstore.training.evaluate import evaluate
from lmdbstore.training.trainer import WARMUP_SHARE, train
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

MY_CNN = REPO / "examples" / "my_cnn.py"
FACTORY = f"{MY_CNN}:build"
BATCH = 100


def _cfg(**kw: object) -> TrainConfig:
    base: dict[str, object] = {"epochs": 2, "lr": 5e-3, "model": FACTORY, "model_args": {"width": 8}}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def _lcfg() -> LoaderConfig:
    return LoaderConfig(batch_size=BATCH, workers=0, shuffle="random", persistent_workers=False)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]  # type: ignore[no-any-return]


def _my_cnn() -> Any:
    """examples/my_cnn.py, imported as a user's script would import it."""
    sys.path.insert(0, str(MY_CNN.parent))
    try:
        import my_cnn
    finally:
        sys.path.remove(str(MY_CNN.parent))
    return my_cnn


def _hand_written(store: Path, epochs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same model and recipe in a loop written with the public pieces: the trainer's split, order
    (``EpochBatchSampler`` random, seed + epoch), AdamW under a one-cycle schedule, channels-last on the CPU."""
    my_cnn = _my_cnn()
    with StoreReader(store) as r:
        labels, spv = r.labels(), r.meta.samples_per_value
    train_idx, _ = stratified_split(labels, 0.1, seed)
    torch.manual_seed(seed)
    model = my_cnn.build((1, 25, 25), 5, width=8).to(memory_format=torch.channels_last)
    sampler = EpochBatchSampler(train_idx, BATCH, shuffle="random", seed=seed, samples_per_value=spv)
    loader = make_loader(LmdbBatchDataset(store), sampler, LoaderConfig(batch_size=BATCH, workers=0))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 5e-3, total_steps=epochs * len(sampler), pct_start=WARMUP_SHARE)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _val_accuracy(model: torch.nn.Module, store: Path, seed: int = 0) -> float:
    with StoreReader(store) as r:
        labels = r.labels()
    _, val_idx = stratified_split(labels, 0.1, seed)
    ds = LmdbBatchDataset(store)
    x, y = ds[np.sort(val_idx)]
    model.eval()
    with torch.no_grad():
        return float((model(x.contiguous(memory_format=torch.channels_last)).argmax(1) == y).float().mean())


def test_train_with_a_user_model_gives_the_hand_written_loops_weights(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ingest_synthetic(store, 2000, seed=3)  # learnable: the accuracies mean something
    out = tmp_path / "run"
    res = train(store, out, _cfg(), _lcfg(), log=None, progress=False)
    ours = _weights(out / CHECKPOINT_NAME)
    theirs = _hand_written(store, epochs=2)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k  # bit-identical: same order, same steps, same recipe
    model = _my_cnn().build((1, 25, 25), 5, width=8).to(memory_format=torch.channels_last)
    model.load_state_dict(theirs)
    assert res.final.val_accuracy is not None and res.final.val_accuracy > 0.5
    assert _val_accuracy(model, store) == pytest.approx(res.final.val_accuracy, abs=1e-6)  # the same accuracy
    ckpt = load_checkpoint(out / CHECKPOINT_NAME)
    assert ckpt["model_factory"] == "my_cnn:build" and json.loads(ckpt["model_args"]) == {"width": 8}
    assert ckpt["in_shape"] == [1, 25, 25]
    # eval rebuilds it from the factory the caller names, with the checkpoint's arguments
    r = evaluate(store, out / CHECKPOINT_NAME, workers=0, model=FACTORY, split="val")
    assert r["samples"] == 200 and r["accuracy"] == pytest.approx(res.final.val_accuracy)


def test_resume_inside_an_epoch_with_a_user_model_ends_as_the_uninterrupted_run(
    small_store: StoreInfo, tmp_path: Path
) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(small_store.path, whole, _cfg(), _lcfg(), log=None, progress=False)
    calls = iter(range(10**6))
    with pytest.raises(TrainingInterrupted) as err:  # stop after the 5th step of the first epoch (a Ctrl-C)
        train(small_store.path, cut, _cfg(), _lcfg(), log=None, progress=False, stop=lambda: next(calls) == 4)
    assert (err.value.epoch, err.value.step, err.value.checkpoint) == (1, 5, cut / CHECKPOINT_NAME)
    assert load_checkpoint(cut / CHECKPOINT_NAME)["step"] == 5
    # the CLI resumes it: --model and --model-arg as the first run had them
    args = ["train", small_store.path, "--out", cut, "--resume", "--epochs", "2", "--lr", "5e-3", "--batch", BATCH]
    done = run_cli(*args, "--workers", 0, "--shuffle", "random", "--model", FACTORY, "--model-arg", "width=8")
    assert done.exit_code == 0, done.stderr
    assert "resuming epoch 1 after its step 5" in done.stdout
    assert f"model {FACTORY}(width=8)" in done.stdout  # the plan line says which model it trains (issue 40)
    a, b = _weights(whole / CHECKPOINT_NAME), _weights(cut / CHECKPOINT_NAME)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_of_another_model_is_one_line(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(small_store.path, out, _cfg(epochs=1, max_steps_per_epoch=2), _lcfg(), log=None, progress=False)
    ckpt = out / CHECKPOINT_NAME
    cases = [
        ([], "holds a model of factory my_cnn:build", "--model"),  # its code is never imported on its word
        (["--model", "lmdbstore.training.model:build_cnn"], "not lmdbstore.training.model:build_cnn", "--model"),
        (["--model", FACTORY, "--model-arg", "width=9"], 'built with model_args {"width": 8}', "--model-arg"),
    ]
    for extra, words, flag in cases:
        line = one_error_line(run_cli("eval", small_store.path, ckpt, "--workers", 0, *extra))
        assert words in line and flag in line and "model_args=" not in line, line
    # resuming with other arguments is refused too, before anything is trained
    resume = ["train", small_store.path, "--out", out, "--resume", "--batch", BATCH]
    line = one_error_line(run_cli(*resume, "--model", FACTORY, "--model-arg", "width=4"))
    assert 'model_args {"width": 8}, not {"width": 4}' in line
    # the built-in CNN's run does not resume a user model's checkpoint either
    assert "not lmdbstore.training.model:build_cnn" in one_error_line(run_cli(*resume))


BROKEN = """
import torch
from torch import nn

class Boom(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.lin = nn.Linear(625, classes)
    def forward(self, x):
        raise RuntimeError("boom in forward")

class Wrong(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.lin = nn.Linear(625, classes + 1)
    def forward(self, x):
        return self.lin(x.flatten(1))

def boom(in_shape, classes):
    return Boom(classes)

def wrong_logits(in_shape, classes):
    return Wrong(classes)

def raises(in_shape, classes):
    raise KeyError("no such layer")

def not_a_module(in_shape, classes):
    return 42
"""


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("boom", "raised in forward on a batch of shape (100, 1, 25, 25): RuntimeError: boom in forward"),
        ("wrong_logits", "returned shape (100, 6) for a batch of shape (100, 1, 25, 25); logits of shape (100, 5)"),
        ("raises", "model factory raised KeyError: 'no such layer' (called with in_shape (1, 25, 25), classes 5"),
        ("not_a_module", "model factory returned a int, not a torch.nn.Module"),
        ("missing", "the model module has no function 'missing'"),
    ],
)
def test_a_failing_user_model_is_one_line_naming_its_factory(
    small_store: StoreInfo, tmp_path: Path, ref: str, words: str
) -> None:
    (tmp_path / "broken.py").write_text(BROKEN)
    factory = f"{tmp_path / 'broken.py'}:{ref}"
    res = run_cli(
        "train", small_store.path, "--out", tmp_path / "run", "--model", factory, "--batch", BATCH, "--workers", 0
    )
    line = one_error_line(res)
    assert res.exit_code == 1 and words in line and factory in line, line


def test_model_references_that_cannot_load(small_store: StoreInfo, tmp_path: Path) -> None:
    base = ["train", small_store.path, "--out", tmp_path / "run", "--workers", 0, "--batch", BATCH]
    (tmp_path / "syntax.py").write_text("def build(:\n")
    cases = [
        (["--model", "nomodule_xyz:build"], "cannot import model module 'nomodule_xyz' (ModuleNotFoundError"),
        (["--model", f"{tmp_path / 'none.py'}:build"], "no such model file"),
        (["--model", f"{tmp_path / 'syntax.py'}:build"], "loading the model file raised SyntaxError"),
        (["--model", "justaname"], "model must be 'module:function' or 'path/to/file.py:function'"),
        (["--model-arg", "width=3"], "--model-arg needs --model"),
        (["--model", FACTORY, "--model-arg", "novalue"], "--model-arg must be NAME=VALUE"),
        (["--model", FACTORY, "--width", "8"], "width is the built-in CNN's argument"),
        (["--optimizer", "lion"], "optimizer must be one of 'adamw', 'sgd'"),
        (["--label-smoothing", "1.5"], "label_smoothing must be in [0, 1)"),
    ]
    for extra, words in cases:
        assert words in one_error_line(run_cli(*base, *extra)), extra
    assert not (tmp_path / "run" / CHECKPOINT_NAME).exists()


def test_a_module_reference_imports_from_the_current_directory(small_store: StoreInfo, tmp_path: Path) -> None:
    """``lmdbstore train --model my_cnn:build`` run where my_cnn.py lies (the console script's sys.path lacks it)."""
    shutil.copy(MY_CNN, tmp_path / "my_cnn.py")
    cmd = [sys.executable, "-c", "from lmdbstore_cli.main import main; main()"]
    args = ["train", str(small_store.path), "--out", "run", "--epochs", "1", "--max-steps", "2", "--batch", str(BATCH)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*cmd, *args, "--model", "my_cnn:build", "--model-arg", "width=4", "--optimizer", "sgd", "--label-smoothing",
         "0.1", "--weight-decay", "0.01", "--json"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ckpt = load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)
    assert ckpt["model_factory"] == "my_cnn:build"  # the identity: the same as examples/my_cnn.py:build
    recorded = json.loads(ckpt["train_config"])
    assert (recorded["optimizer"], recorded["label_smoothing"], recorded["weight_decay"]) == ("sgd", 0.1, 0.01)
    assert "momentum_buffer" in next(iter(ckpt["optimizer"]["state"].values()))  # SGD's state, not AdamW's
    r = evaluate(small_store.path, tmp_path / "run" / CHECKPOINT_NAME, workers=0, model=FACTORY)
    assert r["samples"] == 2000


def test_compile_is_refused_in_one_line_without_a_cpu_compiler(
    small_store: StoreInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, c++ or clang++ to be found
    monkeypatch.setenv("CXX", "")
    res = run_cli("train", small_store.path, "--out", tmp_path / "run", "--compile", "--batch", "100")
    assert res.exit_code == 1 and "--compile needs a C++ compiler for torch.compile on the CPU" in one_error_line(res)


#: A model of one linear layer: inductor builds one C++ kernel for it (the bias gradient's sum; the matrix products
#: call the BLAS), where examples/my_cnn.py takes a dozen, each a g++ run of seconds (most of what compiling costs).
TINY = """
from torch import nn

def build(in_shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_shape[0] * in_shape[1] * in_shape[2], classes))
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_compile_trains_on_the_cpu(small_store: StoreInfo, tmp_path: Path) -> None:
    """``compile=True``: the steps and the validations run through ``torch.compile`` (inductor's C++ kernels), the
    checkpoints hold the bare model's weights, and the best one evaluates."""
    (tmp_path / "tiny.py").write_text(TINY)
    factory = f"{tmp_path / 'tiny.py'}:build"
    out = tmp_path / "run"
    cfg = TrainConfig(epochs=1, lr=5e-3, model=factory, max_steps_per_epoch=3, compile=True)
    res = train(small_store.path, out, cfg, _lcfg(), log=None)
    assert res.final.train_samples == 3 * BATCH and np.isfinite(res.final.train_loss)
    assert not any(k.startswith("_orig_mod") for k in _weights(out / CHECKPOINT_NAME))  # the bare model's weights
    assert evaluate(small_store.path, out / BEST_NAME, workers=0, model=factory)["samples"] == 2000
