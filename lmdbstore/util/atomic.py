"""Files that appear whole or not at all: written under a temporary name beside the target, then renamed.

A crash or an error while writing leaves the target as it was (absent, or the old file); the temporary
is hidden (``.NAME.TAG-PID``) and removed when the write fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_paths", "fsync_path", "temp_beside"]


def temp_beside(path: Path, tag: str) -> Path:
    """The hidden temporary name ``.NAME.TAG-PID`` beside ``path`` (the same file system, so renaming it
    into place is atomic)."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


@contextmanager
def atomic_paths(paths: Sequence[Path], tag: str = "part") -> Iterator[list[Path]]:
    """Temporary names for ``paths``, renamed into place (in order) only if the block succeeds; on any
    error the temporaries are removed and the targets are left as they were."""
    tmps = [temp_beside(p, tag) for p in paths]
    try:
        yield tmps
        for t, p in zip(tmps, paths, strict=True):
            os.replace(t, p)
    finally:
        for t in tmps:
            t.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (after a rename, the directory holds the new entry durably)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
