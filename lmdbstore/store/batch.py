"""Reading one batch of samples from one snapshot: by file offset, or through liblmdb lookups (private).

:class:`~lmdbstore.store.reader.StoreReader` decides which path a batch takes and checks, before and after,
that the snapshot is still the file's; the functions here only read.  A batch is cut into *runs*:
consecutive samples of one value whose rows in the output are consecutive too (a block-order batch comes
sorted, so its runs are whole pieces of values; in random order they are single samples).  Each run is one
copy: one ``preadv`` (or slice copy) by offset, or one slice of liblmdb's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lmdbstore.errors import ChecksumError, CorruptStoreError
from lmdbstore.format.checksums import compute_checksum
from lmdbstore.format.layout import DB_SAMPLES, encode_key
from lmdbstore.format.pages import PAGEHDRSZ
from lmdbstore.store.handle import Handle
from lmdbstore.store.positions import VERIFY_HINT, PositionTable, check_heads

__all__ = [
    "Runs",
    "plan_runs",
    "prefetch_ranges",
    "read_by_lmdb",
    "read_by_offset",
    "read_cached",
    "read_rows",
    "read_samples",
    "value",
    "whole_value_runs",
]

#: A batch whose runs average fewer samples than this (random order) is read row by row when wholly cached.
ROW_RUN_SAMPLES = 4
#: A run of at least this many samples of one value (block order) that is not cached is read with the whole value.
EXTEND_RUN_SAMPLES = 4


@dataclass(frozen=True)
class Runs:
    """A batch's runs: ``first[r]`` the key of the value run ``r`` reads from, ``skip[r]`` samples into it,
    ``dst[r]`` its first row in the output, ``rows[r]`` its length in samples."""

    first: np.ndarray
    skip: np.ndarray
    dst: np.ndarray
    rows: np.ndarray


def plan_runs(idx: np.ndarray, spv: int) -> Runs:
    """Cut the sample indices ``idx`` (any order, repeats allowed) into runs (see the module docstring)."""
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


def whole_value_runs(runs: Runs, h: Handle) -> np.ndarray:
    """Indices of the runs that copy a whole value (block and window orders read most values whole)."""
    m = h.meta
    full = np.minimum(m.samples_per_value, m.count - runs.first)
    return np.flatnonzero((runs.skip == 0) & (runs.rows == full))


def read_cached(h: Handle, table: PositionTable | None, idx: np.ndarray, out: np.ndarray, whole: bool) -> bool:
    """Fill ``out`` with the samples at ``idx`` (in range) if every byte is in the page cache and every value's
    header was checked; ``False``: nothing was read (see :func:`read_samples` for the arguments)."""
    if table is None or h.engine is None:
        return False
    if read_rows(h, table, idx, out, whole) is not None:
        return True
    m = h.meta
    runs = plan_runs(idx, m.samples_per_value)
    values = runs.first // m.samples_per_value
    voffs = table.offsets[values]
    if (voffs < 0).any() or not table.checked[values].all() or (whole and m.trailer_bytes):
        return False
    sb = m.sample_bytes
    view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    d0 = runs.dst * sb
    return h.engine.read(view, voffs + runs.skip * sb, d0, d0 + runs.rows * sb, only_cached=True)


def read_samples(
    h: Handle, table: PositionTable | None, idx: np.ndarray, out: np.ndarray | None, verify: bool, whole: bool
) -> np.ndarray:
    """The samples at ``idx`` (in range) in ``out`` or a new array: by file offset with a ``table`` (a batch of
    short runs wholly in the page cache by one gather in output order, else run by run), else through liblmdb
    (``verify``: every value's checksum; ``whole``: the checksums of values read whole by offset).

    Raises:
        CorruptStoreError / ChecksumError: as :func:`read_by_offset` and :func:`read_by_lmdb`.
    """
    m = h.meta
    if table is not None:
        got = read_rows(h, table, idx, out, whole)
        if got is not None:
            return got
    runs = plan_runs(idx, m.samples_per_value)
    if out is None:
        out = np.empty((len(idx), *m.shape), m.np_dtype)
    if table is not None:
        read_by_offset(h, table, runs, out, whole)
    else:
        read_by_lmdb(h, runs, out, verify)
    return out


def read_rows(
    h: Handle, table: PositionTable, idx: np.ndarray, out: np.ndarray | None, checksums: bool
) -> np.ndarray | None:
    """The samples at ``idx`` copied row by row from the map in output order, straight into ``out`` (or a new
    array), when every value's header was checked, no whole value is to be checksummed, and every sample's
    bytes are in the page cache now: one call of the compiled copier for any order (as fast as a memmap's
    ``mm[idx]``, or its slice copy of a block); without it, one numpy gather, for random-like batches only
    (short runs; block batches copy a slice per run faster).  ``None`` (nothing read): read the batch run by run
    (:func:`read_by_offset`).

    Raises:
        CorruptStoreError: the data file was truncated under the reader.
    """
    engine = h.engine
    if engine is None:
        return None
    n = len(idx)
    if engine.fast is None:
        steps = int(np.count_nonzero(idx[1:] - idx[:-1] == 1))  # a run of k samples has k - 1 such steps
        if (n - steps) * ROW_RUN_SAMPLES <= n:
            return None
    m = h.meta
    spv, sb = m.samples_per_value, m.sample_bytes
    whole = checksums and m.trailer_bytes and _may_hold_whole_values(idx, spv)
    if whole and whole_value_runs(plan_runs(idx, spv), h).size:
        return None
    offs = _sample_offsets(engine, table, idx, spv, sb)
    if offs is None:
        return None  # a value not checked yet (read_by_offset checks it), or of the wrong length (it raises)
    rows = None if out is None else out.reshape(n, -1).view(np.uint8)
    got = engine.read_rows(offs, sb, rows)
    return None if got is None else (out if out is not None else got.view(m.np_dtype).reshape(n, *m.shape))


def _sample_offsets(engine: Any, table: PositionTable, idx: np.ndarray, spv: int, sb: int) -> np.ndarray | None:
    """Each sample's file offset, if every value of ``idx`` has an offset and its header was checked; else ``None``.
    One pass of the compiled copier where there is one, else numpy."""
    if engine.fast is not None:
        offs = np.empty(len(idx), np.int64)
        idx = np.ascontiguousarray(idx)
        return offs if engine.fast.locate(idx, table.offsets, table.checked, spv, sb, offs) < 0 else None
    values = idx // spv
    if not table.checked[values].all():
        return None
    offs = table.offsets[values]
    if (offs < 0).any():
        return None
    offs += (idx - values * spv) * sb
    return offs


def _may_hold_whole_values(idx: np.ndarray, spv: int) -> bool:
    """Whether ``idx`` has enough consecutive steps to hold a whole value (a cheap test before planning runs)."""
    return int(np.count_nonzero(idx[1:] - idx[:-1] == 1)) >= spv - 1


def read_by_offset(h: Handle, table: PositionTable, runs: Runs, out: np.ndarray, checksums: bool) -> None:
    """Fill ``out`` from the file at the table's offsets: one read per run.

    Every value's overflow-page header is checked the first time the value is read in this process (before
    anything is returned; the run is then read from the header on, in one read); a run of several samples that
    is not cached is read with the rest of its value (:data:`EXTEND_RUN_SAMPLES`); with ``checksums``, values
    read whole are checked against their stored checksum.

    Raises:
        CorruptStoreError: a value of the wrong length, a wrong overflow header, a short read.
        ChecksumError: a whole value does not match its checksum.
    """
    m, engine = h.meta, h.engine
    assert engine is not None
    sb, spv = m.sample_bytes, m.samples_per_value
    values = runs.first // spv
    voffs = table.offsets[values]
    if (voffs < 0).any():
        key = int(runs.first[voffs < 0][0])
        raise CorruptStoreError("value has the wrong length", path=h.path, key=key, hint=VERIFY_HINT)
    d0 = runs.dst * sb
    ends = d0 + runs.rows * sb
    view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    # A block-like run (several samples of a value) that is not cached is read with the rest of its value: the
    # other pieces of the value come in the next batches (block order cuts values in block_buffer pieces), and
    # one read of a whole value costs the disk less than two of its halves.
    block_like = runs.rows >= EXTEND_RUN_SAMPLES
    before = np.where(block_like, runs.skip * sb, 0)
    after = np.where(block_like, (np.minimum(spv, m.count - runs.first) - runs.skip - runs.rows) * sb, 0)
    # A value read for the first time in this process has its overflow header checked before anything is
    # returned; its run is read from the header on, in the same read (one disk read, not two).
    new = ~table.checked[values]
    if new.any():
        heads = engine.read_headed(
            view, voffs[new] - PAGEHDRSZ, runs.skip[new] * sb, d0[new], ends[new], PAGEHDRSZ, after[new]
        )
        check_heads(table, values[new], heads, h.path)
    old = ~new
    engine.read(view, voffs[old] + runs.skip[old] * sb, d0[old], ends[old], around=(before[old], after[old]))
    if checksums and m.trailer_bytes:
        whole = whole_value_runs(runs, h)
        if whole.size:
            _check_whole(h, view, voffs[whole], d0[whole], ends[whole], runs.first[whole])


def _check_whole(h: Handle, view: memoryview, voffs: np.ndarray, d0: np.ndarray, ends: np.ndarray, keys: Any) -> None:
    """Compare each whole value read into ``view[d0:end]`` with its stored checksum (the trailer after it)."""
    m, engine = h.meta, h.engine
    assert engine is not None
    fn = compute_checksum(m.checksum)
    assert fn is not None
    t = m.trailer_bytes
    trailers = engine.gather(voffs + (ends - d0), t)
    for i, (d, e) in enumerate(zip(d0.tolist(), ends.tolist(), strict=True)):
        if fn(view[d:e]) != trailers[i].tobytes():
            raise ChecksumError("checksum mismatch", path=h.path, key=int(keys[i]), hint=VERIFY_HINT)


def value(h: Handle, first: int, verify: bool) -> memoryview:
    """The payload of the value keyed ``first`` through liblmdb (length checked, trailer removed), a view of the
    map: call and use it under ``h.lmdb()``.

    Raises:
        CorruptStoreError: the value is missing or of the wrong length.  ChecksumError: with ``verify``.
    """
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
    """Fill ``out`` through liblmdb lookups: each value looked up once per run of samples that share it.

    This is the hot path of ``positions=False`` readers in random order: numpy prepares every per-run input
    up front (one 8-byte key object per run), so the loop does no slicing or arithmetic of its own.

    Raises:
        CorruptStoreError: a missing or wrong-length value.  ChecksumError: with ``verify``.
    """
    m = h.meta
    sb, spv = m.sample_bytes, m.samples_per_value
    keys = runs.first.astype(">u8").view("V8").tolist()
    offs = (runs.skip * sb).tolist()
    dsts = (runs.dst * sb).tolist()
    ends = (runs.dst * sb + runs.rows * sb).tolist()
    ov = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers
    get, db = h.txn.get, h.dbs[DB_SAMPLES]
    # unchecked fast path: still refuse a value of the wrong length (the last value is shorter)
    full_len, tail_first = spv * sb + m.trailer_bytes, m.count - m.count % spv
    tail_len = m.expected_value_len(tail_first) if tail_first < m.count else full_len
    tail_key = encode_key(tail_first)
    last: Any = None
    buf: Any = None
    with h.lmdb():  # liblmdb's map: kept from shrinking, one thread at a time
        for k, o, d, e in zip(keys, offs, dsts, ends, strict=True):
            if k != last:
                last = k
                if verify:
                    buf = value(h, int.from_bytes(k, "big"), True)
                else:
                    buf = get(k, db=db)
                    if buf is None or len(buf) != (tail_len if k == tail_key else full_len):
                        buf = value(h, int.from_bytes(k, "big"), False)  # raises the precise error
            ov[d:e] = buf[o : o + e - d]


def prefetch_ranges(table: PositionTable, lo: Any, hi: Any) -> tuple[list[int], list[int]]:
    """The byte ranges of the file holding the samples of ranges ``lo[i]..hi[i]-1``: one range per sample
    range whose values lie together (the writer appends them in order), else one per value."""
    spv = table.samples_per_value
    lo_v = np.asarray(lo, np.int64).reshape(-1) // spv
    hi_v = (np.asarray(hi, np.int64).reshape(-1) - 1) // spv
    off = table.offsets
    vlen = int(table.lengths.max()) if len(off) else 0
    starts: list[int] = []
    ends: list[int] = []
    for a, b in zip(lo_v.tolist(), hi_v.tolist(), strict=True):
        seg = off[max(a, 0) : min(b, len(off) - 1) + 1]
        seg = seg[seg >= 0]
        if seg.size == 0:
            continue
        s0, s1 = int(seg.min()), int(seg.max()) + vlen
        if s1 - s0 <= 2 * vlen * seg.size:  # laid out together: one read
            starts.append(s0)
            ends.append(min(s1, table.file_size))
        else:  # scattered pages: one read per value
            starts.extend(seg.tolist())
            ends.extend(np.minimum(seg + vlen, table.file_size).tolist())
    return starts, ends
