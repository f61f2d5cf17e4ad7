"""How many reads a reader keeps in flight on a cold batch: :class:`InFlight`, following the disk.

A fast NVMe disk serves more random reads at 64 in flight than at 16 (1.5x measured in issue 21), a slow or
network disk gains nothing from more and is only flooded.  With ``io_threads=None`` (the default) the count
adapts by hill climbing on the throughput the disk delivered: after each batch that sent at least
:data:`MIN_RUNS_PER_READ` reads per thread to the I/O threads, the count moves one step (x2 or /2) in the
direction that last helped, and turns back when the rate fell by more than :data:`NOISE` against the previous
step.  It stays within :data:`MIN_IO_THREADS` .. :data:`MAX_IO_THREADS` and starts at
:data:`~lmdbstore.store.preads.DEFAULT_IO_THREADS`.  An explicit ``io_threads`` is used as given.

Only the count of reads in flight depends on these measurements, never which bytes are read or whether a run
is read from the map or the disk (that is the kernel's answer, :mod:`lmdbstore.store.residency`).
"""

from __future__ import annotations

__all__ = ["MAX_IO_THREADS", "MIN_IO_THREADS", "MIN_RUNS_PER_READ", "NOISE", "InFlight"]

#: Bounds of the adaptive count of reads in flight.
MIN_IO_THREADS = 4
MAX_IO_THREADS = 64
#: A batch tells the rate at a count only when it sent at least this many reads per thread.
MIN_RUNS_PER_READ = 4
#: A rate lower than the previous step's by more than this share counts as worse (disks are noisy).
NOISE = 0.1


class InFlight:
    """The count of reads in flight for one reader in one process (see the module docstring).

    Args:
        start: the first count.
        fixed: never change it (an explicit ``io_threads``).
    """

    def __init__(self, start: int, fixed: bool = False):
        self.count = max(1, start)
        self.fixed = fixed
        self.up = True
        self.last_rate: float | None = None

    def observe(self, reads: int, seconds: float) -> None:
        """``reads`` missing runs were read by the I/O threads in ``seconds`` at the current count."""
        if self.fixed or seconds <= 0 or reads < MIN_RUNS_PER_READ * self.count:
            return
        rate = reads / seconds
        if self.last_rate is not None and rate < self.last_rate * (1 - NOISE):
            self.up = not self.up  # the last step made it worse: go back the other way
        self.last_rate = rate
        step = self.count * 2 if self.up else self.count // 2
        nxt = min(MAX_IO_THREADS, max(MIN_IO_THREADS, step))
        if nxt == self.count:  # at a bound: try the other way next time
            self.up = not self.up
        self.count = nxt
