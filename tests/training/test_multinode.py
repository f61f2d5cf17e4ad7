"""Two ``torchrun`` "nodes" on this machine (``--nnodes 2 --node-rank 0/1``, c10d rendezvous on localhost, gloo,
one process per node): each with its own copy of the store (``lmdbstore copy``), and each with different shards
of a set.  Every sample exactly once per epoch across both nodes (the trainer's own data steps, recorded), and
the CLI trainer on shards: metrics summed over both nodes, checkpoints from rank 0 only.  Real processes and
stores; tiny data, two epochs, few steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, SetInfo, build_set

from lmdbstore.loader.samplers import stratified_split
from lmdbstore.tools.copy import copy_store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo over loopback tested on Linux")

#: The trainer's data steps on each rank (rank_data: placement, split, sampler; make_loaders): which samples
#: (first pixel: a sample's id across both nodes) each rank reads per epoch, gathered by rank 0.
RANK_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from lmdbstore.config import LoaderConfig
from lmdbstore.training.data import make_loaders, read_store
from lmdbstore.training.distributed import init_distributed
from lmdbstore.training.placement import rank_data

out, shuffle, stores = sys.argv[1], sys.argv[2], sys.argv[3:]
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
gathered = [None] * info.world_size
dist.all_gather_object(gathered, epochs)
if info.rank == 0:
    with open(out, "w") as fh:
        json.dump(gathered, fh)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(node_args: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run ``torchrun`` once per node (both on this machine, one process each), node ``k`` with ``node_args[k]``;
    the c10d rendezvous is hosted by whichever node binds its port first."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k)),
                *("--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
                *("--rdzv-id", "lmdbstore-test", "--local-addr", "127.0.0.1", "--max-restarts", "0"),
                *args,
            ],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, args in enumerate(node_args)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> SetInfo:
    """Four stores: node 0 holds the first two (1,000 + 517 samples), node 1 the other two (263 + 840); the
    fourth adds class "y", and the nodes' class lists differ."""
    parts = [(1000, ["a", "b", "c"]), (517, ["c", "a", "x"]), (263, ["b", "a"]), (840, ["y", "c"])]
    return build_set(tmp_path_factory.mktemp("shards"), parts)


def _run_script(tmp_path: Path, node_stores: list[list[Path]], shuffle: str) -> list[list[dict]]:
    script, out = tmp_path / "rank.py", tmp_path / "seen.json"
    script.write_text(RANK_SCRIPT)
    procs = _two_nodes([[str(script), str(out), shuffle, *map(str, s)] for s in node_stores], tmp_path)
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_copy_per_node_reads_every_sample_once_per_epoch(tmp_path: Path, shards: SetInfo) -> None:
    store = shards.paths[0]
    copies = [tmp_path / "node0" / "store", tmp_path / "node1" / "store"]
    for c in copies:
        c.parent.mkdir()
        copy_store(store, c)  # what `lmdbstore copy` does: each node its own copy on its own disk
    ranks = _run_script(tmp_path, [[copies[0]], [copies[1]]], "block")
    assert len(ranks) == 2
    for epoch in range(2):
        assert ranks[0][epoch]["groups"] == 1  # the same data on both nodes: one global order
        assert ranks[0][epoch]["steps"] == ranks[1][epoch]["steps"]
        both = ranks[0][epoch]["seen"] + ranks[1][epoch]["seen"]
        assert sorted(both) == list(range(1000))  # every sample exactly once across the nodes
    assert ranks[0][0]["seen"] != ranks[0][1]["seen"]


def test_shards_per_node_read_every_sample_once_per_epoch(tmp_path: Path, shards: SetInfo) -> None:
    ranks = _run_script(tmp_path, [shards.paths[:2], shards.paths[2:]], "random")
    for epoch in range(2):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert a["groups"] == b["groups"] == 2
        assert a["steps"] == b["steps"]  # DDP: as many steps on both nodes, though their shards differ in size
        assert a["classes"] == b["classes"] == ["a", "b", "c", "x", "y"]  # one class list, by name
        assert sorted(a["seen"] + b["seen"]) == list(range(len(shards.x)))  # each sample once, on its node
        assert {min(a["seen"]) < 1517, min(b["seen"]) < 1517} == {True, False}  # each node its own shards


def test_train_cli_on_shards_per_node(tmp_path: Path, shards: SetInfo) -> None:
    outs = [tmp_path / "out0", tmp_path / "out1"]
    common = ["--batch", "64", "--epochs", "2", "--workers", "1", "--no-progress", "--json", "--device", "cpu"]
    node_args = [
        ["-m", "lmdbstore", "train", *map(str, shards.paths[:2]), "--out", str(outs[0]), *common],
        ["-m", "lmdbstore", "train", *map(str, shards.paths[2:]), "--out", str(outs[1]), *common],
    ]
    procs = _two_nodes(node_args, REPO)
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    written = [o for o in outs if (o / "checkpoint.pt").exists()]
    assert len(written) == 1 and not any(o.exists() for o in outs if o not in written)  # rank 0 only
    lines = [json.loads(x) for x in (written[0] / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]  # once, not once per node (epochs count from 1)
    names = shards.names
    classes = sorted(set(names))
    n_train = n_val = 0
    for part in (slice(0, 1517), slice(1517, None)):  # each node splits its own shards
        t, v = stratified_split(np.searchsorted(classes, names[part]), 0.1, 0)
        n_train, n_val = n_train + len(t), n_val + len(v)
    assert all(m["train_samples"] == n_train for m in lines)  # summed over both nodes, each sample once
    final = json.loads(next(p.stdout for p in procs if p.stdout.strip()))  # --json: rank 0's stdout, JSON only
    assert np.array(final["confusion"]).sum() == n_val and final["classes"] == ["a", "b", "c", "x", "y"]
    plan = next(ln for p in procs for ln in p.stderr.splitlines() if ln.startswith("training on"))
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
