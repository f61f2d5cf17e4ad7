"""Progress bars, built in one place: tqdm on stderr, cleared when done, or a silent stand-in.

The library never prints to stdout (``--json`` keeps it for JSON).  Bars show: ``True`` always, ``False`` never,
``None`` (the default everywhere) only when stderr is a terminal (:func:`bars_wanted`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Bar", "NoBar", "ProgressFactory", "bar_from", "bars_wanted", "progress_bar", "progress_factory"]


def bars_wanted(requested: bool | None) -> bool:
    """Whether to show bars: ``requested``, or with ``None`` whether stderr is a terminal."""
    if requested is not None:
        return requested
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Bar(Protocol):
    """What the library calls on a bar (a subset of ``tqdm``)."""

    n: float

    def update(self, n: float = 1) -> Any: ...

    def close(self) -> None: ...


class NoBar:
    """A bar that shows nothing (progress turned off), counting like one."""

    def __init__(self) -> None:
        self.n = 0.0

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


#: ``factory(desc, total)`` -> a bar counting samples (what ``ingest`` takes as ``progress``).
ProgressFactory = Callable[[str, int], Bar]


def progress_bar(
    desc: str,
    *,
    total: int | None = None,
    unit: str = "samples",
    initial: int = 0,
    enabled: bool | None = True,
) -> Any:
    """A tqdm bar on stderr (``leave=False``: it disappears when closed) or, when not ``enabled``
    (:func:`bars_wanted`), a :class:`NoBar`.  Sample counts are shown scaled (``12.3k samples/s``); other
    units as they are."""
    if not bars_wanted(enabled):
        return NoBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        unit_scale=unit == "samples",
        dynamic_ncols=True,
        leave=False,
        file=sys.stderr,
    )


def progress_factory(enabled: bool | None) -> ProgressFactory | None:
    """A :data:`ProgressFactory` of sample bars, or ``None`` when progress is off (:func:`bars_wanted`)."""
    if not bars_wanted(enabled):
        return None
    return lambda desc, total: progress_bar(desc, total=total)


def bar_from(factory: ProgressFactory | None, desc: str, total: int) -> Bar:
    """``factory(desc, total)``, or a :class:`NoBar` when there is no factory."""
    return factory(desc, total) if factory is not None else NoBar()
