"""Many stores read as one (StoreSet, open_reader([...])): one index space, classes mapped by name, every read
path equal to the concatenation of the stores, the set's metadata, and the one-line errors of stores that do
not make a set.  Real stores throughout; the first pixel of every sample is its index in the set."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import SET_CLASSES, SetInfo, build_set, build_store, make_data

from lmdbstore import StoreReader, StoreSet, ValidationError, open_reader, open_writer
from lmdbstore.store.readers import as_reader, data_file_bytes


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> SetInfo:
    return build_set(tmp_path_factory.mktemp("set"))


def test_one_index_space_and_classes_by_name(three: SetInfo) -> None:
    with open_reader(three.paths) as s:
        assert isinstance(s, StoreSet)
        assert len(s) == len(three.x) and s.shape == (25, 25) and s.dtype == np.float32
        assert s.classes == SET_CLASSES  # first seen first
        assert s.offsets.tolist() == [0, 1000, 1517, 1780] and s.counts == [1000, 517, 263]
        np.testing.assert_array_equal(np.asarray(s.classes)[s.labels()], three.names)
        np.testing.assert_array_equal(np.asarray(s.classes)[s.labels_of([1516, 3, 1779])], three.names[[1516, 3, 1779]])
        for c, name in enumerate(s.classes):
            np.testing.assert_array_equal(s.class_indices(c), np.flatnonzero(three.names == name))
        m = s.meta
        assert m.count == 1780 and m.classes == SET_CLASSES
        assert m.class_counts == [int((three.names == c).sum()) for c in SET_CLASSES]
        assert s.read_path == "positions"  # every store keeps its own position table


def test_every_read_path_equals_the_concatenation(three: SetInfo) -> None:
    rng = np.random.default_rng(3)
    with open_reader(three.paths) as s:
        scattered = rng.integers(0, len(three.x), 700)  # any order, repeats, every store
        np.testing.assert_array_equal(s.read_batch(scattered), three.x[scattered])
        grouped = np.sort(scattered)  # grouped by store: straight into out
        out = np.empty((len(grouped), 25, 25), np.float32)
        assert s.read_batch(grouped, out=out) is out
        np.testing.assert_array_equal(out, three.x[grouped])
        np.testing.assert_array_equal(s.read(1516), three.x[1516])
        np.testing.assert_array_equal(s.read_range(990, 1530), three.x[990:1530])  # spans three stores
        np.testing.assert_array_equal(s.read_range(0, 1780), three.x)
        assert s.read_range(5, 5).shape == (0, 25, 25) and s.read_batch([]).shape == (0, 25, 25)
        chunks = list(s.iter_chunks(300))
        assert all(len(np.unique(s.store_of(np.arange(a, a + len(c))))) == 1 for a, c, _ in chunks)
        np.testing.assert_array_equal(np.concatenate([c for _, c, _ in chunks]), three.x)
        np.testing.assert_array_equal(np.concatenate([lab for *_, lab in chunks]), s.labels())
        s.prefetch([900, 1700], [1100, 1780])  # ranges across stores: each store reads its own part ahead
        with pytest.raises(IndexError, match="sample index 1780 out of range for a set of 1780 samples"):
            s.read_batch([0, 1780])
        with pytest.raises(IndexError, match=r"range 0\.\.1781 outside a set of 1780 samples"):
            s.read_range(0, 1781)


def test_the_set_equals_one_merged_store(three: SetInfo, tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    with open_reader(three.paths) as s, open_writer(merged, shape=(25, 25), dtype="float32", classes=s.classes) as w:
        w.append(three.x, s.labels())
    with open_reader(three.paths) as s, open_reader(merged) as one:
        a, b = s.meta.value_stats, one.meta.value_stats
        assert (a.n, a.min, a.max, a.nonfinite) == (b.n, b.min, b.max, b.nonfinite)
        assert a.mean == pytest.approx(b.mean, rel=1e-9) and a.std == pytest.approx(b.std, rel=1e-9)
        assert s.meta.class_counts == one.meta.class_counts
        np.testing.assert_array_equal(s.labels(), one.labels())
    assert data_file_bytes(open_reader(three.paths)) == sum((p / "data.mdb").stat().st_size for p in three.paths)


def test_a_set_of_one_store_is_that_store(three: SetInfo) -> None:
    with open_reader(three.paths[:1]) as s, open_reader(three.paths[0]) as r:
        assert isinstance(r, StoreReader) and isinstance(s, StoreSet)
        assert s.classes == r.classes and s.meta.class_counts == r.meta.class_counts
        np.testing.assert_array_equal(s.labels(), r.labels())
        np.testing.assert_array_equal(s.read_range(0, len(s)), r.read_range(0, len(r)))


def test_classes_fix_the_order_and_must_cover_every_store(three: SetInfo) -> None:
    order = ["x", "e", "d", "c", "b", "a", "z"]  # a class no store has is fine: count 0
    with open_reader(three.paths, classes=order) as s:
        assert s.classes == order and s.meta.class_counts[-1] == 0
        np.testing.assert_array_equal(np.asarray(order)[s.labels()], three.names)
    with pytest.raises(ValidationError, match=r"s1: classes 'x' of this store are not in the set's classes") as err:
        open_reader(three.paths, classes=["a", "b", "c", "d", "e"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="classes: only a set of stores"):
        open_reader(three.paths[0], classes=["a"])


def test_stores_that_do_not_make_a_set_are_one_line_errors(three: SetInfo, tmp_path: Path) -> None:
    x, y = make_data(40, 9, shape=(24, 25))
    other_shape = build_store(tmp_path / "shape", x, y)
    with pytest.raises(ValidationError, match=r"shape: samples of shape \(24, 25\) float32 differ from the set's"):
        open_reader([*three.paths, other_shape])
    x, y = make_data(40, 9, dtype=np.float64)
    other_dtype = build_store(tmp_path / "dtype", x, y)
    with pytest.raises(ValidationError, match=r"samples of shape \(25, 25\) float64 differ") as err:
        open_reader([three.paths[0], other_dtype])
    assert str(err.value).count("\n") == 0 and "hint:" in str(err.value)
    with pytest.raises(ValueError, match="given twice"):
        StoreSet([three.paths[0], three.paths[1], three.paths[0]])
    with pytest.raises(ValueError, match="non-empty list"):
        StoreSet([])


def test_a_set_travels_by_pickle_and_opens_where_it_lands(three: SetInfo) -> None:
    s = open_reader(three.paths)
    s.labels()
    copy = pickle.loads(pickle.dumps(s))
    assert copy._labels is None  # the label table is not shipped; each process reads its own
    idx = np.arange(0, 1780, 7)
    np.testing.assert_array_equal(copy.read_batch(idx), three.x[idx])
    assert copy.classes == SET_CLASSES
    s.close()
    copy.close()


def test_as_reader_takes_paths_lists_and_readers(three: SetInfo) -> None:
    assert isinstance(as_reader(three.paths[0]), StoreReader)
    assert isinstance(as_reader(tuple(three.paths)), StoreSet)
    s = StoreSet(three.paths)
    assert as_reader(s) is s
    mixed = StoreSet([StoreReader(three.paths[0], positions=False), three.paths[1]])
    assert mixed.readers[0].positions is False and mixed.read_path == "lmdb"
    np.testing.assert_array_equal(mixed.read_batch([5, 1200, 3]), three.x[[5, 1200, 3]])
