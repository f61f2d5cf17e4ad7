"""The identity of a :func:`~lmdbstore.ingestion.parallel.write_parallel` task: the sha-256 of a canonical
encoding of its *content* (version ``c1``), the same in every process, on every machine and under every hash seed
(not ``repr``, nor a pickle: docs/design.md says why, and lists what each type is encoded by).  One tag byte per
value; floats by their 8 bytes (``-0.0`` is not ``0.0``); dicts and sets by their elements' digests, sorted;
numpy values by dtype (byte order normalized), shape and bytes (``np.int64(3)`` is not the task ``3``).  Exact
types only: anything else (your own class, a subclass of ``int``, an object array, a container holding itself)
is refused before the store is touched, naming the task and the fix (plain values, or ``task_id=``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import struct
from collections.abc import Callable, Iterable, Mapping, MappingView, Sequence
from collections.abc import Set as AbstractSet
from pathlib import PurePath
from typing import Any

import numpy as np

from lmdbstore.errors import clip

__all__ = ["ENCODING", "MAX_DEPTH", "TaskIdentities", "Unidentifiable", "digest_of", "task_digest", "task_list"]

#: Version of the canonical encoding, part of every ledger key it makes (a change is a new version).
ENCODING = "c1"
#: Deepest nesting of containers encoded (deeper: refused, as a value no task needs).
MAX_DEPTH = 64
#: Bytes of a task's digest.
DIGEST_BYTES = 32
_SEED = b"lmdbstore write_parallel tasks " + ENCODING.encode()


class Unidentifiable(Exception):
    """A value inside a task that has no content identity (``what``: its type, or why)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


class _Encoder:
    """Feeds the canonical encoding of one value into a hash (see the module docstring)."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.path: set[int] = set()  # ids of the containers being encoded (a container holding itself)

    def put(self, tag: bytes, data: bytes = b"") -> None:
        self.h.update(tag + struct.pack(">Q", len(data)) + data)

    def text(self, s: str) -> None:
        self.put(b"S", s.encode("utf-8", "surrogatepass"))

    def count(self, n: int) -> None:
        self.h.update(struct.pack(">Q", n))

    def value(self, v: Any, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise Unidentifiable(f"a value nested deeper than {MAX_DEPTH} levels")
        t = type(v)
        scalar = _SCALARS.get(t)
        if scalar is not None:
            scalar(self, v)
        elif isinstance(v, (np.ndarray, np.generic)):
            self.array(v)
        elif isinstance(v, enum.Enum):
            self.put(b"E", _type_name(t).encode())
            self.text(v.name)
        elif isinstance(v, PurePath):
            self.put(b"P", str(v).encode("utf-8", "surrogatepass"))
        else:
            self.container(v, t, depth)

    def container(self, v: Any, t: type, depth: int) -> None:
        if id(v) in self.path:
            raise Unidentifiable(f"a {t.__name__} holding itself")
        self.path.add(id(v))
        try:
            if t in (tuple, list):
                self.count(len(v))
                self.h.update(b"(" if t is tuple else b"[")
                for item in v:
                    self.value(item, depth + 1)
            elif t in (set, frozenset, dict):
                items = v.items() if t is dict else ((e,) for e in v)
                parts = sorted(b"".join(digest_of(p, depth + 1, self.path) for p in item) for item in items)
                self.put({set: b"<", frozenset: b">", dict: b"{"}[t], b"".join(parts))
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                self.put(b"K", _type_name(t).encode())
                fields = dataclasses.fields(v)
                self.count(len(fields))
                for f in fields:
                    self.text(f.name)
                    self.value(getattr(v, f.name), depth + 1)
            elif isinstance(v, tuple) and hasattr(t, "_fields"):  # a named tuple
                self.put(b"Q", _type_name(t).encode())
                self.count(len(v))
                for name, item in zip(t._fields, v, strict=True):
                    self.text(name)
                    self.value(item, depth + 1)
            else:
                raise Unidentifiable(f"a {_type_name(t)}")
        finally:
            self.path.discard(id(v))

    def array(self, a: np.ndarray | np.generic) -> None:
        arr = np.asarray(a)
        dt = arr.dtype
        padded = dt.kind in "fc" and dt.itemsize > (8 if dt.kind == "f" else 16)  # long double: padding bytes
        if dt.hasobject or dt.names is not None or dt.subdtype is not None or padded:
            raise Unidentifiable(f"a numpy {'array' if isinstance(a, np.ndarray) else 'scalar'} of dtype {dt}")
        little = dt.newbyteorder("<")
        if dt != little:
            arr = arr.astype(little)
        self.put(b"A" if isinstance(a, np.ndarray) else b"a", little.str.encode())
        self.count(arr.ndim)
        for d in arr.shape:
            self.count(d)
        self.count(arr.nbytes)
        self.h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _int(e: _Encoder, v: int) -> None:
    e.put(b"I", v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True))


def _range(e: _Encoder, v: range) -> None:
    e.put(b"R")
    for x in (v.start, v.stop, v.step):
        _int(e, x)


_SCALARS: dict[type, Callable[[_Encoder, Any], None]] = {
    type(None): lambda e, v: e.put(b"N"),
    bool: lambda e, v: e.put(b"T" if v else b"F"),
    int: _int,
    float: lambda e, v: e.put(b"D", struct.pack(">d", v)),
    complex: lambda e, v: e.put(b"C", struct.pack(">dd", v.real, v.imag)),
    str: _Encoder.text,
    bytes: lambda e, v: e.put(b"B", v),
    bytearray: lambda e, v: e.put(b"b", bytes(v)),
    range: _range,
}


def digest_of(v: Any, depth: int = 0, path: set[int] | None = None) -> bytes:
    """The sha-256 digest of the canonical encoding of ``v``.

    Raises:
        Unidentifiable: ``v`` holds a value of a type without a content identity.
    """
    h = hashlib.sha256()
    enc = _Encoder(h)
    if path is not None:
        enc.path = path
    enc.value(v, depth)
    return h.digest()


def task_digest(task: Any, index: int = 0, task_id: Callable[[Any], Any] | None = None) -> bytes:
    """The digest of task number ``index`` (only for messages): of its content, or of ``task_id(task)``.

    Raises:
        ValueError: the task (or its ``task_id``) has no content identity; one line naming ``tasks[index]``,
            its type, what in it cannot be identified, and the fix.
    """
    try:
        if task_id is None:
            return digest_of(task)
        return hashlib.sha256(b"task_id" + digest_of(task_id(task))).digest()
    except Unidentifiable as exc:
        kind = type(task).__qualname__
        said = f"task_id(tasks[{index}]) (type {kind})" if task_id else f"tasks[{index}] (type {kind})"
        fix = (
            "make task_id return plain values (str, int, tuples)"
            if task_id
            else "use plain values (int, float, str, bytes, tuples, lists, dicts, sets, numpy arrays, paths, "
            "dataclasses) or pass task_id= to name each task"
        )
        raise ValueError(f"{said} has no stable identity ({exc.what} cannot be identified by content); {fix}") from None
    except RecursionError:
        raise ValueError(f"tasks[{index}] (type {type(task).__qualname__}) is nested too deeply to identify") from None


def task_list(tasks: Iterable[Any], task_id: Callable[[Any], Any] | None = None) -> list[Any]:
    """The tasks in the order a run writes them: an ordered collection as given; an *unordered* one (a set-like,
    a mapping's keys, a dict's view) in the order of its tasks' digests, the same under every hash seed.

    Raises:
        ValueError: a task without identity, or two tasks of an unordered collection with one identity (their
            order could differ in a rerun): one line naming them.
    """
    if not isinstance(tasks, (AbstractSet, Mapping, MappingView)):
        return list(tasks)
    items = list(tasks)
    digests = [task_digest(t, i, task_id) for i, t in enumerate(items)]
    order = sorted(range(len(items)), key=digests.__getitem__)
    for a, b in itertools.pairwise(order):
        if digests[a] == digests[b]:
            raise ValueError(
                f"tasks: {type(tasks).__name__} holds two tasks with one identity ({clip(repr(items[a]))} and "
                f"{clip(repr(items[b]))}): an unordered collection of them has no order a rerun repeats; pass a list"
            )
    return [items[i] for i in order]


class TaskIdentities:
    """The digests of ``tasks``, and of each of its first ``k`` tasks taken together (a shorter run whose digest is
    one of its prefixes' is a run this list extends); ``task_id``: name each task by ``task_id(task)`` instead.

    Raises:
        ValueError: a task without a content identity (see :func:`task_digest`).
    """

    def __init__(self, tasks: Sequence[Any], task_id: Callable[[Any], Any] | None = None) -> None:
        self.n = len(tasks)
        self._digests = b"".join(task_digest(t, i, task_id) for i, t in enumerate(tasks))

    def prefix_digests(self, lengths: set[int]) -> dict[int, str]:
        """``{k: digest of the first k tasks}`` for every ``k`` in ``lengths`` up to the list's length."""
        out: dict[int, str] = {}
        h = hashlib.sha256(_SEED)
        for k in range(self.n + 1):
            if k:
                h.update(self._digests[(k - 1) * DIGEST_BYTES : k * DIGEST_BYTES])
            if k in lengths:
                out[k] = _hex(h)
        return out

    @property
    def digest(self) -> str:
        """The digest of the whole list (``ENCODING``-tagged, as it appears in the ledger key)."""
        return self.prefix_digests({self.n})[self.n]


def _hex(h: Any) -> str:
    """The ledger's form of a running digest: the encoding's name and 128 bits in hex."""
    return f"{ENCODING}-{h.copy().hexdigest()[:32]}"
