"""``verify_store``: a clean store verifies clean, each kind of damage is found at the right index, and a store
replaced while it is verified is one line "replaced".

The damage is done with raw py-lmdb (a real second writer of the same files) or by editing bytes of
``data.mdb`` on disk; nothing is mocked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import build_store, make_data

from lmdbstore import CorruptStoreError, StoreNotFoundError, StoreReader, WriterConfig, open_writer
from lmdbstore.errors import StoreReplacedError
from lmdbstore.format.layout import classidx_key, encode_key
from lmdbstore.tools.verify import PROBLEM_KINDS, AtRest, Problem, VerifyReport, verify_store

#: py-lmdb >= 3.0 ships the offline page walker that verify's structure check uses
HAS_STRUCTURE_CHECK = importlib.util.find_spec("lmdb.verify") is not None
needs_structure_check = pytest.mark.skipif(not HAS_STRUCTURE_CHECK, reason="py-lmdb < 3.0 has no lmdb.verify")

SHAPE = (3, 3)
N = 140_000  # > 2 label chunks of 65,536
SPV = 7
CLASSES = ["a", "b", "c", "d", "e"]
SAMPLE_BYTES = 9 * 4


def _source() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, *SHAPE), dtype=np.float32)
    # class "a" gets 60%: > 65,536 entries, so its index list spans two chunks
    y = rng.choice(5, size=N, p=[0.6, 0.1, 0.1, 0.1, 0.1]).astype(np.int64)
    return x, y


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    path = tmp_path_factory.mktemp("verify") / "store"
    x, y = _source()
    with open_writer(
        path, shape=SHAPE, dtype="float32", classes=CLASSES, config=WriterConfig(samples_per_value=SPV)
    ) as w:
        for lo in range(0, N, 30_001):
            w.append(x[lo : lo + 30_001], y[lo : lo + 30_001], progress=("src", min(lo + 30_001, N)))
    return path, x, y


@pytest.fixture
def store(pristine: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A private copy of the pristine store, free to damage."""
    path, x, y = pristine
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    return copy, x, y


@contextmanager
def raw_env(path: Path) -> Iterator[lmdb.Environment]:
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 30)
    try:
        yield env
    finally:
        env.close()


def _put(path: Path, db: bytes, key: bytes, value: bytes) -> None:
    with raw_env(path) as env, env.begin(write=True) as txn:
        txn.put(key, value, db=env.open_db(db, txn=txn))


def _get(path: Path, db: bytes, key: bytes) -> bytes:
    with raw_env(path) as env, env.begin() as txn:
        value = txn.get(key, db=env.open_db(db, txn=txn))
    assert value is not None
    return bytes(value)


def _delete(path: Path, db: bytes, key: bytes) -> None:
    with raw_env(path) as env, env.begin(write=True) as txn:
        assert txn.delete(key, db=env.open_db(db, txn=txn))


def _edit_meta(path: Path, **changes: object) -> None:
    meta = json.loads(_get(path, b"meta", b"meta"))
    meta.update(changes)
    _put(path, b"meta", b"meta", json.dumps(meta).encode())


def _kinds(report: VerifyReport) -> list[str]:
    return [p.kind for p in report.problems]


# ---------------------------------------------------------------------------------------------- clean


def test_clean_store_verifies_with_every_count(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    seen: list[int] = []
    report = verify_store(path, progress=seen.append)
    assert report.ok, report.problems
    assert report.complete and not report.problems
    n_values = -(-N // SPV)
    assert report.count == N
    assert report.samples_checked == N
    assert report.values_checked == n_values
    assert report.checksums_checked == n_values
    assert report.labels_checked == N and report.label_chunks_checked == 3
    assert report.class_index_entries_checked == N
    assert report.progress_entries_checked == 1
    assert seen and seen == sorted(seen) and seen[-1] == N
    assert report.structure_checked == HAS_STRUCTURE_CHECK
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is True and d["problems"] == [] and d["samples_checked"] == N


def test_verify_accepts_an_open_reader_and_leaves_it_usable(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, x, _ = store
    with StoreReader(path, lock=True) as r:
        report = verify_store(r)
        assert report.ok and report.samples_checked == N
        assert not report.structure_checked and report.notes
        np.testing.assert_array_equal(r.read(N - 1), x[N - 1])


@needs_structure_check
def test_structure_check_waits_for_no_writer(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    """The page walk needs the file at rest: with the writer lock held it is skipped (with a note),
    and while it runs it holds the lock shared, so a writer is refused rather than racing it."""
    import fcntl
    import os

    path, _, _ = store
    fd = os.open(path / "writer.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live writer holds
        report = verify_store(path)
        assert report.ok and not report.structure_checked
        assert any("writer is appending" in n for n in report.notes)
    finally:
        os.close(fd)
    assert verify_store(path).structure_checked == HAS_STRUCTURE_CHECK


def test_bad_max_problems_is_a_value_error(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    with pytest.raises(ValueError, match="max_problems"):
        verify_store(store[0], max_problems=0)


def test_unverifiable_stores_raise_instead_of_reporting(
    tmp_path: Path, store: tuple[Path, np.ndarray, np.ndarray]
) -> None:
    with pytest.raises(StoreNotFoundError):
        verify_store(tmp_path / "nope")
    path = store[0]
    _put(path, b"meta", b"meta", b"{not json")
    with pytest.raises(CorruptStoreError, match="not valid JSON"):
        verify_store(path)


# ---------------------------------------------------------------------------------------------- samples


def test_flipped_byte_in_value_is_a_checksum_problem(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    first = 700 * SPV
    value = bytearray(_get(path, b"samples", encode_key(first)))
    value[5] ^= 0x01
    _put(path, b"samples", encode_key(first), bytes(value))
    report = verify_store(path)
    assert not report.ok
    assert report.problems == [Problem("checksum", first, report.problems[0].message)]
    assert "crc32" in report.problems[0].message
    # the checksum is what catches it: without checksums the bytes look fine
    assert verify_store(path, checksums=False).ok


def test_flipped_byte_on_disk_is_found(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, x, _ = store
    k = 98_765
    data = bytearray((path / "data.mdb").read_bytes())
    off = data.find(x[k].tobytes())
    assert off > 0 and data.find(x[k].tobytes(), off + 1) == -1
    data[off + 6] ^= 0x40
    (path / "data.mdb").write_bytes(bytes(data))
    report = verify_store(path)
    assert report.structure_checked == HAS_STRUCTURE_CHECK
    assert [(p.kind, p.index) for p in report.problems] == [("checksum", k - k % SPV)]


def test_deleted_value_is_missing(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    _delete(path, b"samples", encode_key(1234 * SPV))
    _delete(path, b"samples", encode_key((N - 1) - (N - 1) % SPV))  # the last value too
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [
        ("missing-value", 1234 * SPV),
        ("missing-value", (N - 1) - (N - 1) % SPV),
    ]
    assert report.values_checked == -(-N // SPV) - 2


def test_value_of_wrong_length(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    first = 42 * SPV
    value = _get(path, b"samples", encode_key(first))
    _put(path, b"samples", encode_key(first), value[:-1])
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [("value-length", first)]
    assert f"{len(value) - 1} bytes, expected {len(value)}" in report.problems[0].message


def test_extra_sample_keys(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    _put(path, b"samples", encode_key(701), b"x" * 256)  # off the 7-sample grid
    _put(path, b"samples", encode_key(N + 3 * SPV), b"y" * 256)  # beyond the count
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [("extra-value", 701), ("extra-value", N + 3 * SPV)]
    _put(path, b"samples", b"short", b"z")  # a key of the wrong width: a tree lmdbstore's page parser cannot read
    for workers in (1, 2):
        report = verify_store(path, workers=workers)
        assert [(p.kind, p.index) for p in report.problems] == [("structure", None)] and not report.complete
        assert "samples B-tree cannot be read" in report.problems[0].message and "8-byte key" in str(report.problems[0])
        assert any("content checks skipped" in n for n in report.notes)


# ---------------------------------------------------------------------------------------------- labels, class index


def test_label_out_of_range(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, y = store
    i = 65_536 + 12_345  # in the second label chunk
    chunk = bytearray(_get(path, b"labels", encode_key(65_536)))
    chunk[12_345] = 9
    _put(path, b"labels", encode_key(65_536), bytes(chunk))
    report = verify_store(path)
    first = report.problems[0]
    assert (first.kind, first.index) == ("label-range", i)
    assert "label 9" in first.message
    # the consequences are reported too: the class count and the class's index list disagree
    kinds = _kinds(report)
    assert "class-count" in kinds
    assert ("classidx-mismatch", i) in [(p.kind, p.index) for p in report.problems]
    assert CLASSES[int(y[i])] in " ".join(p.message for p in report.problems if p.kind == "class-count")


def test_missing_or_short_label_chunk(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    _delete(path, b"labels", encode_key(65_536))
    last = _get(path, b"labels", encode_key(131_072))
    _put(path, b"labels", encode_key(131_072), last[:-3])
    report = verify_store(path, max_problems=100)
    pairs = [(p.kind, p.index) for p in report.problems]
    assert pairs[:2] == [("missing-label-chunk", 65_536), ("label-chunk-length", 131_072)]


def test_class_index_entry_changed(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, y = store
    idx_b = np.flatnonzero(y == 1)
    chunk = np.frombuffer(_get(path, b"classidx", classidx_key(1, 0)), "<u8").copy()
    np.testing.assert_array_equal(chunk, idx_b)  # the fixture is what we think it is
    chunk[10] = idx_b[10] + 1
    _put(path, b"classidx", classidx_key(1, 0), chunk.tobytes())
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [("classidx-mismatch", int(idx_b[10]) + 1)]
    assert "position 10" in report.problems[0].message and f"sample {int(idx_b[10])}" in report.problems[0].message


def test_class_index_second_chunk_unsorted_or_missing(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, y = store
    idx_a = np.flatnonzero(y == 0)
    assert len(idx_a) > 65_536
    chunk = np.frombuffer(_get(path, b"classidx", classidx_key(0, 65_536)), "<u8").copy()
    chunk[[3, 4]] = chunk[[4, 3]]  # same entries, out of order
    _put(path, b"classidx", classidx_key(0, 65_536), chunk.tobytes())
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [("classidx-mismatch", int(idx_a[65_536 + 4]))]
    assert f"position {65_536 + 3}" in report.problems[0].message

    _delete(path, b"classidx", classidx_key(0, 65_536))
    _put(path, b"classidx", classidx_key(3, 999), b"\0" * 8)  # off the chunk grid
    report = verify_store(path)
    assert [(p.kind, p.index) for p in report.problems] == [
        ("missing-classidx-chunk", 65_536),
        ("extra-classidx-chunk", 999),
    ]


def test_class_counts_wrong(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, y = store
    counts = np.bincount(y, minlength=5).tolist()
    counts[2] += 5
    counts[4] -= 5  # still sums to count, so the metadata parses
    _edit_meta(path, class_counts=counts)
    report = verify_store(path, max_problems=50)
    pairs = [(p.kind, p.index) for p in report.problems]
    assert pairs[:2] == [("class-count", None), ("class-count", None)]
    assert "'c' has" in report.problems[0].message and f"says {counts[2]}" in report.problems[0].message
    assert "'e' has" in report.problems[1].message
    assert {"classidx-length"} <= set(_kinds(report))


# ---------------------------------------------------------------------------------------------- the rest


def test_extra_databases_keys_and_bad_ledger(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    with raw_env(path) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"junk", txn=txn))
        txn.put(b"other", b"{}", db=env.open_db(b"meta", txn=txn))
        # a pickle payload in the ledger is reported as malformed, never unpickled
        txn.put(b"evil", pickle.dumps({"done": 3}), db=env.open_db(b"progress", txn=txn))
    report = verify_store(path)
    assert _kinds(report) == ["extra-db", "extra-meta-key", "progress"]
    assert "junk" in report.problems[0].message and "evil" in report.problems[2].message


def test_value_stats_must_cover_count(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    meta = json.loads(_get(path, b"meta", b"meta"))
    meta["value_stats"]["n"] -= 9
    _put(path, b"meta", b"meta", json.dumps(meta).encode())
    report = verify_store(path)
    assert _kinds(report) == ["stats"]


def test_max_problems_stops_early(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, _ = store
    with raw_env(path) as env, env.begin(write=True) as txn:
        db = env.open_db(b"samples", txn=txn)
        for v in range(100, 130):
            txn.delete(encode_key(v * SPV), db=db)
    report = verify_store(path, max_problems=5)
    assert not report.ok and not report.complete
    assert [(p.kind, p.index) for p in report.problems] == [("missing-value", v * SPV) for v in range(100, 105)]


def _current_main_root(data: bytes) -> int:
    """Page number of the main database's root, from the newer of LMDB 0.9's two meta pages."""
    best = (-1, -1)
    for page in (0, 1):
        base = page * 4096 + 16  # page header
        txnid = struct.unpack_from("<Q", data, base + 24 + 2 * 48 + 8)[0]
        root = struct.unpack_from("<Q", data, base + 24 + 48 + 40)[0]
        best = max(best, (txnid, root))
    return best[1]


@needs_structure_check
def test_damaged_btree_is_a_structure_problem_without_touching_liblmdb(
    store: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    path, _, _ = store
    data = bytearray((path / "data.mdb").read_bytes())
    root = _current_main_root(bytes(data))
    assert 2 <= root < len(data) // 4096
    data[root * 4096 + 16 : root * 4096 + 4096] = b"\xa5" * (4096 - 16)  # garbage nodes in the main DB root
    (path / "data.mdb").write_bytes(bytes(data))
    report = verify_store(path)
    assert not report.ok and not report.complete and report.structure_checked
    assert set(_kinds(report)) == {"structure"}
    assert any("content checks skipped" in n for n in report.notes)


def test_every_problem_kind_is_documented() -> None:
    assert all(kind and text for kind, text in PROBLEM_KINDS.items())
    assert str(Problem("checksum", 7, "crc32 mismatch")) == "checksum at 7: crc32 mismatch"


# ---------------------------------------------------------------------------------------------- CLI


def _cli() -> object:
    main = pytest.importorskip("lmdbstore_cli.main")
    return main.app


def test_cli_verify_clean_and_json(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    from typer.testing import CliRunner

    path, _, _ = store
    res = CliRunner().invoke(_cli(), ["verify", str(path)])  # type: ignore[arg-type]
    assert res.exit_code == 0, res.output
    assert f"{path}: OK" in res.stdout
    res = CliRunner().invoke(_cli(), ["verify", str(path), "--json"])  # type: ignore[arg-type]
    assert res.exit_code == 0
    d = json.loads(res.stdout)
    assert d["ok"] is True and d["samples_checked"] == N and d["problems"] == []


def test_cli_verify_reports_problems_and_exits_1(store: tuple[Path, np.ndarray, np.ndarray]) -> None:
    from typer.testing import CliRunner

    path, _, _ = store
    first = 300 * SPV
    value = bytearray(_get(path, b"samples", encode_key(first)))
    value[0] ^= 0x80
    _put(path, b"samples", encode_key(first), bytes(value))
    _delete(path, b"samples", encode_key(400 * SPV))
    runner = CliRunner()
    res = runner.invoke(_cli(), ["verify", str(path)])  # type: ignore[arg-type]
    assert res.exit_code == 1
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"problem at {first}: [checksum]")
    assert lines[1].startswith(f"problem at {400 * SPV}: [missing-value]")
    assert "2 problem(s)" in lines[-1]
    res = runner.invoke(_cli(), ["verify", str(path), "--max-problems", "1", "--json"])  # type: ignore[arg-type]
    assert res.exit_code == 1
    d = json.loads(res.stdout)
    assert d["ok"] is False and d["complete"] is False
    assert [(p["kind"], p["index"]) for p in d["problems"]] == [("checksum", first)]
    res = runner.invoke(_cli(), ["verify", str(path), "--no-checksums"])  # type: ignore[arg-type]
    assert res.exit_code == 1 and "[checksum]" not in res.stdout and "[missing-value]" in res.stdout


def test_cli_verify_as_a_subprocess(store: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path) -> None:
    import subprocess
    import sys

    _cli()
    path, _, _ = store
    ok = subprocess.run([sys.executable, "-m", "lmdbstore", "verify", str(path)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("OK"), ok.stderr
    _put(path, b"meta", b"meta", b'{"format": "lmdbstore", "format_version": 99}')
    bad = subprocess.run([sys.executable, "-m", "lmdbstore", "verify", str(path)], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    assert "unsupported format version 99" in bad.stderr and "Traceback" not in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "lmdbstore", "verify", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert missing.returncode != 0 and missing.stderr.count("\n") == 1 and "no such store" in missing.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses file permissions")
def test_verify_reads_a_read_only_store(small_store) -> None:  # type: ignore[no-untyped-def]
    from conftest import run_cli

    path = small_store.path
    files = list(path.iterdir())
    try:
        for p in files:
            p.chmod(0o444)
        path.chmod(0o555)
        r = run_cli("verify", path, "--no-progress")
        assert r.exit_code == 0, r.output
        assert run_cli("stats", path).exit_code == 0
    finally:
        path.chmod(0o755)
        for p in files:
            p.chmod(0o644)


# ---------------------------------------------------------------------------------------------- replaced meanwhile
#: A store replaced while it is verified -- ``rm -r A && cp -r B A``, or ``cp B/data.mdb A/data.mdb`` in place,
#: caught half-way as a copy in progress leaves it -- is a one-line "replaced" error (the CLI's exit 2), never a
#: report on another file (issue 39 #5: 9 ``structure`` problems, exit 1, though both stores are healthy).  The
#: replacement is made from verify's own ``total`` callback, which comes once the walk and the value pass began.
REPLACED_N = 8_003  # 10 MB in 2,001 values of 4 float16 25x25 samples


def _replaceable(path: Path, seed: int) -> Path:
    x, y = make_data(REPLACED_N, seed, dtype=np.float16)
    return build_store(path, x, y, config=WriterConfig(samples_per_value=4), batch=3_000)


def _half_copied(src: Path, dst: Path) -> None:
    """``dst`` as ``cp src dst`` leaves it half-way: the first half of the file written."""
    data = src.read_bytes()
    with open(dst, "r+b" if dst.exists() else "wb") as f:
        f.truncate(0)
        f.write(data[: len(data) // 2])


def _rm_cp(a: Path, b: Path) -> None:
    shutil.rmtree(a)
    a.mkdir()
    for f in b.iterdir():
        if f.name != "data.mdb":
            shutil.copy(f, a / f.name)
    _half_copied(b / "data.mdb", a / "data.mdb")


def _in_place(a: Path, b: Path) -> None:
    _half_copied(b / "data.mdb", a / "data.mdb")


@pytest.mark.parametrize("replace", [_rm_cp, _in_place], ids=["rm-r-and-cp-r", "cp-in-place"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_store_replaced_while_verified_is_one_line_replaced(
    tmp_path: Path, replace: Callable[[Path, Path], None], workers: int
) -> None:
    a, b = _replaceable(tmp_path / "a", 0), _replaceable(tmp_path / "b", 1)
    assert verify_store(a).ok and verify_store(b).ok  # both healthy

    def meanwhile(_count: int) -> None:  # the walk and the value pass have begun
        replace(a, b)

    with pytest.raises(StoreReplacedError, match="the data file was replaced while it was verified") as err:
        verify_store(a, workers=workers, total=meanwhile)
    assert "run verify again" in str(err.value) and "\n" not in str(err.value)
    shutil.rmtree(a)
    shutil.copytree(b, a)  # the copy done: verify again
    assert verify_store(a, workers=workers).ok


def test_the_checks_see_the_file_opened_and_liblmdb_must_show_it(tmp_path: Path) -> None:
    """What ``AtRest`` holds is the file as opened: a path that names another file since, or liblmdb opened on
    another file, is "replaced"; the same file, untouched, is not."""
    a, b = _replaceable(tmp_path / "a", 0), _replaceable(tmp_path / "b", 1)
    rest = AtRest(a)
    try:
        assert rest.meta is not None and rest.snap is not None and rest.meta.count == REPLACED_N
        rest.check_unchanged()
        with StoreReader(a) as r:
            rest.check_same(r)  # the same file and snapshot
        os.rename(a / "data.mdb", tmp_path / "old.mdb")
        shutil.copy(b / "data.mdb", a / "data.mdb")
        with pytest.raises(StoreReplacedError):
            rest.check_unchanged()
        with StoreReader(a) as r, pytest.raises(StoreReplacedError):
            rest.check_same(r)
    finally:
        rest.close()
