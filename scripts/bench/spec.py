"""What a benchmark is, as data: the samples its stores hold, what it builds or reuses, and its rows (a measurement,
the baselines it is held against in the same run, and at most one goal).

Nothing here measures or runs anything: :mod:`.driver` runs a :class:`Benchmark`, :mod:`.suites` declares them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

#: The ways a baseline is taken: right before and right after each round of the row (the disk's limits, which
#: swing within minutes), once a round next to the row's own measurement, or as recorded earlier in the run
#: (by this row or an earlier one: a figure that cannot be measured again, e.g. of a store already deleted).
WHEN = ("bracket", "round", "recorded")


@dataclass(frozen=True)
class Data:
    """The samples of a benchmark's stores and files: ``samples`` of ``shape`` in ``dtype`` (``quick`` of them under
    ``--quick``), made by :func:`.data.produce` (noise, element ``[0, 0]`` the index modulo 1,024, five classes)."""

    samples: int
    dtype: str = "float32"
    quick: int = 40_000
    shape: tuple[int, ...] = (25, 25)

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        return f"{self.samples:,} samples of {'x'.join(map(str, self.shape))} {self.dtype}"


@dataclass
class Ctx:
    """What a measurement is given: the benchmark's data (``--quick`` and overrides applied), the paths of what the
    driver built (:meth:`path`), the seconds one timed measurement runs, a scratch directory (new for each
    measurement, removed after it), the round, and
    :meth:`drop`, which drops the pages of the files of what the measurement reads (cold measurements call it once
    their store is open)."""

    data: Data
    paths: dict[str, Path]
    seconds: float
    quick: bool
    scratch: Path
    built: dict[str, float] = field(default_factory=dict)
    round: int = 0
    drop: Callable[[], None] = lambda: None
    batch: int = 4096

    def path(self, kind: str) -> Path:
        return self.paths[kind]

    def stores(self, kind: str) -> list[Path]:
        """The store directories of artifact ``kind``: one, or the parts of a set (``set4``)."""
        p = self.paths[kind]
        return sorted(q for q in p.iterdir() if q.is_dir()) if kind == "set4" else [p]

    def pick(self, full: Any, quick: Any) -> Any:
        """``quick`` under ``--quick``, else ``full``."""
        return quick if self.quick else full


@dataclass(frozen=True)
class Measure:
    """One measurement: ``fn(ctx)`` returns its numbers by name.  ``label`` names it (and identifies it within a
    benchmark: one definition, measured once a round however many rows show its numbers); ``uses``: the artifacts it
    reads (``ctx.drop()`` drops their pages; ``warm``: read into the page cache first, when they fit); ``once``: one
    round whatever ``--rounds`` (a build, a size, a training run)."""

    label: str
    fn: Callable[[Ctx], dict[str, float]]
    uses: tuple[str, ...] = ("store",)
    warm: bool = False
    once: bool = False


@dataclass(frozen=True)
class Baseline:
    """A measurement a row's figure is held against, taken as ``when`` says (:data:`WHEN`); ``key``: which of its
    numbers (default: the row's own key)."""

    measure: Measure
    when: str = "round"
    key: str | None = None

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(f"when must be one of {WHEN}, got {self.when!r}")


@dataclass(frozen=True)
class Goal:
    """``op`` (``>=`` or ``<=``) ``target``, on the ratio to the row's first baseline or on the figure itself."""

    op: str
    target: float
    on: str = "ratio"

    def met(self, value: float | None) -> bool | None:
        if value is None or value != value:
            return None
        return value >= self.target if self.op == ">=" else value <= self.target


def at_least(target: float, on: str = "ratio") -> Goal:
    return Goal(">=", target, on)


def at_most(target: float, on: str = "ratio") -> Goal:
    return Goal("<=", target, on)


@dataclass(frozen=True)
class Row:
    """One line of a benchmark's table: number ``key`` of ``measure`` in ``unit``, its baselines, its one goal."""

    name: str
    measure: Measure
    key: str = "rate"
    unit: str = "samples/s"
    baselines: tuple[Baseline, ...] = ()
    goal: Goal | None = None

    def __post_init__(self) -> None:
        if self.goal is not None and self.goal.on == "ratio" and not self.baselines:
            raise ValueError(f"row {self.name!r}: a goal on the ratio needs a baseline")


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: its ``rows`` on ``data``, in the ``artifacts`` the driver builds or reuses (:mod:`.data`),
    with the importable modules it ``needs`` (``"cuda"``: a CUDA device) checked before anything is built, and the
    data fields ``--samples``/``--dtype`` may override (default: the samples)."""

    name: str
    title: str
    about: str
    rows: tuple[Row, ...]
    data: Data = Data(0, quick=0)
    needs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ("samples",)

    @property
    def artifacts(self) -> list[str]:
        """Every artifact a row reads, in the order the rows first need them."""
        out: list[str] = []
        for row in self.rows:
            for m in (row.measure, *(b.measure for b in row.baselines)):
                out += [k for k in m.uses if k not in out]
        return out

    def resolved(self, quick: bool, samples: int | None, dtype: str | None) -> Data:
        """The data this run uses: ``--quick``'s size, then ``--samples``/``--dtype`` where declared overridable.

        Raises:
            ValueError: an override this benchmark does not take.
        """
        for name, value in (("samples", samples), ("dtype", dtype)):
            if value is not None and name not in self.overrides:
                raise ValueError(f"{self.name} takes no --{name}")
        data = replace(self.data, samples=self.data.quick) if quick else self.data
        if samples is not None:
            data = replace(data, samples=samples)
        return replace(data, dtype=dtype) if dtype is not None else data
