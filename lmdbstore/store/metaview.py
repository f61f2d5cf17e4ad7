"""What a reader of one store and a set of stores share (:class:`MetaView`), and the checks of their arguments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lmdbstore.format.meta import StoreMeta
from lmdbstore.util.memory import clip_count

__all__ = ["MetaView", "check_in_range", "check_out", "range_bounds", "sample_indices", "whole_number"]


def sample_indices(indices: Any, *, flat: bool = True) -> np.ndarray:
    """``indices`` as int64 sample numbers (flattened unless ``flat=False``), nothing cast silently (``ValueError``: a
    boolean mask, or indices that are not integers: ``1.7`` would read sample 1)."""
    arr = np.asarray(indices)
    if arr.dtype.kind not in "iu":
        if arr.dtype == np.bool_:
            raise ValueError("indices: a boolean mask is not a list of sample indices (use np.flatnonzero(mask))")
        if arr.size:
            raise ValueError(f"indices must be integer sample indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    return arr.reshape(-1) if flat else arr


def check_in_range(idx: np.ndarray, count: int, what: str = "store") -> None:
    """Refuse an index of ``idx`` (from :func:`sample_indices`) outside ``0..count-1`` (``-1`` is not the last).
    Raises ``IndexError``: naming the first such index."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= count):
        bad = int(idx[(idx < 0) | (idx >= count)][0])
        raise IndexError(f"indices: sample index {bad} out of range for a {what} of {count} samples")


def check_out(out: Any, n: int, meta: StoreMeta) -> np.ndarray | None:
    """``out`` (or ``None``) if it can take ``n`` samples of the store ``meta`` describes: a writable C-contiguous
    numpy array of the store's dtype and shape ``(n, *shape)`` (``ValueError``: naming ``out``, what it must be and
    what it is)."""
    if out is None:
        return None
    want = (n, *meta.shape)
    dt = meta.np_dtype
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a numpy array of shape {want} and dtype {dt.name}, got {type(out).__name__}")
    if out.shape != want or out.dtype != dt or not out.flags.c_contiguous or not out.flags.writeable:
        flags = ("" if out.flags.c_contiguous else " not C-contiguous") + ("" if out.flags.writeable else " read-only")
        raise ValueError(
            f"out must be a writable C-contiguous array of shape {want} and dtype {dt.name} (the store's), "
            f"got shape {out.shape} dtype {out.dtype.name}{flags}"
        )
    return out


def whole_number(value: Any, name: str, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as an int in ``lo..hi`` (``hi=None``: no bound); bools, floats and strings are refused, not cast
    (``ValueError``: naming ``name``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {str(value)[:40]!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in {lo}..{'' if hi is None else hi}, got {v}")
    return v


def range_bounds(lo: Any, hi: Any) -> tuple[np.ndarray, np.ndarray]:
    """``lo`` and ``hi`` of sample ranges as int64 arrays of one length (``prefetch``'s arguments). Raises
    ``ValueError``: not integers, or not one ``hi`` per ``lo``."""
    lo_a, hi_a = sample_indices(lo), sample_indices(hi)
    if lo_a.shape != hi_a.shape:
        raise ValueError(f"lo and hi must have one entry per range, got {lo_a.size} and {hi_a.size}")
    return lo_a, hi_a


class MetaView:
    """What a reader and a set share: ``len()``, ``shape``, ``dtype`` and ``classes`` from ``self.meta`` (a subclass
    provides it, ``read_batch`` and ``labels``), ranges, chunks, labels of indices."""

    #: what the reader reads, in messages ("store", "set")
    noun = "store"

    def read_batch(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def labels(self) -> np.ndarray:
        raise NotImplementedError

    def read(self, index: int) -> np.ndarray:
        """One sample of the store's shape and dtype (a copy).

        Raises:
            ValueError: ``index`` not an integer.  IndexError: outside ``0..len-1``.
        """
        i = whole_number(index, "index", -(1 << 63))
        if not 0 <= i < len(self):
            raise IndexError(f"index: sample {i} out of range for a {self.noun} of {len(self)} samples")
        return self.read_batch(np.array([i]))[0]

    def _range(self, start: Any, stop: Any) -> tuple[int, int]:
        """``start``, ``stop`` checked: integers (else ``ValueError``) with ``0 <= start <= stop <= len`` (else
        ``IndexError``)."""
        n = len(self)
        a = whole_number(start, "start", -(1 << 63))
        b = n if stop is None else whole_number(stop, "stop", -(1 << 63))
        if not 0 <= a <= b <= n:
            raise IndexError(f"range {a}..{b} outside a {self.noun} of {n} samples")
        return a, b

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Samples ``start..stop-1`` in order, reading each value once (sequential scans).

        Raises:
            ValueError: ``start`` or ``stop`` not an integer.  IndexError: the range is not inside.
        """
        start, stop = self._range(start, stop)
        return self.read_batch(np.arange(start, stop))

    def iter_chunks(
        self, chunk: int = 65536, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(first_index, samples, labels)`` over ``start..stop`` in chunks of about ``chunk`` samples (fewer
        where ``chunk`` samples would take more memory than the machine can give: a
        :class:`~lmdbstore.util.memory.MemoryBoundWarning` says so); a set's chunks never span two stores.

        Raises:
            ValueError: ``chunk`` not a positive integer, ``start``/``stop`` not integers.
            IndexError: ``start..stop`` not inside.
        """
        c = whole_number(chunk, "chunk", 1)
        start, stop = self._range(start, stop)
        what = "samples per chunk"
        c = clip_count(min(c, max(stop - start, 1)), self.meta.sample_bytes, what=what, parameter="chunk", stacklevel=3)
        labels = self.labels()
        for lo, hi in self._pieces(start, stop):
            for a in range(lo, hi, c):
                b = min(a + c, hi)
                yield a, self.read_range(a, b), labels[a:b]

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of ``start..stop`` a chunk does not cross (a set: each store's)."""
        return [(start, stop)]

    def labels_of(self, indices: Any) -> np.ndarray:
        """Class ids of ``indices`` (from the cached label table), in the shape of ``indices``.

        Raises:
            IndexError, ValueError: as :meth:`read_batch`'s ``indices``.
        """
        idx = sample_indices(indices, flat=False)
        check_in_range(idx.reshape(-1), len(self), self.noun)
        return self.labels()[idx]

    def _class_id(self, class_id: Any) -> int:
        """``class_id`` as an int in ``0..len(classes)-1`` (else ``ValueError`` naming it)."""
        c = whole_number(class_id, "class_id", -(1 << 62))
        if not 0 <= c < len(self.classes):
            raise ValueError(f"class_id must be in 0..{len(self.classes) - 1}, got {class_id}")
        return c

    @property
    def meta(self) -> StoreMeta:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.meta.count

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.np_dtype

    @property
    def classes(self) -> list[str]:
        return list(self.meta.classes)
