"""The public API in ``lmdbstore/__init__.py``: every name in ``__all__`` resolves, and importing the package
(and writing a store through it) does not import torch or matplotlib."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as ROOT

import lmdbstore


def test_every_public_name_resolves() -> None:
    missing = [name for name in lmdbstore.__all__ if getattr(lmdbstore, name, None) is None]
    assert missing == []
    assert len(set(lmdbstore.__all__)) == len(lmdbstore.__all__)


def test_torch_names_resolve_to_the_torch_modules() -> None:
    from lmdbstore.frameworks.torch_data import make_loader
    from lmdbstore.loader.window import WindowBatchSampler

    assert lmdbstore.make_loader is make_loader
    assert lmdbstore.WindowBatchSampler is WindowBatchSampler


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        lmdbstore.no_such_name  # noqa: B018


def test_import_and_writing_do_not_import_torch_or_matplotlib(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, lmdbstore\n"
        f"with lmdbstore.open_writer({str(tmp_path / 's')!r}, shape=(3, 3), dtype='float32', classes=['a', 'b']) as w:\n"
        "    w.append(np.zeros((4, 3, 3), np.float32), np.array([0, 1, 0, 1]))\n"
        "with lmdbstore.open_reader(" + repr(str(tmp_path / "s")) + ") as r:\n"
        "    assert len(r) == 4\n"
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_train_is_the_trainer_function_and_evaluate_its_scorer() -> None:
    from lmdbstore.training.evaluate import evaluate
    from lmdbstore.training.trainer import TrainResult, train

    assert lmdbstore.train is train and callable(lmdbstore.train)
    assert lmdbstore.evaluate is evaluate
    assert lmdbstore.TrainResult is TrainResult


def test_stratified_split_is_public_and_torch_free() -> None:
    code = (
        "import sys\n"
        "from lmdbstore import stratified_split\n"
        "import numpy as np\n"
        "train, val = stratified_split(np.repeat(np.arange(4), 25), 0.2, seed=1)\n"
        "print(len(train), len(val), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["80", "20", "False"]
