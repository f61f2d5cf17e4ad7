"""Files that appear whole or not at all: written under a temporary name beside the target, then renamed.

A crash or an error while writing leaves the target as it was (absent, or the old file); the temporary
is hidden (``.NAME.TAG-PID``) and removed when the write fails.  A process killed mid-write cannot remove
its own: :func:`remove_stale_temps` lets the next write to the same target remove it, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lmdbstore.util.paths import check_not_special

__all__ = ["atomic_paths", "fsync_path", "pid_alive", "remove_stale_temps", "temp_beside"]


def temp_beside(path: Path, tag: str) -> Path:
    """The hidden temporary name ``.NAME.TAG-PID`` beside ``path`` (the same file system, so renaming it
    into place is atomic)."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts: it may be the writer)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: Path, tag: str, *, allowed: frozenset[str] | None = None) -> list[Path]:
    """Remove the temporaries ``.NAME.TAG-PID`` of ``path`` and ``tag`` whose PID runs no process (this
    process's own counts as not running: call it before creating the temporary).  A directory goes only when it
    holds nothing but regular files named in ``allowed`` (e.g. ``data.mdb``, ``lock.mdb``): a user's own
    directory of that name stays.  Returns what was removed; errors are ignored.
    """
    pattern = re.compile(re.escape(f".{path.name}.{tag}-") + r"([0-9]{1,10})")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for e in entries:
        m = pattern.fullmatch(e.name)
        pid = int(m.group(1)) if m is not None else 0
        if m is None or (pid != os.getpid() and pid_alive(pid)):
            continue
        p = Path(e.path)
        with contextlib.suppress(OSError):
            if e.is_file(follow_symlinks=False):
                p.unlink()
                removed.append(p)
            elif e.is_dir(follow_symlinks=False) and allowed is not None and _only(p, allowed):
                shutil.rmtree(p)
                removed.append(p)
    return removed


def _only(directory: Path, names: frozenset[str]) -> bool:
    """Whether ``directory`` holds only regular files whose names are in ``names``."""
    return all(c.name in names and c.is_file(follow_symlinks=False) for c in os.scandir(directory))


@contextmanager
def atomic_paths(paths: Sequence[Path], tag: str = "part") -> Iterator[list[Path]]:
    """Temporary names for ``paths``, renamed into place (in order) only if the block succeeds; on any
    error the temporaries are removed and the targets are left as they were.  Temporaries of these targets
    left by killed processes are removed first (:func:`remove_stale_temps`).

    Raises:
        LmdbStoreError: a target is a device, FIFO or socket (:func:`~lmdbstore.util.paths.check_not_special`).
    """
    for p in paths:
        check_not_special(p)  # never rename a regular file over a device, FIFO or socket
        remove_stale_temps(p, tag)
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
