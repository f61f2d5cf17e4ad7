"""The resume ledger (lmdbstore.format.ledger): its key schemes, its entries, and a damaged entry in a real store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, make_data, raw_env

from lmdbstore import CorruptStoreError, WriterConfig, open_writer
from lmdbstore.format.layout import DB_PROGRESS
from lmdbstore.format.ledger import (
    MAX_NAME_BYTES,
    MAX_RUN_CHARS,
    PARALLEL_PREFIX,
    encode_entry,
    parallel_key,
    parallel_prefix,
    parse_entry,
    source_key,
    synthetic_key,
)
from lmdbstore.tools.verify import verify_store

# ----------------------------------------------------------------------------- key schemes


def test_source_key_names_kind_digest_and_file() -> None:
    assert source_key("npz", "0123abcd", "train.npz") == "npz:0123abcd:train.npz"


def test_source_key_keeps_at_most_max_name_bytes_of_the_name_and_never_half_a_character() -> None:
    long = "x" * 300
    assert source_key("npy", "d", long) == "npy:d:" + "x" * MAX_NAME_BYTES
    odd = "a" + "é" * 60  # 121 bytes: the cut at byte 100 falls inside an "é"
    kept = source_key("npy", "d", odd).split(":", 2)[2]
    assert kept == "a" + "é" * 49
    assert len(kept.encode()) == MAX_NAME_BYTES - 1


def test_parallel_keys_of_one_run_share_its_prefix() -> None:
    prefix = parallel_prefix("nightly")
    assert prefix == f"{PARALLEL_PREFIX}nightly:"
    assert parallel_key("nightly", "feed") == "parallel:nightly:feed"
    assert parallel_key("nightly", "beef").startswith(prefix)
    assert not parallel_key("nightly2", "feed").startswith(prefix)


def test_a_long_run_name_is_cut_the_same_way_in_prefix_and_key() -> None:
    run = "r" * (MAX_RUN_CHARS + 50)
    assert parallel_prefix(run) == PARALLEL_PREFIX + "r" * MAX_RUN_CHARS + ":"
    assert parallel_key(run, "d") == parallel_prefix(run) + "d"
    assert len(parallel_key(run, "0" * 64).encode()) <= 511  # LMDB's key limit


def test_synthetic_key() -> None:
    assert synthetic_key(1000, 7) == "synthetic:n=1000:seed=7"
    assert synthetic_key(1000, 8) != synthetic_key(1000, 7)


# ----------------------------------------------------------------------------- entries


@pytest.mark.parametrize(("done", "total"), [(0, None), (5, 10), (10**12, 10**12), (np.int64(3), None)])
def test_encode_then_parse_round_trips(done: int, total: int | None) -> None:
    raw = encode_entry(done, total)
    assert json.loads(raw) == {"done": int(done), "total": total}
    assert parse_entry(raw, "store", "k") == {"done": int(done), "total": total}
    assert parse_entry(memoryview(raw), None, "k") == {"done": int(done), "total": total}


def test_an_entry_may_carry_more_fields_and_no_total() -> None:
    assert parse_entry(b'{"done": 4}', None, "k") == {"done": 4}
    assert parse_entry(b'{"done": 4, "total": 9, "note": "x"}', None, "k")["note"] == "x"


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xff\xfe", b"{", b"not json", b"[1, 2]", b'"done"', b"3", b'{"total": 3}', b"\x80\x04K\x03."],
)
def test_an_entry_that_is_not_json_with_done_is_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptStoreError, match="resume-ledger entry is malformed") as err:
        parse_entry(raw, "/data/store", "npy:d:f.npy")
    assert err.value.path == "/data/store" and err.value.key == "npy:d:f.npy"
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("done", "shown"), [(-1, "-1"), (True, "True"), (1.5, "1.5"), ("3", "'3'"), (None, "None")])
def test_a_done_count_that_is_not_a_non_negative_int_is_corrupt(done: object, shown: str) -> None:
    raw = json.dumps({"done": done, "total": None}).encode()
    with pytest.raises(CorruptStoreError) as err:
        parse_entry(raw, "s", "k")
    assert err.value.message == f"resume-ledger entry has done={shown}"
    assert err.value.key == "k"


# ----------------------------------------------------------------------------- through a real store


def _store_with_ledger(path: Path) -> Path:
    x, y = make_data(40, seed=3, shape=(3,))
    with open_writer(path, shape=(3,), dtype="float32", classes=CLASSES, config=WriterConfig(sync=False)) as w:
        w.append(x[:25], y[:25], progress=(source_key("npy", "aa", "one.npy"), 25), progress_total=25)
        w.append(x[25:], y[25:], progress=(synthetic_key(15, 1), 15))
    return path


def test_a_real_ledger_reads_back_and_verifies(tmp_path: Path) -> None:
    path = _store_with_ledger(tmp_path / "s")
    with open_writer(path) as w:
        assert w.progress("npy:aa:one.npy") == 25
        assert w.progress("never:written") == 0
        assert w.progress_entries() == {
            "npy:aa:one.npy": {"done": 25, "total": 25},
            "synthetic:n=15:seed=1": {"done": 15, "total": None},
        }
    report = verify_store(path)
    assert report.ok and report.progress_entries_checked == 2


@pytest.mark.parametrize("damaged", [b'{"done": -4, "total": null}', b'{"done": 2', b"\x80\x04K\x03."])
def test_a_damaged_entry_is_reported_by_verify_and_refused_by_the_writer(tmp_path: Path, damaged: bytes) -> None:
    path = _store_with_ledger(tmp_path / "s")
    with raw_env(path) as env, env.begin(write=True) as txn:
        txn.put(b"npy:aa:one.npy", damaged, db=env.open_db(DB_PROGRESS, txn=txn))
    report = verify_store(path)
    assert not report.ok
    assert [(p.kind, p.index, p.message) for p in report.problems] == [
        ("progress", None, "resume-ledger entry b'npy:aa:one.npy' is not valid JSON with a 'done' count")
    ]
    assert report.progress_entries_checked == 2
    with open_writer(path) as w:
        assert w.progress("synthetic:n=15:seed=1") == 15  # the intact entry still reads
        with pytest.raises(CorruptStoreError, match="resume-ledger entry") as err:
            w.progress("npy:aa:one.npy")
        assert err.value.key == "npy:aa:one.npy" and err.value.path == str(path)
        with pytest.raises(CorruptStoreError, match="resume-ledger entry"):
            w.progress_entries()
