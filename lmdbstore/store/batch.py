"""Reading one batch of samples from one snapshot (the caller checks the snapshot rule): by file offset, every store's
part in one compiled call (:func:`~lmdbstore.store.fileread.read_together`), or through liblmdb, one slice of a
value per *run* (consecutive samples of one value whose rows in the output are consecutive too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lmdbstore.errors import ChecksumError, CorruptStoreError
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.layout import DB_SAMPLES, encode_key
from lmdbstore.format.pages import DAMAGE_HINT
from lmdbstore.store.fileread import EXTEND_RUN_SAMPLES, OK, read_together
from lmdbstore.store.handle import Handle
from lmdbstore.store.positions import PositionTable

__all__ = ["Runs", "plan_runs", "read_parts", "read_samples"]


@dataclass(frozen=True)
class Runs:
    """A batch's runs: ``first[r]`` the key of the value run ``r`` reads from, ``skip[r]`` samples into it,
    ``dst[r]`` its first row in the output, ``rows[r]`` its length in samples."""

    first: np.ndarray
    skip: np.ndarray
    dst: np.ndarray
    rows: np.ndarray


def plan_runs(idx: np.ndarray, spv: int) -> Runs:
    """Cut the sample indices ``idx`` (any order, repeats allowed) into runs."""
    n = len(idx)
    step = idx[1:] - idx[:-1]
    if (step >= 0).all():  # sorted already (block and window batches): rows keep their order
        order, sidx = np.arange(n), idx
        cut = step != 1
    else:
        order = np.argsort(idx, kind="stable")
        sidx = idx[order]
        cut = (sidx[1:] - sidx[:-1] != 1) | (order[1:] - order[:-1] != 1)
    firsts = sidx - sidx % spv
    cut |= firsts[1:] != firsts[:-1]
    brk = np.flatnonzero(np.concatenate(([True], cut)))
    return Runs(firsts[brk], sidx[brk] - firsts[brk], order[brk], np.diff(np.append(brk, n)))


def read_samples(
    h: Handle,
    table: PositionTable | None,
    idx: np.ndarray,
    out: np.ndarray | None,
    lmdb: bool,
    verify: bool,
    whole: bool,
) -> np.ndarray:
    """The samples at ``idx`` (in range) in ``out`` or a new array: by file offset (:func:`read_parts`), or with
    ``lmdb`` through liblmdb (``verify``: every value's checksum) once the ``table`` located them (its checks: no
    page of theirs another owner's). ``whole``: check the checksums of values read whole by offset
    (``CorruptStoreError`` / ``ChecksumError``: as :func:`read_parts` and :func:`read_by_lmdb`)."""
    m = h.meta
    if out is None:
        out = np.empty((len(idx), *m.shape), m.np_dtype)
    if table is not None and not lmdb:
        read_parts([(h, table, idx, out, whole)])
        return out
    if table is not None and h.files is not None:
        table.ensure(idx // m.samples_per_value, h.files)
    read_by_lmdb(h, plan_runs(idx, m.samples_per_value), out, verify)
    return out


def read_parts(parts: list[tuple[Handle, PositionTable, np.ndarray, np.ndarray, bool]]) -> None:
    """Fill each part's ``out`` with its samples by file offset, all parts (stores of a set) in one compiled call,
    once the leaves of values not located yet were read (:meth:`PositionTable.ensure`); with a part's ``checksums``,
    values read whole are checked against their stored checksum (``ChecksumError``; ``CorruptStoreError``: a value of
    the wrong length, a wrong overflow header, a short read, a damaged leaf)."""
    todo = []
    for h, table, idx, out, _ in parts:
        assert h.files is not None
        if not table.complete:
            table.ensure(idx // table.samples_per_value, h.files)
        args = (out.reshape(-1).view(np.uint8), idx, table.offsets, table.checked, table.layout, EXTEND_RUN_SAMPLES)
        todo.append((h.files, args))
    for (h, table, idx, out, checksums), (status, detail) in zip(parts, read_together(todo), strict=True):
        assert h.files is not None
        if status != OK:  # (NEED: every value was located above)
            raise h.files.fail(status, detail, key=detail * table.samples_per_value)
        if checksums and h.meta.trailer_bytes:
            _check_whole(h, table, idx, out)


def _check_whole(h: Handle, table: PositionTable, idx: np.ndarray, out: np.ndarray) -> None:
    """Compare each value read whole (block and window orders read most values whole) into ``out`` with its stored
    checksum (the trailer after it).  Raises ``ChecksumError``: naming the first value that does not match."""
    m, files, fn = h.meta, h.files, compute_checksum(h.meta.checksum)
    assert files is not None and fn is not None
    spv, sb = m.samples_per_value, m.sample_bytes
    runs = plan_runs(idx, spv)
    w = np.flatnonzero((runs.skip == 0) & (runs.rows == np.minimum(spv, m.count - runs.first)))
    if not w.size:
        return
    d0, n, first = runs.dst[w] * sb, runs.rows[w] * sb, runs.first[w]
    trailers = files.gather(table.offsets[first // spv] + n, m.trailer_bytes)
    view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    for i, (d, e) in enumerate(zip(d0.tolist(), (d0 + n).tolist(), strict=True)):
        if fn(view[d:e]) != trailers[i].tobytes():
            raise ChecksumError("checksum mismatch", path=h.path, key=int(first[i]), hint=DAMAGE_HINT)


def value(h: Handle, first: int, verify: bool) -> memoryview:
    """The payload of the value keyed ``first`` through liblmdb (length checked, trailer removed), a view of the map:
    call and use it under ``h.lmdb()`` (``CorruptStoreError``: the value is missing or of the wrong length;
    ``ChecksumError``: with ``verify``)."""
    m = h.meta
    buf = h.txn.get(encode_key(first), db=h.dbs[DB_SAMPLES])
    if buf is None:
        raise CorruptStoreError("value missing", path=h.path, key=first)
    want = m.expected_value_len(first)
    if len(buf) != want:
        raise CorruptStoreError(f"value has {len(buf)} bytes, expected {want}", path=h.path, key=first)
    payload = buf[: want - m.trailer_bytes]
    if verify and m.trailer_bytes:
        fn = compute_checksum(m.checksum)
        assert fn is not None
        if fn(payload) != bytes(buf[want - m.trailer_bytes :]):
            raise ChecksumError("checksum mismatch", path=h.path, key=first)
    return memoryview(payload)


def read_by_lmdb(h: Handle, runs: Runs, out: np.ndarray, verify: bool) -> None:
    """Fill ``out`` through liblmdb lookups, each value looked up once per run of samples that share it (numpy
    prepares every per-run input: the loop of ``positions=False`` readers does no arithmetic of its own). Raises
    ``CorruptStoreError``: a missing or wrong-length value; ``ChecksumError``: with ``verify``."""
    m = h.meta
    sb = m.sample_bytes
    keys = runs.first.astype(">u8").view("V8").tolist()
    want = (np.minimum(m.samples_per_value, m.count - runs.first) * sb + m.trailer_bytes).tolist()
    offs, dsts, ends = (runs.skip * sb).tolist(), (runs.dst * sb).tolist(), ((runs.dst + runs.rows) * sb).tolist()
    ov = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers
    get, db, last = h.txn.get, h.dbs[DB_SAMPLES], None
    buf: Any = None
    with h.lmdb():  # liblmdb's map: kept from shrinking, one thread at a time
        for k, n, o, d, e in zip(keys, want, offs, dsts, ends, strict=True):
            if k != last:
                last, buf = k, None if verify else get(k, db=db)
                if buf is None or len(buf) != n:  # checked, or missing or of the wrong length: the precise error
                    buf = value(h, int.from_bytes(k, "big"), verify)
            ov[d:e] = buf[o : o + e - d]
