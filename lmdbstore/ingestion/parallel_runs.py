"""Which run a :func:`~lmdbstore.ingestion.parallel.write_parallel` call is: its resume-ledger key, the tasks
already committed, and the runs of the same name it must never be mixed with.

A run is a name (``produce``'s module and qualified name, or ``name=``) and a task list identified by content
(:mod:`~lmdbstore.ingestion.task_identity`); its ledger entry ``parallel:<name>:c1-<digest of the tasks>``
counts the tasks committed, of ``total``.  Against the entries of the same name already in the store (the one
statement of these rules; docs/design.md says why):

* the same tasks: resume after the tasks committed (all of them: nothing to do);
* a finished run of the first ``k`` of these tasks: this list extends it; write from task ``k`` on (a grown
  task list adds only its new tasks);
* anything else -- an unfinished run of other tasks or of a prefix of these, a finished run of other tasks --
  is refused in one line: the tasks might overlap, and a store that mixed two runs could not be undone.
  ``name=`` writes the tasks as a separate run.

Entries of the previous scheme (``parallel:<name>:<16 hex digits>`` of the tasks' reprs) are matched where the
reprs identify the tasks (:data:`_FAITHFUL` and containers of them) and resumed under their old key; else refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

from lmdbstore.format.ledger import parallel_key, parallel_prefix
from lmdbstore.ingestion.task_identity import ENCODING, TaskIdentities

__all__ = ["RunPlan", "legacy_prefix_digests", "plan_run"]

#: The digest part of a key of the content scheme, and of the previous (repr) scheme.
CONTENT_DIGEST = re.compile(rf"{ENCODING}-[0-9a-f]{{32}}")
LEGACY_DIGEST = re.compile(r"[0-9a-f]{16}")
#: The exact types whose repr identifies a value (the previous scheme's keys are trusted for these only).
_FAITHFUL = (type(None), bool, int, float, str, bytes, range, PosixPath, PurePosixPath, WindowsPath, PureWindowsPath)


@dataclass(frozen=True)
class RunPlan:
    """What a call writes: under ledger entry ``key``, the tasks from ``start`` on."""

    key: str
    start: int


@dataclass(frozen=True)
class _Entry:
    """A ledger entry of a run of this name: its key, task digest, tasks done and total."""

    key: str
    digest: str
    legacy: bool
    done: int
    total: int | None

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total


def _faithful(v: Any, depth: int = 0) -> bool:
    """Whether ``repr(v)`` identifies ``v`` (see the module docstring)."""
    t = type(v)
    if t in _FAITHFUL:
        return t is not int or v.bit_length() < 10_000  # repr refuses ints of over 4,300 digits
    if depth > 64 or t not in (tuple, list, dict):
        return False
    items = [x for kv in v.items() for x in kv] if t is dict else v
    return all(_faithful(x, depth + 1) for x in items)


def legacy_prefix_digests(tasks: Sequence[Any], lengths: set[int]) -> dict[int, str] | None:
    """The previous scheme's digests (of the reprs) of the first ``k`` tasks for every ``k`` in ``lengths``;
    ``None`` when a task among them has a repr that does not identify it."""
    wanted = {k for k in lengths if 0 <= k <= len(tasks)}
    if not all(_faithful(t) for t in tasks[: max(wanted, default=0)]):
        return None
    out: dict[int, str] = {}
    h = hashlib.sha256()
    for k in range(max(wanted, default=-1) + 1):
        if k in wanted:
            out[k] = h.copy().hexdigest()[:16]
        if k < len(tasks):
            h.update(repr(tasks[k]).encode("utf-8", "replace") + b"\0")
    return out


def _entries(ledger: dict[str, dict[str, Any]], run: str) -> list[_Entry]:
    """The ledger entries of the runs named ``run`` (not those of a longer name that starts like it)."""
    prefix = parallel_prefix(run)
    out = []
    for key, entry in ledger.items():
        rest = key[len(prefix) :] if key.startswith(prefix) else ""
        content, legacy = CONTENT_DIGEST.fullmatch(rest), LEGACY_DIGEST.fullmatch(rest)
        if content or legacy:
            total = entry.get("total")
            total = total if isinstance(total, int) and not isinstance(total, bool) else None
            out.append(_Entry(key, rest, bool(legacy), int(entry["done"]), total))
    return out


def plan_run(ledger: dict[str, dict[str, Any]], run: str, tasks: Sequence[Any], ids: TaskIdentities) -> RunPlan:
    """The key and first task of the run named ``run`` over ``tasks`` (identified by ``ids``), given the
    store's ledger (see the module docstring).

    Raises:
        ValueError: one line naming the run, what the store holds and what to do (a run the rules refuse, or a
            ledger that records more tasks than were given).
    """
    key = parallel_key(run, ids.digest)
    entries = _entries(ledger, run)
    if not tasks or not entries:
        return RunPlan(key, 0)
    lengths = {e.total for e in entries if e.total is not None}
    content = ids.prefix_digests(lengths)
    legacy = legacy_prefix_digests(tasks, lengths) if any(e.legacy for e in entries) else {}
    exact: _Entry | None = None
    extended, refused = 0, []
    for e in entries:
        mine = (legacy or {}) if e.legacy else content
        same = e.total is not None and mine.get(e.total) == e.digest
        if same and e.total == len(tasks):
            exact = e
        elif same and e.finished:
            extended = max(extended, int(e.total or 0))
        else:
            refused.append((e, same))
    if exact is not None and exact.done > len(tasks):
        raise ValueError(f"the store's ledger records {exact.done} tasks done for {run!r}, but {len(tasks)} were given")
    if exact is not None and exact.finished:
        return RunPlan(exact.key, exact.done)  # nothing to write: nothing can be mixed
    for e, prefix in refused:
        _refuse(run, e, prefix, len(tasks), legacy is None)
    if exact is None:
        return RunPlan(key, extended)
    if exact.done < extended:
        raise ValueError(
            f"the store's ledger records {exact.done} of these tasks done for {run!r}, but {extended} in a run "
            "these tasks extend"
        )
    return RunPlan(exact.key, exact.done)


def _refuse(run: str, e: _Entry, prefix: bool, n: int, unmatched: bool) -> None:
    """Raise the one-line error for an entry of run ``run`` that these ``n`` tasks may not continue
    (``unmatched``: these tasks' reprs cannot be matched with an entry of the previous scheme)."""
    if e.legacy and unmatched:
        raise ValueError(
            f"the store holds run {run!r} ({e.done} of {e.total} tasks) recorded by an older lmdbstore, which "
            "named tasks by their repr, and these tasks' reprs do not identify them (numpy arrays, sets, "
            "objects): whether they are that run's cannot be told; give another name= to write them as a "
            "separate run"
        )
    if prefix:
        raise ValueError(
            f"the store holds an unfinished run {run!r} of the first {e.total} of these tasks ({e.done} done); "
            f"rerun it with those {e.total} tasks to finish it, then with all {n}"
        )
    if not e.finished:
        raise ValueError(
            f"the store holds an unfinished run {run!r} of other tasks ({e.done} of {e.total} done); rerun it with "
            "the same tasks to finish it, or give another name= to write these as a separate run"
        )
    raise ValueError(
        f"the store holds a finished run {run!r} of other tasks ({e.total} tasks), and these tasks neither are "
        "those nor begin with them: writing them would mix two runs; give another name= to write them as a "
        "separate run"
    )
