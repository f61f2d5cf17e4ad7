"""torch only where torch is used: in processes where ``import torch`` fails (a ``sys.meta_path`` finder
refuses it, as if it were not installed), ingest, stats, verify, export, copy, synth and the pictures work,
so do the samplers and the Keras (TensorFlow backend) and tf.data adapters, and ``train``/``eval``/``demo``
and the torch names of the library say in one line which extra to install."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, StoreInfo

#: Makes ``import torch`` fail in the process, the way it fails when torch is not installed.
NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""

CLI = (
    NO_TORCH
    + """
sys.argv = ["lmdbstore", *sys.argv[1:]]
from lmdbstore_cli.main import main
main()
"""
)

#: Runs each command of the JSON list ``argv[1]`` in turn in this one process, then prints their exit statuses.
CLI_COMMANDS = (
    NO_TORCH
    + """
import json
from lmdbstore_cli.main import main
codes = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["lmdbstore", *argv]
    try:
        main()
    except SystemExit as exc:
        codes.append(exc.code)
print("EXIT", json.dumps(codes))
"""
)

LIBRARY = (
    NO_TORCH
    + """
import numpy as np
import lmdbstore
store = sys.argv[1]
s = lmdbstore.EpochBatchSampler(np.arange(10), 4)
assert [len(b) for b in s] == [4, 4, 2]
try:
    lmdbstore.train
except ImportError as exc:
    print("train:", exc)
print("torch" in sys.modules)
"""
)

FRAMEWORKS = (
    NO_TORCH
    + """
import lmdbstore
store = sys.argv[1]
if __name__ == "__main__":
    ds = lmdbstore.keras_dataset(store, split="train", batch_size=256, workers=2)
    n = sum(len(y) for _, y in ds)
    t = lmdbstore.tf_dataset(store, split="val", batch_size=256, workers=1)
    m = sum(len(y) for _, y in t)
    print(n, m, "torch" in sys.modules)
"""
)


def _run(code: str, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=full_env, cwd=REPO,
        timeout=300,
    )  # fmt: skip


def test_the_commands_that_need_no_torch_work_without_it(small_store: StoreInfo, tmp_path: Path) -> None:
    store = small_store.path
    commands = [
        ("ingest", tmp_path / "new", "--synthetic", "600"),
        ("stats", store),
        ("verify", store),
        ("export", store, tmp_path / "out.npz", "--split", "val"),
        ("copy", store, tmp_path / "copy"),
        ("synth", tmp_path / "d.npz", "-n", "100"),
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        commands.append(("show", store, "-o", tmp_path / "s.png", "--per-class", "1", "--dpi", "20"))
    r = _run(CLI_COMMANDS, json.dumps([[str(a) for a in cmd] for cmd in commands]))  # one process: one start
    assert r.returncode == 0, r.stderr
    exits = json.loads(r.stdout.splitlines()[-1].removeprefix("EXIT "))
    assert exits == [0] * len(commands), (list(zip(commands, exits, strict=True)), r.stderr)
    assert (tmp_path / "out.npz").is_file() and (tmp_path / "copy" / "data.mdb").is_file()


@pytest.mark.parametrize("command", [["train"], ["eval", "CKPT"], ["demo"]])
def test_train_eval_and_demo_name_the_extra_in_one_line(
    small_store: StoreInfo, tmp_path: Path, command: list[str]
) -> None:
    args = (
        [small_store.path, tmp_path / "ckpt.pt"]
        if command[0] == "eval"
        else []
        if command[0] == "demo"
        else [small_store.path]
    )
    r = _run(CLI, command[0], *args, *(["--dir", tmp_path / "d"] if command[0] == "demo" else []))
    assert r.returncode == 1
    err = r.stderr.strip()
    assert err.count("\n") == 0 and f"{command[0]} needs PyTorch" in err and "lmdbstore[torch]" in err
    assert not (tmp_path / "d").exists()  # nothing was started


def test_the_library_without_torch(small_store: StoreInfo) -> None:
    r = _run(LIBRARY, small_store.path)
    assert r.returncode == 0, r.stderr
    assert "train: lmdbstore.train needs torch" in r.stdout and "lmdbstore[torch]" in r.stdout
    assert r.stdout.strip().endswith("False")


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="needs tensorflow and keras (lmdbstore[frameworks])",
)
def test_keras_and_tf_data_without_torch(small_store: StoreInfo) -> None:
    r = _run(FRAMEWORKS, small_store.path, env={"KERAS_BACKEND": "tensorflow"})
    assert r.returncode == 0, r.stderr[-3000:]
    n_train, n_val, torch_loaded = r.stdout.split()
    assert int(n_train) + int(n_val) == 2000 and torch_loaded == "False"
