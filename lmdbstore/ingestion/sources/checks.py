"""Argument checks and read-error reporting that every source kind shares, so every kind raises the same
one-line errors for the same mistakes.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import SourceError, one_line

__all__ = ["READ_ERRORS", "Label", "check_label", "check_range", "stat_file"]

#: A class name or a class id: what the ``label=`` option and a source's labels hold.
Label = str | int

#: Errors that mean "this file's bytes are bad or unreadable" while reading it.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, zipfile.BadZipFile)


def check_range(batch: int, start: int, n: int) -> None:
    """Refuse (``ValueError``) a ``batch`` below 1 or a ``start`` outside ``0..n``, or either not an integer
    (``bool`` included): the :meth:`Source.iter_batches` contract."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= n:
        raise ValueError(f"start must be an integer in 0..{n}, got {start!r}")


def check_label(label: Any) -> Label | None:
    """Validate the ``label=`` option: a non-empty class name or a class id >= 0 (or None); returns it as
    ``str`` or ``int``.

    Raises:
        ValueError: another type (``bool`` included), an empty or blank name, or a negative id.
    """
    if label is None:
        return None
    if isinstance(label, bool) or not isinstance(label, (str, int, np.integer)):
        raise ValueError(f"label must be a class name (str) or class id (int), got {label!r}")
    if isinstance(label, str):
        if not label.strip():
            raise ValueError("label must not be an empty class name")
        return label
    if label < 0:
        raise ValueError(f"label must be a class id >= 0, got {label}")
    return int(label)


def stat_file(path: Path) -> os.stat_result:
    """Stat a source file (its size and mtime identify the content in the resume ledger).

    Raises:
        SourceError: the file is missing, cannot be accessed, is not a regular file, or is empty.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SourceError("no such file or directory", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot access ({one_line(exc)})", path=path) from exc
    if not path.is_file():
        raise SourceError("not a regular file", path=path)
    if st.st_size == 0:
        raise SourceError("file is empty (0 bytes)", path=path)
    return st
