"""Opening paths as sources (sources/opening.py): bad input of every kind fails in one line naming the file;
a source given twice is refused."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import SOURCE_SHAPE as SHAPE
from conftest import h5py, make_x, needs_h5py, one_error_line, one_line, run_cli, truncate_file

from lmdbstore.errors import SourceError
from lmdbstore.ingestion.sources import open_source, open_sources


def test_open_sources_refuses_duplicates(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_x())
    np.save(tmp_path / "b.npy", make_x())
    srcs = open_sources([tmp_path / "a.npy", tmp_path / "b.npy"], label="a")
    assert [len(s) for s in srcs] == [N, N]
    with pytest.raises(SourceError) as err:
        open_sources([tmp_path / "a.npy", tmp_path / ".." / tmp_path.name / "a.npy"], label="a")
    one_line(err, "a.npy", "more than once")


def _npz_short_member(path: Path) -> None:
    """A well-formed zip whose x.npy header promises more rows than the member holds."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (N, *SHAPE)})
    buf.write(make_x(N // 2).tobytes())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", buf.getvalue())
        zf.writestr("y.npy", _npy_bytes(np.zeros(N, int)))


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


Case = tuple[str, dict[str, Any], Callable[[Path], None], str]


BAD_INPUTS: list[Case] = [
    ("missing.npy", {"label": "a"}, lambda p: None, "no such file"),
    ("empty.npy", {"label": "a"}, lambda p: p.write_bytes(b""), "empty"),
    ("empty.npz", {}, lambda p: p.write_bytes(b""), "empty"),
    ("empty.h5", {}, lambda p: p.write_bytes(b""), "empty"),
    ("garbage.npy", {"label": "a"}, lambda p: p.write_bytes(b"hello, not numpy"), "not a valid .npy"),
    ("garbage.h5", {}, lambda p: p.write_bytes(b"hello, not hdf5" * 100), "not a readable HDF5"),
    ("trunc.npy", {"label": "a"}, lambda p: (np.save(p, make_x()), truncate_file(p, 0.7)), "truncated"),
    ("tail.npy", {"label": "a"}, lambda p: (np.save(p, make_x()), p.open("ab").write(b"junk")), "unexpected bytes"),
    ("nolabel.npy", {}, lambda p: np.save(p, make_x()), "label=CLASS"),
    ("zero.npy", {"label": "a"}, lambda p: np.save(p, np.zeros((0, 4, 3), "f4")), "no samples"),
    ("flat.npy", {"label": "a"}, lambda p: np.save(p, np.zeros(10, "f4")), "ndim >= 2"),
    (
        "obj.npy",
        {"label": "a"},
        lambda p: np.save(p, np.array([[1, "a"], [2, "b"]], object), allow_pickle=True),
        "Python objects",
    ),
    ("rec.npy", {"label": "a"}, lambda p: np.save(p, np.zeros((3, 2), "i4,f4")), "numeric"),
    ("str.npy", {"label": "a"}, lambda p: np.save(p, np.array([["a", "b"]])), "numeric"),
    ("trunc.npz", {}, lambda p: (np.savez(p, x=make_x(), y=np.zeros(N, int)), truncate_file(p, 0.5)), "zip"),
    ("short.npz", {}, _npz_short_member, "array 'x' is truncated"),
    (
        "nox.npz",
        {},
        lambda p: np.savez(p, data=make_x(), labels=np.zeros(N, int)),
        "no array 'x' in the archive; it holds: data, labels",
    ),
    ("noy.npz", {}, lambda p: np.savez(p, x=make_x(), labels=np.zeros(N, int)), "no label array 'y'"),
    (
        "len.npz",
        {},
        lambda p: np.savez(p, x=make_x(), y=np.zeros(N - 1, int)),
        f"{N} samples but label array 'y' has {N - 1}",
    ),
    ("float_y.npz", {}, lambda p: np.savez(p, x=make_x(), y=np.zeros(N)), "class ids or class names"),
    ("zero.npz", {}, lambda p: np.savez(p, x=np.zeros((0, 4, 3), "f4"), y=np.zeros(0, int)), "no samples"),
    ("obj.npz", {"label": "a"}, lambda p: np.savez(p, x=np.array([[1, None]], object)), "pickled Python objects"),
    (
        "nox.h5",
        {},
        lambda p: _write_h5(p, data=make_x()),
        "no samples dataset 'x' in the file; it holds: data",
    ),
    (
        "len.h5",
        {},
        lambda p: _write_h5(p, x=make_x(), y=np.zeros(N + 1, int)),
        f"{N} samples but label dataset 'y' has {N + 1}",
    ),
    ("zero.h5", {}, lambda p: _write_h5(p, x=np.zeros((0, 3, 3)), y=np.zeros(0, int)), "no samples"),
    ("data.csv", {}, lambda p: p.write_text("1,2,3\n"), "unsupported source type '.csv'"),
]


def _write_h5(path: Path, **arrays: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v


@pytest.mark.parametrize(
    ("fname", "kwargs", "make", "expect"),
    [pytest.param(*c, id=c[0], marks=[needs_h5py] if c[0].endswith(".h5") else []) for c in BAD_INPUTS],
)
def test_bad_file_inputs(
    tmp_path: Path, fname: str, kwargs: dict[str, Any], make: Callable[[Path], None], expect: str
) -> None:
    path = tmp_path / fname
    make(path)
    with pytest.raises(SourceError) as err:
        open_source(path, **kwargs)
    one_line(err, path, expect)


def _tree(root: Path) -> None:
    """A class tree ``root/{cat,dog}/0.npy`` (and files no source kind reads: they never count)."""
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        np.save(root / c / "0.npy", make_x())
    (root / "README.txt").write_text("notes")
    (root / ".cache").mkdir()


def _shards(root: Path) -> None:
    from tfrecord_writer import encode_example, write_records

    root.mkdir(parents=True, exist_ok=True)
    write_records(root / "extra.tfrecord", (encode_example({"x": row.reshape(-1), "y": [0]}) for row in make_x(3)))
    (root / "dataset_info.json").write_text("{}")


#: (what the directory is, the stray entry put beside it, words of the refusal): every kind with a stray of another.
STRAYS = [
    ("tree", "extra.tfrecord", "mixes TFRecord files (extra.tfrecord) and class subdirectories (cat, dog)"),
    ("tree", "x.npy", "mixes class subdirectories (cat, dog) and files (x.npy)"),
    ("tree", "x.h5", "mixes class subdirectories (cat, dog) and files (x.h5)"),
    ("shards", "x.npz", "mixes TFRecord files (extra.tfrecord) and files (x.npz)"),
    ("shards", "sub/", "mixes TFRecord files (extra.tfrecord) and class subdirectories (sub)"),
    ("store", "extra.tfrecord", "mixes a store (data.mdb) and TFRecord files (extra.tfrecord)"),
    ("tree", "cat/a.tfrecord", "cat: the class directory holds 'a.tfrecord' beside its .npy files"),
    ("tree", "dog/more/", "dog: the class directory holds 'more' beside its .npy files"),
    ("tree", "dog/y.npz", "dog: the class directory holds 'y.npz' beside its .npy files"),
]


@pytest.mark.parametrize(("kind", "stray", "words"), STRAYS, ids=[f"{k}+{s}" for k, s, _ in STRAYS])
def test_a_directory_mixing_kinds_is_refused(tmp_path: Path, kind: str, stray: str, words: str) -> None:
    """Issue 40: a stray .tfrecord at the top of a class tree ingested its 3 records and dropped the classes'
    samples in silence; a directory read as one kind now refuses an entry of another kind, in one line."""
    root = tmp_path / "root"
    if kind == "store":
        from lmdbstore.ingestion.pipeline import ingest_synthetic

        ingest_synthetic(root, 10)
    else:
        (_tree if kind == "tree" else _shards)(root)
    assert len(open_source(root, sample_shape=SHAPE if kind == "tree" else None)) >= 1  # alone, it reads
    if stray.endswith("/"):
        (root / stray).mkdir()
    elif stray.endswith(".tfrecord"):
        _shards(tmp_path / "s")
        (tmp_path / "s" / "extra.tfrecord").rename(root / stray)
    else:
        (root / stray).write_bytes(b"\0")
    line = one_error_line(run_cli("ingest", tmp_path / "out", root))
    assert words in line and "hint:" in line, line
    assert not (tmp_path / "out").exists()
