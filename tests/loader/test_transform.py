"""The batch transform hook (lmdbstore.loader.transform) through real DataLoader workers and reused buffers:
in place, a new array of the same shape (copied back into the buffer), one of another shape or dtype (a
fresh tensor), with spawn; a transform that breaks the contract is one line naming what is wrong."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.transform import apply_transform

BATCH = 96


def negate_in_place(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    np.negative(x, out=x)
    return x, y


def shifted(x: np.ndarray, y: np.ndarray, by: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    return x + np.float32(by), (y + 1) % 5  # new arrays of the same shape and dtype


def pooled(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[..., ::5, ::5].astype(np.float64), y  # another shape and dtype


def flip_augment(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented augmentation example: noise and horizontal flips, in place."""
    rng = np.random.default_rng()
    x += rng.normal(0, 0.1, x.shape).astype(x.dtype)
    flip = rng.random(len(x)) < 0.5
    x[flip] = x[flip, ..., ::-1]
    return x, y


def _run(info: StoreInfo, transform, context: str = "fork", workers: int = 2):  # type: ignore[no-untyped-def]
    ds = LmdbBatchDataset(info.path, transform=transform)
    sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, shuffle="random", seed=2)
    cfg = LoaderConfig(batch_size=BATCH, workers=workers, multiprocessing_context=context)
    loader = make_loader(ds, sampler, cfg)
    out = []
    for _ in range(2):  # twice: the second pass reuses the first pass's buffers
        sampler.set_epoch(0)
        out.append([(x.clone(), y.clone()) for x, y in loader])
    return out, sampler.batches(0), loader


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_in_place_transform_lands_in_the_reused_buffers(small_store: StoreInfo, context: str) -> None:
    # spawned readers each start an interpreter and import torch (seconds of CPU): one is enough to carry the
    # transform by reference into a spawned process; two readers share the slots in the forked case
    passes, batches, loader = _run(small_store, negate_in_place, context, workers=2 if context == "fork" else 1)
    for got in passes:
        for (x, y), idx in zip(got, batches, strict=True):
            np.testing.assert_array_equal(x.numpy()[:, 0], -small_store.x[idx])
            np.testing.assert_array_equal(y.numpy(), small_store.y[idx])
    assert loader.feed.came == {"slot": 2 * len(batches), "sent": 0, "here": 0}  # both passes through the slots


def test_a_new_array_of_the_same_shape_is_copied_into_the_buffer(small_store: StoreInfo) -> None:
    passes, batches, loader = _run(small_store, functools.partial(shifted, by=2.0))
    for (x, y), idx in zip(passes[1], batches, strict=True):
        np.testing.assert_allclose(x.numpy()[:, 0], small_store.x[idx] + 2.0, rtol=1e-6)
        np.testing.assert_array_equal(y.numpy(), (small_store.y[idx] + 1) % 5)
    assert loader.feed.came["sent"] == loader.feed.came["here"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_another_shape_or_dtype_comes_in_a_fresh_tensor(small_store: StoreInfo, workers: int) -> None:
    passes, batches, loader = _run(small_store, pooled, workers=workers)
    for (x, _), idx in zip(passes[1], batches, strict=True):
        assert x.dtype == torch.float64 and x.shape == (len(idx), 1, 5, 5)
        np.testing.assert_array_equal(x.numpy()[:, 0], small_store.x[idx][:, ::5, ::5])
    if workers:  # each batch's slot was given back at once, none is left taken
        assert loader.feed.came["sent"] == 2 * len(batches) and set(loader.feed.state) == {0}


def test_the_documented_augmentation_runs_in_the_workers(small_store: StoreInfo) -> None:
    passes, batches, _ = _run(small_store, flip_augment)
    (x, y), idx = passes[0][0], batches[0]
    assert x.shape == (BATCH, 1, 25, 25) and not np.array_equal(x.numpy()[:, 0], small_store.x[idx])
    np.testing.assert_array_equal(y.numpy(), small_store.y[idx])


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (lambda x, y: x, "pair"),
        (lambda x, y: (x, y[:-1]), "samples and"),
        (lambda x, y: (x, y.astype(np.float32)), "integer labels"),
    ],
)
def test_a_transform_breaking_the_contract_is_one_line(bad, words: str) -> None:  # type: ignore[no-untyped-def]
    x, y = np.zeros((4, 3, 3), np.float32), np.arange(4)
    with pytest.raises(ValueError, match=words) as err:
        apply_transform(bad, x, y)
    assert "\n" not in str(err.value)


def small_labels(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    np.negative(x, out=x)  # x stays in the reused buffer; the labels come back as another integer type
    return x, ((y + 2) % 5).astype(np.int16)


def test_labels_cross_from_the_workers_intact(small_store: StoreInfo) -> None:
    """Labels travel beside the buffer slot as bytes with their dtype and shape (issue 21: no shared-memory
    segment per batch); they arrive as the int64 labels of each batch, for plain and transformed batches."""
    for transform, want in ((None, lambda y: y), (small_labels, lambda y: (y + 2) % 5)):
        passes, batches, loader = _run(small_store, transform)
        for got in passes:
            for (x, y), idx in zip(got, batches, strict=True):
                assert y.dtype == torch.int64 and y.shape == (len(idx),)
                np.testing.assert_array_equal(y.numpy(), want(small_store.y[idx]))
                sign = -1 if transform is not None else 1
                np.testing.assert_array_equal(x.numpy()[:, 0], sign * small_store.x[idx])
        assert loader.feed.came["sent"] == loader.feed.came["here"] == 0
