"""The built-in synthetic dataset: deterministic, z-scored, balanced, streamed to .npz."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmdbstore.ingestion.synth import SYNTH_CLASSES, synth_batches, write_synth_npz


def test_batches_are_deterministic_zscored_and_cover_all_classes() -> None:
    a = list(synth_batches(5000, seed=1, batch=1000))
    b = list(synth_batches(5000, seed=1, batch=1000))
    assert all(np.array_equal(xa, xb) and np.array_equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    x = np.concatenate([p[0] for p in a])
    y = np.concatenate([p[1] for p in a])
    assert x.shape == (5000, 25, 25) and x.dtype == np.float32
    assert np.allclose(x.mean(axis=(1, 2)), 0, atol=1e-4)
    assert np.allclose(x.std(axis=(1, 2)), 1, atol=1e-3)
    counts = np.bincount(y, minlength=5)
    assert counts.min() > 800 and y.max() == 4
    other = np.concatenate([p[0] for p in synth_batches(5000, seed=2, batch=1000)])
    assert not np.array_equal(x, other)


def test_classes_are_separable_but_not_linearly_trivial() -> None:
    x, y = next(synth_batches(6000, seed=0, batch=6000))
    flat = x.reshape(len(x), -1).astype(np.float64)
    w, *_ = np.linalg.lstsq(flat[:5000], np.eye(5)[y[:5000]], rcond=None)
    linear_acc = float(((flat[5000:] @ w).argmax(1) == y[5000:]).mean())
    assert 0.3 < linear_acc < 0.8  # far above chance but leaves work for a CNN
    # class means differ clearly (the patterns carry signal)
    means = np.stack([x[y == c].mean(0) for c in range(5)])
    assert np.abs(means[0] - means[2]).max() > 0.2


def test_npz_matches_the_stream(tmp_path: Path) -> None:
    out = tmp_path / "d.npz"
    write_synth_npz(out, 3000, seed=4)
    with np.load(out) as d:
        x, y, names = d["x"], d["y"], d["class_names"]
    x2, y2 = next(synth_batches(3000, seed=4))
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert names.tolist() == list(SYNTH_CLASSES)
    assert [p.name for p in tmp_path.iterdir()] == ["d.npz"]  # no temporary left beside it


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n must be"):
        list(synth_batches(-1))
    with pytest.raises(ValueError, match="batch must be"):
        list(synth_batches(10, batch=0))
    with pytest.raises(ValueError, match="n must be positive"):
        write_synth_npz(tmp_path / "x.npz", 0)
