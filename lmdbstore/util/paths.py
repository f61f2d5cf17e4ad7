"""The one rule for the paths commands write to (private): refused up front, with one line, before any work.

Every command that writes checks its output here: one that exists must be a regular file or a directory (a
device, FIFO or socket is refused, never replaced: a rename over ``/dev/null`` as root replaces the device); it
must not be, or lie inside, one of the command's sources (``export S S/data.mdb``); its directory must exist (for
a file) or be creatable (for a directory), and be writable.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lmdbstore.errors import LmdbStoreError

__all__ = ["check_not_special", "check_output_file", "check_outside", "make_output_dir", "write_errors"]

PathLike = str | os.PathLike[str]
#: What ``stat`` calls the kinds of files no output may be.
_SPECIAL = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def check_not_special(path: PathLike, what: str = "output") -> None:
    """Raise :class:`LmdbStoreError` when ``path`` (followed through links) is a device, FIFO or socket."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    kind = _SPECIAL.get(stat.S_IFMT(mode))
    if kind is not None:
        raise LmdbStoreError(f"{what} is {kind}, not a regular file", path=Path(path), hint="give a file name")


def check_outside(path: PathLike, sources: Iterable[PathLike], what: str = "output") -> None:
    """Raise :class:`LmdbStoreError` when ``path`` is one of ``sources`` or lies inside one (paths resolved)."""
    out = Path(path).resolve()
    for src in sources:
        s = Path(src).resolve()
        if out == s or s in out.parents:
            where = "is" if out == s else "lies inside"
            raise LmdbStoreError(
                f"{what} {where} the source {src}: writing it would destroy what is read",
                path=Path(path),
                hint="write it somewhere else",
            )


def check_output_file(path: PathLike, what: str = "output", sources: Iterable[PathLike] = ()) -> Path:
    """Raise :class:`LmdbStoreError` unless a file can be written at ``path``: no directory, device, FIFO or
    socket there, not one of ``sources`` nor inside one, in an existing directory this process may write.
    Returns ``path`` as a :class:`Path`."""
    p = Path(path)
    if p.is_dir():
        raise LmdbStoreError(f"{what} is a directory", path=p, hint="give a file name")
    check_not_special(p, what)
    check_outside(p, sources, what)
    parent = p.parent
    if not parent.exists():
        raise LmdbStoreError(f"{what} directory does not exist", path=parent, hint="create it first")
    if not parent.is_dir():
        raise LmdbStoreError(f"the {what}'s parent is not a directory", path=parent)
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise LmdbStoreError(f"cannot write the {what}: permission denied", path=p)
    return p


def make_output_dir(path: PathLike, what: str = "output directory", sources: Iterable[PathLike] = ()) -> Path:
    """Create the directory ``path`` (and its parents) if needed; raise :class:`LmdbStoreError` when it is a
    file, a device, lies under a file, is one of ``sources`` or inside one, or cannot be created or written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LmdbStoreError(f"{what} exists and is not a directory", path=p, hint="give a directory")
    check_outside(p, sources, what)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmdbStoreError(f"cannot create the {what} ({exc.strerror or exc})", path=exc.filename or p) from exc
    if not os.access(p, os.W_OK | os.X_OK):
        raise LmdbStoreError(f"cannot write to the {what}: permission denied", path=p)
    return p


@contextmanager
def write_errors(path: PathLike, action: str) -> Iterator[None]:
    """Re-raise an ``OSError`` met while writing ``path`` as one-line :class:`LmdbStoreError`."""
    try:
        yield
    except OSError as exc:
        raise LmdbStoreError(f"{action}: {exc.strerror or exc}", path=exc.filename or Path(path)) from exc
