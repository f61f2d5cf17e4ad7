"""`lmdbstore.ingest`: validate-then-write, resume from the ledger, appends, synthetic ingest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, build_store, make_data, snapshot_store

from lmdbstore import SourceError, StoreExistsError, ValidationError, WriterConfig, open_reader, open_writer
from lmdbstore.ingest import ingest, ingest_synthetic
from lmdbstore.sources import open_sources
from lmdbstore.synth import synth_batches


def _npz(path: Path, x: np.ndarray, y: np.ndarray, **extra: np.ndarray) -> Path:
    np.savez(path, x=x, y=y, **extra)
    return path


def test_round_trip_of_several_sources(tmp_path: Path) -> None:
    x1, y1 = make_data(700, 1)
    x2, _ = make_data(300, 2)
    a = _npz(tmp_path / "a.npz", x1, np.array(CLASSES)[y1])
    b = tmp_path / "b.npy"
    np.save(b, x2)
    rep = ingest(tmp_path / "s", open_sources([a]), classes=CLASSES)
    assert rep.created and rep.added == 700
    rep = ingest(tmp_path / "s", open_sources([b], label="c"))
    assert not rep.created and rep.added == 300 and rep.total == 1000
    with open_reader(tmp_path / "s") as r:
        assert np.array_equal(r.read_range(0, 1000), np.concatenate([x1, x2]))
        assert np.array_equal(r.labels(), np.concatenate([y1, np.full(300, 2)]))
        assert r.classes == CLASSES


def test_bad_source_among_good_ones_writes_nothing(tmp_path: Path) -> None:
    x, y = make_data(500, 3)
    store = build_store(tmp_path / "s", x, y)
    before = snapshot_store(store)
    good = _npz(tmp_path / "good.npz", *make_data(200, 4))
    bad_x, bad_y = make_data(200, 5)
    bad_x[150, 3, 3] = np.nan
    bad = _npz(tmp_path / "bad.npz", bad_x, bad_y)
    with pytest.raises(ValidationError) as err:
        ingest(store, open_sources([good, bad]))
    assert "bad.npz" in str(err.value) and "150" in str(err.value) and "\n" not in str(err.value)
    assert snapshot_store(store) == before


@pytest.mark.parametrize(
    ("make_bad", "error", "words"),
    [
        (lambda x, y: (x[:, :24], y), ValidationError, "shape"),
        (lambda x, y: (x.astype(np.float64), y), ValidationError, "dtype"),
        (lambda x, y: (x, np.where(y == 0, 9, y)), ValidationError, "out of range"),
    ],
)
def test_bad_sources_leave_the_store_as_it_was(tmp_path: Path, make_bad, error, words) -> None:  # type: ignore[no-untyped-def]
    store = build_store(tmp_path / "s", *make_data(100, 6))
    before = snapshot_store(store)
    bx, by = make_bad(*make_data(50, 7))
    src = _npz(tmp_path / "bad.npz", bx, by)
    with pytest.raises(error, match=words):
        ingest(store, open_sources([src]))
    assert snapshot_store(store) == before


def test_cast_converts_float64(tmp_path: Path) -> None:
    store = build_store(tmp_path / "s", *make_data(10, 1))
    x, y = make_data(40, 2, dtype=np.float64)
    ingest(store, open_sources([_npz(tmp_path / "d.npz", x, y)]), cast=True)
    with open_reader(store) as r:
        assert np.array_equal(r.read_range(10, 50), x.astype(np.float32))


def test_a_new_store_is_not_created_from_a_bad_source(tmp_path: Path) -> None:
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(SourceError, match="empty"):
        ingest(tmp_path / "s", open_sources([tmp_path / "empty.npy"], label="a"))
    assert not (tmp_path / "s").exists()


def test_rerun_skips_finished_sources_and_resumes_a_partial_one(tmp_path: Path) -> None:
    x, y = make_data(5000, 8)
    src_path = _npz(tmp_path / "d.npz", x, y)
    store = tmp_path / "s"
    # An interrupted run: the first 3 batches of the source were committed with their ledger position.
    (src,) = open_sources([src_path])
    with open_writer(store, shape=(25, 25), dtype="float32", classes=CLASSES, config=WriterConfig()) as w:
        pos = 0
        for bx, by in src.iter_batches(700):
            pos += len(bx)
            w.append(bx, np.asarray(CLASSES)[by] if by.dtype.kind in "iu" else by, progress=(src.fingerprint(), pos))
            w.commit()
            if pos >= 2100:
                break
    rep = ingest(store, open_sources([src_path]), batch=1000)
    assert rep.sources[0].skipped == 2100 and rep.sources[0].written == 2900
    again = ingest(store, open_sources([src_path]))
    assert again.added == 0 and again.sources[0].skipped == 5000
    with open_reader(store) as r:
        assert len(r) == 5000
        assert np.array_equal(r.read_range(0, 5000), x)
        assert np.array_equal(r.labels(), y)


def test_classes_must_match_an_existing_store(tmp_path: Path) -> None:
    store = build_store(tmp_path / "s", *make_data(10, 1))
    src = _npz(tmp_path / "d.npz", *make_data(10, 2))
    with pytest.raises(ValidationError, match="classes"):
        ingest(store, open_sources([src]), classes=["x", "y"])
    with pytest.raises((ValidationError, StoreExistsError), match="dtype"):
        ingest(store, open_sources([src]), dtype="float64")


def test_synthetic_ingest_is_resumable_and_exact(tmp_path: Path) -> None:
    store = tmp_path / "s"
    x_all = np.concatenate([b[0] for b in synth_batches(3000, seed=2, batch=1000)])
    # interrupted after 1000 samples (committed with the same ledger key ingest_synthetic uses)
    with open_writer(
        store, shape=(25, 25), dtype="float32", classes=["blob", "ring", "hstripes", "vstripes", "checker"]
    ) as w:
        bx, by = next(synth_batches(3000, seed=2, batch=1000))
        w.append(bx, by, progress=("synthetic:n=3000:seed=2", 1000))
    rep = ingest_synthetic(store, 3000, seed=2, batch=1000)
    assert rep.added == 2000 and rep.total == 3000
    with open_reader(store) as r:
        assert np.array_equal(r.read_range(0, 3000), x_all)


def test_npz_class_names_keep_their_order_and_ids(tmp_path: Path) -> None:
    x, y = make_data(60, 9, n_classes=3)
    src = _npz(tmp_path / "d.npz", x, y, class_names=np.array(["zeta", "alpha", "mid"]))
    ingest(tmp_path / "s", open_sources([src]))
    with open_reader(tmp_path / "s") as r:
        assert r.classes == ["zeta", "alpha", "mid"]
        assert np.array_equal(r.labels(), y)
