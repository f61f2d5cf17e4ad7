"""Two ``torchrun`` "nodes" on this machine (``--nnodes 2 --node-rank 0/1``, c10d rendezvous on localhost, gloo,
one process per node; one job serves every test here): each with its own copy of the store (``lmdbstore copy``),
and each with different shards of a set.  Every sample exactly once per epoch across both nodes (the trainer's own
data steps, recorded), and the CLI trainer on shards: metrics summed over both nodes, checkpoints from rank 0 only.
Real processes and stores; tiny data, two epochs, few steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, TESTS, SetInfo, build_set

from lmdbstore.loader.samplers import stratified_split
from lmdbstore.tools.copy import copy_store

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over loopback tested on Linux"),
    pytest.mark.slow,  # the one torchrun job every test here shares: ~12-15 s of CPU
]

#: What node ``argv[1]`` runs (one process a node): ``lmdbstore train`` on its shards (tests/cli_runs.py), then the
#: trainer's data steps (rank_data: placement, split, sampler; make_loaders) on a copy of one store per node and on
#: shards per node: which samples (first pixel: a sample's id across both nodes) each rank reads per epoch,
#: gathered by rank 0 into ``seen-CASE.json``.  ``node{argv[1]}.json`` holds its CLI arguments and its stores.
RANK_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from cli_runs import cli

node = sys.argv[1]
plan = json.load(open(f"node{node}.json"))
if cli(f"train.{node}", plan["train"]):  # a failed run ends the node (torchrun then stops the other)
    sys.exit(f"train failed on node {node}")

from lmdbstore.config import LoaderConfig
from lmdbstore.training.data import make_loaders, read_store
from lmdbstore.training.distributed import init_distributed
from lmdbstore.training.placement import rank_data

for case, shuffle in (("copies", "block"), ("shards", "random")):
    stores = plan[case]
    info = init_distributed("cpu")
    lcfg = LoaderConfig(batch_size=64, workers=1, shuffle=shuffle, seed=5)
    mine = rank_data(read_store(stores if len(stores) > 1 else stores[0]), 0.0, lcfg, info, print)
    loader, _ = make_loaders(mine.data, mine.sampler, mine.val_idx, lcfg, mine.placement.share, torch.device("cpu"))
    epochs = []
    for epoch in range(2):
        mine.sampler.set_epoch(epoch)
        seen = [x[:, 0, 0, 0].round().long().tolist() for x, _ in loader]
        epochs.append({"seen": [i for b in seen for i in b], "steps": len(seen), "groups": mine.placement.groups,
                       "classes": mine.data.classes})
    del loader
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, epochs)
    if info.rank == 0:
        with open(f"seen-{case}.json", "w") as fh:
            json.dump(gathered, fh)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Nodes:
    """The two-node job's directory (``train.NODE.out``/``.err``: each node's ``lmdbstore train`` outputs), the
    shards, and each node's run directory."""

    dir: Path
    shards: SetInfo
    outs: list[Path]

    def seen(self, case: str) -> list[list[dict[str, Any]]]:
        return json.loads((self.dir / f"seen-{case}.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Nodes:
    """One job of two ``torchrun`` nodes (``--nnodes 2 --node-rank 0/1``, c10d rendezvous on this machine, one
    process each) for every test here.  Four stores as shards: node 0 holds the first two (1,000 + 517 samples),
    node 1 the other two (263 + 840); the fourth adds class "y", and the nodes' class lists differ.  Each node also
    has its own copy of the first store (what ``lmdbstore copy`` does: each node its own copy on its own disk)."""
    base = tmp_path_factory.mktemp("nodes")
    parts = [(1000, ["a", "b", "c"]), (517, ["c", "a", "x"]), (263, ["b", "a"]), (840, ["y", "c"])]
    shards = build_set(base / "shards", parts)
    outs = [base / "out0", base / "out1"]
    common = ["--batch", "64", "--epochs", "2", "--workers", "1", "--no-progress", "--json", "--device", "cpu"]
    for k, node_shards in enumerate((shards.paths[:2], shards.paths[2:])):
        copy = base / f"node{k}" / "store"
        copy.parent.mkdir()
        copy_store(shards.paths[0], copy)
        plan = {
            "train": ["train", *map(str, node_shards), "--out", str(outs[k]), *common],
            "copies": [str(copy)],
            "shards": [str(p) for p in node_shards],
        }
        (base / f"node{k}.json").write_text(json.dumps(plan))
    (base / "rank.py").write_text(RANK_SCRIPT)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k)),
                *("--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
                *("--rdzv-id", "lmdbstore-test", "--local-addr", "127.0.0.1", "--max-restarts", "0"),
                str(base / "rank.py"),
                str(k),
            ],
            cwd=base,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]  # the c10d rendezvous is hosted by whichever node binds its port first
    errs = [p.communicate(timeout=300)[1] for p in procs]
    logs = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(base.glob("*.err")))
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err[-3000:] + logs
    return Nodes(base, shards, outs)


def test_a_copy_per_node_reads_every_sample_once_per_epoch(nodes: Nodes) -> None:
    ranks = nodes.seen("copies")
    assert len(ranks) == 2
    for epoch in range(2):
        assert ranks[0][epoch]["groups"] == 1  # the same data on both nodes: one global order
        assert ranks[0][epoch]["steps"] == ranks[1][epoch]["steps"]
        both = ranks[0][epoch]["seen"] + ranks[1][epoch]["seen"]
        assert sorted(both) == list(range(1000))  # every sample exactly once across the nodes
    assert ranks[0][0]["seen"] != ranks[0][1]["seen"]


def test_shards_per_node_read_every_sample_once_per_epoch(nodes: Nodes) -> None:
    ranks = nodes.seen("shards")
    for epoch in range(2):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert a["groups"] == b["groups"] == 2
        assert a["steps"] == b["steps"]  # DDP: as many steps on both nodes, though their shards differ in size
        assert a["classes"] == b["classes"] == ["a", "b", "c", "x", "y"]  # one class list, by name
        assert sorted(a["seen"] + b["seen"]) == list(range(len(nodes.shards.x)))  # each sample once, on its node
        assert {min(a["seen"]) < 1517, min(b["seen"]) < 1517} == {True, False}  # each node its own shards


def test_train_cli_on_shards_per_node(nodes: Nodes) -> None:
    outs = nodes.outs
    written = [o for o in outs if (o / "checkpoint.pt").exists()]
    assert len(written) == 1 and not any(o.exists() for o in outs if o not in written)  # rank 0 only
    lines = [json.loads(x) for x in (written[0] / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]  # once, not once per node (epochs count from 1)
    names = nodes.shards.names
    classes = sorted(set(names))
    n_train = n_val = 0
    for part in (slice(0, 1517), slice(1517, None)):  # each node splits its own shards
        t, v = stratified_split(np.searchsorted(classes, names[part]), 0.1, 0)
        n_train, n_val = n_train + len(t), n_val + len(v)
    assert all(m["train_samples"] == n_train for m in lines)  # summed over both nodes, each sample once
    stdout = [(nodes.dir / f"train.{k}.out").read_text() for k in range(2)]
    assert sum(bool(s.strip()) for s in stdout) == 1  # --json: rank 0's stdout, JSON only; the other prints nothing
    final = json.loads(next(s for s in stdout if s.strip()))
    assert np.array(final["confusion"]).sum() == n_val and final["classes"] == ["a", "b", "c", "x", "y"]
    stderr = [(nodes.dir / f"train.{k}.err").read_text() for k in range(2)]
    plan = next(ln for err in stderr for ln in err.splitlines() if ln.startswith("training on"))
    assert f"{n_train} train / {n_val} val samples" in plan and "2 sets of shards" in plan


def _equal_steps(steps: int = 11) -> Any:
    """A shard's sampler cut to ``steps`` steps: 1,000 samples in 8 batches of 125, the largest halved to 11."""
    from lmdbstore.loader.samplers import EpochBatchSampler
    from lmdbstore.training.placement import EqualSteps

    return EqualSteps(EpochBatchSampler(np.arange(1000), 125, seed=4), steps)


def _epoch_of(e: int) -> list[list[int]]:
    sampler = _equal_steps()
    sampler.set_epoch(e)
    return [b.tolist() for b in sampler]


def test_equal_steps_passes_and_resume_inside_an_epoch_through_the_loader(tmp_path: Path) -> None:
    from conftest import build_store, make_data

    from lmdbstore.config import LoaderConfig
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader

    x, y = make_data(1000, 2)
    store = build_store(tmp_path / "s", x, y)
    cfg = LoaderConfig(batch_size=125, workers=2, multiprocessing_context="fork")
    loader = make_loader(LmdbBatchDataset(store), _equal_steps(), cfg)

    def ids(batch: Any) -> list[int]:
        return batch[0][:, 0, 0, 0].round().long().tolist()  # type: ignore[no-any-return]

    assert [ids(b) for b in loader] == _epoch_of(0)  # the first pass is epoch 0 (iter() twice draws nothing)
    batches = iter(loader)
    head = [ids(next(batches)) for _ in range(7)]
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["steps"]) == (1, 7, 11)
    del batches, loader
    resumed = make_loader(LmdbBatchDataset(store), _equal_steps(), cfg)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # what the trainer does before the epoch
    assert head + [ids(b) for b in resumed] == _epoch_of(1)
    older = {k: v for k, v in state.items() if k != "steps"}  # a checkpoint of before: the same steps
    again = make_loader(LmdbBatchDataset(store), _equal_steps(), cfg)
    again.load_state_dict(older)
    assert [ids(b) for b in again] == _epoch_of(1)[7:]
    with pytest.raises(ValueError, match="for 11 steps an epoch, this sampler has 12"):
        make_loader(LmdbBatchDataset(store), _equal_steps(12), cfg).load_state_dict(state)
