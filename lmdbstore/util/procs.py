"""How reader processes start: which ``multiprocessing`` start method is safe in this process.

A process that has imported TensorFlow (or JAX) runs thread pools of its own; a child forked from it
inherits their locks in whatever state they were, and can hang for ever (seen with DataLoader workers
stuck in TensorFlow's thread-pool teardown).  Such a process starts its readers with ``forkserver``: they
are forked from a small server process started before any of those threads existed.  Elsewhere the
platform default stays (``fork`` on Linux: fastest, and workers inherit the parent's position table).
"""

from __future__ import annotations

import sys

__all__ = ["FORK_UNSAFE_MODULES", "fork_unsafe", "start_method"]

#: Modules whose presence makes forking unsafe (they start threads that a forked child cannot use).
FORK_UNSAFE_MODULES = ("tensorflow", "jax")


def fork_unsafe() -> str | None:
    """The first of :data:`FORK_UNSAFE_MODULES` imported in this process, or ``None``."""
    return next((m for m in FORK_UNSAFE_MODULES if m in sys.modules), None)


def start_method(requested: str | None) -> str | None:
    """The start method for reader processes: ``requested`` when given; else ``"forkserver"`` when this
    process has imported a module that makes forking unsafe, else ``None`` (the platform default)."""
    if requested is not None:
        return requested
    return "forkserver" if fork_unsafe() else None
