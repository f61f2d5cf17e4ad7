"""Ingest sources: every kind round-trips bit for bit, bad input fails in one line naming the file."""

from __future__ import annotations

import io
import math
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli_measured

from lmdbstore import open_reader, open_writer
from lmdbstore.errors import LmdbStoreError, SourceError, ValidationError
from lmdbstore.ingestion.sources import (
    DirectoryClassSource,
    H5Source,
    NpySource,
    NpzSource,
    Source,
    infer_classes,
    open_source,
    open_sources,
    scan_source,
)

try:
    import h5py
except ImportError:  # pragma: no cover - h5py is a dev dependency
    h5py = None
needs_h5py = pytest.mark.skipif(h5py is None, reason="h5py (lmdbstore[hdf5]) is not installed")

SHAPE = (4, 3)
N = 157
BATCHES = [1, 7, 64, 1000]


def make_x(n: int = N, shape: tuple[int, ...] = SHAPE, dtype: Any = "f4", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, *shape)).astype(dtype)
    return rng.integers(0, 100, (n, *shape)).astype(dtype)


def collect(src: Source, batch: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """All (x, y) from ``start``, checking the batch contract on the way."""
    xs, ys = [], []
    for x, y in src.iter_batches(batch, start):
        assert x.dtype == src.dtype and x.shape[1:] == src.shape
        assert 1 <= len(x) <= batch and len(y) == len(x) and y.ndim == 1
        assert x.flags.c_contiguous and x.flags.writeable
        xs.append(x)
        ys.append(y)
    if not xs:
        return np.zeros((0, *src.shape), src.dtype), np.zeros(0)
    return np.concatenate(xs).astype(src.dtype), np.concatenate(ys)  # concatenate drops byte order


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_roundtrip(src: Source, x: np.ndarray, y: np.ndarray) -> None:
    """Every batch size and several start offsets give exactly x[start:], y[start:]."""
    assert len(src) == len(x)
    for batch in BATCHES:
        for start in (0, 5, len(x) - 1, len(x)):
            got_x, got_y = collect(src, batch, start)
            assert same_bits(got_x, x[start:]), (batch, start)
            assert got_y.tolist() == y[start:].tolist(), (batch, start)


def one_line(err: pytest.ExceptionInfo[Any], *names: str | Path) -> str:
    text = str(err.value)
    assert "\n" not in text
    for name in names:
        assert str(name) in text, (name, text)
    return text


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("label", ["cat", 3])
def test_npy_roundtrip(tmp_path: Path, label: str | int) -> None:
    x = make_x()
    np.save(tmp_path / "a.npy", x)
    (src,) = open_source(tmp_path / "a.npy", label=label)
    assert isinstance(src, NpySource) and src.name == str(tmp_path / "a.npy")
    assert src.shape == SHAPE and src.dtype == np.dtype("f4")
    assert_roundtrip(src, x, np.full(N, label))
    assert src.class_names() == (["cat"] if label == "cat" else None)
    _, y = collect(src, 50)
    assert y.dtype.kind == ("U" if label == "cat" else "i")


@pytest.mark.parametrize(
    "x",
    [
        make_x(40, (2, 3, 5), "u1"),
        make_x(40, (6,), ">f8"),  # big-endian: yielded as found in the file
        np.asfortranarray(make_x(40, (5, 7), "f4")),  # strided on disk
        make_x(40, (3, 3), "i8"),
    ],
    ids=["uint8-3d", "big-endian", "fortran", "int64"],
)
def test_npy_dtypes_and_layouts(tmp_path: Path, x: np.ndarray) -> None:
    np.save(tmp_path / "a.npy", x)
    (src,) = open_source(tmp_path / "a.npy", label="a")
    assert src.dtype == x.dtype and src.shape == x.shape[1:]
    assert_roundtrip(src, np.ascontiguousarray(x), np.full(len(x), "a"))


@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflated"])
@pytest.mark.parametrize("labels", ["ints", "names"])
def test_npz_roundtrip(tmp_path: Path, compressed: bool, labels: str) -> None:
    x = make_x()
    y = np.arange(N) % 5 if labels == "ints" else np.array(["ant", "bee", "cow"])[np.arange(N) % 3]
    save = np.savez_compressed if compressed else np.savez
    save(tmp_path / "d.npz", x=x, y=y, other=np.zeros(3))
    (src,) = open_source(tmp_path / "d.npz")
    assert isinstance(src, NpzSource) and src.name == f"{tmp_path / 'd.npz'}[x]"
    assert src.class_names() is None
    assert_roundtrip(src, x, y)
    assert [v.tolist() for v in src.iter_labels(50, 7)] == [y[7:57].tolist(), y[57:107].tolist(), y[107:].tolist()]


def test_npz_custom_keys_class_names_and_label_override(tmp_path: Path) -> None:
    x = make_x()
    ids = np.arange(N) % 3
    names = np.array(["zebra", "ant", "mole"])
    np.savez_compressed(tmp_path / "d.npz", samples=x, target=ids.astype(np.uint8), class_names=names)
    (src,) = open_source(tmp_path / "d.npz", x_key="samples", y_key="target")
    assert src.class_names() == ["zebra", "ant", "mole"]
    # integer ids index the archive's own class_names: the source yields the names
    assert_roundtrip(src, x, names[ids])
    # label= replaces the labels; the label array need not exist
    np.savez(tmp_path / "nolab.npz", x=x)
    (src2,) = open_source(tmp_path / "nolab.npz", label="ant")
    assert_roundtrip(src2, x, np.full(N, "ant"))
    assert src2.class_names() == ["ant"]


def write_dir(root: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """b_dog: 3 stacks (one of them a single-row stack); a_cat: 20 single-sample files; c_eel: empty."""
    (root / "b_dog").mkdir(parents=True)
    (root / "a_cat").mkdir()
    (root / "c_eel").mkdir()  # a class with no files: still a class name, no source
    (root / ".hidden").mkdir()
    np.save(root / "b_dog" / "s2.npy", x[20:50])
    np.save(root / "b_dog" / "s1.npy", x[50:51])  # stack of one: shape (1, *SHAPE)
    np.save(root / "b_dog" / "s0.npy", x[51:90])
    (root / "b_dog" / "notes.txt").write_text("ignored")
    for i in range(20):
        np.save(root / "a_cat" / f"{i:03d}.npy", x[i])
    # files sorted by name: b_dog is s0, s1, s2
    return {"a_cat": x[:20], "b_dog": np.concatenate([x[51:90], x[50:51], x[20:50]])}


def test_directory_roundtrip(tmp_path: Path) -> None:
    x = make_x(90)
    want = write_dir(tmp_path / "root", x)
    srcs = open_source(tmp_path / "root")
    assert [type(s) for s in srcs] == [DirectoryClassSource, DirectoryClassSource]
    assert [s.class_name for s in srcs] == ["a_cat", "b_dog"]  # type: ignore[attr-defined]
    for s in srcs:
        assert s.shape == SHAPE and s.dtype == np.dtype("f4")
        assert s.class_names() == ["a_cat", "b_dog", "c_eel"]
        cls = s.class_name  # type: ignore[attr-defined]
        assert_roundtrip(s, want[cls], np.full(len(want[cls]), cls))
    dog = srcs[1]
    assert dog.locate(0) == (tmp_path / "root" / "b_dog" / "s0.npy", 0)
    assert dog.locate(39) == (tmp_path / "root" / "b_dog" / "s1.npy", 0)
    assert dog.locate(41) == (tmp_path / "root" / "b_dog" / "s2.npy", 1)
    # tiny single-sample files are gathered into full batches
    assert [len(b) for b, _ in srcs[0].iter_batches(8)] == [8, 8, 4]


def test_directory_of_stacks_and_sample_shape(tmp_path: Path) -> None:
    x = make_x(60)
    root = tmp_path / "r"
    (root / "k").mkdir(parents=True)
    np.save(root / "k" / "a.npy", x[:30])
    np.save(root / "k" / "b.npy", x[30:])
    # equally shaped files: read as single samples of shape (30, 4, 3) unless told otherwise
    (whole,) = open_source(root)
    assert whole.shape == (30, *SHAPE) and len(whole) == 2
    (stacked,) = open_source(root, sample_shape=SHAPE)
    assert stacked.shape == SHAPE
    assert_roundtrip(stacked, x, np.full(60, "k"))
    # stacks of different lengths are recognised as stacks
    np.save(root / "k" / "b.npy", x[30:50])
    (src,) = open_source(root)
    assert src.shape == SHAPE and len(src) == 50


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


def test_batches_are_independent_arrays(tmp_path: Path) -> None:
    """A caller (the writer) may keep every yielded batch: none is reused."""
    x = make_x()
    np.save(tmp_path / "a.npy", x)
    (src,) = open_source(tmp_path / "a.npy", label="a")
    kept = [b for b, _ in src.iter_batches(10)]
    assert same_bits(np.concatenate(kept), x)


def test_bad_batch_and_start_arguments(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_x())
    (src,) = open_source(tmp_path / "a.npy", label="a")
    with pytest.raises(ValueError, match="batch"):
        next(src.iter_batches(0))
    with pytest.raises(ValueError, match="start"):
        next(src.iter_batches(4, N + 1))
    with pytest.raises(ValueError, match="label"):
        open_source(tmp_path / "a.npy", label=True)
    with pytest.raises(ValueError, match="label"):
        open_source(tmp_path / "a.npy", label=-1)


# ---------------------------------------------------------------------------------------------- fingerprints
def test_fingerprints(tmp_path: Path) -> None:
    x = make_x()
    npy, npz, root = tmp_path / "a.npy", tmp_path / "b.npz", tmp_path / "root"
    np.save(npy, x)
    np.savez(npz, x=x, y=np.arange(N) % 2, z=x)
    write_dir(root, make_x(90))

    def fp(path: Path, **kw: Any) -> list[str]:
        return [s.fingerprint() for s in open_source(path, **kw)]

    a = fp(npy, label="a")
    assert a == fp(npy, label="a")  # stable across opens
    assert a != fp(npy, label="b") and a != fp(npy, label=0)
    assert fp(npz) != fp(npz, x_key="z") and fp(npz) != fp(npz, label="a")
    fps = {*a, *fp(npz), *fp(root)}
    assert len(fps) == 4 and all(len(f.encode()) < 300 for f in fps)

    # same size, new content and mtime -> new fingerprint
    np.save(npy, x + 1)
    st = npy.stat()
    os.utime(npy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fp(npy, label="a") != a
    # only touching the file also counts as a change (mtime_ns)
    b = fp(npy, label="a")
    os.utime(npy, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert fp(npy, label="a") != b

    # a file added to one class changes that class's fingerprint only
    cat, dog = fp(root)
    np.save(root / "b_dog" / "s9.npy", make_x(2))
    cat2, dog2 = fp(root)
    assert cat2 == cat and dog2 != dog


def test_open_sources_refuses_duplicates(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_x())
    np.save(tmp_path / "b.npy", make_x())
    srcs = open_sources([tmp_path / "a.npy", tmp_path / "b.npy"], label="a")
    assert [len(s) for s in srcs] == [N, N]
    with pytest.raises(SourceError) as err:
        open_sources([tmp_path / "a.npy", tmp_path / ".." / tmp_path.name / "a.npy"], label="a")
    one_line(err, "a.npy", "more than once")


# ---------------------------------------------------------------------------------------------- bad input
def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 3
    data[i : i + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


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
    ("trunc.npy", {"label": "a"}, lambda p: (np.save(p, make_x()), _truncate(p, 0.7)), "truncated"),
    ("tail.npy", {"label": "a"}, lambda p: (np.save(p, make_x()), p.open("ab").write(b"junk")), "unexpected bytes"),
    ("nolabel.npy", {}, lambda p: np.save(p, make_x()), "--label"),
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
    ("trunc.npz", {}, lambda p: (np.savez(p, x=make_x(), y=np.zeros(N, int)), _truncate(p, 0.5)), "zip"),
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


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4), (6,)], ids=["2d", "3d", "1d"])
def test_npz_fortran_members_read_as_numpy_reads_them(
    tmp_path: Path, save: Callable[..., None], shape: tuple[int, ...]
) -> None:
    """Fortran-order members are accepted like Fortran-order .npy files, streamed and transposed as numpy does."""
    x = np.asfortranarray(make_x(N, shape))
    y = np.arange(N) % 5
    path = tmp_path / "f.npz"
    save(path, x=x, y=y)
    with zipfile.ZipFile(path) as zf, zf.open("x.npy") as f:
        np.lib.format.read_magic(f)
        assert np.lib.format.read_array_header_1_0(f)[1]  # really stored fortran_order=True
    (src,) = open_source(path)
    assert src.shape == shape and src.dtype == x.dtype
    assert_roundtrip(src, np.load(path)["x"], y)
    assert same_bits(collect(src, 64)[0], np.ascontiguousarray(x))


def _bomb_class_names(path: Path, n: int = 4_000_000, descr: str = "<U100") -> None:
    """A valid npz whose deflated ``class_names`` member really holds n x U100 zeros (1.6 GB), a few MB on disk."""
    np.savez(path, x=make_x(), y=np.zeros(N, int))
    with (
        zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
        zf.open("class_names.npy", "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": (n,)})
        left = n * np.dtype(descr).itemsize
        chunk = bytes(16 << 20)
        while left:
            f.write(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
    assert path.stat().st_size < 16 << 20


def test_class_names_member_claiming_millions_of_names_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "bomb.npz"
    _bomb_class_names(path)
    with pytest.raises(SourceError) as err:
        open_source(path)
    text = one_line(err, path, "'class_names'", "4000000", "65535")
    assert len(text) < 500
    r = run_cli_measured(tmp_path, "ingest", tmp_path / "s", path, "--no-progress")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.strip().count("\n") == 0, r.stderr[:2000]
    assert "'class_names'" in r.stderr and len(r.stderr) < 500
    assert r.peak_mib < 300, r.peak_mib
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("names", "expect"),
    [
        (np.zeros(70_000, "<U1"), "70000 class names"),
        (np.array(["a", "b" * 1000]), "1000 characters"),
        (np.array([["a", "b"]]), "1-D array of strings"),
        (np.array([1, 2]), "1-D array of strings"),
    ],
    ids=["count", "width", "2d", "ints"],
)
def test_npz_class_names_header_is_bounded(tmp_path: Path, names: np.ndarray, expect: str) -> None:
    path = tmp_path / "n.npz"
    np.savez(path, x=make_x(), y=np.zeros(N, int), class_names=names)
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert len(one_line(err, path, "'class_names'", expect)) < 500


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


def test_member_lists_in_messages_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "many.npz"
    np.savez(path, **{f"m{i:03d}": np.zeros(1) for i in range(200)})
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert len(one_line(err, path, "m000, m001", "(195 more)")) < 500


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
def test_corrupt_npz_member_fails_while_reading(tmp_path: Path, save: Callable[..., None]) -> None:
    path = tmp_path / "c.npz"
    save(path, x=make_x(2000), y=np.zeros(2000, int))
    _corrupt_middle(path)
    with pytest.raises(SourceError) as err:
        src = open_source(path)[0]
        for _ in src.iter_batches(256):
            pass
    one_line(err, path)


def test_npy_truncated_after_opening(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, make_x())
    (src,) = open_source(path, label="a")
    _truncate(path, 0.5)
    with pytest.raises(SourceError) as err:
        collect(src, 16)
    one_line(err, path, "truncated")


def _dir_case(root: Path, case: str) -> Path:
    """Build a bad directory; return the path the error must name."""
    root.mkdir()
    if case == "no-subdirs":
        np.save(root / "a.npy", make_x(3))
        return root
    (root / "cat").mkdir()
    (root / "dog").mkdir()
    if case == "no-npy":
        (root / "cat" / "x.txt").write_text("hi")
        return root
    np.save(root / "cat" / "001.npy", make_x(1)[0])
    np.save(root / "cat" / "002.npy", make_x(1)[0])
    bad = root / "dog" / "007.npy"
    if case == "other-shape":
        np.save(bad, make_x(1, (5, 5))[0])
    elif case == "other-dtype":
        np.save(bad, make_x(1, SHAPE, "f8")[0])
    elif case == "empty-file":
        bad.write_bytes(b"")
    elif case == "truncated-file":
        np.save(bad, make_x(10))
        _truncate(bad, 0.6)
    elif case == "garbage-file":
        bad.write_bytes(b"x" * 5000)
    return bad


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("no-subdirs", "no class subdirectories"),
        ("no-npy", "no .npy files"),
        ("other-shape", "shape (5, 5)"),
        ("other-dtype", "dtype float64"),
        ("empty-file", "empty"),
        ("truncated-file", "truncated"),
        ("garbage-file", "not a valid .npy"),
    ],
)
def test_bad_directories(tmp_path: Path, case: str, expect: str) -> None:
    named = _dir_case(tmp_path / "root", case)
    with pytest.raises(SourceError) as err:
        open_source(tmp_path / "root")
    one_line(err, named, expect)


def test_directory_refuses_label(tmp_path: Path) -> None:
    write_dir(tmp_path / "root", make_x(90))
    with pytest.raises(SourceError) as err:
        open_source(tmp_path / "root", label="a")
    one_line(err, tmp_path / "root", "label")


def _shaped_dir(root: Path, *groups: tuple[int, tuple[int, ...]]) -> list[Path]:
    """``root/<class>/NNN.npy``: ``count`` files of each ``shape``, alternating between two classes; their paths."""
    paths = []
    for count, shape in groups:
        for _ in range(count):
            p = root / ("cat", "dog")[len(paths) % 2] / f"{len(paths):03d}.npy"
            p.parent.mkdir(parents=True, exist_ok=True)
            np.save(p, make_x(1, shape, seed=len(paths))[0])
            paths.append(p)
    return paths


@pytest.mark.parametrize("odd_shape", [(24, 25), (25,)])
def test_directory_one_odd_file_is_named_not_read_as_stacks(tmp_path: Path, odd_shape: tuple[int, ...]) -> None:
    """One malformed file must not turn (25, 25) samples into stacks of 25-vectors (or the reverse)."""
    root = tmp_path / "root"
    *_, odd = _shaped_dir(root, (12, (25, 25)), (1, odd_shape))
    with pytest.raises(SourceError) as err:
        open_source(root)
    text = one_line(err, odd, f"shape {odd_shape}", "12 of 13 files have (25, 25)", "--sample-shape")
    assert str(root / "cat") not in text.replace(str(odd), "")  # only the odd file is named
    # the files really are stacks of 25-vectors: say so explicitly
    (cat, dog) = open_source(root, sample_shape=(25,))
    assert cat.shape == (25,) and len(cat) + len(dog) == 12 * 25 + math.prod(odd_shape) // 25


def test_directory_single_samples_and_stacks_keep_their_shape(tmp_path: Path) -> None:
    _shaped_dir(tmp_path / "a", (6, (25, 25)))
    (cat, dog) = open_source(tmp_path / "a")
    assert cat.shape == (25, 25) and len(cat) + len(dog) == 6
    # single samples mixed with stacks of them, of any lengths, or as many of one length
    _shaped_dir(tmp_path / "b", (4, (25, 25)), (1, (3, 25, 25)), (1, (7, 25, 25)), (1, (1, 25, 25)))
    _shaped_dir(tmp_path / "c", (3, (25, 25)), (3, (10, 25, 25)))
    for root, n in ((tmp_path / "b", 15), (tmp_path / "c", 33)):
        (cat, dog) = open_source(root)
        assert cat.shape == dog.shape == (25, 25) and len(cat) + len(dog) == n


def test_directory_many_odd_files_are_counted(tmp_path: Path) -> None:
    root = tmp_path / "root"
    paths = _shaped_dir(root, (100, (25, 25)), (30, (24, 25)))
    with pytest.raises(SourceError) as err:
        open_source(root)
    text = one_line(err, root, "30 of 130 files", "100 of 130 files have (25, 25)", "(27 more)")
    assert sum(f"{p.parent.name}/{p.name}" in text for p in paths) == 3  # the first three odd files
    assert "cat/100.npy (24, 25)" in text and len(text) < 500


def test_directory_without_a_majority_shape_needs_it_given(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _shaped_dir(root, (10, (25, 25)), (10, (24, 25)))
    with pytest.raises(SourceError) as err:
        open_source(root)
    text = one_line(err, root, "cannot tell the sample shape", "(25, 25) in 10", "(24, 25) in 10", "--sample-shape")
    assert ".npy" not in text
    with pytest.raises(SourceError) as err:
        open_source(root, sample_shape=(25, 25))
    one_line(err, root, "10 of 20 files", "given sample shape is (25, 25)", "cat/010.npy (24, 25)", "(7 more)")
    (cat, dog) = open_source(root, sample_shape=(25,))
    assert cat.shape == (25,) and len(cat) + len(dog) == 10 * 25 + 10 * 24


# ---------------------------------------------------------------------------------------------- scan_source
CLASSES = ["ant", "bee", "cow"]


def test_scan_accepts_good_sources_and_reports_progress(tmp_path: Path) -> None:
    x = make_x()
    np.savez_compressed(tmp_path / "d.npz", x=x, y=np.array(CLASSES)[np.arange(N) % 3])
    np.save(tmp_path / "a.npy", x.astype("f8"))
    (npz,) = open_source(tmp_path / "d.npz")
    seen: list[int] = []
    scan_source(npz, shape=SHAPE, dtype="float32", classes=CLASSES, batch=50, progress=seen.append)
    assert seen == [50, 50, 50, 7]
    (npy,) = open_source(tmp_path / "a.npy", label=2)
    with pytest.raises(ValidationError) as err:
        scan_source(npy, shape=SHAPE, dtype="float32", classes=CLASSES)
    one_line(err, tmp_path / "a.npy", "dtype float64")
    scan_source(npy, shape=SHAPE, dtype="float32", classes=CLASSES, cast=True)  # casting allowed


@pytest.mark.parametrize("start", [0, 100])
def test_scan_names_first_nonfinite_sample(tmp_path: Path, start: int) -> None:
    x = make_x(300)
    x[123, 1, 2] = np.nan
    x[200, 0, 0] = np.inf
    np.save(tmp_path / "a.npy", x)
    (src,) = open_source(tmp_path / "a.npy", label="ant")
    with pytest.raises(ValidationError) as err:
        scan_source(src, shape=SHAPE, dtype="f4", classes=CLASSES, batch=32, start=start)
    assert err.value.key == 123 and err.value.path == str(tmp_path / "a.npy")
    one_line(err, tmp_path / "a.npy", "NaN")
    scan_source(src, shape=SHAPE, dtype="f4", classes=CLASSES, allow_nonfinite=True, batch=32)
    with pytest.raises(ValidationError) as err:
        scan_source(src, shape=SHAPE, dtype="f4", classes=CLASSES, batch=32, start=150)
    assert err.value.key == 200


def test_scan_names_the_directory_file(tmp_path: Path) -> None:
    x = make_x(90)
    x[58] = np.inf  # b_dog/s0.npy holds x[51:90] -> row 7 of that file
    write_dir(tmp_path / "root", x)
    srcs = open_source(tmp_path / "root")
    scan_source(srcs[0], shape=SHAPE, dtype="f4", classes=["a_cat", "b_dog"])
    with pytest.raises(ValidationError) as err:
        scan_source(srcs[1], shape=SHAPE, dtype="f4", classes=["a_cat", "b_dog"], batch=16)
    assert err.value.key == 7
    one_line(err, tmp_path / "root" / "b_dog" / "s0.npy")
    with pytest.raises(ValidationError) as err:
        scan_source(srcs[0], shape=SHAPE, dtype="f4", classes=["b_dog"])
    one_line(err, tmp_path / "root" / "a_cat" / "000.npy", "unknown class label 'a_cat'")


@pytest.mark.parametrize(
    ("y", "kw", "key", "expect"),
    [
        (np.where(np.arange(N) == 77, 3, 1), {}, 77, "label 3 out of range"),
        (np.where(np.arange(N) == 90, "dog", "ant"), {}, 90, "unknown class label 'dog'"),
        (np.where(np.arange(N) == 12, 5, 0), {"class_names": np.array(["ant", "bee"])}, 12, "outside the file's"),
    ],
    ids=["id-out-of-range", "unknown-name", "id-outside-class-names"],
)
def test_scan_names_first_bad_label(tmp_path: Path, y: np.ndarray, kw: dict[str, Any], key: int, expect: str) -> None:
    np.savez(tmp_path / "d.npz", x=make_x(), y=y, **kw)
    (src,) = open_source(tmp_path / "d.npz")
    with pytest.raises(ValidationError) as err:
        scan_source(src, shape=SHAPE, dtype="f4", classes=CLASSES, batch=20)
    assert err.value.key == key
    one_line(err, tmp_path / "d.npz", expect)


def test_scan_wrong_shape_and_label_option(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_x(10, (5, 5)))
    (src,) = open_source(tmp_path / "a.npy", label="ant")
    with pytest.raises(ValidationError) as err:
        scan_source(src, shape=SHAPE, dtype="f4", classes=CLASSES)
    one_line(err, tmp_path / "a.npy", "shape")
    (src,) = open_source(tmp_path / "a.npy", label=7)
    with pytest.raises(ValidationError) as err:
        scan_source(src, shape=(5, 5), dtype="f4", classes=CLASSES)
    one_line(err, tmp_path / "a.npy", "label 7 out of range")


# ---------------------------------------------------------------------------------------------- infer_classes
def test_infer_classes(tmp_path: Path) -> None:
    x = make_x()
    write_dir(tmp_path / "root", make_x(90))
    np.savez(tmp_path / "ids.npz", x=x, y=np.arange(N) % 4)
    np.savez(tmp_path / "names.npz", x=x, y=np.array(["zz", "b_dog"])[np.arange(N) % 2])
    np.savez(tmp_path / "cn.npz", x=x, y=np.zeros(N, int), class_names=np.array(["q", "p"]))
    np.save(tmp_path / "a.npy", x)

    def infer(*paths: str, **kw: Any) -> list[str]:
        return infer_classes(open_sources([tmp_path / p for p in paths], **kw))

    assert infer("root") == ["a_cat", "b_dog", "c_eel"]
    assert infer("ids.npz") == ["0", "1", "2", "3"]
    assert infer("a.npy", label=6) == [str(i) for i in range(7)]
    assert infer("names.npz", "root") == ["a_cat", "b_dog", "c_eel", "zz"]
    mixed = open_source(tmp_path / "cn.npz") + open_source(tmp_path / "a.npy", label="m")
    assert infer_classes(mixed) == ["m", "p", "q"]
    assert infer("ids.npz", "root", "names.npz") == ["a_cat", "b_dog", "c_eel", "zz"]  # ids 0..3 fit
    with pytest.raises(ValidationError) as err:
        infer("ids.npz", "cn.npz")  # ids up to 3, only 2 names
    one_line(err, tmp_path / "ids.npz", "integer label 3")
    with pytest.raises(ValueError):
        infer_classes([])


# ---------------------------------------------------------------------------------------------- with the writer
def test_batches_feed_a_real_store(tmp_path: Path) -> None:
    """What the sources yield is what StoreWriter.append accepts; the store reads back the same."""
    x = make_x(90)
    want = write_dir(tmp_path / "root", x)
    y = np.array(["a_cat", "b_dog"])[np.arange(N) % 2]
    np.savez_compressed(tmp_path / "d.npz", x=make_x(seed=1), y=y)
    srcs = open_sources([tmp_path / "root", tmp_path / "d.npz"])
    classes = infer_classes(srcs)
    for s in srcs:
        scan_source(s, shape=SHAPE, dtype="f4", classes=classes)
    store = tmp_path / "store"
    with open_writer(store, shape=SHAPE, dtype="float32", classes=classes) as w:
        for s in srcs:
            for bx, by in s.iter_batches(33, w.progress(s.fingerprint())):
                w.append(bx, by, progress=(s.fingerprint(), w.count))
    with open_reader(store) as r:
        assert len(r) == 20 + 70 + N
        assert same_bits(r.read_range(0, 90), np.concatenate([want["a_cat"], want["b_dog"]]))
        assert same_bits(r.read_range(90, 90 + N), make_x(seed=1))
        labels = r.labels()
        assert [classes[i] for i in labels[90:].tolist()] == y.tolist()
        assert labels[:20].tolist() == [0] * 20 and labels[20:90].tolist() == [1] * 70


# ---------------------------------------------------------------------------------------------- streaming
def test_npy_streams_without_loading_the_file(tmp_path: Path) -> None:
    """Iterating a ~200 MB .npy keeps RSS growth far below the file size (no mmap, no whole-file read)."""
    psutil = pytest.importorskip("psutil")
    n, shape = 80_000, (25, 25)  # 200 MB of float32
    path = tmp_path / "big.npy"
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((8000, *shape)).astype("f4")
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n, *shape)})
        for i in range(n // len(chunk)):
            chunk[:, 0, 0] = i  # mark each chunk so the order can be checked
            f.write(chunk.tobytes())
    del chunk
    (src,) = open_source(path, label="a")
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, total, marks = 0, 0, []
    for x, _ in src.iter_batches(4000):
        marks.append(float(x[0, 0, 0]))
        total += len(x)
        peak = max(peak, proc.memory_info().rss - base)
        del x
    assert total == n
    assert marks == [float(i // 2) for i in range(20)]
    assert peak < 80 * 2**20, (
        f"RSS grew by {peak / 2**20:.0f} MiB while streaming a {path.stat().st_size >> 20} MiB file"
    )


def test_errors_are_lmdbstore_errors() -> None:
    assert issubclass(SourceError, LmdbStoreError) and issubclass(ValidationError, LmdbStoreError)
