"""HDF5 sources (sources/h5.py): datasets round trip, ``class_names`` is bounded before it is read, a
missing h5py is one line naming the extra."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import assert_roundtrip, h5py, make_x, needs_h5py, one_error_line, one_line, run_cli

from lmdbstore.errors import SourceError
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import H5Source, open_source
from lmdbstore.store.reader import StoreReader


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
    (src,) = open_source(path, x_key="grp/x", y_key="grp/y", **kw)
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
    (src,) = open_source(path)  # the names are needed only without classes=
    with pytest.raises(SourceError) as err:
        src.class_names()
    assert len(one_line(err, path, "'class_names'", expect, "hint: give the classes with classes=")) < 500


NAMES = ["ant", "bee", "cow"]
#: A class_names attribute as people write it with h5py.
ATTRIBUTES: dict[str, Any] = {
    "list": NAMES,
    "bytes array": np.array([n.encode() for n in NAMES]),
    "json": json.dumps(NAMES),  # the seed user's file: f.attrs["class_names"] = json.dumps(names)
    "json bytes": np.bytes_(json.dumps(NAMES).encode()),
    "commas": "ant, bee,cow",
    "newlines": "ant\nbee\ncow\n",
}


def _h5_with_names(path: Path, value: Any, on: str, labels: Any = None) -> np.ndarray:
    x = make_x()
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, np.arange(N) % 3 if labels is None else labels
        (f if on == "file" else f["y"]).attrs["class_names"] = value
    return x


@needs_h5py
@pytest.mark.parametrize("on", ["file", "labels"])
@pytest.mark.parametrize("kind", list(ATTRIBUTES))
def test_h5_class_names_attributes_of_every_kind(tmp_path: Path, kind: str, on: str) -> None:
    """Issue 40: a JSON string attribute (it ingested before) or a delimited one was refused as "dataset
    'class_names' must be a non-empty 1-D array"; every form h5py writes now names the classes."""
    x = _h5_with_names(tmp_path / "d.h5", ATTRIBUTES[kind], on)
    (src,) = open_source(tmp_path / "d.h5")
    assert src.class_names() == NAMES
    assert_roundtrip(src, x, np.array(NAMES)[np.arange(N) % 3])


@needs_h5py
def test_h5_names_that_cannot_be_read_are_settled_by_classes(tmp_path: Path) -> None:
    """Names a string does not list unambiguously: one line naming the attribute and --classes; with --classes
    (and --workers 2) the file's ids index those classes."""
    for k, value in enumerate(["ant bee cow", '["ant", "bee"', "ant,bee\ncow"]):
        path = tmp_path / f"d{k}.h5"
        _h5_with_names(path, value, "labels")
        line = one_error_line(run_cli("ingest", tmp_path / "s", path))
        assert f"{path}: attribute 'class_names' of dataset 'y' does not list class names unambiguously" in line
        assert line.endswith("hint: give the classes with --classes")
    res = run_cli("ingest", tmp_path / "s", path, "--classes", "p,q,r", "--workers", "2")
    assert res.exit_code == 0, res.stderr
    with StoreReader(tmp_path / "s") as r:
        assert list(r.meta.classes) == ["p", "q", "r"] and r.labels().tolist() == (np.arange(N) % 3).tolist()
    path = tmp_path / "json.h5"
    x = _h5_with_names(path, json.dumps(NAMES), "file")
    res = run_cli("ingest", tmp_path / "t", path, "--workers", "2")
    assert res.exit_code == 0, res.stderr
    with StoreReader(tmp_path / "t") as r:
        assert list(r.meta.classes) == NAMES and np.array_equal(r.read_range(0, N), x)


@needs_h5py
def test_h5_names_holding_nul_are_refused(tmp_path: Path) -> None:
    """Issue 40: b"a\0" and b"a" must not merge into one class.  HDF5 strings cannot end in NUL (h5py refuses to
    write them); names that hold one some other way (a JSON escape, a fixed-width bytes array) are refused."""
    for value in (json.dumps(["a", "a\u0000"]), np.array([b"a", b"a\0b"]), '["a\\u0000"]'):
        _h5_with_names(tmp_path / "names.h5", value, "file", np.zeros(N, int))
        (src,) = open_source(tmp_path / "names.h5")
        with pytest.raises(SourceError, match="holds a name with a control character"):
            src.class_names()
        with pytest.raises(SourceError, match="control character"):
            ingest(tmp_path / "s", [src])
    assert not (tmp_path / "s").exists()
