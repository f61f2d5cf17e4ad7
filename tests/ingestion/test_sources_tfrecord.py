"""TFRecord sources (issue 35): files and directories of shards of tf.train.Example, read without TensorFlow,
crc-checked, validated like every source, resumable per shard; the same store as TensorFlow's own parse."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli_subprocess, make_data, one_error_line, run_cli

from lmdbstore.errors import SourceError, ValidationError
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import TFRecordSource, open_source, open_sources
from lmdbstore.ingestion.sources.tfrecord_io import encode_example, parse_example, write_records
from lmdbstore.store.reader import StoreReader

NAMES = np.array(["a", "b", "c", "d", "e"])


def write_shards(root: Path, x: np.ndarray, y: np.ndarray, shards: int, kind: str = "bytes") -> list[Path]:
    """``x``/``y`` as ``shards`` TFRecord files ``root/data.tfrecord-0000k-of-0000n``: the sample as raw bytes
    (``kind="bytes"``) or a float list, the label as an int64 id (bytes kind) or a bytes class name (float kind)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, part in enumerate(np.array_split(np.arange(len(x)), shards)):
        p = root / f"data.tfrecord-{k:05d}-of-{shards:05d}"
        if kind == "bytes":
            recs = (encode_example({"x": x[i].tobytes(), "y": [int(y[i])]}) for i in part)
        else:
            recs = (encode_example({"x": x[i].reshape(-1), "y": NAMES[y[i]].encode()}) for i in part)
        write_records(p, recs)
        paths.append(p)
    return paths


def store_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    with StoreReader(path) as r:
        return r.read_range(0, r.meta.count), r.labels(), list(r.meta.classes)


@pytest.mark.parametrize("kind", ["bytes", "float"])
def test_shards_ingest_to_a_store_equal_to_the_source(tmp_path: Path, kind: str) -> None:
    x, y = make_data(1000, 3)
    write_shards(tmp_path / "shards", x, y, 4, kind)
    srcs = open_source(tmp_path / "shards", dtype="float32" if kind == "bytes" else None, sample_shape=(25, 25))
    assert [s.path.name for s in srcs] == [f"data.tfrecord-0000{k}-of-00004" for k in range(4)]  # one per shard
    rep = ingest(tmp_path / "s", srcs)
    sx, sy, classes = store_arrays(tmp_path / "s")
    assert rep.added == 1000 and np.array_equal(sx, x)
    want = [str(i) for i in range(5)] if kind == "bytes" else list(NAMES)  # ids, or the records' names
    assert classes == want and np.array_equal(sy, y)


def test_int64_list_samples_and_a_label_option(tmp_path: Path) -> None:
    x = np.arange(60, dtype=np.int64).reshape(20, 3)
    write_records(tmp_path / "f.tfrecords", (encode_example({"v": row}) for row in x))
    (src,) = open_source(tmp_path / "f.tfrecords", x_key="v", label="only")
    assert (src.shape, src.dtype, len(src)) == ((3,), np.dtype("<i8"), 20)
    ingest(tmp_path / "s", [src])
    sx, _, classes = store_arrays(tmp_path / "s")
    assert np.array_equal(sx, x) and classes == ["only"]


def test_shards_resume_one_by_one(tmp_path: Path) -> None:
    x, y = make_data(600, 4)
    paths = write_shards(tmp_path / "shards", x, y, 3)
    ingest(tmp_path / "s", open_sources(paths[:2], dtype="float32", sample_shape=(25, 25)))  # as if cut after two
    rep = ingest(tmp_path / "s", open_source(tmp_path / "shards", dtype="float32", sample_shape=(25, 25)))
    assert [s.skipped for s in rep.sources] == [200, 200, 0] and rep.added == 200
    sx, sy, _ = store_arrays(tmp_path / "s")
    assert np.array_equal(sx, x) and np.array_equal(sy, y)


def _record_offsets(path: Path) -> list[tuple[int, int]]:
    """(start, data length) of every record of a TFRecord file."""
    data, at, out = path.read_bytes(), 0, []
    while at < len(data):
        (n,) = struct.unpack_from("<Q", data, at)
        out.append((at, n))
        at += 12 + n + 4
    return out


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_record_is_one_line_naming_file_and_record(tmp_path: Path) -> None:
    x, y = make_data(300, 5)
    paths = write_shards(tmp_path / "shards", x, y, 3)
    start, _ = _record_offsets(paths[1])[7]
    _flip(paths[1], start + 12 + 30)  # a byte of record 7's data
    res = run_cli("ingest", tmp_path / "s", tmp_path / "shards", "--dtype", "float32", "--sample-shape", "25,25")
    line = one_error_line(res)
    assert res.exit_code == 1 and str(paths[1]) in line and "record 7 is damaged" in line and "crc32c" in line
    assert not (tmp_path / "s").exists()  # validated before anything is written
    # a damaged length, a cut file
    start, _ = _record_offsets(paths[2])[4]
    _flip(paths[2], start + 2)
    with pytest.raises(SourceError, match="record 4 is damaged: the crc32c of its length") as err:
        open_source(paths[2], dtype="float32")
    assert "\n" not in str(err.value)
    raw = paths[0].read_bytes()
    paths[0].write_bytes(raw[: len(raw) - 100])
    with pytest.raises(SourceError, match="record 99 is cut short"):
        open_source(paths[0], dtype="float32")


def test_records_of_another_layout_are_refused(tmp_path: Path) -> None:
    good = encode_example({"x": np.zeros(625, np.float32).tobytes(), "y": [1]})
    cases = [
        (
            [good, encode_example({"x": np.zeros(600, np.float32).tobytes(), "y": [1]})],
            "record 1: feature 'x' holds 2400 bytes",
        ),
        ([good, encode_example({"x": np.zeros(625, np.float32).tobytes()})], "record 1 has no label feature 'y'"),
        ([good, encode_example({"x": np.zeros(625, np.float32), "y": [1]})], "record 1: feature 'x' is a float list"),
        ([good, encode_example({"x": np.full(625, np.nan, np.float32).tobytes(), "y": [1]})], "non-finite"),
        ([good, b"\x0a\x05garbage"], "record 1 is no tf.train.Example"),
    ]
    for k, (records, words) in enumerate(cases):
        p = tmp_path / f"bad{k}.tfrecord"
        write_records(p, records)
        with pytest.raises((SourceError, ValidationError), match=words.replace("(", r"\(")) as err:
            ingest(tmp_path / f"s{k}", open_source(p, dtype="float32", sample_shape=(25, 25)))
        assert str(p) in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / f"s{k}").exists()


def test_opening_errors_name_the_option_to_give(tmp_path: Path) -> None:
    write_records(tmp_path / "f.tfrecord", [encode_example({"x": b"\0" * 2500, "y": [0]})])
    cases = [
        ([], "holds bytes, whose dtype a TFRecord does not record -- hint: give the samples' --dtype"),
        (["--dtype", "float32", "--sample-shape", "5,5"], "holds 625 values, sample_shape (5, 5) needs 25"),
        (
            ["--dtype", "float32", "--x-key", "img"],
            "record 0 has no feature 'img'; it has: x, y -- hint: choose the sample feature with --x-key",
        ),
        (
            ["--dtype", "float32", "--y-key", "lab"],
            "hint: choose the label feature with --y-key, or label every sample with --label CLASS",
        ),
    ]
    for extra, words in cases:
        line = one_error_line(run_cli("ingest", tmp_path / "s", tmp_path / "f.tfrecord", *extra))
        assert words in line, line
    (tmp_path / "empty.tfrecord").write_bytes(b"")
    assert "file is empty" in one_error_line(run_cli("ingest", tmp_path / "s", tmp_path / "empty.tfrecord"))


def test_parse_example_skips_unknown_fields_and_bounds_lengths() -> None:
    msg = encode_example({"x": np.arange(3, dtype=np.float32), "n": [5, -2], "s": [b"ab", b"c"]})
    got = parse_example(msg)
    assert got["x"][0] == "float" and np.array_equal(got["x"][1], [0, 1, 2])
    assert got["n"][0] == "int64" and got["n"][1].tolist() == [5, -2] and got["s"] == ("bytes", [b"ab", b"c"])
    assert set(parse_example(msg, ["n"])) == {"n"}
    with pytest.raises(ValueError, match="claims"):
        parse_example(b"\x0a\xff\xff\xff\x0f" + b"\0" * 10)  # a length far past the message's end


NO_TF = """
import sys
sys.modules["tensorflow"] = None  # import tensorflow raises ImportError: TensorFlow is as good as uninstalled
from lmdbstore_cli.main import main
sys.argv = ["lmdbstore", *sys.argv[1:]]
try:
    main()
finally:
    assert sys.modules["tensorflow"] is None
"""


def test_ingest_works_with_tensorflow_hidden(tmp_path: Path) -> None:
    x, y = make_data(200, 6)
    write_shards(tmp_path / "shards", x, y, 2, "float")
    args = ["ingest", str(tmp_path / "s"), str(tmp_path / "shards"), "--sample-shape", "25,25"]
    done = subprocess.run([sys.executable, "-c", NO_TF, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    sx, sy, classes = store_arrays(tmp_path / "s")
    assert np.array_equal(sx, x) and classes == list(NAMES) and np.array_equal(sy, y)


TF_WRITE = """
import sys
import numpy as np
import tensorflow as tf

x, y, root = np.load(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3]
names = [b"a", b"b", b"c", b"d", b"e"]
for k, part in enumerate(np.array_split(np.arange(len(x)), 3)):
    with tf.io.TFRecordWriter(f"{root}/tf.tfrecord-{k:05d}-of-00003") as w:
        for i in part:
            f = {"raw": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x[i].tobytes()])),
                 "flt": tf.train.Feature(float_list=tf.train.FloatList(value=x[i].reshape(-1))),
                 "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
                 "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[names[y[i]]]))}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
# TensorFlow's own parse of what it wrote: the reference the store must equal
spec = {"raw": tf.io.FixedLenFeature([], tf.string), "flt": tf.io.FixedLenFeature([625], tf.float32),
        "id": tf.io.FixedLenFeature([], tf.int64)}
files = sorted(tf.io.gfile.glob(f"{root}/tf.tfrecord-*"))
xs, fs, ids = [], [], []
for rec in tf.data.TFRecordDataset(files):
    e = tf.io.parse_single_example(rec, spec)
    xs.append(np.frombuffer(e["raw"].numpy(), np.float32)); fs.append(e["flt"].numpy()); ids.append(e["id"].numpy())
np.savez(f"{root}/tf_parsed.npz", raw=np.stack(xs).reshape(-1, 25, 25), flt=np.stack(fs).reshape(-1, 25, 25), id=np.array(ids))
"""


@pytest.mark.slow
def test_the_store_equals_tensorflows_parse_of_shards_tensorflow_wrote(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    x, y = make_data(300, 7)
    root = tmp_path / "shards"
    root.mkdir()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    done = subprocess.run(
        [sys.executable, "-c", TF_WRITE, str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), str(root)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ref = np.load(root / "tf_parsed.npz")
    (root / "tf_parsed.npz").unlink()
    # the bytes feature with int ids, and the float list with names, through the CLI (which never imports TF)
    a = cli_subprocess(
        "ingest",
        tmp_path / "a",
        root,
        "--x-key",
        "raw",
        "--y-key",
        "id",
        "--dtype",
        "float32",
        "--sample-shape",
        "25,25",
    )
    b = cli_subprocess(
        "ingest", tmp_path / "b", root, "--x-key", "flt", "--y-key", "name", "--sample-shape", "25,25", "--workers", "2"
    )
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ax, ay, _ = store_arrays(tmp_path / "a")
    bx, by, bnames = store_arrays(tmp_path / "b")
    assert np.array_equal(ax, ref["raw"]) and np.array_equal(ay, ref["id"]) and np.array_equal(ax, x)
    assert np.array_equal(bx, ref["flt"]) and bnames == list(NAMES) and np.array_equal(by, ref["id"])
    assert isinstance(open_source(root, dtype="float32", x_key="raw", y_key="id")[0], TFRecordSource)
