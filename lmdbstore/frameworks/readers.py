"""Reader processes for the Keras and tf.data feeds: each reads whole batches straight into a shared-memory
slot (:mod:`lmdbstore.frameworks.slots`) and answers with the slot number only.  numpy only, no torch.

Why processes: a warm batch is thousands of small copies out of the page cache, Python-driven and
GIL-bound, so reader *threads* in one process serialize (a ``from_generator`` over ``read_batch`` reached
0.67x ``make_loader`` with the same workers).  Processes read in parallel; the slot protocol keeps the
samples from being pickled.

Protocol: a reader maps the slots and says ``("ready",)``; once all have, the slots' file name is removed.
For its ``k``-th batch the feed writes the sample numbers into the slot's label area (int64, as many as
the labels) and sends ``(slot, rows)`` to reader ``k % workers`` -- a few bytes, whatever the batch size;
the reader takes the numbers from there before it writes the labels over them.  Each reader
works its queue in order, so the answers, read back reader by reader in the same round, come in batch
order.  An answer is ``("slot", slot, rows)`` (the batch is in the slot), ``("fresh", slot, x, y)`` (a
transform returned another shape or dtype: the arrays travel pickled) or ``("error", kind, message)``.
Readers ignore Ctrl-C (the consumer's process handles it and stops them) and die with the consumer's
process whatever kills it (:mod:`lmdbstore.util.lifeline`); one that dies is reported as a one-line
:class:`~lmdbstore.errors.LmdbStoreError`.  The start method follows
:func:`~lmdbstore.util.procs.start_method` (``forkserver`` once TensorFlow's or JAX's runtime runs).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from lmdbstore import errors
from lmdbstore.errors import LmdbStoreError
from lmdbstore.frameworks.slots import SegmentFd, SharedSlots
from lmdbstore.loader.transform import Transform, apply_transform
from lmdbstore.store.readers import Reader
from lmdbstore.util.lifeline import Lifeline
from lmdbstore.util.procs import check_main_guard, main_script_hidden, start_hint, start_method

__all__ = ["BatchLayout", "InlineReader", "ReaderPool", "serve_reads"]

#: Seconds a reader gets to stop by itself before it is terminated.
STOP_TIMEOUT = 5.0


@dataclass(frozen=True)
class BatchLayout:
    """How the samples of a store lie in a batch: ``(N, H, W, 1)`` for (H, W) samples and ``(N, H, W, C)``
    for (C, H, W) samples when ``channels_last``, else ``(N, *shape)`` as stored."""

    shape: tuple[int, ...]
    dtype: str
    channels_last: bool = True

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one sample in a batch."""
        if self.channels_last and len(self.shape) == 2:
            return (*self.shape, 1)
        if self.channels_last and len(self.shape) == 3:
            c, h, w = self.shape
            return (h, w, c)
        return self.shape

    @property
    def item_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def read(self, reader: Reader, idx: np.ndarray, out: np.ndarray) -> None:
        """Read samples ``idx`` into ``out`` (``(len(idx), *item_shape)``); (C, H, W) samples are moved
        channels-last on the way."""
        if self.channels_last and len(self.shape) == 3:
            np.copyto(out, reader.read_batch(idx).transpose(0, 2, 3, 1))
        else:
            reader.read_batch(idx, out=out.reshape(len(idx), *self.shape))


def read_into(
    reader: Reader,
    labels: np.ndarray,
    layout: BatchLayout,
    slots: SharedSlots,
    slot: int,
    idx: np.ndarray,
    transform: Transform | None,
) -> tuple[Any, ...]:
    """Read batch ``idx`` into ``slot`` (samples and labels), run ``transform`` on it; the answer of the
    protocol in the module docstring (``("slot", ...)`` or ``("fresh", ...)``)."""
    rows = len(idx)
    x = slots.x(slot, rows, layout.item_shape, np.dtype(layout.dtype))
    y = slots.y(slot, rows)
    layout.read(reader, idx, x)
    y[:] = labels[idx]
    if transform is not None:
        tx, ty, in_buffer = apply_transform(transform, x, y)
        if not in_buffer:
            return ("fresh", slot, np.ascontiguousarray(tx), ty)
        y[:] = ty
    return ("slot", slot, rows)


def serve_reads(
    conn: Connection,
    reader: Reader,
    layout: BatchLayout,
    segment: SegmentFd | str,
    shape: tuple[int, int, int],
    transform: Transform | None,
    lifeline: Lifeline,
) -> None:
    """A reader process: answer ``(slot, rows)`` requests on ``conn`` until ``None`` or end of input.
    ``shape`` is ``(slots, rows per slot, bytes per sample)`` of the shared ``segment``; the process ends
    when the owner of ``lifeline`` does."""
    lifeline.attach()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    try:
        slots = SharedSlots(*shape, segment=segment)
        labels = reader.labels()
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""))
        return
    conn.send(("ready",))
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            slot, rows = request
            try:
                idx = slots.y(slot, rows).copy()  # the sample numbers, where the labels go
                answer = read_into(reader, labels, layout, slots, slot, idx, transform)
            except Exception as exc:  # sent to the consumer, raised there as one line
                answer = ("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            conn.send(answer)
    finally:
        reader.close()
        slots.close()


def raise_answer(kind: str, message: str) -> None:
    """Raise a reader's error in the consumer: the same lmdbstore error class, ``ValueError`` for a
    transform that broke its contract, else :class:`~lmdbstore.errors.LmdbStoreError` naming the kind."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, LmdbStoreError):
        raise cls(message)
    if kind == "ValueError":
        raise ValueError(message)
    raise LmdbStoreError(f"reader process failed: {kind}: {message}")


class InlineReader:
    """The reader "pool" without processes: reads each batch when its answer is asked for, in the
    consumer's thread (``workers=0``)."""

    def __init__(self, reader: Reader, layout: BatchLayout, slots: SharedSlots, transform: Transform | None):
        self.reader, self.layout, self.slots, self.transform = reader, layout, slots, transform
        self.labels = reader.labels()
        self.pending: deque[tuple[int, np.ndarray]] = deque()

    def submit(self, slot: int, idx: np.ndarray) -> None:
        self.pending.append((slot, idx))

    def answer(self) -> tuple[Any, ...]:
        slot, idx = self.pending.popleft()
        return read_into(self.reader, self.labels, self.layout, self.slots, slot, idx, self.transform)

    def close(self) -> None:
        self.pending.clear()


def _stop(procs: list[Any], conns: list[Connection]) -> None:
    """Ask every reader to stop, then terminate the ones that do not."""
    for c in conns:
        with contextlib.suppress(OSError, ValueError):  # already gone
            c.send(None)
    for p in procs:
        p.join(STOP_TIMEOUT)
        if p.is_alive():
            p.terminate()
            p.join(STOP_TIMEOUT)
    for c in conns:
        c.close()


class ReaderPool:
    """``workers`` reader processes over one store and one set of slots (see the module docstring).

    Args:
        reader: the store (only its path and options travel).
        layout: the batch layout.
        slots: the shared slots (created by the caller, which unlinks them).
        workers: processes (at least 1).
        transform: run on each batch in the reader (see :mod:`lmdbstore.loader.transform`).
        context: the start method (``None``: :func:`~lmdbstore.util.procs.start_method`'s choice).
    """

    def __init__(
        self,
        reader: Reader,
        layout: BatchLayout,
        slots: SharedSlots,
        workers: int,
        transform: Transform | None = None,
        context: str | None = None,
    ):
        self.method = start_method(context)
        check_main_guard(self.method, "the reader processes")
        ctx = mp.get_context(self.method)
        lifeline = Lifeline.here(self.method)
        shape = (slots.n, slots.rows, layout.item_bytes)
        self.slots = slots
        self.procs, self.conns = [], []
        reader.close()  # no open environment crosses into the readers
        with main_script_hidden(self.method, transform):  # the script's imports only for a transform of its own
            for _ in range(workers):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(  # type: ignore[attr-defined]
                    target=serve_reads,
                    args=(theirs, reader, layout, slots.segment, shape, transform, lifeline),
                    daemon=True,
                )
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
        self._stopper = weakref.finalize(self, _stop, self.procs, self.conns)
        for k in range(workers):
            ready = self._receive(k)
            if ready[0] == "error":
                self.close()
                raise_answer(ready[1], ready[2])
        slots.unlink()  # every reader has mapped them: nothing is left behind, whatever happens next
        self.sent = 0  # requests sent
        self.answered = 0  # answers read

    def submit(self, slot: int, idx: np.ndarray) -> None:
        """Send the next batch's request to its reader.

        Raises:
            LmdbStoreError: the reader died.
        """
        k = self.sent % len(self.conns)
        self.slots.y(slot, len(idx))[:] = idx  # the reader takes them from there (protocol: module docstring)
        try:
            self.conns[k].send((slot, len(idx)))
        except OSError:
            self._died(k)
        self.sent += 1

    def answer(self) -> tuple[Any, ...]:
        """The answer to the oldest unanswered request (waits for it).

        Raises:
            LmdbStoreError: the reader died.
        """
        answer = self._receive(self.answered % len(self.conns))
        self.answered += 1
        return answer

    def _receive(self, k: int) -> tuple[Any, ...]:
        """The next message of reader ``k`` (waits for it, watching the process)."""
        conn, proc = self.conns[k], self.procs[k]
        while not conn.poll():
            wait([conn, proc.sentinel])
            if not proc.is_alive() and not conn.poll():
                self._died(k)
        try:
            return conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            self._died(k)
            raise  # unreachable: _died raises

    def _died(self, k: int) -> None:
        proc = self.procs[k]
        proc.join(STOP_TIMEOUT)
        raise LmdbStoreError(f"reader process {k} died (exit code {proc.exitcode})", hint=start_hint(self.method))

    def close(self) -> None:
        """Stop the readers (also done when the pool is garbage-collected)."""
        self._stopper()
