"""Directory sources ``ROOT/<class>/*.npy`` (sources/directory.py): one source per class, single samples
and stacks, the sample shape decided (or refused) with the odd files named."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import SOURCE_SHAPE as SHAPE
from conftest import assert_roundtrip, make_x, one_line, truncate_file, write_dir

from lmdbstore.errors import SourceError
from lmdbstore.ingestion.sources import DirectoryClassSource, open_source


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
        truncate_file(bad, 0.6)
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
    text = one_line(err, odd, f"shape {odd_shape}", "12 of 13 files have (25, 25)", "sample_shape=H,W")
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
    text = one_line(err, root, "cannot tell the sample shape", "(25, 25) in 10", "(24, 25) in 10", "sample_shape=H,W")
    assert ".npy" not in text
    with pytest.raises(SourceError) as err:
        open_source(root, sample_shape=(25, 25))
    one_line(err, root, "10 of 20 files", "given sample shape is (25, 25)", "cat/010.npy (24, 25)", "(7 more)")
    (cat, dog) = open_source(root, sample_shape=(25,))
    assert cat.shape == (25,) and len(cat) + len(dog) == 10 * 25 + 10 * 24
