"""``.npy`` sources (sources/npy.py, sources/npyio.py): round trips in every dtype and layout, a file
truncated after opening, streaming without loading the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import SOURCE_SHAPE as SHAPE
from conftest import assert_roundtrip, collect, make_x, one_line, truncate_file

from lmdbstore.errors import SourceError
from lmdbstore.ingestion.sources import NpySource, open_source


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


def test_npy_truncated_after_opening(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, make_x())
    (src,) = open_source(path, label="a")
    truncate_file(path, 0.5)
    with pytest.raises(SourceError) as err:
        collect(src, 16)
    one_line(err, path, "truncated")


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
