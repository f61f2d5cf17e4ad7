"""Every public read and write method given hostile arguments (issue 34 #10): each call either does exactly what it
says -- the samples asked for, in ``out`` when given -- or raises ``IndexError``/``ValueError`` (the writer's
checks: ``ValidationError``) in one line naming what was wrong; never another sample's bytes, never ``True`` with
bytes that are not the samples, never ``CorruptStoreError`` for the caller's mistake, never another exception; and
a refused call leaves the store as it was.  Hypothesis draws the arguments; the reported cases come first."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLASSES, build_set, build_store, make_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdbstore import WriterConfig, open_writer
from lmdbstore.errors import CorruptStoreError, LmdbStoreError, ValidationError
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader

N = 300
EXAMPLES = 120
HOSTILE = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# ---------------------------------------------------------------------------------------------- strategies
big_ints = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, -18, N, N + 3, 2**31, 2**63 - 1, -(2**63), 2**64, 0, 1, N - 1]),
)
scalars = st.one_of(
    big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.sampled_from([np.int64(5), np.uint64(2**64 - 1), np.float32(1.5), np.bool_(True), np.int8(-3), 1 + 2j]),
)
index_arrays = st.one_of(
    st.lists(big_ints, max_size=12),
    st.lists(scalars, max_size=6),
    st.builds(
        lambda vals, dt: np.asarray(vals).astype(dt, casting="unsafe"),
        st.lists(st.integers(-400, 400), max_size=12),
        st.sampled_from(["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "?"]),
    ),
    st.builds(lambda n: np.arange(n).reshape(-1, 1) % N, st.integers(0, 8)),  # 2-D
    st.just(np.array([], dtype=object)),
    st.just(np.array([1, "a"], dtype=object)),
    st.just(np.array(2**64 - 1, dtype=np.uint64)),  # wraps to -1 as int64
)
anything = st.one_of(scalars, index_arrays)


def outs(n: int) -> st.SearchStrategy[Any]:
    """``out`` arrays: right, and wrong in every way one at a time."""
    good = (n, 25, 25)
    return st.sampled_from(
        ["good", "dtype", "shape", "flat", "strided", "readonly", "big-endian", "list", "short"]
    ).map(
        lambda k: {
            "good": lambda: np.full(good, 7, np.float32),
            "dtype": lambda: np.zeros(good, np.int32),  # the same item size
            "shape": lambda: np.zeros((n, 625), np.float32),
            "flat": lambda: np.zeros(n * 625, np.float32),
            "strided": lambda: np.zeros((n, 25, 50), np.float32)[:, :, ::2],
            "readonly": lambda: np.frombuffer(bytes(n * 2500), np.float32).reshape(good),
            "big-endian": lambda: np.zeros(good, ">f4"),
            "list": lambda: [[0.0] * 625] * n,
            "short": lambda: np.zeros((max(n - 1, 0), 25, 25), np.float32),
        }[k]()
    )


# ---------------------------------------------------------------------------------------------- the rule
def _one_line(exc: BaseException) -> None:
    assert "\n" not in str(exc) and str(exc), repr(exc)


def _call(fn: Callable[[], Any], allowed: tuple[type[BaseException], ...] = (IndexError, ValueError)) -> Any:
    """``fn()``'s result, or ``None`` when it raised one of ``allowed`` in one line; anything else fails."""
    try:
        return fn()
    except CorruptStoreError as exc:  # the store is healthy: never its fault
        raise AssertionError(f"CorruptStoreError for the caller's mistake: {exc}") from exc
    except allowed as exc:
        _one_line(exc)
        return None


def _as_indices(value: Any) -> np.ndarray | None:
    """What a read of ``value`` may return: the samples at these indices (``None``: it must refuse)."""
    arr = np.asarray(value) if not isinstance(value, (str, bytes)) else np.asarray([value])
    if arr.dtype.kind not in "iu" and not (arr.dtype == object and arr.size == 0) and arr.size:
        return None
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
        return None
    flat = arr.astype(np.int64).reshape(-1) if arr.size else np.zeros(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= N):
        return None
    return flat


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, np.ndarray, np.ndarray]]:
    x, y = make_data(N, seed=9)
    path = build_store(tmp_path_factory.mktemp("hostile") / "s", x, y, config=WriterConfig(sync=False))
    yield path, x, y


@pytest.fixture(scope="module")
def reader(store: tuple[Path, np.ndarray, np.ndarray]) -> Iterator[StoreReader]:
    with StoreReader(store[0]) as r:
        r.read_batch(np.arange(N))  # warm
        yield r


# ---------------------------------------------------------------------------------------------- drawn
@HOSTILE
@given(indices=anything, data=st.data())
def test_hostile_reads(
    reader: StoreReader, store: tuple[Path, np.ndarray, np.ndarray], indices: Any, data: Any
) -> None:
    x, y = store[1], store[2]
    want = _as_indices(indices)
    got = _call(lambda: reader.read_batch(indices))
    assert (got is None) == (want is None), (indices, want)
    if got is not None:
        assert got.tobytes() == x[want].tobytes()
    n = 0 if want is None else len(want)
    out = data.draw(outs(n))
    given_out = out.copy() if isinstance(out, np.ndarray) else out
    res = _call(lambda: reader.read_batch(indices, given_out))
    if res is not None:  # what was filled is the samples, nothing else
        assert want is not None and isinstance(given_out, np.ndarray)
        assert given_out.dtype == np.float32 and given_out.tobytes() == x[want].tobytes()
    labels = _call(lambda: reader.labels_of(indices))
    assert (labels is None) == (want is None)
    if labels is not None:
        assert labels.reshape(-1).tolist() == y[want].tolist()


@HOSTILE
@given(a=scalars, b=scalars, c=scalars)
def test_hostile_scalar_arguments(
    reader: StoreReader, store: tuple[Path, np.ndarray, np.ndarray], a: Any, b: Any, c: Any
) -> None:
    x, y = store[1], store[2]

    def whole(v: Any) -> int | None:
        return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else None

    one = _call(lambda: reader.read(a))
    assert (one is None) == (whole(a) is None or not 0 <= whole(a) < N)  # type: ignore[operator]
    if one is not None:
        assert one.tobytes() == x[whole(a)].tobytes()
    rng = _call(lambda: reader.read_range(a, b))
    if rng is not None:
        assert rng.tobytes() == x[whole(a) : whole(b)].tobytes()
    chunks = _call(lambda: list(reader.iter_chunks(a, b, c)))  # chunk, start, stop
    if chunks is not None:
        lo, hi = whole(b), N if c is None else whole(c)  # stop=None: to the end
        assert lo is not None and hi is not None
        assert b"".join(s.tobytes() for _, s, _ in chunks) == x[lo:hi].tobytes()
    ci = _call(lambda: reader.class_indices(a))
    if ci is not None:
        assert ci.tolist() == np.flatnonzero(y == whole(a)).tolist()
    _call(lambda: list(reader.iter_raw(a)))
    _call(lambda: reader.prefetch(a, b))


@HOSTILE
@given(indices=anything, a=scalars, data=st.data())
def test_hostile_set_reads(tmp_path_factory: pytest.TempPathFactory, indices: Any, a: Any, data: Any) -> None:
    s = _set(tmp_path_factory)
    x = _SET[1]
    want = _as_indices(indices)
    got = _call(lambda: s.read_batch(indices))
    assert (got is None) == (want is None)
    if got is not None:
        assert got.tobytes() == x[want].tobytes()
    out = data.draw(outs(0 if want is None else len(want)))
    given_out = out.copy() if isinstance(out, np.ndarray) else out
    if _call(lambda: s.read_batch(indices, given_out)) is not None:
        assert isinstance(given_out, np.ndarray) and given_out.tobytes() == x[want].tobytes()
    for call in (
        lambda: s.read(a),
        lambda: s.read_range(a, N),
        lambda: s.class_indices(a),
        lambda: s.labels_of(indices),
    ):
        _call(call)
    _call(lambda: list(s.iter_chunks(a, 0, 10)))
    _call(lambda: s.prefetch(indices, indices))


_SET: list[Any] = []


def _set(factory: pytest.TempPathFactory) -> StoreSet:
    """One set of three stores of N samples together (made once)."""
    if not _SET:
        info = build_set(factory.mktemp("hostile-set"), [(100, ["a", "b"]), (150, ["b", "c"]), (50, ["c"])])
        s = StoreSet(info.paths)
        s.read_batch(np.arange(N))
        _SET.extend([s, info.x])
    return _SET[0]  # type: ignore[no-any-return]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    x=st.one_of(
        st.builds(
            lambda n, dt: np.zeros((n, 25, 25), dt), st.integers(0, 3), st.sampled_from(["f4", "f8", "i4", "f2"])
        ),
        st.builds(lambda n: np.zeros((n, 5, 5), np.float32), st.integers(1, 3)),
        st.builds(lambda v: np.full((1, 25, 25), v, np.float32), st.sampled_from([np.nan, np.inf, 1e38])),
        scalars,
        st.just([[0.0] * 25] * 25),
    ),
    y=st.one_of(scalars, st.lists(st.one_of(st.integers(-3, 8), st.sampled_from([*CLASSES, "z", "a\0"])), max_size=4)),
    progress=st.one_of(st.none(), st.tuples(st.one_of(st.text(max_size=3), scalars), scalars), scalars),
    name=st.one_of(st.text(max_size=3), scalars),
)
def test_hostile_writes(tmp_path_factory: pytest.TempPathFactory, x: Any, y: Any, progress: Any, name: Any) -> None:
    """``append``, ``progress`` and ``check_samples`` with drawn arguments: appended exactly, or refused in one line
    (``ValidationError``, ``ValueError``) with nothing of the batch kept; the store then commits and reads back."""
    path = tmp_path_factory.mktemp("hostile-w") / "s"
    allowed = (ValidationError, ValueError)
    with open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=WriterConfig(sync=False)) as w:
        before = w.count
        first = _call(lambda: w.append(x, y, progress=progress), allowed)
        arr = np.asarray(x) if first is not None else None
        if first is None:
            assert w.count == before  # nothing of a refused batch
        _call(lambda: w.check_samples(x), allowed)
        _call(lambda: w.progress(name), allowed)
        added = w.count - before
    with StoreReader(path) as r:
        assert len(r) == added
        if added:
            assert arr is not None
            assert r.read_range(0, added).tobytes() == np.asarray(arr, np.float32).reshape(added, 25, 25).tobytes()


def test_a_refused_call_is_one_line_of_the_right_class(reader: StoreReader) -> None:
    """The classes and the parameter named, for the record (the drawn tests accept either class)."""
    cases: list[tuple[Callable[[], Any], type[BaseException], str]] = [
        (lambda: reader.read_batch([1.7]), ValueError, "integer"),
        (lambda: reader.read_batch(np.ones(3, bool)), ValueError, "boolean mask"),
        (lambda: reader.read_batch([N]), IndexError, "indices"),
        (lambda: reader.read(True), ValueError, "index"),
        (lambda: reader.read(N), IndexError, "index"),
        (lambda: reader.read_range(0.0, 5), ValueError, "start"),
        (lambda: reader.read_range(0, N + 1), IndexError, "range"),
        (lambda: list(reader.iter_chunks(0)), ValueError, "chunk"),
        (lambda: reader.class_indices(1.0), ValueError, "class_id"),
        (lambda: list(reader.iter_raw(b"nope")), ValueError, "db_name"),
        (lambda: reader.prefetch([0, 1], [5]), ValueError, "lo and hi"),
        (lambda: reader.labels_of([-1]), IndexError, "indices"),
        (lambda: reader.read_batch([0], np.zeros((1, 25, 25), np.float32)[:, ::-1]), ValueError, "out"),
    ]
    for call, cls, word in cases:
        with pytest.raises(cls, match=word) as exc:
            call()
        assert not isinstance(exc.value, LmdbStoreError) and "\n" not in str(exc.value)
