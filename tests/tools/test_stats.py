"""`store_stats` / `format_stats` against numpy on the data written."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, edit_meta_text, one_error_line, run_cli, strict_json

from lmdbstore import CorruptStoreError, NotAStoreError, StoreNotFoundError, StoreReader
from lmdbstore.tools.stats import format_stats, store_stats


def test_stats_match_the_data(small_store: StoreInfo) -> None:
    s = store_stats(small_store.path)
    x, y = small_store.x, small_store.y
    assert s["samples"] == len(x) and s["shape"] == [25, 25] and s["dtype"] == "<f4"
    assert [c["name"] for c in s["classes"]] == CLASSES
    assert [c["count"] for c in s["classes"]] == np.bincount(y, minlength=5).tolist()
    assert sum(c["share"] for c in s["classes"]) == pytest.approx(1.0)
    v = s["values"]
    f = x.astype(np.float64)
    assert v["mean"] == pytest.approx(f.mean(), rel=1e-9, abs=1e-9)
    assert v["std"] == pytest.approx(f.std(), rel=1e-9)
    assert v["min"] == float(x.min()) and v["max"] == float(x.max())
    assert v["nonfinite"] == 0 and v["method"].startswith("exact")
    b = s["bytes"]
    assert b["raw"] == len(x) * 2500
    assert b["per_sample_raw"] == 2500
    assert 1.0 <= b["ratio_samples_to_raw"] <= 1.05
    assert b["used_pages_total"] >= b["samples_db"]
    assert s["lmdb"]["depth"]["samples"] >= 1
    assert s["samples_per_value"] == 18 and s["checksum"] == "crc32"


def test_sampled_stats_read_back(small_store: StoreInfo) -> None:
    s = store_stats(small_store.path, sample=500, seed=3)
    assert s["values"]["method"].startswith("random sample of 500")
    idx = np.sort(np.random.default_rng(3).choice(len(small_store.x), size=500, replace=False))
    picked = small_store.x[idx].astype(np.float64)
    assert s["values"]["mean"] == pytest.approx(picked.mean())
    assert s["values"]["std"] == pytest.approx(picked.std())
    assert s["values"]["max"] == float(picked.max())


def test_table_mentions_everything(small_store: StoreInfo) -> None:
    text = format_stats(store_stats(small_store.path))
    for word in ("samples", "shape (25, 25)", "18 samples per value", "B/sample", "depth", "mean", "a ", "e "):
        assert word in text


def test_missing_and_foreign(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StoreNotFoundError):
        store_stats(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotAStoreError):
        store_stats(tmp_path / "f")


@pytest.mark.parametrize("sample", [-1, 0])
def test_sample_must_be_positive(small_store: StoreInfo, sample: int) -> None:
    with pytest.raises(ValueError, match=r"^sample must be a positive"):
        store_stats(small_store.path, sample=sample)
    result = run_cli("stats", small_store.path, "--sample", str(sample))
    assert result.exit_code == 1
    assert "--sample" in one_error_line(result)


@pytest.mark.parametrize(("old", "new"), [('"sum": ', '"sum": NaN, "x": '), ('"max": ', '"max": Infinity, "x": ')])
def test_tampered_nonfinite_statistics_are_refused(small_store: StoreInfo, old: str, new: str) -> None:
    # json.loads accepts NaN/Infinity: they used to reach `stats --json` and make it print invalid JSON
    edit_meta_text(small_store.path, lambda raw: raw.replace(old, new, 1))
    with pytest.raises(CorruptStoreError, match="non-finite"):
        store_stats(small_store.path)
    result = run_cli("stats", small_store.path, "--json")
    assert result.exit_code == 1 and "non-finite" in one_error_line(result)


def test_tampered_huge_integer_sum_is_one_line(small_store: StoreInfo) -> None:
    edit_meta_text(small_store.path, lambda raw: raw.replace('"sum": ', '"sum": ' + "9" * 400 + ', "x": ', 1))
    result = run_cli("stats", small_store.path, "--json")
    assert result.exit_code == 1 and "value_stats sum" in one_error_line(result)


def test_stats_json_is_valid_json(small_store: StoreInfo) -> None:
    result = run_cli("stats", small_store.path, "--json")
    assert result.exit_code == 0
    assert strict_json(result.stdout)["samples"] == len(small_store.x)


def test_stats_are_of_the_file_opened_when_the_path_names_another_since(
    small_store: StoreInfo, store_factory: Callable[..., StoreInfo], tmp_path: Path
) -> None:
    """Issue 39 #5's sibling: the file sizes came from a second look at the path."""
    other = store_factory(5000, name="other")
    copy = tmp_path / "copy"
    shutil.copytree(small_store.path, copy)
    with StoreReader(copy) as r:
        assert r.meta.count == len(small_store.x)
        os.rename(copy / "data.mdb", tmp_path / "old.mdb")
        shutil.copy(other.path / "data.mdb", copy / "data.mdb")
        s = store_stats(r)
    assert s["samples"] == len(small_store.x) and s["path"] == str(copy)
    assert s["bytes"]["file_size"] == os.path.getsize(tmp_path / "old.mdb") != os.path.getsize(copy / "data.mdb")
