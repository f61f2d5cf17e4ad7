"""Validating sources before writing (sources/scan.py): the first bad sample or label is named with its file;
classes are inferred from the sources; what passes is what a real store accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import SOURCE_SHAPE as SHAPE
from conftest import make_x, one_line, same_bits, write_dir

from lmdbstore import open_reader, open_writer
from lmdbstore.errors import ValidationError
from lmdbstore.ingestion.sources import infer_classes, open_source, open_sources, scan_source

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
