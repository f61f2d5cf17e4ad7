"""Ray through its futures: :class:`RayExecutor`, a ``concurrent.futures.Executor`` whose tasks are Ray tasks, so
``write_parallel(..., executor=RayExecutor())`` runs the producers on a Ray cluster.

It is the few lines any Ray user would write, kept here so that cancelling a future also cancels its Ray task.
Ray (``lmdbstore[ray]``) is imported when the executor is made, never by ``import lmdbstore``.  A task Ray gave up
retrying (``max_retries``) reaches ``write_parallel`` as ``WorkerCrashedError`` (...) and is named in a ``TaskError``.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

__all__ = ["RayExecutor"]


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` (the one remote function every submitted call goes through)."""
    return fn(*args, **kwargs)


class RayExecutor(cf.Executor):
    """A ``concurrent.futures.Executor`` over Ray tasks (``ray.init()`` first where Ray is not initialized).

    ``options``: Ray task options for every call (e.g. ``num_cpus=1``, ``max_retries=3``), as
    ``ray.remote(...).options(**options)`` takes them.  ``workers``: the tasks the cluster runs at once (its CPUs
    divided by ``num_cpus``) when the executor is made, which ``write_parallel`` sizes its window from.

    Raises:
        ImportError: Ray is not installed.
    """

    def __init__(self, **options: Any) -> None:
        import ray

        if not ray.is_initialized():
            ray.init()
        self._ray = ray
        self._remote = ray.remote(call).options(**options)
        per_task = float(options.get("num_cpus", 1) or 1)
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1) // per_task))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        """Start ``fn(*args, **kwargs)`` as a Ray task; its future's ``cancel()`` cancels the task too."""
        ref = self._remote.remote(fn, *args, **kwargs)
        fut: cf.Future[Any] = ref.future()
        ray = self._ray

        def on_done(f: cf.Future[Any]) -> None:
            if f.cancelled():
                ray.cancel(ref)

        fut.add_done_callback(on_done)
        return fut
