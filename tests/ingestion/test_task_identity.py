"""Task identity by content (lmdbstore/ingestion/task_identity.py), as property tests (Hypothesis): the digest of
a task is the same in other processes under other hash seeds (sets rebuilt in another order there), equal
for equal tasks however they were built, and different for different ones -- including long numpy arrays
that differ in one middle element, which their reprs do not show."""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import struct
import subprocess
import sys
import tempfile
from collections import namedtuple
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays, from_dtype

from lmdbstore.ingestion.task_identity import TaskIdentities, task_digest

DTYPES = ["bool", "int8", "<i4", ">i4", "uint64", "<f2", "<f4", ">f8", "<c8", "<U3", "S2", "<M8[s]"]
#: What a subprocess prints: the hex digest of every task of the pickled list it is given.
DIGESTS = (
    "import pickle, sys; from lmdbstore.ingestion.task_identity import task_digest; "
    "tasks = pickle.load(open(sys.argv[1], 'rb')); print(' '.join(task_digest(t).hex() for t in tasks))"
)


def _hashable() -> st.SearchStrategy[Any]:
    """Values that may be set members and dict keys (no NaN: two NaNs make a set of two equal-looking members)."""
    base = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=6)
        | st.binary(max_size=6)
    )
    return st.recursive(base, lambda c: st.lists(c, max_size=3).map(tuple) | st.frozensets(c, max_size=3), max_leaves=6)


def _numpy() -> st.SearchStrategy[Any]:
    dtype = st.sampled_from(DTYPES).map(np.dtype)
    shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
    arr = st.tuples(dtype, shapes).flatmap(lambda ds: arrays(ds[0], ds[1]))
    scalar = dtype.flatmap(lambda d: from_dtype(d).map(lambda v: np.asarray(v, dtype=d)[()]))
    return arr | scalar


def values() -> st.SearchStrategy[Any]:
    """Tasks of every kind the encoding knows, nested."""
    base = (
        _hashable()
        | st.floats()
        | st.complex_numbers()
        | st.text(max_size=6).map(PurePosixPath)
        | st.builds(range, st.integers(-5, 5), st.integers(-5, 5), st.sampled_from([1, 2, -1]))
        | _numpy()
    )
    return st.recursive(
        base,
        lambda c: (
            st.lists(c, max_size=4)
            | st.lists(c, max_size=4).map(tuple)
            | st.dictionaries(_hashable(), c, max_size=3)
            | st.sets(_hashable(), max_size=4)
        ),
        max_leaves=12,
    )


def strict(v: Any) -> Any:
    """What makes two tasks the same task, written independently of the encoding: the type, and the value
    bit for bit (a float by its bytes, an array by dtype, shape and bytes), sets and dicts in any order."""
    t = type(v)
    if t is float:
        return "float", struct.pack(">d", v)
    if t is complex:
        return "complex", struct.pack(">dd", v.real, v.imag)
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        little = a.dtype.newbyteorder("<")
        return type(v).__name__, little.str, a.shape, a.astype(little).tobytes()
    if t in (tuple, list):
        return t.__name__, tuple(strict(x) for x in v)
    if t in (set, frozenset):
        return t.__name__, frozenset(strict(x) for x in v)
    if t is dict:
        return "dict", frozenset((strict(k), strict(x)) for k, x in v.items())
    if isinstance(v, PurePosixPath):
        return "path", str(v)
    if t is range:
        return "range", v.start, v.stop, v.step
    return t.__name__, v


def _rebuilt(v: Any) -> Any:
    """An equal task built anew: containers copied, sets and dicts filled in reverse order."""
    t = type(v)
    if t in (tuple, list):
        return t(_rebuilt(x) for x in v)
    if t in (set, frozenset):
        return t(reversed([_rebuilt(x) for x in v]))
    if t is dict:
        return dict(reversed([(_rebuilt(k), _rebuilt(x)) for k, x in v.items()]))
    return pickle.loads(pickle.dumps(v))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values(), values())
def test_equal_tasks_have_one_digest_and_different_tasks_another(a: Any, b: Any) -> None:
    assert task_digest(a) == task_digest(_rebuilt(a))
    assert (task_digest(a) == task_digest(b)) == (strict(a) == strict(b))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(values(), min_size=1, max_size=25))
def test_digests_are_the_same_in_other_processes_under_other_hash_seeds(tasks: list[Any]) -> None:
    tasks.append(frozenset(f"member {i}" for i in range(12)))  # certainly iterated in another order there
    here = " ".join(task_digest(t).hex() for t in tasks)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tasks.pickle"
        path.write_bytes(pickle.dumps(tasks))
        for seed in ("0", "4242"):
            env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
            out = subprocess.run(
                [sys.executable, "-c", DIGESTS, str(path)], capture_output=True, text=True, env=env, timeout=60
            )
            assert out.returncode == 0, out.stderr[-2000:]
            assert out.stdout.split() == here.split()


@settings(max_examples=50, deadline=None)
@given(st.integers(1001, 50_000), st.data())
def test_long_arrays_that_differ_in_one_middle_element_differ(n: int, data: st.DataObject) -> None:
    a = np.arange(n, dtype=np.int64)
    b = a.copy()
    b[data.draw(st.integers(3, n - 4))] = -7  # numpy prints only the first and last three
    assume(repr(a) == repr(b))
    assert task_digest((0, a)) != task_digest((0, b))
    assert task_digest(a.reshape(-1, 1)) != task_digest(a)  # same bytes, other shape


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Spec:
    seed: int
    files: tuple[str, ...]


Pair = namedtuple("Pair", "x y")


def test_enums_dataclasses_named_tuples_and_paths_by_content() -> None:
    assert task_digest(Spec(1, ("a",))) == task_digest(Spec(1, ("a",)))
    assert task_digest(Spec(1, ("a",))) != task_digest(Spec(2, ("a",)))
    assert task_digest(Color.RED) != task_digest(Color.BLUE) != task_digest(1)
    assert task_digest(Pair(1, 2)) != task_digest((1, 2))
    assert task_digest(Path("a/b")) == task_digest(PurePosixPath("a/b")) != task_digest("a/b")


@pytest.mark.parametrize(
    ("task", "words"),
    [
        (object(), r"tasks\[4\] \(type object\) has no stable identity \(a builtins.object"),
        ((1, [2, {"k": lambda: 0}]), r"tasks\[4\] \(type tuple\) .*a builtins.function"),
        (np.array([1, None]), r"numpy array of dtype object"),
        (np.zeros(2, dtype="f16"), r"numpy array of dtype float128"),
        (np.zeros(2, dtype=[("a", "i4")]), r"numpy array of dtype"),
        (type("MyInt", (int,), {})(3), r"\(type MyInt\) .*MyInt cannot be identified by content"),
    ],
)
def test_values_without_identity_are_named_with_the_fix(task: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words) as err:
        task_digest(task, 4)
    assert "task_id=" in str(err.value) and "\n" not in str(err.value)


def test_a_container_holding_itself_or_nested_too_deep_is_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="a list holding itself"):
        task_digest((0, loop))
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        task_digest(deep)
    shared = [1, 2]
    assert task_digest((shared, shared)) == task_digest(([1, 2], [1, 2]))  # shared, not a loop


@given(st.lists(values(), max_size=8))
@settings(max_examples=30, deadline=None)
def test_prefix_digests_are_the_digests_of_the_shorter_lists(tasks: list[Any]) -> None:
    ids = TaskIdentities(tasks)
    prefixes = ids.prefix_digests(set(range(len(tasks) + 2)))
    assert sorted(prefixes) == list(range(len(tasks) + 1))
    for k, digest in prefixes.items():
        assert digest == TaskIdentities(tasks[:k]).digest
    assert len(set(prefixes.values())) == len(prefixes)
