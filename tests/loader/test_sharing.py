"""Batches on reused buffers that leave the process stay intact (lmdbstore.loader.sharing): sent through
``torch.multiprocessing`` queues (fork and spawn, with and without ``share_memory_()``), as a storage, or
inherited by a forked child, each batch is checked sample by sample after the loader has moved on and
reused its buffers (the reported finding: 24 of 30 batches overwritten).  Tensors that are not on a
handed-out buffer keep torch's sharing semantics."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.dataset import BufferedLoader, LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.sharing import held_by_this_process

BATCH = 100


def _loader(info: StoreInfo) -> tuple[Any, list[np.ndarray]]:
    ds = LmdbBatchDataset(info.path)
    sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, shuffle="random", seed=4)
    loader = make_loader(ds, sampler, LoaderConfig(batch_size=BATCH, workers=2, multiprocessing_context="fork"))
    assert isinstance(loader, BufferedLoader)
    expected = [b.copy() for b in sampler]
    sampler.set_epoch(0)  # every pass takes the next epoch (loader.passes): the loader's is the one just listed
    return loader, expected


def _consumer(q: Any, out: Any) -> None:
    """Hold every batch received until the end, then report which ones no longer hold their samples."""
    held = []
    while (item := q.get()) is not None:
        held.append(item)
    time.sleep(0.5)
    out.put([i for i, (x, want) in enumerate(held) if not np.array_equal(x[:, 0, 0, 0].numpy(), want)])


@pytest.mark.parametrize(("context", "share"), [("fork", False), ("spawn", True)])
def test_batches_sent_through_a_queue_stay_intact(small_store: StoreInfo, context: str, share: bool) -> None:
    ctx = tmp.get_context(context)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(q, out))
    p.start()
    loader, expected = _loader(small_store)
    for (x, _), idx in zip(loader, expected, strict=True):
        if share:
            x.share_memory_()  # already shared memory: a no-op that must not make the copy optional
        q.put((x, small_store.x[idx][:, 0, 0]))
    q.put(None)
    overwritten = out.get(timeout=120)
    p.join(60)
    assert overwritten == [] and len(expected) == 20
    assert loader.reuse_counts()[0] > 0  # the loader went on reusing its buffers meanwhile


def _storage_consumer(q: Any, out: Any) -> None:
    held = []
    while (item := q.get()) is not None:
        held.append(item)
    time.sleep(0.5)
    out.put(
        [i for i, (s, want) in enumerate(held) if torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes() != want]
    )


def test_storages_sent_through_a_queue_stay_intact(small_store: StoreInfo) -> None:
    """A storage object alone also keeps its buffer from reuse (torch does not count it in the storage's
    use count), and travels as a copy."""
    ctx = tmp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_storage_consumer, args=(q, out))
    p.start()
    loader, _ = _loader(small_store)
    for x, _ in loader:
        s = x.untyped_storage()
        q.put((s, torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes()))
    q.put(None)
    assert out.get(timeout=120) == []
    p.join(60)


def _hold(x: torch.Tensor, want: np.ndarray, conn: Any) -> None:
    time.sleep(0.5)
    conn.send(bool(np.array_equal(x[:, 0, 0, 0].numpy(), want)))


def test_batches_inherited_by_forked_children_stay_intact(small_store: StoreInfo) -> None:
    ctx = mp.get_context("fork")
    loader, expected = _loader(small_store)
    children = []
    for i, ((x, _), idx) in enumerate(zip(loader, expected, strict=True)):
        if i % 4 == 0:
            here, there = ctx.Pipe()
            p = ctx.Process(target=_hold, args=(x, small_store.x[idx][:, 0, 0], there))
            p.start()
            children.append((p, here))
    assert [here.recv() for _, here in children] == [True] * len(children)
    for p, _ in children:
        p.join(60)


def _add_one(q: Any, done: Any) -> None:
    t = q.get()
    t += 1
    done.set()


def test_other_tensors_keep_torchs_sharing(small_store: StoreInfo) -> None:
    loader, _ = _loader(small_store)
    x, _ = next(iter(loader))
    assert held_by_this_process(x.untyped_storage().data_ptr())
    plain = torch.zeros(4).share_memory_()
    assert not held_by_this_process(plain.untyped_storage().data_ptr())
    ctx = tmp.get_context("fork")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_add_one, args=(q, done))
    p.start()
    q.put(plain)  # pickled through torch's reducer, untouched by ours
    assert done.wait(120)
    p.join(60)
    assert plain.tolist() == [1.0] * 4  # shared, as torch shares it: not copied
