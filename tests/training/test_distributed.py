"""Distributed training with torchrun, the gloo backend and 2 CPU processes (real process groups).

One ``torchrun --nproc_per_node 2`` serves every test here (each launch starts three interpreters importing
torch): in each rank, ``lmdbstore train`` as ``torchrun -m lmdbstore train`` runs it (tests/cli_runs.py), with the
built-in CNN, then with a user's model (the first run joins the process group itself), each run's outputs in
files of their own; then the samplers' shares through real DataLoader workers, in both orders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TESTS, build_store, make_data

from lmdbstore.ingestion.pipeline import ingest_synthetic
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.reader import StoreReader
from lmdbstore.training.evaluate import evaluate
from lmdbstore.util.runfiles import CHECKPOINT_NAME

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over loopback tested on Linux"),
    pytest.mark.slow,  # the one torchrun job every test here shares: ~12-15 s of CPU
]

MY_CNN = REPO / "examples" / "my_cnn.py"
FACTORY = f"{MY_CNN}:build"
MODES = ("random", "block")

#: What each rank runs: ``lmdbstore`` once per line of ``runs.json`` (name, arguments); then each order's shares
#: of the samplers (the first pixel of a sample encodes its index), gathered into ``seen-ORDER.json``.
RANK_SCRIPT = r"""
import json, os, sys
import numpy as np
import torch.distributed as dist
from cli_runs import cli

for name, argv in json.load(open("runs.json")):
    if cli(f"{name}.{os.environ['RANK']}", argv):  # a failed run ends the rank (torchrun then stops the other)
        sys.exit(f"{name} failed on rank {os.environ['RANK']}")

from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler

for mode in ("random", "block"):
    ds = LmdbBatchDataset(sys.argv[1])
    sampler = EpochBatchSampler(np.arange(len(ds)), 100, shuffle=mode, samples_per_value=18, seed=7,
                                rank=dist.get_rank(), world_size=dist.get_world_size())
    loader = make_loader(ds, sampler, LoaderConfig(batch_size=100, workers=2))
    per_epoch = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen, steps = [], 0
        for x, y in loader:
            seen.extend(x[:, 0, 0, 0].round().long().tolist())
            steps += 1
        per_epoch.append({"seen": seen, "steps": steps})
    del loader
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_epoch)
    if dist.get_rank() == 0:
        with open(f"seen-{mode}.json", "w") as fh:
            json.dump(gathered, fh)
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Launch:
    """The torchrun job's directory (each run's ``NAME.RANK.out``/``.err``) and its stores."""

    dir: Path
    synth: Path  # 3,000 samples of the learnable synthetic set
    small: Path  # 2,000 samples, as ``small_store``

    def out(self, name: str, rank: int) -> str:
        return (self.dir / f"{name}.{rank}.out").read_text()

    def err(self, name: str, rank: int) -> str:
        return (self.dir / f"{name}.{rank}.err").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The stores, then the one torchrun job (RANK_SCRIPT) every test here reads the results of."""
    base = tmp_path_factory.mktemp("ddp")
    x, y = make_data(1237, seed=5)
    shares = build_store(base / "shares", x, y)
    ingest_synthetic(base / "synth", 3000, seed=1)
    x, y = make_data(2000, seed=1234)
    small = build_store(base / "small", x, y)
    runs = [
        ("builtin", ["train", base / "synth", "--batch", 128, "--epochs", 2, "--workers", 1, "--val-limit", 1,
                     "--val-every", 5, "--out", base / "builtin-run", "--no-progress", "--json"]),
        ("user", ["train", small, "--out", base / "user-run", "--epochs", 1, "--batch", 100, "--workers", 0,
                  "--model", FACTORY, "--model-arg", "width=8", "--json"]),
    ]  # fmt: skip
    (base / "runs.json").write_text(json.dumps([(name, [str(a) for a in argv]) for name, argv in runs]))
    (base / "rank.py").write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(base / "rank.py"), str(shares)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    proc = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(base.glob("*.err")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    return Launch(base, base / "synth", small)


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_reads_a_disjoint_share_exactly_once(launch: Launch, mode: str) -> None:
    ranks = json.loads((launch.dir / f"seen-{mode}.json").read_text())
    assert len(ranks) == 2
    for epoch in range(2):
        shares = [ranks[r][epoch]["seen"] for r in range(2)]
        assert ranks[0][epoch]["steps"] == ranks[1][epoch]["steps"]  # DDP needs equal step counts
        assert not set(shares[0]) & set(shares[1])
        combined = sorted(shares[0] + shares[1])
        assert combined == list(range(1237))  # every sample exactly once
    assert ranks[0][0]["seen"] != ranks[0][1]["seen"]  # a new order each epoch


def test_torchrun_train_cli_with_gloo(launch: Launch) -> None:
    """``lmdbstore train`` under torchrun, 2 processes: metrics reduced over the ranks and written once, rank 0's
    JSON on stdout; with --val-limit 1 (batch per process) and --val-every 5 each validation reads 1 batch on each
    rank (they are compared after every validation: unequal counts fail the run) and 256 samples in all."""
    store, out = launch.synth, launch.dir / "builtin-run"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]  # written once (rank 0), not once per rank
    train_idx, val_idx = stratified_split(StoreReader(store).labels(), 0.1, 0)
    # metrics are reduced over both ranks: together they saw the whole training split once per epoch
    assert all(m["train_samples"] == len(train_idx) for m in lines)
    stderr = launch.err("builtin", 0)
    assert "training on cpu (2 process(es))" in stderr  # --json: the lines go to stderr
    assert f"validates 256 of {len(val_idx)} samples (1 batch(es) a process)" in stderr
    final = json.loads(launch.out("builtin", 0))  # and stdout is rank 0's one JSON document
    assert launch.out("builtin", 1) == ""  # the other rank prints nothing
    assert np.array(final["confusion"]).sum() == 256  # the limited validation, both ranks
    assert (out / "checkpoint.pt").is_file()
    steps = -(-len(train_idx) // 256)  # 128 a batch on each of 2 ranks
    for m in lines:
        assert (m["val_samples"], m["val_batches"]) == (256, 1)
        within = range(steps * (m["epoch"] - 1) + 1, steps * m["epoch"])
        assert [v["step"] for v in m["validations"]] == [s for s in within if s % 5 == 0]
        assert all((v["samples"], v["batches"]) == (256, 1) for v in m["validations"])


def test_torchrun_trains_a_user_model(launch: Launch) -> None:
    """``train --model FILE.py:FUNC --model-arg`` under torchrun: every rank builds the user's model."""
    summary = json.loads(launch.out("user", 0))
    assert launch.out("user", 1) == ""
    assert summary["final"]["train_samples"] == 1800  # both ranks' shares, each sample once
    assert "2 process(es)" in launch.err("user", 0)
    r = evaluate(launch.small, launch.dir / "user-run" / CHECKPOINT_NAME, workers=0, model=FACTORY, split="val")
    assert r["accuracy"] == pytest.approx(summary["final"]["val_accuracy"])
