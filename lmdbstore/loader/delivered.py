"""Where a loader stands: the batches it has *delivered* to the loop, which is what a resumed run must skip.

A DataLoader with workers draws batches from its sampler ahead of the loop -- ``workers x prefetch_factor``
of them as soon as an epoch starts, one more for every batch delivered -- so the sampler's own position
(:mod:`lmdbstore.loader.passes`) counts batches read or being read, not trained: resuming from it skipped
batches that were never trained (after 5 of 36 batches with 2 workers the sampler said 9).  A loader built
by :func:`~lmdbstore.loader.dataset.make_loader` counts what it hands out, and its ``state_dict()`` is the
sampler's state at that count: taken after the loop received ``k`` batches of an epoch, it resumes at
batch ``k`` of that epoch -- with any number of workers and any prefetch, across the end of an epoch (a
finished epoch resumes with the next one), and with a new order per pass or per ``set_epoch``.  That is
torchdata's ``StatefulDataLoader`` contract, and PyTorch Lightning saves and restores such a loader in its
mid-epoch checkpoints (it treats a loader with ``state_dict``/``load_state_dict`` as resumable).

The state is in the sampler's format (``{"epoch", "position", ...}`` plus what must match: kind, seed, batch
size, samples, world size), so a sampler state saved by an older trainer loads into the loader, and the
loader's into the sampler.  ``load_state_dict`` pins that epoch and position for the loader's next pass:
the batches already trained are skipped without being read.

A batch sampler without that interface (a ``torch.utils.data.BatchSampler``, a list of index arrays)
resumes by count: ``{"position": k, "batches": n}``, and the next pass skips its first ``k`` batches
without reading them -- exact when that pass repeats the interrupted one's batches.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Delivered"]


class Delivered:
    """The batches delivered by the iterations of one loader, and the loader's state from them.

    Args:
        sampler: the loader's :class:`~lmdbstore.loader.sampling.LoaderSampler` (its ``inner`` is the batch
            sampler the state is about; its ``skip`` makes a pass skip batches, for samplers without state).
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.iteration = 0  # number of the latest iteration begun (or invalidated by a load)
        self.pass_: tuple[int, int] | None = None  # (epoch, first batch) of the latest iteration's pass
        self.count = 0  # batches the latest iteration has delivered

    @property
    def inner(self) -> Any:
        return self.sampler.inner

    def stateful(self) -> bool:
        """Whether the batch sampler keeps epochs and positions itself (:class:`~lmdbstore.loader.passes.EpochPasses`
        or a wrapper of one that forwards them)."""
        return all(callable(getattr(self.inner, name, None)) for name in ("state_at", "upcoming_pass", "pinned_pass"))

    def begin(self) -> int:
        """Call when an iteration starts, before it draws from the sampler; returns its number."""
        self.iteration += 1
        self.count = 0
        self.pass_ = self.inner.upcoming_pass() if self.stateful() else (0, int(self.sampler.skip))
        return self.iteration

    def delivered(self, iteration: int) -> None:
        """Call as iteration ``iteration`` hands a batch to the loop (an older iteration's do not count)."""
        if iteration == self.iteration:
            self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """The state that resumes after the batches delivered so far (see the module docstring)."""
        if not self.stateful():
            start = self.pass_[1] if self.pass_ is not None else int(self.sampler.skip)
            return {"position": start + self.count, "batches": _length(self.sampler)}
        if self.pass_ is None or self.inner.pinned_pass() is not None:
            return dict(self.inner.state_dict())  # nothing delivered since the sampler was pinned (or ever)
        epoch, start = self.pass_
        return dict(self.inner.state_at(epoch, start + self.count))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the loader's next pass resume from ``state``.

        Raises:
            ValueError: the state is malformed or belongs to another sampler (naming what differs).
        """
        if self.stateful():
            self.inner.load_state_dict(state)
        else:
            self.sampler.skip = _position(state, _length(self.sampler))
        self.iteration += 1  # an iteration still running no longer counts
        self.pass_ = None
        self.count = 0


def _length(sampler: Any) -> int | None:
    """Batches per pass of ``sampler`` (``None``: it does not say)."""
    try:
        return len(sampler)
    except TypeError:
        return None


def _position(state: Any, batches: int | None) -> int:
    """The batches to skip for a count state of a sampler of ``batches`` batches (0 after a finished pass).

    Raises:
        ValueError: not a ``{"position": int >= 0, "batches": int or None}`` state of a sampler of that length.
    """
    if not isinstance(state, dict):
        raise ValueError(f"loader state must be a dict, got {type(state).__name__}")
    position, total = state.get("position"), state.get("batches")
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise ValueError(f"loader state: position must be a non-negative integer, got {position!r}")
    if total != batches:
        raise ValueError(f"loader state is for a sampler of {total} batches, this one has {batches}")
    if batches is not None and position > batches:
        raise ValueError(f"loader state: position {position} is past the {batches} batches of a pass")
    return 0 if position == batches else position
