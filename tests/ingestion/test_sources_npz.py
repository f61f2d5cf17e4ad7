"""``.npz`` sources (sources/npz.py): stored and deflated members round trip (Fortran order too), the
``class_names`` member is bounded before it is read, corrupt members fail while reading."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import assert_roundtrip, collect, make_x, one_line, run_cli_measured, same_bits

from lmdbstore.errors import SourceError, ValidationError
from lmdbstore.ingestion.sources import NpzSource, infer_classes, open_source


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


def test_member_lists_in_messages_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "many.npz"
    np.savez(path, **{f"m{i:03d}": np.zeros(1) for i in range(200)})
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert len(one_line(err, path, "m000, m001", "(195 more)")) < 500


def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 3
    data[i : i + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


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


def test_npz_label_names_holding_a_control_character_are_refused(tmp_path: Path) -> None:
    """Issue 40: the one name check applies to an npz's labels as to its class_names (numpy keeps an inner NUL)."""
    np.savez(tmp_path / "d.npz", x=make_x(), y=np.array(["a", "a\0b"] * (N // 2) + ["a"] * (N % 2)))
    with pytest.raises(ValidationError) as err:
        infer_classes(open_source(tmp_path / "d.npz"))
    one_line(err, tmp_path / "d.npz", r"class label 'a\x00b' holds a control character (at 1)")
