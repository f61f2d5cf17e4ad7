"""PyTorch Lightning with ``strategy="ddp"`` and its defaults, 2 CPU processes (gloo), over make_loader:
Lightning keeps the loader (its sampler shards by rank itself), every rank reads its own disjoint share,
every sample once per epoch, a new order every epoch.  Skipped without pytorch_lightning."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS, StoreInfo

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over loopback tested on Linux"),
]


def test_ddp_with_the_defaults_reads_disjoint_shares_in_a_new_order_each_epoch_and_resumes_exactly(
    small_store: StoreInfo, tmp_path: Path
) -> None:
    """Lightning DDP (2 gloo processes): every rank reads its own disjoint share, every sample once per epoch, a
    new order every epoch; checkpointed inside an epoch and resumed (issue 33), each rank trains exactly the
    batches of its share it had not trained, in order, then the next epoch whole."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    script = TESTS / "frameworks" / "lightning_ddp.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(small_store.path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "inject" not in proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    orders = []
    for epoch in ("0", "1", "2"):
        shares = [[i for b in rank["full"][epoch] for i in b] for rank in ranks]
        assert len(ranks[0]["full"][epoch]) == len(ranks[1]["full"][epoch]) == 20  # 2000 samples, batches of 50
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(2000))
        orders.append(shares[0])
    assert orders[0] != orders[1] != orders[2]
    for rank in ranks:
        full, resumed = rank["full"], rank["resumed"]
        assert list(resumed) == ["1", "2"]
        assert full["1"][:8] + resumed["1"] == full["1"]  # the rest of epoch 2, each batch once, in order
        assert resumed["2"] == full["2"]


def test_a_mid_epoch_checkpoint_resumes_exactly_the_batches_not_trained(small_store: StoreInfo, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    script = TESTS / "frameworks" / "lightning_resume.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(small_store.path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert not [w for w in result["warnings"] if "not resumable" in w]  # Lightning takes the loader as resumable
    (state,) = result["loader_state"]  # the loader's own state, in Lightning's checkpoint
    assert (state["epoch"], state["position"]) == (1, 9)  # the batches trained, not those the workers drew
    full, resumed = result["full"], result["resumed"]
    assert list(resumed) == ["1"]  # the resumed run trains the rest of epoch 2 only
    assert full["1"][:9] + resumed["1"] == full["1"]  # the epoch's batches, each once, in order
    assert sorted(i for b in full["1"][:9] + resumed["1"] for i in b) == list(range(2000))
