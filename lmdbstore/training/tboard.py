"""TensorBoard scalars of a training run, written as an event file into the run directory when the
``tensorboard`` package is installed, with TensorBoard's own protocol buffers and record writer (not
``torch.utils.tensorboard``, which loads TensorFlow: docs/design.md says why).  A resumed run starts a new event
file that first tells TensorBoard to drop what an earlier file logged from the resumed step on.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_PREFIX", "ScalarLog", "open_scalar_log"]

#: File names of TensorBoard event files start with this.
EVENTS_PREFIX = "events.out.tfevents."


def _stamp(path: Path) -> int:
    """The seconds field of an event file's name (0 when it has none)."""
    field = path.name[len(EVENTS_PREFIX) :].split(".", 1)[0]
    return int(field) if field.isdigit() else 0


class ScalarLog:
    """An open event file: :meth:`scalars` appends, :meth:`close` closes (see the module docstring)."""

    def __init__(self, out: Path, purge_from: int | None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2, summary_pb2
        # TensorBoard reads a run's files in name order: this one must sort after every earlier one
        stamp = max([int(time.time()), *(_stamp(p) + 1 for p in out.glob(f"{EVENTS_PREFIX}*"))])
        self.path = out / f"{EVENTS_PREFIX}{stamp:010d}.{socket.gethostname()}.{os.getpid()}.lmdbstore"
        self._writer = RecordWriter(open(self.path, "wb"))  # noqa: SIM115  # closed by close()
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_from is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._write(event_pb2.Event(wall_time=time.time(), step=purge_from, session_log=start))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Log ``values`` (tag -> number; ``None`` and non-finite ones are left out) at ``step``."""
        vals = [
            self._summary.Summary.Value(tag=tag, simple_value=float(v))
            for tag, v in values.items()
            if v is not None and v == v and abs(v) != float("inf")
        ]
        if vals:
            summary = self._summary.Summary(value=vals)
            self._write(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


def open_scalar_log(out: Path | None, *, resumed_at: int | None, fresh: bool) -> ScalarLog | None:
    """The run's :class:`ScalarLog` in ``out``, or ``None`` without ``out`` or without the ``tensorboard``
    package.  ``fresh``: a new run in an old directory, whose old event files are removed first;
    ``resumed_at``: the optimizer steps a resumed run's checkpoint had done (what earlier files logged for
    later steps is dropped)."""
    if out is None:
        return None
    try:
        import tensorboard.compat.proto.event_pb2  # noqa: F401
    except ImportError:
        return None
    if fresh:
        for old in out.glob(f"{EVENTS_PREFIX}*"):
            old.unlink(missing_ok=True)
    return ScalarLog(out, None if resumed_at is None else resumed_at + 1)
