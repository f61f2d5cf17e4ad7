"""TFRecord sources (issue 35): files and directories of shards of tf.train.Example, read without TensorFlow,
crc-checked, validated like every source, resumable per shard; the same store as TensorFlow's own parse."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import os
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_roundtrip, make_data, one_error_line, run_cli
from tfrecord_writer import encode_example, write_records

from lmdbstore.errors import SourceError, ValidationError
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import TFRecordSource, open_source, open_sources
from lmdbstore.ingestion.sources.tfrecord_io import RecordFile, crc32c_module, parse_example
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


# ------------------------------------------------------------------------------------- the wire format (issue 40)
def _varint(v: int) -> bytes:
    """A varint of ``v`` (not reduced mod 2**64: a value above it makes an overlong varint)."""
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v >> 7 else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _example(**features: bytes) -> bytes:
    """An Example of hand-made ``Feature`` messages (the bytes after each name)."""
    return _ld(1, b"".join(_ld(1, _ld(1, k.encode()) + _ld(2, v)) for k, v in features.items()))


def _unpacked_floats(v: np.ndarray) -> bytes:
    return _ld(2, b"".join(b"\x0d" + f.tobytes() for f in v.astype("<f4")))


def _unpacked_ints(v: list[int]) -> bytes:
    return _ld(3, b"".join(b"\x08" + _varint(i & (1 << 64) - 1) for i in v))


#: Int64 values whose varints take every length, 1 to 10 bytes (negative ones take 10).
VARINT_VALUES = [
    0,
    1,
    127,
    128,
    1 << 14,
    1 << 21,
    1 << 28,
    1 << 35,
    1 << 42,
    1 << 49,
    1 << 56,
    (1 << 63) - 1,
    -1,
    -(1 << 63),
]


def _wire_records(n: int) -> list[bytes]:
    """Records of every protobuf form TensorFlow reads: unpacked float and int lists, packed ints of every varint
    length, empty lists and an empty Feature, unknown fields (of every wire type) in the Example, in a Feature and
    in a FloatList, a two-byte key; record ``i``'s values depend on ``i``."""
    unknown = _varint(7 << 3 | 0) + _varint(300) + _varint(8 << 3 | 1) + b"\0" * 8 + _varint(9 << 3 | 5) + b"\0" * 4
    out = []
    for i in range(n):
        f = np.arange(i, i + 5, dtype=np.float32) / 3
        ints = [v + i if 0 <= v < (1 << 62) else v for v in VARINT_VALUES]
        out.append(
            _example(
                uf=_unpacked_floats(f),
                ui=_unpacked_ints(ints),
                pi=_ld(3, _ld(1, b"".join(_varint(v & (1 << 64) - 1) for v in ints))),
                ef=_ld(2, b""),
                ei=_ld(3, b""),
                e=b"",
                uk=_ld(2, _ld(1, f.tobytes()) + unknown) + unknown,  # TensorFlow refuses them before the values
            )
            + _varint(20 << 3 | 2)
            + _varint(2)
            + b"zz"
            + unknown
        )
    return out


#: What each feature of :func:`_wire_records` is read as by TensorFlow (VarLenFeature).
WIRE_FEATURES = {
    "uf": "float32",
    "ui": "int64",
    "pi": "int64",
    "ef": "float32",
    "ei": "int64",
    "e": "float32",
    "uk": "float32",
}


def test_every_wire_form_parses_to_its_values() -> None:
    rec = _wire_records(3)[2]
    got = parse_example(rec, [*WIRE_FEATURES, "absent"])
    assert set(got) == set(WIRE_FEATURES)
    want_f = np.arange(2, 7, dtype=np.float32) / 3
    ints = [v + 2 if 0 <= v < (1 << 62) else v for v in VARINT_VALUES]
    assert got["uf"][0] == "float" and np.array_equal(got["uf"][1], want_f) and np.array_equal(got["uk"][1], want_f)
    assert got["ui"][1].tolist() == ints and got["pi"][1].tolist() == ints and got["pi"][0] == "int64"
    assert [got[k][0] for k in ("ef", "ei", "e")] == ["float", "int64", "empty"]
    assert all(len(got[k][1]) == 0 for k in ("ef", "ei", "e"))
    msg = encode_example({"x": np.arange(3, dtype=np.float32), "n": [5, -2], "s": [b"ab", b"c"]})
    kind, offsets = parse_example(msg, ["s"])["s"]
    assert kind == "bytes" and [msg[a:b] for a, b in offsets] == [b"ab", b"c"]
    for bad, words in [
        (b"\x0a\xff\xff\xff\x0f" + b"\0" * 10, "claims"),  # a length far past the message's end
        (_example(v=_ld(3, _ld(1, b"\xff" * 9 + b"\x7f"))), "above 2\\*\\*64"),  # a crc-valid 2**70 - 1
        (_example(v=_ld(3, _ld(1, b"\xff" * 10 + b"\x01"))), "longer than 10 bytes"),
        (_example(v=_ld(2, _ld(1, b"\0" * 5))), "not a multiple of 4"),
        (_example(v=_ld(2, b"\x08\x01")), "a float list holds a field of wire type 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_example(bad, ["v", "x"])


def test_an_unpacked_list_costs_its_values_not_35_times_its_record() -> None:
    """Issue 40: 1 MB of unpacked floats took ~35 MB; now the values' array and little else."""
    v = np.random.default_rng(0).standard_normal(20_000).astype(np.float32)
    for feature, nbytes in ((_unpacked_floats(v), 4 * len(v)), (_unpacked_ints(list(range(20_000))), 8 * 20_000)):
        rec = _example(x=feature)
        tracemalloc.start()
        try:
            kind, values = parse_example(rec, ["x"])["x"]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(values) == 20_000 and peak < nbytes + len(rec) // 2, (kind, peak, len(rec))
    assert np.array_equal(parse_example(_example(x=_unpacked_floats(v)), ["x"])["x"][1], v)


def test_empty_lists_overlong_varints_and_nul_names_in_files(tmp_path: Path) -> None:
    """Issue 40: an empty FloatList in any feature is an empty array (the file ingests); a varint above 2**64 and
    a class name holding NUL are one line naming file and record, also through the CLI."""
    x, y = make_data(40, 8)
    recs = [
        _example(x=_ld(1, _ld(1, x[i].tobytes())), y=_ld(3, _ld(1, _varint(int(y[i])))), boxes=_ld(2, b""))
        for i in range(40)
    ]
    write_records(tmp_path / "ok.tfrecord", recs)
    (src,) = open_source(tmp_path / "ok.tfrecord", dtype="float32", sample_shape=(25, 25))
    assert_roundtrip(src, x, y)
    bad = [*recs[:2], _example(x=_ld(1, _ld(1, x[2].tobytes())), y=_ld(3, _ld(1, b"\xff" * 9 + b"\x7f"))), *recs[3:]]
    write_records(tmp_path / "varint.tfrecord", bad)
    names = [encode_example({"x": x[i].tobytes(), "y": name}) for i, name in enumerate([b"a", b"b", b"a\0", b"b"])]
    write_records(tmp_path / "nul.tfrecord", names)
    for path, words in (("varint.tfrecord", "record 2 is no tf.train.Example (a varint is above 2**64)"),
                        ("nul.tfrecord", "class label 'a\\x00' holds a control character (at 2)")):  # fmt: skip
        res = run_cli("ingest", tmp_path / "s", tmp_path / path, "--dtype", "float32", "--sample-shape", "25,25")
        line = one_error_line(res)
        assert res.exit_code == 1 and str(tmp_path / path) in line and words in line, line
        assert not (tmp_path / "s").exists()
    with pytest.raises(SourceError, match="record 0: feature 'boxes' holds 0 values --"):
        open_source(tmp_path / "ok.tfrecord", x_key="boxes", label="a")


def test_big_endian_bytes_are_read_in_the_order_named(tmp_path: Path) -> None:
    """Issue 40: --dtype '>f4' read the bytes little-endian (byte-swapped values, exit 0)."""
    x, y = make_data(30, 9)
    write_records(
        tmp_path / "be.tfrecord",
        (encode_example({"x": x[i].astype(">f4").tobytes(), "y": [int(y[i])]}) for i in range(30)),
    )
    res = run_cli("ingest", tmp_path / "s", tmp_path / "be.tfrecord", "--dtype", ">f4", "--sample-shape", "25,25")
    assert res.exit_code == 0, res.stderr
    sx, sy, _ = store_arrays(tmp_path / "s")
    assert np.array_equal(sx, x) and np.array_equal(sy, y)
    little, big = (open_source(tmp_path / "be.tfrecord", dtype=d)[0].fingerprint() for d in ("<f4", ">f4"))
    assert little != big  # read differently: never the same ledger entry


def _compressed(path: Path, how: str, members: int = 1) -> Path:
    """``path`` as TensorFlow's GZIP or ZLIB file (gzip: ``members`` concatenated members)."""
    raw = path.read_bytes()
    out = path.with_name(f"{how}-{path.name}")
    if how == "zlib":
        out.write_bytes(zlib.compress(raw))
    else:
        cut = np.linspace(0, len(raw), members + 1).astype(int)
        out.write_bytes(b"".join(gzip.compress(raw[a:b]) for a, b in itertools.pairwise(cut)))
    return out


def test_gzip_and_zlib_files_are_read_detected_or_forced(tmp_path: Path) -> None:
    """Issue 40: GZIP/ZLIB files were "record 0 is damaged"; now told by content or forced with --compression,
    streamed (memory bounded), a cut or a wrongly forced stream one line."""
    x, y = make_data(60, 10)
    (plain,) = write_shards(tmp_path / "d", x, y, 1)
    for how, members in (("gzip", 1), ("gzip", 3), ("zlib", 1)):
        path = _compressed(plain, how, members)
        (src,) = open_source(path, dtype="float32", sample_shape=(25, 25))
        assert isinstance(src, TFRecordSource) and src.compression == how
        assert_roundtrip(src, x, y)
        (forced,) = open_source(path, dtype="float32", sample_shape=(25, 25), compression=how.upper())
        assert (
            isinstance(forced, TFRecordSource)
            and forced.compression == how
            and np.array_equal(next(forced.iter_batches(100, 7))[0], x[7:])
        )
    res = run_cli(
        "ingest", tmp_path / "s", path, "--dtype", "float32", "--sample-shape", "25,25", "--compression", "zlib"
    )
    assert res.exit_code == 0 and np.array_equal(store_arrays(tmp_path / "s")[0], x)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    for extra, words in (([], "read failed at record"), (["--compression", "none"], "record 0 is damaged")):
        line = one_error_line(run_cli("ingest", tmp_path / "t", path, "--dtype", "float32", *extra))
        assert str(path) in line and words in line, line
    np.savez(tmp_path / "x.npz", x=x, y=y)
    line = one_error_line(run_cli("ingest", tmp_path / "t", tmp_path / "x.npz", "--compression", "gzip"))
    assert "--compression does not apply to these sources" in line
    with pytest.raises(ValueError, match="compression must be one of none, zlib, gzip"):
        open_source(plain, compression="bz2")


def test_reading_a_big_compressed_file_holds_a_record_not_the_file(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((400, 2500)).astype(np.float32)  # 4 MB of samples
    write_records(tmp_path / "f.tfrecord", (encode_example({"x": row.tobytes(), "y": [0]}) for row in x))
    path = _compressed(tmp_path / "f.tfrecord", "gzip")
    tracemalloc.start()
    try:
        (src,) = open_source(path, dtype="float32")
        total = sum(len(xb) for xb, _ in src.iter_batches(16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 400 and peak < 4 << 20, peak  # a 1 MiB read, its inflated piece, a batch: not the 4 MB


def test_ingest_works_with_tensorflow_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = make_data(200, 6)
    write_shards(tmp_path / "shards", x, y, 2, "float")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow raises ImportError: as if uninstalled
    res = run_cli("ingest", tmp_path / "s", tmp_path / "shards", "--sample-shape", "25,25", "--workers", "2")
    assert res.exit_code == 0, res.stderr
    sx, sy, classes = store_arrays(tmp_path / "s")
    assert np.array_equal(sx, x) and classes == list(NAMES) and np.array_equal(sy, y)


#: Run once per module, in a process of its own (TensorFlow's runtime in the test process would make later tests
#: of that worker start their readers by forkserver): TensorFlow's own writer writes every variant file (TF-made
#: Examples and the hand-made wire forms of :func:`_wire_records`, plain, GZIP and ZLIB) and its own reader
#: (TFRecordDataset + parse_single_example) reads each back; the values go to ``tf.npz``.
TF_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf

root = sys.argv[1]
x, y = np.load(f"{root}/x.npy"), np.load(f"{root}/y.npy")
blob, cuts = open(f"{root}/wire.bin", "rb").read(), np.load(f"{root}/cuts.npy")
names = [b"a", b"b", b"c", b"d", b"e"]
lists = {"bytes": lambda v: tf.train.Feature(bytes_list=tf.train.BytesList(value=v)),
         "float": lambda v: tf.train.Feature(float_list=tf.train.FloatList(value=v)),
         "int64": lambda v: tf.train.Feature(int64_list=tf.train.Int64List(value=v))}
made = [tf.train.Example(features=tf.train.Features(feature={
    "raw": lists["bytes"]([x[i].tobytes()]), "flt": lists["float"](x[i].reshape(-1)), "id": lists["int64"]([int(y[i])]),
    "name": lists["bytes"]([names[y[i]]]), "boxes": lists["float"]([])})).SerializeToString() for i in range(len(x))]
wire = [blob[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
specs = {"made": {"raw": tf.string, "flt": tf.float32, "id": tf.int64, "name": tf.string, "boxes": tf.float32},
         "wire": {"uf": tf.float32, "ui": tf.int64, "pi": tf.int64, "ef": tf.float32, "ei": tf.int64, "e": tf.float32,
                  "uk": tf.float32}}
out = {}
for comp in ("", "GZIP", "ZLIB"):
    for kind, records in (("made", made), ("wire", wire)):
        path = f"{root}/{kind}-{comp.lower() or 'none'}.tfrecord"
        with tf.io.TFRecordWriter(path, tf.io.TFRecordOptions(compression_type=comp)) as w:
            for r in records:
                w.write(r)
        spec = {k: tf.io.VarLenFeature(t) for k, t in specs[kind].items()}
        got = {k: [] for k in spec}
        for rec in tf.data.TFRecordDataset(path, compression_type=comp):
            for k, v in tf.io.parse_single_example(rec, spec).items():
                got[k].append(v.values.numpy())
        for k, vs in got.items():
            if specs[kind][k] == tf.string:  # bytes values: their lengths and their bytes
                vs = [np.frombuffer(b"".join(v), np.uint8) for v in vs]
            out[f"{path.rsplit('/', 1)[1]}:{k}:lengths"] = np.array([len(v) for v in vs])
            out[f"{path.rsplit('/', 1)[1]}:{k}"] = np.concatenate(vs)
np.savez(f"{root}/tf.npz", **out)
"""


@pytest.fixture(scope="module")
def tf_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, np.ndarray, np.ndarray]:
    """The variant files TensorFlow wrote and what TensorFlow read from them (skipped without TensorFlow)."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed (lmdbstore[frameworks])")
    root = tmp_path_factory.mktemp("tf")
    x, y = make_data(60, 7)
    np.save(root / "x.npy", x)
    np.save(root / "y.npy", y)
    wire = _wire_records(12)
    (root / "wire.bin").write_bytes(b"".join(wire))
    np.save(root / "cuts.npy", np.cumsum([0] + [len(r) for r in wire]))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", TF_SCRIPT, str(root)], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root, np.load(root / "tf.npz"), x, y


def _tf_values(ref: Any, name: str, feature: str) -> list[np.ndarray]:
    """TensorFlow's values of ``feature`` in each record of file ``name``."""
    cuts = np.cumsum([0, *ref[f"{name}:{feature}:lengths"]])
    return [ref[f"{name}:{feature}"][a:b] for a, b in itertools.pairwise(cuts)]


@pytest.mark.slow
@pytest.mark.parametrize("comp", ["none", "gzip", "zlib"])
def test_files_tensorflow_wrote_read_as_tensorflow_reads_them(tf_files: Any, comp: str) -> None:
    """The differential check (issues 35, 40): files written by TensorFlow's own writer, plain, GZIP and ZLIB,
    read here as TensorFlow's TFRecordDataset + parse_single_example reads them: its Examples (raw bytes, float
    lists, int64 ids, bytes names, an empty FloatList) as sources, and every wire form (unpacked lists, varints of
    every length, empty lists, an empty Feature, unknown fields) value for value."""
    root, ref, x, y = tf_files
    made, wire = root / f"made-{comp}.tfrecord", root / f"wire-{comp}.tfrecord"
    assert np.array_equal(np.stack(_tf_values(ref, made.name, "raw")).view(np.float32).reshape(x.shape), x)
    (raw,) = open_source(made, x_key="raw", y_key="id", dtype="float32", sample_shape=(25, 25))
    (flt,) = open_source(made, x_key="flt", y_key="name", sample_shape=(25, 25))
    assert isinstance(raw, TFRecordSource) and raw.compression == comp == getattr(flt, "compression", None)
    assert_roundtrip(
        raw,
        np.stack(_tf_values(ref, made.name, "flt")).reshape(x.shape),
        np.concatenate(_tf_values(ref, made.name, "id")),
    )
    assert_roundtrip(flt, x, NAMES[y])
    kinds = {"float32": "float", "int64": "int64"}
    with RecordFile(wire, comp, crc32c_module()) as f:
        records = list(iter(f.next, None))
    assert len(records) == 12
    for feature, dtype in WIRE_FEATURES.items():
        want = _tf_values(ref, wire.name, feature)
        got = [parse_example(r, [feature])[feature] for r in records]
        assert all(k in (kinds[dtype], "empty") and v.dtype == dtype for k, v in got), feature
        assert all(np.array_equal(v, w) for (_, v), w in zip(got, want, strict=True)), feature
