"""The resume ledger (sub-database ``progress``, docs/FORMAT.md): its key schemes and its entries, in one place.  An
entry (key: the producer's UTF-8 name; value: JSON ``{"done": int, "total": int | null}``, never pickled) is committed
with the samples it counts.  Names: ``KIND:<content digest>:<file name>`` for a source,
``parallel:<run>:c1-<tasks digest>`` for ``write_parallel`` (``done`` counts tasks), ``synthetic:n=<n>:seed=<seed>``.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from lmdbstore.errors import CorruptStoreError, clip

__all__ = [
    "MAX_NAME_KEY_BYTES",
    "MAX_POSITION",
    "PARALLEL_PREFIX",
    "check_entry",
    "encode_entry",
    "parallel_key",
    "parallel_prefix",
    "parse_entry",
    "source_key",
    "synthetic_key",
]

#: Prefix of every ``write_parallel`` run's entry.
PARALLEL_PREFIX = "parallel:"
#: Longest run name kept in a key (LMDB keys are at most 511 bytes).
MAX_RUN_CHARS = 200
#: Bytes of a file name kept in a source's key.
MAX_NAME_BYTES = 100
#: Largest position (``done``) or total an entry may record (a signed 64-bit integer).
MAX_POSITION = (1 << 63) - 1
#: Longest producer name, in UTF-8 bytes (LMDB's longest key).
MAX_NAME_KEY_BYTES = 511


def _is_count(value: object) -> bool:
    """An integer (Python's or numpy's, never a bool) in ``0..MAX_POSITION``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= int(value) <= MAX_POSITION


def check_entry(name: object, done: object, total: object) -> tuple[str, int, int | None]:
    """An entry about to be recorded, checked: ``name`` a non-empty string of at most :data:`MAX_NAME_KEY_BYTES`
    UTF-8 bytes, ``done`` and ``total`` (or ``None``) integers in ``0..MAX_POSITION`` (not bools, floats or strings:
    ``2.5``, ``"7"``, ``True`` are refused, not cast).  Raises ``ValueError``: naming ``progress`` (the name and
    position) or ``progress_total``."""
    try:
        size = len(name.encode("utf-8")) if isinstance(name, str) else -1  # a lone surrogate cannot be stored
    except UnicodeEncodeError:
        size = -1
    if not 0 < size <= MAX_NAME_KEY_BYTES:
        raise ValueError(
            f"progress: the name must be a non-empty string of at most {MAX_NAME_KEY_BYTES} UTF-8 bytes, "
            f"got {str(name)[:40]!r}"
        )
    if not _is_count(done):
        raise ValueError(f"progress: the position must be an integer in 0..2**63-1, got {str(done)[:40]!r}")
    if total is not None and not _is_count(total):
        raise ValueError(f"progress_total must be None or an integer in 0..2**63-1, got {str(total)[:40]!r}")
    return str(name), int(done), None if total is None else int(total)  # type: ignore[call-overload]


def source_key(kind: str, digest: str, file_name: str) -> str:
    """The entry name of a source of ``kind`` whose content hashes to ``digest``, read from ``file_name``."""
    short = file_name.encode()[:MAX_NAME_BYTES].decode(errors="ignore")
    return f"{kind}:{digest}:{short}"


def parallel_prefix(run: str) -> str:
    """What every entry of the ``write_parallel`` run named ``run`` starts with (any task list)."""
    return f"{PARALLEL_PREFIX}{run[:MAX_RUN_CHARS]}:"


def parallel_key(run: str, tasks_digest: str) -> str:
    """The entry name of the ``write_parallel`` run ``run`` over the tasks whose digest is ``tasks_digest``
    (``c1-<hex>``)."""
    return parallel_prefix(run) + tasks_digest


def synthetic_key(n: int, seed: int) -> str:
    """The entry name of ``n`` built-in synthetic samples drawn with ``seed``."""
    return f"synthetic:n={n}:seed={seed}"


def encode_entry(done: int, total: int | None) -> bytes:
    """The stored value of an entry: ``done`` units committed, of ``total`` when known."""
    return json.dumps({"done": int(done), "total": total}).encode()


def parse_entry(raw: bytes | memoryview, path: str | Path | None, name: str) -> dict[str, Any]:
    """Decode one entry (JSON ``{"done": int >= 0, "total": int | None}``).  Raises ``CorruptStoreError``: the entry
    is not such JSON (damaged or foreign data; never unpickled)."""
    try:
        entry = json.loads(bytes(raw).decode("utf-8"))
        done = entry["done"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise CorruptStoreError(f"resume-ledger entry is malformed ({exc})", path=path, key=name) from exc
    if not _is_count(done):
        raise CorruptStoreError(f"resume-ledger entry has done={clip(repr(done))}", path=path, key=name)
    total = entry.get("total")
    if total is not None and not _is_count(total):
        raise CorruptStoreError(f"resume-ledger entry has total={clip(repr(total))}", path=path, key=name)
    return dict(entry)
