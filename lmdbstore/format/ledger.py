"""The resume ledger (sub-database ``progress``): its key schemes and its entries, in one place.

Each entry says how far one producer got: key = the producer's name (UTF-8), value = JSON
``{"done": int, "total": int | null}``, committed in the same transaction as the samples it counts, so a
rerun resumes exactly.  The producers' names:

* a source file or store: ``KIND:<sha256 prefix of what identifies its content>:<file name>``;
* ``write_parallel``: ``parallel:<run name>:c1-<32 hex digits>``, the digest of the tasks' canonical encoding
  (:mod:`lmdbstore.ingestion.task_identity`; ``done`` counts tasks, not samples); stores written before it
  hold ``parallel:<run name>:<16 hex digits>``, a digest of the tasks' reprs, still resumed where the reprs
  identify the tasks (:mod:`lmdbstore.ingestion.parallel_runs`);
* the built-in synthetic data: ``synthetic:n=<count>:seed=<seed>``.

Entries are JSON, never pickled; a malformed one is a :class:`~lmdbstore.errors.CorruptStoreError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmdbstore.errors import CorruptStoreError

__all__ = [
    "PARALLEL_PREFIX",
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
    """Decode one entry (JSON ``{"done": int >= 0, "total": int | None}``).

    Raises:
        CorruptStoreError: the entry is not such JSON (damaged or foreign data; never unpickled).
    """
    try:
        entry = json.loads(bytes(raw).decode("utf-8"))
        done = entry["done"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise CorruptStoreError(f"resume-ledger entry is malformed ({exc})", path=path, key=name) from exc
    if not isinstance(done, int) or isinstance(done, bool) or done < 0:
        raise CorruptStoreError(f"resume-ledger entry has done={done!r}", path=path, key=name)
    return dict(entry)
