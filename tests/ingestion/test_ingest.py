"""`lmdbstore.ingestion.pipeline`: validate-then-write, resume from the ledger, appends, synthetic ingest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, build_store, make_data, run_cli_measured, snapshot_store

from lmdbstore import SourceError, StoreExistsError, ValidationError, WriterConfig, open_reader, open_writer
from lmdbstore.ingestion.pipeline import ingest, ingest_synthetic
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.ingestion.synth import synth_batches


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


# ---------------------------------------------------------------------------------------------- hostile labels
def _three(tmp_path: Path, y: np.ndarray, name: str = "h.npz") -> Path:
    return _npz(tmp_path / name, make_data(len(y))[0], y)


@pytest.mark.parametrize("big", [10**7, 2**40], ids=["1e7", "2**40"])
def test_a_huge_integer_label_is_refused_before_anything_is_sized_by_it(tmp_path: Path, big: int) -> None:
    src = _three(tmp_path, np.array([0, 1, big]))
    with pytest.raises(ValidationError) as err:
        ingest(tmp_path / "new", open_sources([src]))  # classes inferred from the labels
    msg = str(err.value)
    assert str(big) in msg and "h.npz" in msg and "(at 2)" in msg and "65534" in msg
    assert len(msg) < 500 and "\n" not in msg
    assert not (tmp_path / "new").exists()
    store = build_store(tmp_path / "old", *make_data(50))
    before = snapshot_store(store)
    with pytest.raises(ValidationError) as err:
        ingest(store, open_sources([src]))
    assert str(big) in str(err.value) and len(str(err.value)) < 500
    assert snapshot_store(store) == before
    r = run_cli_measured(tmp_path, "ingest", tmp_path / "cli", src, "--no-progress")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.strip().count("\n") == 0, r.stderr[:2000]
    assert str(big) in r.stderr and len(r.stderr) < 500
    assert r.peak_mib < 300, r.peak_mib
    assert not (tmp_path / "cli").exists()


def test_a_huge_label_option_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_data(3)[0])
    with pytest.raises(ValidationError, match="label 1099511627776 is beyond"):
        ingest(tmp_path / "s", open_sources([tmp_path / "a.npy"], label=2**40))
    assert not (tmp_path / "s").exists()


def test_uint64_label_beyond_int64_is_reported_exactly(tmp_path: Path) -> None:
    y = np.array([0, 2**63 + 5, 1], np.uint64)
    src = _three(tmp_path, y)
    for classes in (CLASSES, None):
        with pytest.raises(ValidationError) as err:
            ingest(tmp_path / "s", open_sources([src]), classes=classes)
        assert "9223372036854775813" in str(err.value) and "(at 1)" in str(err.value), str(err.value)
    assert not (tmp_path / "s").exists()
    x = make_data(3)[0]
    with open_writer(tmp_path / "w", shape=(25, 25), dtype="float32", classes=CLASSES) as w:
        with pytest.raises(ValidationError, match=r"label 9223372036854775813 out of range 0\.\.4"):
            w.append(x, y)
        w.append(x, y.astype(np.int64) % 5)  # in range: accepted


@pytest.mark.parametrize(
    "classes",
    [["a", "", "b"], ["a", "  ", "b"], ["a", "b", "a"], ["\t"]],
    ids=["empty", "blank", "duplicate", "only-blank"],
)
def test_empty_blank_and_repeated_class_names_are_refused(tmp_path: Path, classes: list[str]) -> None:
    src = _three(tmp_path, np.array([0, 1, 0]))
    with pytest.raises(ValueError, match=r"^classes must") as err:
        ingest(tmp_path / "s", open_sources([src]), classes=classes)
    assert len(str(err.value)) < 500
    with pytest.raises(ValueError, match=r"^classes must"):
        open_writer(tmp_path / "w", shape=(25, 25), dtype="float32", classes=classes)
    assert not (tmp_path / "s").exists() and not (tmp_path / "w").exists()


def test_long_class_lists_are_shown_capped_in_errors(tmp_path: Path) -> None:
    store = build_store(tmp_path / "s", *make_data(20))
    before = snapshot_store(store)
    src = _three(tmp_path, np.array([0, 1, 0]))
    many = [f"class-{i}-{'x' * 50}" for i in range(5000)]
    with pytest.raises(ValidationError) as err:
        ingest(store, open_sources([src]), classes=many)
    assert "(4995 more)" in str(err.value) and len(str(err.value)) < 500
    with pytest.raises(StoreExistsError) as err2:
        open_writer(store, classes=many)
    assert "(4995 more)" in str(err2.value) and len(str(err2.value)) < 500
    with pytest.raises(ValueError, match="got 70000 names") as err3:
        ingest(tmp_path / "new", open_sources([src]), classes=[str(i) for i in range(70000)])
    assert len(str(err3.value)) < 500
    names = np.array([f"n{i}" for i in range(3000)])
    bad = _npz(tmp_path / "names.npz", make_data(3)[0], names[:3])
    with pytest.raises(ValidationError) as err4:
        ingest(store, open_sources([bad]))  # unknown names: the store's classes are listed capped
    assert len(str(err4.value)) < 500
    assert snapshot_store(store) == before


def test_fortran_order_npz_round_trips_bit_for_bit(tmp_path: Path) -> None:
    x, y = make_data(700, 9)
    xf = np.asfortranarray(x)
    for save, name in ((np.savez, "f.npz"), (np.savez_compressed, "fz.npz")):
        save(tmp_path / name, x=xf, y=np.asfortranarray(y))
    np.save(tmp_path / "f.npy", xf)
    rep = ingest(tmp_path / "s", open_sources([tmp_path / "f.npz", tmp_path / "fz.npz"]), classes=CLASSES, batch=64)
    assert rep.added == 1400
    ingest(tmp_path / "s", open_sources([tmp_path / "f.npy"], label="b"), batch=100)
    with open_reader(tmp_path / "s") as r:
        got = r.read_range(0, 2100)
        assert got.tobytes() == np.concatenate([x, x, x]).tobytes()
        assert np.array_equal(r.labels(), np.concatenate([y, y, np.full(700, 1)]))


def test_big_endian_samples_of_every_source_kind_are_stored_little_endian(tmp_path: Path) -> None:
    """Issue 40's sibling check: wherever a byte order enters (a .npy/.npz header, an HDF5 dataset, a class
    directory's files, ingest's dtype=), big-endian samples are read as such and stored little-endian."""
    h5py = pytest.importorskip("h5py")
    x, y = make_data(40, 11)
    be = x.astype(">f4")
    np.save(tmp_path / "a.npy", be)
    np.savez(tmp_path / "b.npz", x=be, y=y)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["x"], f["y"] = be, y
    for k, c in enumerate(CLASSES[:2]):
        (tmp_path / "root" / c).mkdir(parents=True)
        np.save(tmp_path / "root" / c / "0.npy", be[20 * k : 20 * (k + 1)])
    cases = [("a.npy", {"label": "a"}, {"dtype": ">f4"}), ("b.npz", {}, {}), ("c.h5", {}, {}), ("root", {}, {})]
    for name, open_kw, ingest_kw in cases:
        store = tmp_path / f"s-{name}"
        ingest(store, open_sources([tmp_path / name], sample_shape=(25, 25), **open_kw), **ingest_kw)
        with open_reader(store) as r:
            assert r.meta.dtype == "<f4" and np.array_equal(r.read_range(0, 40), x), name
