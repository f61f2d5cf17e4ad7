"""One exception hierarchy for everything lmdbstore raises on purpose: ``str(err)`` is a single line with the
``path``, ``key`` and ``hint`` of :class:`LmdbStoreError`; py-lmdb's errors are translated at the boundary.
"""

from __future__ import annotations

import errno
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import lmdb

__all__ = [
    "ChecksumError",
    "CorruptStoreError",
    "FormatVersionError",
    "LmdbStoreError",
    "ModelError",
    "NotAStoreError",
    "SourceError",
    "StoreExistsError",
    "StoreFullError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreReplacedError",
    "TaskError",
    "TrainingInterrupted",
    "ValidationError",
    "clip",
    "one_line",
    "preview",
    "translate_lmdb_errors",
    "translate_read_errors",
    "unwrap_worker_message",
]

#: Items of a list (class names, files, labels, members) an error message shows before "... (N more)".
PREVIEW_ITEMS = 5
#: Characters of one item shown in a message (a longer name is cut with "...").
PREVIEW_ITEM_CHARS = 40
#: Characters an error's message keeps at most (a backstop: messages should be short by construction).
MAX_MESSAGE_CHARS = 400


def clip(text: object, limit: int = PREVIEW_ITEM_CHARS) -> str:
    """``str(text)`` on one line, cut to at most ``limit`` characters (ending ``...`` when cut)."""
    s = str(text)
    if len(s) > 4 * limit:  # do not split a huge text only to throw most of it away
        s = s[: 4 * limit]
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: max(limit - 3, 0)] + "..."


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of a caught exception on one line (at most ``limit`` characters), to quote it in a message."""
    text = " ".join(str(exc).split())
    return clip(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, limit)


def preview(
    items: Iterable[object],
    *,
    total: int | None = None,
    limit: int = PREVIEW_ITEMS,
    quote: bool = False,
    sep: str = ", ",
) -> str:
    """The first ``limit`` of ``items`` for an error message, then ``... (N more)``; never unbounded.

    Each item is clipped to :data:`PREVIEW_ITEM_CHARS` (``quote``: shown as ``repr``).  ``total`` is the
    number of items when ``items`` is a lazy iterable (taken from ``len(items)`` otherwise).
    """
    if total is None and isinstance(items, Sized):
        total = len(items)
    shown = [repr(clip(x)) if quote else clip(x) for x in islice(items, limit)]
    text = sep.join(shown)
    if total is not None and total > len(shown):
        text += f"{sep if shown else ''}... ({total - len(shown)} more)"
    return text


#: How torch re-raises a DataLoader worker's exception in the main process: ``exc_type(msg)`` with this text.
_WORKER_WRAPPED = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\s*\nOriginal Traceback", re.S)


def unwrap_worker_message(text: str) -> str:
    """The original one-line message of an exception torch re-raised from a DataLoader worker (the last line of
    the traceback its text carries, ``module.X: <message>``); any other text unchanged."""
    if not _WORKER_WRAPPED.match(text):
        return text
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else text
    head, sep, rest = last.partition(": ")
    return rest if sep and re.fullmatch(r"[\w.]+", head) else last


class LmdbStoreError(Exception):
    """Base class of every error lmdbstore raises deliberately: ``message`` (one line), and optionally the ``path``
    of the store or file concerned, the ``key`` (sample index, value key, field) and a ``hint`` of what to do."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        key: object = None,
        hint: str | None = None,
    ) -> None:
        # a DataLoader worker's error re-raised by torch carries the worker's traceback: keep its message,
        # on one line and of bounded length
        self.message = clip(unwrap_worker_message(str(message)), MAX_MESSAGE_CHARS)
        self.path = str(path) if path is not None else None
        self.key = key
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = []
        if self.path is not None:
            parts.append(f"{self.path}:")
        parts.append(self.message)
        if self.key is not None:
            parts.append(f"(at {self.key})")
        text = " ".join(parts)
        if self.hint:
            text += f" -- hint: {self.hint}"
        return " ".join(text.split())


class StoreNotFoundError(LmdbStoreError):
    """The store path does not exist."""


class StoreExistsError(LmdbStoreError):
    """A store was asked to be created where one already exists (or the parameters disagree)."""


class NotAStoreError(LmdbStoreError):
    """The path exists but is not an lmdbstore store (no LMDB environment or no metadata)."""


class CorruptStoreError(LmdbStoreError):
    """The store is damaged: malformed metadata, missing or wrong-sized values, torn tables."""


class FormatVersionError(CorruptStoreError):
    """The store was written by an incompatible (newer or unknown) format version."""


class ChecksumError(CorruptStoreError):
    """A value's stored checksum does not match its bytes."""


class StoreReplacedError(LmdbStoreError):
    """The store at a path is no longer the one a reader, set or feed opened: another store, or another data
    file, was put there (``cp`` over ``data.mdb``, ``rm -r`` and a new copy, a rename over it) while it was open.
    Nothing read from the old one is mixed with the new one; open a new reader (or ``refresh()``) to read it."""


class StoreLockedError(LmdbStoreError):
    """Another writer holds the store's write lock."""


class StoreFullError(LmdbStoreError):
    """The disk or the configured maximum map size is exhausted."""


class ValidationError(LmdbStoreError):
    """Input samples or labels are unacceptable (shape, dtype, non-finite values, unknown labels)."""


class SourceError(LmdbStoreError):
    """An ingest source file cannot be read (missing, truncated, empty, wrong layout)."""


class ModelError(LmdbStoreError):
    """A model factory cannot be loaded or called, or the model it built failed in a step (``path``: the factory)."""


class TrainingInterrupted(LmdbStoreError):
    """Training stopped on request (``train(stop=...)``, Ctrl-C in ``lmdbstore train``).

    Attributes:
        checkpoint: the checkpoint to resume from (``path``; ``None`` when the run writes none).
        epoch, step: where it stopped: ``step`` steps into epoch ``epoch`` (numbered from 1).
    """

    def __init__(self, message: str, *, checkpoint: Path | None, epoch: int, step: int) -> None:
        hint = "continue with the same call and resume=True" if checkpoint is not None else None
        super().__init__(message, path=checkpoint, hint=hint)
        self.checkpoint, self.epoch, self.step = checkpoint, epoch, step


class TaskError(LmdbStoreError):
    """A task of ``write_parallel`` raised (``key`` is its index) or a worker process died.

    ``remote_traceback`` holds the worker's traceback text when there is one.
    """

    remote_traceback: str | None = None


#: Below this many bytes available to us, an I/O error on write is taken for a full disk.
DISK_FULL_BYTES = 1 << 20


def _disk_full(path: str | Path) -> bool:
    """Whether the filesystem holding ``path`` (or its parent) has all but run out of space."""
    for p in (Path(path), Path(path).parent):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < DISK_FULL_BYTES
    return False


@contextmanager
def translate_lmdb_errors(path: str | Path, action: str) -> Iterator[None]:
    """Re-raise py-lmdb (and OS) errors met while doing ``action`` on ``path`` as our own.

    Raises:
        StoreFullError: map full beyond the allowed size, or no space left on the device.
        CorruptStoreError: LMDB reports a corrupted or incompatible environment.
        NotAStoreError: the directory holds no valid LMDB environment.
        LmdbStoreError: any other LMDB failure.
    """
    try:
        yield
    except LmdbStoreError:
        raise
    except lmdb.MapFullError as exc:
        raise StoreFullError(f"{action}: the LMDB map is full", path=path, hint="raise max_map_size") from exc
    except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError) as exc:
        raise CorruptStoreError(f"{action}: LMDB reports corruption ({exc})", path=path) from exc
    except (lmdb.InvalidError, lmdb.VersionMismatchError) as exc:
        raise NotAStoreError(f"{action}: not a valid LMDB environment ({exc})", path=path) from exc
    except lmdb.ReadersFullError as exc:
        raise LmdbStoreError(
            f"{action}: every LMDB reader slot is taken by a live lock=True reader",
            path=path,
            hint="read a store nobody writes with lock=False (no slot), or run fewer lock=True readers",
        ) from exc
    except lmdb.DiskError as exc:
        raise StoreFullError(f"{action}: disk error ({exc})", path=path, hint="free disk space") from exc
    except lmdb.Error as exc:
        text = str(exc)
        if "No space left" in text or "ENOSPC" in text:
            raise StoreFullError(f"{action}: no space left on device", path=path, hint="free disk space") from exc
        if os.strerror(errno.EIO) in text and _disk_full(path):
            # LMDB turns a short write (what a full disk causes) into EIO
            raise StoreFullError(
                f"{action}: no space left on device (LMDB saw a short write)", path=path, hint="free disk space"
            ) from exc
        raise LmdbStoreError(f"{action}: LMDB error: {text}", path=path) from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreFullError(f"{action}: no space left on device", path=path, hint="free disk space") from exc
        raise


@contextmanager
def translate_read_errors(path: str | Path, action: str) -> Iterator[None]:
    """:func:`translate_lmdb_errors` for the read path, which also meets what damaged files raise (reads by file
    offset and the page parser see the data file directly).  Wrap only the reading, never the argument checks.

    Raises:
        CorruptStoreError: anything the data file's contents or its reading raised.
        LmdbStoreError: permission denied, and the LMDB failures of :func:`translate_lmdb_errors`.
    """
    try:
        with translate_lmdb_errors(path, action):
            yield
    except LmdbStoreError:
        raise
    except PermissionError as exc:
        raise LmdbStoreError(
            f"{action}: permission denied ({exc.filename or path})",
            path=path,
            hint="check the permissions of the store's files",
        ) from exc
    except OSError as exc:
        raise CorruptStoreError(
            f"{action}: I/O error reading the store ({exc.strerror or exc})", path=path, hint="check the disk"
        ) from exc
    except (struct.error, ValueError, TypeError, IndexError, OverflowError, BufferError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CorruptStoreError(
            f"{action}: the data file is damaged ({type(exc).__name__}: {first})", path=path
        ) from exc
