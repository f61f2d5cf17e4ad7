"""Distributed training with torchrun, the gloo backend and 2 CPU processes (real process groups)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_store, make_data

from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo over loopback tested on Linux")

RANK_SCRIPT = r"""
import json, sys
import numpy as np
import torch.distributed as dist
from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler

store, out, mode, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ds = LmdbBatchDataset(store)
sampler = EpochBatchSampler(np.arange(len(ds)), 100, shuffle=mode, samples_per_value=18, seed=7,
                            rank=rank, world_size=world)
loader = make_loader(ds, sampler, LoaderConfig(batch_size=100, workers=workers))
per_epoch = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    seen, steps = [], 0
    for x, y in loader:
        seen.extend(x[:, 0, 0, 0].round().long().tolist())  # first pixel encodes the index
        steps += 1
    per_epoch.append({"seen": seen, "steps": steps})
gathered = [None] * world
dist.all_gather_object(gathered, per_epoch)
if rank == 0:
    with open(out, "w") as fh:
        json.dump(gathered, fh)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["random", "block"])
def test_each_rank_reads_a_disjoint_share_exactly_once(tmp_path: Path, mode: str) -> None:
    x, y = make_data(1237, seed=5)
    store = build_store(tmp_path / "store", x, y)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "seen.json"
    proc = _torchrun([str(script), str(store), str(out), mode, "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for epoch in range(2):
        shares = [ranks[r][epoch]["seen"] for r in range(2)]
        assert ranks[0][epoch]["steps"] == ranks[1][epoch]["steps"]  # DDP needs equal step counts
        assert not set(shares[0]) & set(shares[1])
        combined = sorted(shares[0] + shares[1])
        assert combined == list(range(1237))  # every sample exactly once
    assert ranks[0][0]["seen"] != ranks[0][1]["seen"]  # a new order each epoch


def test_torchrun_train_cli_with_gloo(tmp_path: Path) -> None:
    """``lmdbstore train`` under torchrun, 2 processes: metrics reduced over the ranks and written once, rank 0's
    JSON on stdout; with --val-limit 1 (batch per process) and --val-every 5 each validation reads 1 batch on each
    rank (they are compared after every validation: unequal counts fail the run) and 256 samples in all."""
    store = tmp_path / "store"
    ingest_synthetic(store, 3000, seed=1)
    out = tmp_path / "run"
    args = ["-m", "lmdbstore", "train", str(store), "--batch", "128", "--epochs", "2", "--workers", "1"]
    proc = _torchrun([*args, "--val-limit", "1", "--val-every", "5", "--out", str(out), "--no-progress", "--json"],
                     REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]  # written once (rank 0), not once per rank
    train_idx, val_idx = stratified_split(StoreReader(store).labels(), 0.1, 0)
    # metrics are reduced over both ranks: together they saw the whole training split once per epoch
    assert all(m["train_samples"] == len(train_idx) for m in lines)
    assert "training on cpu (2 process(es))" in proc.stderr  # --json: the lines go to stderr
    assert f"validates 256 of {len(val_idx)} samples (1 batch(es) a process)" in proc.stderr
    final = json.loads(proc.stdout)  # and stdout is rank 0's one JSON document
    assert np.array(final["confusion"]).sum() == 256  # the limited validation, both ranks
    assert (out / "checkpoint.pt").is_file()
    steps = -(-len(train_idx) // 256)  # 128 a batch on each of 2 ranks
    for m in lines:
        assert (m["val_samples"], m["val_batches"]) == (256, 1)
        within = range(steps * (m["epoch"] - 1) + 1, steps * m["epoch"])
        assert [v["step"] for v in m["validations"]] == [s for s in within if s % 5 == 0]
        assert all((v["samples"], v["batches"]) == (256, 1) for v in m["validations"])
