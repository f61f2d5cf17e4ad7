"""The Keras PyDataset and the tf.data factory with the real packages (the ``frameworks`` test extra), each
check in a process of its own (framework_checks.py): TensorFlow must not be loaded into the test process,
where later tests fork DataLoader workers.  Skipped when the package is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, TESTS, StoreInfo, damage_store

CHECKS = TESTS / "frameworks" / "framework_checks.py"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _run(check: str, store: Path, backend: str) -> None:
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(CHECKS), check, str(store)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and f"OK {check}" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not _installed("tensorflow"), reason="tensorflow is not installed (lmdbstore[frameworks])")
def test_tf_dataset(small_store: StoreInfo) -> None:
    _run("tf", small_store.path, "tensorflow")


@pytest.mark.skipif(not _installed("tensorflow"), reason="tensorflow is not installed (lmdbstore[frameworks])")
def test_tf_dataset_raises_the_stores_own_error(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(3000)
    damage_store(info.path, "garble_leaf")
    _run("tf_error", info.path, "tensorflow")


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_keras_dataset_under_model_fit(small_store: StoreInfo, backend: str) -> None:
    if not _installed("keras") or not _installed(backend):
        pytest.skip(f"keras or {backend} is not installed (lmdbstore[frameworks])")
    _run("keras", small_store.path, backend)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_model_fit_on_make_loader_gets_a_new_order_every_epoch(small_store: StoreInfo, backend: str) -> None:
    if not _installed("keras") or not _installed(backend):
        pytest.skip(f"keras or {backend} is not installed (lmdbstore[frameworks])")
    _run("keras_make_loader", small_store.path, backend)
