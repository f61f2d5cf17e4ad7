"""Exact running statistics of every value written to a store (kept in its metadata)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["MAX_STATS_SCALE", "ValueStats"]

#: Largest magnitude a value may have after scaling by ``2**-scale``: its square (about 2**900) summed
#: over far more values than any store holds stays below float64's largest finite number (2**1024).
_STATS_MAX_SCALED_EXP = 450
#: ``scale`` a store's metadata may claim (finite float64 values lie below 2**1024).
MAX_STATS_SCALE = 1100


@dataclass
class ValueStats:
    """Exact running statistics of every value ingested (float64 accumulators).

    ``sum`` and ``sumsq`` are kept for the values divided by ``2**scale`` (``scale`` 0 unless values beyond
    about 1e135 arrived), so the sum of squares of values up to float64's largest stays finite; powers of
    two rescale exactly.  ``mean``/``std`` undo the scaling.
    """

    n: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    min: float | None = None
    max: float | None = None
    nonfinite: int = 0
    scale: int = 0

    #: Elements folded in per step, through float64 (and mask) buffers of 2 MiB allocated once per
    #: :meth:`update`: they stay in cache, and no allocation per step faults its pages in afresh (page faults cost
    #: more than the arithmetic; a Dask worker's ``MALLOC_TRIM_THRESHOLD_`` makes every large allocation do so).
    CHUNK = 1 << 18

    def update(self, x: np.ndarray) -> None:
        """Fold a batch of samples in; non-finite values are counted and left out of the moments."""
        self.update_all([x])

    def update_all(self, batches: Sequence[np.ndarray]) -> None:
        """Fold in several batches of one dtype as if concatenated -- the same floats as
        ``update(np.concatenate(batches))`` (the same chunks, summed in the same order), without the copy."""
        flats = [f for f in (np.asarray(b).reshape(-1) for b in batches) if f.size]
        total = sum(f.size for f in flats)
        if not total:
            return
        if len({f.dtype for f in flats}) > 1:  # never in a store (one dtype); numpy would promote
            flats = [np.concatenate(flats)]
        f64 = np.empty(min(total, self.CHUNK), np.float64)
        finite = np.empty(len(f64), np.bool_) if flats[0].dtype.kind == "f" else None
        pieces: list[np.ndarray] = []
        need = self.CHUNK
        for flat in flats:
            pos = 0
            while pos < flat.size:
                take = min(need, flat.size - pos)
                pieces.append(flat[pos : pos + take])
                pos, need = pos + take, need - take
                if not need:
                    self._update_chunk(pieces[0] if len(pieces) == 1 else np.concatenate(pieces), f64, finite)
                    pieces, need = [], self.CHUNK
        if pieces:
            self._update_chunk(pieces[0] if len(pieces) == 1 else np.concatenate(pieces), f64, finite)

    def _rescale(self, scale: int) -> None:
        """Switch to a larger ``scale`` (exact: powers of two)."""
        if scale > self.scale:
            shift = scale - self.scale
            self.sum, self.sumsq = math.ldexp(self.sum, -shift), math.ldexp(self.sumsq, -2 * shift)
            self.scale = scale

    def _update_chunk(self, flat: np.ndarray, f64_buffer: np.ndarray, finite_buffer: np.ndarray | None) -> None:
        """Fold in one chunk, converted to float64 in ``f64_buffer`` (the same values and sums as
        ``flat.astype(np.float64)``: the same contiguous length is reduced in the same order)."""
        if finite_buffer is not None:
            finite_mask = np.isfinite(flat, out=finite_buffer[: flat.size])
            n_bad = int(flat.size - np.count_nonzero(finite_mask))
            if n_bad:
                self.nonfinite += n_bad
                flat = flat[finite_mask]
            if flat.size == 0:
                return
        f64 = f64_buffer[: flat.size]
        f64[...] = flat
        lo, hi = float(f64.min()), float(f64.max())
        peak = max(abs(lo), abs(hi))
        if peak > 0:
            self._rescale(math.frexp(peak)[1] - _STATS_MAX_SCALED_EXP)
        if self.scale:
            np.ldexp(f64, -self.scale, out=f64)
        self.n += int(f64.size)
        self.sum += float(f64.sum())
        self.sumsq += float(np.einsum("i,i->", f64, f64))  # not np.dot: BLAS threads stall on a busy machine
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def merge(self, other: ValueStats) -> None:
        """Fold in statistics computed elsewhere (e.g. in a worker process) over other values."""
        other = replace(other)
        self._rescale(other.scale)
        other._rescale(self.scale)
        self.n, self.sum, self.sumsq = self.n + other.n, self.sum + other.sum, self.sumsq + other.sumsq
        self.nonfinite += other.nonfinite
        self.min = other.min if self.min is None else self.min if other.min is None else min(self.min, other.min)
        self.max = other.max if self.max is None else self.max if other.max is None else max(self.max, other.max)

    def _unscaled(self, v: float) -> float | None:
        try:
            return math.ldexp(v, self.scale)
        except OverflowError:  # only tampered metadata gets here: the writer keeps it in range
            return None

    @property
    def mean(self) -> float | None:
        return self._unscaled(self.sum / self.n) if self.n else None

    @property
    def std(self) -> float | None:
        if not self.n:
            return None
        mean = self.sum / self.n
        return self._unscaled(math.sqrt(max(self.sumsq / self.n - mean * mean, 0.0)))

    def validated(self) -> ValueStats:
        """These statistics with finite float moments, or ``ValueError`` saying which field is bad."""
        for name in ("n", "nonfinite", "scale"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"value_stats {name} must be an integer")
        if not (0 <= self.n <= 1 << 63 and 0 <= self.nonfinite <= 1 << 63):
            raise ValueError("value_stats counts must be non-negative integers below 2**63")
        if not 0 <= self.scale <= MAX_STATS_SCALE:
            raise ValueError(f"value_stats scale must be in 0..{MAX_STATS_SCALE}")
        floats: dict[str, float | None] = {"min": None, "max": None}
        for name in ("sum", "sumsq", "min", "max"):
            v = getattr(self, name)
            if v is None and name in ("min", "max"):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"value_stats {name} must be a number{' or null' if name in ('min', 'max') else ''}")
            try:
                f = float(v)
            except OverflowError:
                raise ValueError(f"value_stats {name} is out of float64 range") from None
            if not math.isfinite(f):
                raise ValueError(f"value_stats {name} must be finite")
            floats[name] = f
        if (floats["sumsq"] or 0.0) < 0:
            raise ValueError("value_stats sumsq must not be negative")
        out = ValueStats(self.n, floats["sum"] or 0.0, floats["sumsq"] or 0.0, floats["min"], floats["max"])
        out.nonfinite, out.scale = self.nonfinite, self.scale
        if out.n and (out.mean is None or out.std is None):
            raise ValueError("value_stats sum/sumsq/scale give a mean or std beyond float64 range")
        return out
