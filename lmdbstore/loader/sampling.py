"""The sampler a loader built by :func:`~lmdbstore.loader.dataset.make_loader` iterates: the user's batch
sampler, wrapped.

The wrapper does three things and changes no order:

* it tags every batch request with the generation of the iteration that asked for it, so that reusable
  buffers of an abandoned iteration are known to be free (:mod:`lmdbstore.loader.buffers`);
* it keeps the wrapped sampler's state reachable: ``loader.sampler.state_dict()`` and the per-pass
  iterator's ``state_dict``/``load_state_dict`` are the wrapped sampler's (:mod:`lmdbstore.loader.passes`),
  which is what torchdata's ``StatefulDataLoader`` restores through, and ``set_epoch`` reaches it too (the
  sampler's position counts batches *drawn*, ahead of the loop; the loader's own ``state_dict`` counts those
  delivered: :mod:`lmdbstore.loader.delivered`);
* it is a ``torch.utils.data.DistributedSampler`` (without that class's own state), because the wrapped
  sampler shards by rank itself.  PyTorch Lightning replaces the sampler of any DataLoader whose sampler is
  not a ``DistributedSampler`` when it trains with DDP, which for a batch sampler means one-sample batches
  (and for :class:`~lmdbstore.loader.dataset.BufferedLoader` used to be an error); with this wrapper
  Lightning leaves the loader as it is, and each rank reads its own share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data.distributed import DistributedSampler

from lmdbstore.loader.buffers import TaggedBatch

__all__ = ["LoaderPass", "LoaderSampler"]


class LoaderPass(Iterator[TaggedBatch]):
    """One pass of a :class:`LoaderSampler`: the wrapped sampler's batches tagged with ``gen``, after
    dropping, when it begins, the ``owner.skip`` batches a loader state asked it to skip (for samplers that
    keep no position themselves).  Its ``state_dict``/``load_state_dict`` are the wrapped pass iterator's
    (absent when that has none)."""

    def __init__(self, inner: Iterator[Any], gen: int, owner: Any = None):
        self.inner = inner
        self.gen = gen
        self.owner = owner
        self.begun = False

    def __iter__(self) -> LoaderPass:
        return self

    def __next__(self) -> TaggedBatch:
        if not self.begun:  # a DataLoader asks for two iterators and draws from the second only
            self.begun = True
            skip = int(getattr(self.owner, "skip", 0))
            if skip:
                self.owner.skip = 0
                for _ in range(skip):
                    next(self.inner)
        return TaggedBatch(self.gen, next(self.inner))

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "gen", "owner", "begun"):  # not set yet
            raise AttributeError(name)
        if name in ("state_dict", "load_state_dict"):
            return getattr(self.inner, name)
        raise AttributeError(name)


class LoaderSampler(DistributedSampler):  # type: ignore[type-arg]
    """Wraps a batch sampler for a loader (see the module docstring).  ``holder.buffers`` (read when an
    iteration starts) gives the generation each request carries; other attributes are the wrapped
    sampler's (``set_epoch``, ``batch_size``, ``state_dict``...)."""

    def __init__(self, sampler: Any, holder: Any = None):  # no super().__init__: it wants a dataset and a group
        self.inner = sampler
        self.holder = holder
        self.skip = 0  # batches the next pass drops unread (a loader state of a sampler without one)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> LoaderPass:
        buffers = getattr(self.holder, "buffers", None)
        return LoaderPass(iter(self.inner), buffers.generation if buffers is not None else 0, self)

    def set_epoch(self, epoch: int) -> None:
        """The wrapped sampler's ``set_epoch`` (a no-op for a sampler without one)."""
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    # what DistributedSampler users read, answered by the wrapped sampler
    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return int(getattr(self.inner, "world_size", 1))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return int(getattr(self.inner, "rank", 0))

    @property
    def epoch(self) -> int:  # type: ignore[override]
        return int(getattr(self.inner, "epoch", 0))

    @property
    def shuffle(self) -> bool:  # type: ignore[override]
        return getattr(self.inner, "shuffle", "random") != "none"

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "holder", "skip"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)
