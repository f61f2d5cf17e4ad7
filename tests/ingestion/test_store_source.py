"""A store as an ingest source: copies, merges with class names mapped by name, class subsets, resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, build_store, make_data, snapshot_store

from lmdbstore import SourceError, ValidationError, open_reader
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.ingestion.sources.store import StoreSource, restrict_store_sources
from lmdbstore.tools.verify import verify_store


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def test_a_store_opens_as_a_source(small_store: StoreInfo) -> None:
    [src] = open_sources([small_store.path])
    assert isinstance(src, StoreSource)
    assert len(src) == 2000 and src.shape == (25, 25) and src.dtype == np.float32
    assert src.class_names() == CLASSES
    xs, ys = zip(*src.iter_batches(700, start=100), strict=True)
    assert np.array_equal(_bits(np.concatenate(xs)), _bits(small_store.x[100:]))
    assert list(np.concatenate(ys)) == list(np.array(CLASSES)[small_store.y[100:]])
    assert list(np.concatenate(list(src.iter_labels(999)))) == list(np.array(CLASSES)[small_store.y])


def test_merge_maps_classes_by_name(tmp_path: Path) -> None:
    xa, ya = make_data(300, 1)
    xb, yb = make_data(200, 2, n_classes=3)
    a = build_store(tmp_path / "a", xa, ya)  # a..e
    b = build_store(tmp_path / "b", xb, yb, classes=["e", "a", "zz"])  # other order, one new class
    rep = ingest(tmp_path / "m", open_sources([a, b]))
    assert rep.added == 500
    with open_reader(tmp_path / "m") as r:
        names = r.classes
        assert names == sorted({*CLASSES, "zz"})
        got = np.array(names)[r.labels()]
        assert list(got[:300]) == list(np.array(CLASSES)[ya])
        assert list(got[300:]) == list(np.array(["e", "a", "zz"])[yb])
        assert np.array_equal(_bits(r.read_range(0, 500)), _bits(np.concatenate([xa, xb])))
    assert verify_store(tmp_path / "m").ok


def test_classes_subset_a_store_and_resume_skips_it(small_store: StoreInfo, tmp_path: Path) -> None:
    dest = tmp_path / "sub"
    srcs = open_sources([small_store.path])
    rep = ingest(dest, srcs, classes=["d", "b"])
    keep = np.isin(small_store.y, [1, 3])
    assert rep.added == int(keep.sum())
    with open_reader(dest) as r:
        assert r.classes == ["d", "b"]
        assert np.array_equal(_bits(r.read_range(0, len(r))), _bits(small_store.x[keep]))
        assert list(np.array(r.classes)[r.labels()]) == list(np.array(CLASSES)[small_store.y[keep]])
    again = ingest(dest, open_sources([small_store.path]), classes=["d", "b"])  # same command: nothing twice
    assert again.added == 0 and again.total == int(keep.sum())


def test_a_store_with_unknown_classes_is_refused_and_nothing_written(small_store: StoreInfo, tmp_path: Path) -> None:
    x, y = make_data(50, 9, n_classes=2)
    dest = build_store(tmp_path / "ab", x, y, classes=["a", "b"])
    before = snapshot_store(dest)
    with pytest.raises(ValidationError, match="unknown class label"):
        ingest(dest, open_sources([small_store.path]))
    assert snapshot_store(dest) == before


def test_a_store_cannot_be_ingested_into_itself(small_store: StoreInfo) -> None:
    before = snapshot_store(small_store.path)
    with pytest.raises(SourceError, match="into itself"):
        ingest(small_store.path, open_sources([small_store.path]))
    assert snapshot_store(small_store.path) == before
    with pytest.raises(SourceError, match="no class 'q'"):
        StoreSource(small_store.path, classes=["q"])


def test_label_option_relabels_every_sample(small_store: StoreInfo, tmp_path: Path) -> None:
    ingest(tmp_path / "one", open_sources([small_store.path], label="all"))
    with open_reader(tmp_path / "one") as r:
        assert r.classes == ["all"] and len(r) == 2000 and int(r.labels().max()) == 0


def test_restrict_passes_other_sources(small_store: StoreInfo, tmp_path: Path) -> None:
    x, y = make_data(10, 4)
    np.savez(tmp_path / "f.npz", x=x, y=y)
    srcs = open_sources([tmp_path / "f.npz", small_store.path])
    out = restrict_store_sources(srcs, tmp_path / "dest", ["a"])
    assert out[0] is srcs[0]
    assert (
        isinstance(out[1], StoreSource)
        and out[1].class_names() == ["a"]
        and len(out[1]) == int((small_store.y == 0).sum())
    )
