"""The checks applied to everything written (lmdbstore.store.validation): sample batches and labels.

The writer, ``ingest`` and ``write_parallel``'s workers all validate through these two functions, so their
rules and messages are pinned here directly; the writer's use of them is exercised on a real store at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, snapshot_store

from lmdbstore import ValidationError, WriterConfig, open_writer
from lmdbstore.store.validation import check_samples, label_ids

F32 = np.dtype("<f4")


def _error(fn: Callable[..., object], *args: object, **kwargs: Any) -> ValidationError:
    """The ValidationError ``fn(*args, **kwargs)`` raises, after checking its message is one line."""
    with pytest.raises(ValidationError) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)
    return err.value


# ----------------------------------------------------------------------------- check_samples: shapes


def test_one_sample_becomes_a_batch_of_one() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = check_samples(x, (3, 4), F32)
    assert out.shape == (1, 3, 4)
    np.testing.assert_array_equal(out[0], x)


def test_a_batch_comes_back_c_contiguous_and_little_endian() -> None:
    x = np.asfortranarray(np.arange(24, dtype=">f4").reshape(2, 3, 4))
    out = check_samples(x, (3, 4), F32)
    assert out.flags.c_contiguous and out.dtype == F32
    np.testing.assert_array_equal(out, x)


def test_an_empty_batch_is_accepted() -> None:
    assert check_samples(np.zeros((0, 3, 4), np.float32), (3, 4), F32).shape == (0, 3, 4)


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 12), (3,), (2, 1, 3, 4)])
def test_a_wrong_shape_is_refused(shape: tuple[int, ...]) -> None:
    err = _error(check_samples, np.zeros(shape, np.float32), (3, 4), F32, path="store.lmdb")
    assert err.message == f"samples have shape {shape}, expected (N, 3, 4)"
    assert err.path == "store.lmdb" and str(err).startswith("store.lmdb: ")


# ----------------------------------------------------------------------------- check_samples: dtypes and casts


def test_another_dtype_is_refused_without_cast() -> None:
    err = _error(check_samples, np.zeros((2, 3), np.float64), (3,), F32)
    assert err.message == "samples have dtype float64, expected float32"
    assert err.hint == "convert them with cast=True"


def test_a_same_kind_cast_converts() -> None:
    x = np.array([[0.1, 2.5, -3.0]], np.float64)
    out = check_samples(x, (3,), F32, cast=True)
    assert out.dtype == F32
    np.testing.assert_array_equal(out, x.astype(np.float32))


@pytest.mark.parametrize(("have", "want"), [(np.float32, np.int16), (np.int64, np.uint8), (np.complex64, np.float32)])
def test_a_cast_across_kinds_is_refused(have: type, want: type) -> None:
    err = _error(check_samples, np.ones((2, 3), have), (3,), np.dtype(want), cast=True)
    assert err.message == f"cannot cast dtype {np.dtype(have)} to {np.dtype(want)}"


def test_a_narrowing_integer_cast_must_fit() -> None:
    ok = check_samples(np.array([[-5, 300]], np.int64), (2,), np.dtype("<i2"), cast=True)
    np.testing.assert_array_equal(ok, [[-5, 300]])
    err = _error(check_samples, np.array([[-40000, 3]], np.int64), (2,), np.dtype("<i2"), cast=True)
    assert err.message == "values -40000..3 do not fit dtype int16"


# ----------------------------------------------------------------------------- check_samples: NaN and inf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_names_the_first_bad_sample(bad: float) -> None:
    x = np.zeros((5, 2, 2), np.float32)
    x[3, 1, 0] = bad
    x[4, 0, 0] = bad
    err = _error(check_samples, x, (2, 2), F32)
    assert err.message == "non-finite value (NaN or inf) in sample 3"
    assert err.hint == "allow_nonfinite=True accepts them"
    np.testing.assert_array_equal(check_samples(x, (2, 2), F32, allow_nonfinite=True), x)  # NaN == NaN here


def test_integer_samples_have_no_non_finite_check() -> None:
    x = np.full((2, 3), np.iinfo(np.int32).max, np.int32)
    np.testing.assert_array_equal(check_samples(x, (3,), np.dtype("<i4")), x)


# ----------------------------------------------------------------------------- label_ids


def test_ids_come_back_in_the_label_dtype() -> None:
    ids = label_ids([0, 4, 2], 3, CLASSES)
    assert ids.dtype == np.uint8
    np.testing.assert_array_equal(ids, [0, 4, 2])
    many = [f"c{i}" for i in range(300)]
    assert label_ids([299, 0], 2, many).dtype == np.dtype("<u2")


def test_class_names_become_ids() -> None:
    np.testing.assert_array_equal(label_ids(["e", "a", "e", "c"], 4, CLASSES), [4, 0, 4, 2])
    np.testing.assert_array_equal(label_ids(np.array([b"b", b"d"]), 2, CLASSES), [1, 3])


@pytest.mark.parametrize("one", ["c", 2, np.int64(2), np.uint8(2)])
def test_one_label_for_the_whole_batch(one: object) -> None:
    np.testing.assert_array_equal(label_ids(one, 3, CLASSES), [2, 2, 2])


@pytest.mark.parametrize(("y", "shape"), [([0, 1], "(2,)"), ([[0], [1], [2]], "(3, 1)")])
def test_labels_of_the_wrong_length_or_rank_are_refused(y: object, shape: str) -> None:
    err = _error(label_ids, y, 3, CLASSES, path="s")
    assert err.message == f"labels must be a 1-D sequence of 3 entries, got shape {shape}"


def test_an_unknown_class_name_is_refused() -> None:
    err = _error(label_ids, ["a", "zebra", "b"], 3, CLASSES)
    assert err.message == "unknown class label 'zebra'; the classes are a, b, c, d, e"


@pytest.mark.parametrize(
    ("y", "bad"), [([0, 5, 1], 5), ([-1, 0, 1], -1), (np.array([3, 2**63 + 5, 0], np.uint64), 2**63 + 5)]
)
def test_an_id_outside_the_classes_is_refused(y: object, bad: int) -> None:
    err = _error(label_ids, y, 3, CLASSES)
    assert err.message == f"label {bad} out of range 0..4"


def test_float_labels_are_refused_unless_there_are_none() -> None:
    err = _error(label_ids, [0.0, 1.0], 2, CLASSES)
    assert err.message == "labels must be integers or class names, got dtype float64"
    assert label_ids(np.zeros(0, np.float64), 0, CLASSES).shape == (0,)


# ----------------------------------------------------------------------------- through a real store


def test_the_writer_applies_these_rules_with_its_store_layout(small_store: StoreInfo, tmp_path: Path) -> None:
    before = snapshot_store(small_store.path)
    x = small_store.x[:4].copy()
    x[2, 0, 0] = np.nan
    with open_writer(small_store.path, config=WriterConfig(sync=False)) as w:
        assert w.check_samples(small_store.x[0]).shape == (1, 25, 25)
        with pytest.raises(ValidationError) as err:
            w.append(x, ["a", "b", "c", "d"])
        assert err.value.message == "non-finite value (NaN or inf) in sample 2"
        assert err.value.path == str(small_store.path)
        with pytest.raises(ValidationError, match=r"label 7 out of range 0\.\.4$"):
            w.append(small_store.x[:2], [0, 7])
    assert snapshot_store(small_store.path) == before
    lenient = WriterConfig(sync=False, allow_nonfinite=True)
    with open_writer(tmp_path / "nan", shape=(25, 25), dtype="float32", classes=CLASSES, config=lenient) as w:
        assert w.append(x, "e") == 0
        assert w.count == 4
