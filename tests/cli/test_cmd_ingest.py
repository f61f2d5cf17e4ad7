"""cli/cmd_ingest.py: ``ingest`` from .npy, .npz, directories of class folders, HDF5 (with workers, class names
from an attribute or a dataset) and ``--synthetic``, appending, reruns adding nothing, and every bad input as one
line that leaves the store as it was; ``synth``; options that do not apply refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CLASSES,
    StoreInfo,
    build_store,
    h5py,
    make_data,
    needs_h5py,
    one_error_line,
    run_cli,
    snapshot_store,
    write_h5,
)

from lmdbstore import ValidationError, open_reader, open_writer
from lmdbstore.errors import SourceError
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.store.reader import StoreReader


def test_ingest_npy_npz_and_directory_then_stats_json(tmp_path: Path) -> None:
    store = tmp_path / "s"
    x1, y1 = make_data(300, 1)
    np.savez(tmp_path / "a.npz", x=x1, y=np.array(CLASSES)[y1])
    r = run_cli("ingest", store, tmp_path / "a.npz", "--classes", ",".join(CLASSES), "--no-progress")
    assert r.exit_code == 0, r.output
    assert "created" in r.stdout and "+300 samples" in r.stdout
    x2, _ = make_data(40, 2)
    np.save(tmp_path / "b.npy", x2)
    r = run_cli("ingest", store, tmp_path / "b.npy", "--label", "d", "--no-progress")
    assert r.exit_code == 0 and "appended to" in r.stdout
    root = tmp_path / "root"
    for i, name in enumerate(("a", "e")):
        (root / name).mkdir(parents=True)
        np.save(root / name / "stack.npy", make_data(5, 10 + i)[0])
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 0, r.output
    r = run_cli("stats", store, "--json")
    assert r.exit_code == 0
    s = json.loads(r.stdout)
    assert s["samples"] == 350
    counts = dict((c["name"], c["count"]) for c in s["classes"])
    assert counts["d"] == int((y1 == 3).sum()) + 40
    assert counts["e"] == int((y1 == 4).sum()) + 5
    assert s["bytes"]["ratio_samples_to_raw"] <= 1.05
    with open_reader(store) as rd:
        got = rd.read_range(0, 350)
    assert np.array_equal(got[:300], x1) and np.array_equal(got[300:340], x2)
    table = run_cli("stats", store)
    assert "18 samples per value" in table.stdout and "exact" in table.stdout


def test_rerunning_the_same_ingest_adds_nothing(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=make_data(100, 1)[0], y=make_data(100, 1)[1])
    args = ("ingest", tmp_path / "s", tmp_path / "a.npz", "--no-progress")
    assert run_cli(*args).exit_code == 0
    r = run_cli(*args)
    assert r.exit_code == 0 and "+0 samples" in r.stdout and "already in the store" in r.stdout


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_bytes(np.lib.format.magic(1, 0) + b"garbage"), ""),
    ],
)
def test_bad_files_give_one_line_and_leave_the_store(tmp_path: Path, setup, words) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "s"
    np.savez(tmp_path / "ok.npz", x=make_data(50, 1)[0], y=make_data(50, 1)[1])
    assert run_cli("ingest", store, tmp_path / "ok.npz", "--no-progress").exit_code == 0
    before = snapshot_store(store)
    bad = tmp_path / "bad.npy"
    setup(bad)
    r = run_cli("ingest", store, bad, "--label", "a", "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "bad.npy" in line and words in line.lower()
    assert snapshot_store(store) == before


def test_nonfinite_is_refused_unless_allowed(tmp_path: Path) -> None:
    x, y = make_data(30, 3)
    x[7, 0, 1] = np.inf
    np.savez(tmp_path / "d.npz", x=x, y=y)
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--no-progress")
    assert r.exit_code == 1 and "non-finite" in one_error_line(r)
    assert not (tmp_path / "s").exists()
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--allow-nonfinite", "--no-progress")
    assert r.exit_code == 0
    s = json.loads(run_cli("stats", tmp_path / "s", "--json").stdout)
    assert s["values"]["nonfinite"] == 1


def _class_dir(root: Path, odd: int) -> Path:
    """``root/{a,b}/*.npy``: 12 (25, 25) samples and ``odd`` (24, 25) files (in ``b``); the first odd one."""
    x, _ = make_data(12 + odd, 7)
    for i in range(12 + odd):
        (root / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        np.save(root / "ab"[i % 2] / f"{i:03d}.npy", x[i] if i < 12 else x[i, 1:])
    return root / "ab"[12 % 2] / "012.npy"


def test_a_malformed_directory_file_is_named_not_read_as_stacks(tmp_path: Path) -> None:
    root, store = tmp_path / "root", tmp_path / "s"
    odd = _class_dir(root, 1)
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 1 and not store.exists()
    line = one_error_line(r)
    assert str(odd) in line and "(24, 25)" in line and "--sample-shape" in line
    r = run_cli("ingest", store, root, "--sample-shape", "25,25", "--no-progress")
    assert r.exit_code == 1 and str(odd) in one_error_line(r) and not store.exists()
    r = run_cli("ingest", store, root, "--sample-shape", "25x25", "--no-progress")
    assert r.exit_code == 1 and "--sample-shape" in one_error_line(r)
    # appending to a store of (25, 25) samples: its shape decides, the store is left as it was
    build_store(store, *make_data(20, 1))
    before = snapshot_store(store)
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 1 and str(odd) in one_error_line(r)
    assert snapshot_store(store) == before
    odd.unlink()
    r = run_cli("ingest", store, root, "--no-progress")
    assert r.exit_code == 0 and "+12 samples" in r.stdout, r.output


def test_a_malformed_directory_as_subprocess(tmp_path: Path) -> None:
    root, store = tmp_path / "root", tmp_path / "s"
    _class_dir(root, 1)
    p = subprocess.run(
        [sys.executable, "-m", "lmdbstore", "ingest", str(store), str(root), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr and not store.exists()
    line = p.stderr.strip()
    assert line.startswith("error: ") and line.count("\n") == 0 and "012.npy" in line, p.stderr


@pytest.mark.parametrize(("classes", "words"), [("a,,b", "blank"), ("a, ,b", "blank"), ("a,b,a", "repeated: 'a'")])
def test_bad_classes_option_gives_one_line(tmp_path: Path, classes: str, words: str) -> None:
    x, y = make_data(30)
    np.savez(tmp_path / "d.npz", x=x, y=y % 3)
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--classes", classes, "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "classes" in line and words in line, line
    assert not (tmp_path / "s").exists()


def test_huge_label_gives_a_short_line(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=make_data(3)[0], y=np.array([0, 1, 10**7]))
    r = run_cli("ingest", tmp_path / "s", tmp_path / "d.npz", "--no-progress")
    assert r.exit_code == 1
    line = one_error_line(r)
    assert "10000000" in line and "d.npz" in line and len(line) < 500
    assert not (tmp_path / "s").exists()


def test_writer_lock_that_is_a_directory(tmp_path: Path, small_store: StoreInfo) -> None:
    before = snapshot_store(small_store.path)
    (small_store.path / "writer.lock").unlink()
    (small_store.path / "writer.lock").mkdir()
    r = run_cli("ingest", small_store.path, "--synthetic", "10", "--no-progress")
    assert r.exit_code == 1 and "writer.lock" in one_error_line(r)
    assert snapshot_store(small_store.path) == before
    assert run_cli("stats", small_store.path).exit_code == 0


@needs_h5py
def test_hdf5_ingests_with_two_workers(tmp_path: Path) -> None:
    src = write_h5(tmp_path / "d.h5", 3000)
    done = run_cli("ingest", tmp_path / "s", src, "--workers", "2")
    assert done.exit_code == 0, done.output
    with StoreReader(tmp_path / "s") as r, h5py.File(src) as f:
        assert r.meta.count == 3000 and np.array_equal(r.read_range(0, 3000), f["x"][()])


@pytest.mark.parametrize("where", ["attr", "dataset", "y_attr"])
@needs_h5py
def test_hdf5_class_names_from_an_attribute_or_a_classes_dataset(tmp_path: Path, where: str) -> None:
    res = run_cli("ingest", tmp_path / "s", write_h5(tmp_path / "d.h5", names=where))
    assert res.exit_code == 0, res.output
    with StoreReader(tmp_path / "s") as r, h5py.File(tmp_path / "d.h5") as f:
        assert list(r.meta.classes) == ["cat", "dog", "eel"] and np.array_equal(r.labels(), f["y"][()])


def test_per_class_stacks_one_at_a_time_say_to_name_the_classes(tmp_path: Path) -> None:
    for k in (0, 36):
        np.save(tmp_path / f"wave{k}.npy", make_data(50, k)[0])
    assert run_cli("ingest", tmp_path / "s", tmp_path / "wave0.npy", "--label", "wave0").exit_code == 0
    done = run_cli("ingest", tmp_path / "s", tmp_path / "wave36.npy", "--label", "wave36")
    line = one_error_line(done)
    assert done.exit_code == 1 and "unknown class label 'wave36'" in line
    assert "hint: a store's classes are fixed when it is created: name them all with --classes" in line
    # what the hint says works
    res = run_cli("ingest", tmp_path / "t", tmp_path / "wave0.npy", "--label", "wave0", "--classes", "wave0,wave36")
    assert res.exit_code == 0
    assert run_cli("ingest", tmp_path / "t", tmp_path / "wave36.npy", "--label", "wave36").exit_code == 0


def test_synthetic_in_float16_and_options_that_do_not_apply(tmp_path: Path) -> None:
    done = run_cli("ingest", tmp_path / "s", "--synthetic", "1000", "--dtype", "float16")
    assert done.exit_code == 0, done.output
    with StoreReader(tmp_path / "s") as r:
        assert r.meta.dtype == "<f2" and r.read_range(0, 10).dtype == np.float16
    np.save(tmp_path / "x.npy", make_data(10, 1)[0])
    cases = [
        (["--synthetic", "10", "--label", "a"], "--label does not apply with --synthetic"),
        (["--synthetic", "10", "--classes", "a,b"], "--classes does not apply with --synthetic"),
        (["--synthetic", "10", "--dtype", "int16"], "must be a float dtype"),
        ([tmp_path / "x.npy", "--label", "a", "--x-key", "v"], "--x-key does not apply to these sources"),
        (
            [tmp_path / "x.npy", "--label", "a", "--sample-shape", "25,25"],
            "--sample-shape does not apply to these sources",
        ),
        ([tmp_path / "x.npy", "--label", "a", "--seed", "1"], "--seed does not apply without --synthetic"),
    ]
    for extra, words in cases:
        assert words in one_error_line(run_cli("ingest", tmp_path / "t", *extra)), extra
    assert not (tmp_path / "t").exists()
    assert (
        "--dtype does not apply"
        not in run_cli(
            "ingest", tmp_path / "u", tmp_path / "x.npy", "--label", "a", "--dtype", "float16", "--cast"
        ).stderr
    )


def test_class_names_with_control_characters_are_refused(tmp_path: Path) -> None:
    for classes in (["a", "b\x00"], ["a\x00"], ["tab\there"], ["esc\x1b[31m"], ["c1\x85"]):
        with pytest.raises(ValueError, match="control character"):
            open_writer(tmp_path / "s", shape=(2,), dtype="float32", classes=classes)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
    with open_writer(tmp_path / "t", shape=(2,), dtype="float32", classes=["a", "b"]) as w:
        for labels in (["a\x00"], "b\x00", [b"a\x00"], ["a", "b\n"]):
            with pytest.raises(ValidationError, match="control character"):
                w.append(np.zeros((len(labels) if isinstance(labels, list) else 1, 2), np.float32), labels)
        assert w.count == 0


def test_class_names_with_control_characters_are_refused_by_ingest(tmp_path: Path) -> None:
    x = np.zeros((4, 3), np.float32)
    npz = tmp_path / "a.npz"
    np.savez(npz, x=x, y=np.array([0, 1, 0, 1]), class_names=np.array(["cat", "d\x01g"]))
    with pytest.raises(SourceError, match="control character"):
        ingest(tmp_path / "s1", open_sources([npz]))
    root = tmp_path / "root"
    for name in ("cat", "d\x01g"):
        (root / name).mkdir(parents=True)
        np.save(root / name / "0.npy", x)
    with pytest.raises(SourceError, match="control character"):
        ingest(tmp_path / "s2", open_sources([root]))
    np.savez(tmp_path / "b.npz", x=x, y=np.array(["cat", "dog", "cat", "dog"]))
    with pytest.raises(ValueError, match="control character"):
        ingest(tmp_path / "s3", open_sources([tmp_path / "b.npz"]), classes=["cat", "dog\x00"])
    r = run_cli("ingest", tmp_path / "s4", root)
    assert r.exit_code == 1 and "control character" in one_error_line(r)
    for s in ("s1", "s2", "s3", "s4"):
        assert not (tmp_path / s / "data.mdb").exists()
