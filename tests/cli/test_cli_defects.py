"""The smaller defects of issue 18, through the library and the CLI: leftovers of killed copies and exports
are removed by the next run (and nothing else is), unwritable destinations and bad ``--device`` values are
one line, class names with control characters are refused at every entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import StoreInfo, one_error_line, run_cli

from lmdbstore import LmdbStoreError, ValidationError, open_writer
from lmdbstore.errors import SourceError
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.tools.copy import copy_store
from lmdbstore.tools.export import export_store


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_copys_leftover_is_removed_by_the_next_copy(small_store: StoreInfo, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dead = _dead_pid()
    leftover = tmp_path / f".dest.copy-{dead}"  # what a copy killed mid-way leaves
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(b"\0" * 8192)
    users = tmp_path / f".dest.copy-{dead + 1}"  # same pattern, but a user's files: never touched
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    live = tmp_path / f".dest.copy-{os.getppid()}"  # a copy still running
    live.mkdir()
    (live / "data.mdb").write_bytes(b"")
    near = tmp_path / f".dest.copy-{dead}x"
    near.write_text("not the pattern")
    copy_store(small_store.path, dest)
    assert not leftover.exists()
    assert (users / "notes.txt").read_text() == "mine" and live.exists() and near.exists()
    assert (dest / "data.mdb").exists()


def test_a_killed_exports_leftover_is_removed_by_the_next_export(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    dead = _dead_pid()
    leftover = tmp_path / f".out.npz.part-{dead}"
    leftover.write_bytes(b"partial zip")
    other = tmp_path / f".other.npz.part-{dead}"  # another target's: not this export's to remove
    other.write_bytes(b"x")
    export_store(small_store.path, out)
    assert not leftover.exists() and other.exists() and out.exists()


@pytest.mark.parametrize(
    "argv", [["copy", "{store}", "/proc/lmdbstore-x"], ["export", "{store}", "/proc/x.npz", "--no-progress"]]
)
def test_unwritable_destinations_are_one_line(small_store: StoreInfo, argv: list[str]) -> None:
    r = run_cli(*[a.format(store=small_store.path) for a in argv])
    assert r.exit_code == 1 and "/proc" in one_error_line(r)


@pytest.mark.parametrize("device", ["cuda:x", "tpu", "cuda", "cuda:3", ""])
def test_bad_devices_are_one_line(small_store: StoreInfo, tmp_path: Path, device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available() and device != "cuda:x":
        pytest.skip("this machine has CUDA")
    r = run_cli("train", small_store.path, "--device", device, "--epochs", "1", "--out", tmp_path / "run")
    assert r.exit_code == 1 and "device" in one_error_line(r)


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


def test_copy_errors_name_the_destination(small_store: StoreInfo, tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="does not exist"):
        copy_store(small_store.path, tmp_path / "no" / "such" / "dir")


# ---------------------------------------------------------------------------------------------- issue 25 #8
def _special(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p)
    else:  # a character device of our own (/dev/null's numbers), never the system's
        try:
            os.mknod(p, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        except (PermissionError, AttributeError):
            pytest.skip("cannot make a character device here")
    return p


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("cmd", ["synth", "export"])
def test_an_output_that_is_a_device_or_fifo_is_refused_not_replaced(
    small_store: StoreInfo, tmp_path: Path, kind: str, cmd: str
) -> None:
    out = _special(tmp_path, kind)
    argv = (
        ["synth", out, "-n", "10"]
        if cmd == "synth"
        else ["export", small_store.path, out, "--force", "--format", "npz"]
    )
    r = run_cli(*argv)
    assert r.exit_code == 1 and "not a regular file" in one_error_line(r)
    mode = out.lstat().st_mode
    assert not __import__("stat").S_ISREG(mode)  # still the FIFO / device
    assert not list(tmp_path.glob(f".{out.name}.*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{s}", "{s}/data.mdb", "--force", "--format", "npy"],
        ["export", "{s}", "{s}/lock.mdb", "--force", "--format", "npz"],
        ["copy", "{s}", "{s}/sub"],
        ["copy", "{s}", "{s}"],
        ["ingest", "{s}/inner", "{s}"],
        ["show", "{s}", "-o", "{s}/data.mdb"],
        ["stats", "{s}", "--plot", "{s}/x.png"],
    ],
)
def test_an_output_inside_or_equal_to_a_source_is_refused(small_store: StoreInfo, argv: list[str]) -> None:
    before = {p.name: p.read_bytes() for p in small_store.path.iterdir()}
    r = run_cli(*[a.format(s=small_store.path) for a in argv])
    assert r.exit_code == 1, r.output
    line = one_error_line(r)
    assert "source" in line or "exists" in line or "a directory" in line, line
    assert {p.name: p.read_bytes() for p in small_store.path.iterdir()} == before  # the store untouched


def test_the_output_rule_in_the_library(small_store: StoreInfo, tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        export_store(small_store.path, small_store.path / "data.mdb", fmt="npy", overwrite=True)
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        copy_store(small_store.path, small_store.path / "sub")
    src = tmp_path / "src.npy"
    np.save(src, np.zeros((4, 3), np.float32))
    with pytest.raises(LmdbStoreError, match="is the source"):
        ingest(src, open_sources([src], label="a"))
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    np.save(root / "a" / "0.npy", np.zeros((3,), np.float32))
    with pytest.raises(LmdbStoreError, match="lies inside the source"):
        ingest(root / "a" / "store", open_sources([root]))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "images", "images/a", "images/a/0.npy", "src.npy", "store", *sorted(
            str(p.relative_to(tmp_path)) for p in small_store.path.iterdir())
    ]  # fmt: skip
