"""HDF5 sources (sources/h5.py): datasets round trip, ``class_names`` is bounded before it is read, a
missing h5py is one line naming the extra."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import assert_roundtrip, h5py, make_x, needs_h5py, one_line

from lmdbstore.errors import SourceError
from lmdbstore.ingestion.sources import H5Source, open_source


@needs_h5py
@pytest.mark.parametrize("labels", ["ints", "names", "label"])
def test_h5_roundtrip(tmp_path: Path, labels: str) -> None:
    x = make_x()
    path = tmp_path / "d.h5"
    y: np.ndarray
    with h5py.File(path, "w") as f:
        f["grp/x"] = x
        if labels == "ints":
            y = np.arange(N) % 4
            f["grp/y"] = y.astype(np.int16)
        elif labels == "names":
            y = np.array(["ant", "bee"])[np.arange(N) % 2]
            f.create_dataset("grp/y", data=y.astype(object), dtype=h5py.string_dtype())
        else:
            y = np.full(N, 2)
    kw: dict[str, Any] = {"label": 2} if labels == "label" else {}
    (src,) = open_source(path, h5_x="grp/x", h5_y="grp/y", **kw)
    assert isinstance(src, H5Source) and src.name == f"{path}[grp/x]"
    assert_roundtrip(src, x, y)


@needs_h5py
def test_h5_class_names_dataset(tmp_path: Path) -> None:
    x = make_x()
    with h5py.File(tmp_path / "d.hdf5", "w") as f:
        f["x"] = x
        f["y"] = np.arange(N) % 2
        f["class_names"] = np.array([b"no", b"yes"])
    (src,) = open_source(tmp_path / "d.hdf5")
    assert src.class_names() == ["no", "yes"]
    assert_roundtrip(src, x, np.array(["no", "yes"])[np.arange(N) % 2])


@needs_h5py
def test_h5_without_h5py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = make_x()
    monkeypatch.setitem(sys.modules, "h5py", None)  # makes `import h5py` raise ImportError
    with pytest.raises(SourceError) as err:
        open_source(tmp_path / "d.h5", label="a")
    assert "pip install 'lmdbstore[hdf5]'" in one_line(err, tmp_path / "d.h5")


@needs_h5py
@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda f: f.create_dataset("class_names", shape=(70_000,), dtype="S2"), "70000 class names"),
        (lambda f: f.create_dataset("class_names", shape=(3,), dtype="S1000"), "1000 characters"),
        (lambda f: f.create_dataset("class_names", data=np.arange(3.0)), "1-D array of strings"),
    ],
    ids=["count", "width", "floats"],
)
def test_h5_class_names_dataset_is_bounded_before_reading(
    tmp_path: Path, make: Callable[[Any], None], expect: str
) -> None:
    path = tmp_path / "n.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = make_x(), np.zeros(N, int)
        make(f)
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert len(one_line(err, path, "'class_names'", expect)) < 500
