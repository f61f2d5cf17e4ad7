"""Checks of the paths commands write to (private): refused up front, with one line, before any work."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmdbstore.errors import LmdbStoreError

__all__ = ["check_output_file", "make_output_dir", "write_errors"]


def check_output_file(path: str | os.PathLike[str], what: str = "output") -> Path:
    """Raise :class:`LmdbStoreError` unless a file can be written at ``path``: not a directory, in an
    existing directory this process may write.  Returns ``path`` as a :class:`Path`."""
    p = Path(path)
    if p.is_dir():
        raise LmdbStoreError(f"{what} is a directory", path=p, hint="give a file name")
    parent = p.parent
    if not parent.exists():
        raise LmdbStoreError(f"the {what}'s directory does not exist", path=parent, hint="create it first")
    if not parent.is_dir():
        raise LmdbStoreError(f"the {what}'s parent is not a directory", path=parent)
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise LmdbStoreError(f"cannot write the {what}: permission denied", path=p)
    return p


def make_output_dir(path: str | os.PathLike[str], what: str = "output directory") -> Path:
    """Create the directory ``path`` (and its parents) if needed; raise :class:`LmdbStoreError` when it is a
    file, lies under one, or cannot be created or written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LmdbStoreError(f"{what} exists and is not a directory", path=p, hint="give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmdbStoreError(f"cannot create the {what} ({exc.strerror or exc})", path=exc.filename or p) from exc
    if not os.access(p, os.W_OK | os.X_OK):
        raise LmdbStoreError(f"cannot write to the {what}: permission denied", path=p)
    return p


@contextmanager
def write_errors(path: str | os.PathLike[str], action: str) -> Iterator[None]:
    """Re-raise an ``OSError`` met while writing ``path`` as one-line :class:`LmdbStoreError`."""
    try:
        yield
    except OSError as exc:
        raise LmdbStoreError(f"{action}: {exc.strerror or exc}", path=exc.filename or Path(path)) from exc
