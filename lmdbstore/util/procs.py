"""How worker and reader processes start: which ``multiprocessing`` start method is safe in this process, and
what to tell the user when the safe one cannot work.

Forking is unsafe only once a runtime's own threads run (a child forked while another thread holds a lock
inherits it held for ever): TensorFlow's first op, JAX's first computation.  So ``fork`` stays (fastest; lambdas
work; no ``__main__`` guard) until one of those runtimes has started, and only then do workers use ``forkserver``.

``forkserver`` and ``spawn`` import the main script again: a script starting workers outside the ``__main__``
guard would start them again (:func:`check_main_guard` says so in one line first), and every child runs the
script's imports (seconds for TensorFlow): a process whose arguments need nothing of the script
(:func:`needs_main`) starts under :func:`main_script_hidden`.
"""

from __future__ import annotations

import ast
import contextlib
import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from functools import cache
from types import FrameType
from typing import Any

from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.memory import MemoryBoundWarning, clip_count

__all__ = [
    "FORK_UNSAFE_MODULES",
    "check_main_guard",
    "fork_unsafe",
    "main_script_hidden",
    "missing_main_guard",
    "needs_main",
    "start_hint",
    "start_method",
    "worker_processes",
]

#: Worker or reader processes per core, at most (:func:`worker_processes`): more only contend for the cores.
WORKERS_PER_CORE = 4
#: Memory one worker or reader process is counted at (a Python with numpy and a batch or result or two).
WORKER_BYTES = 256 << 20
#: Modules whose runtimes, once started, make forking unsafe.
FORK_UNSAFE_MODULES = ("tensorflow", "jax")
#: Thread-name prefixes of those runtimes' pools (TensorFlow's ``tf_Compute``, XLA's ``tf_XLAEigen``...).
RUNTIME_THREAD_PREFIXES = ("tf_",)


def _tf_started() -> bool:
    """Whether TensorFlow's eager runtime exists in this process (created by the first op, not by import)."""
    if "tensorflow" not in sys.modules:
        return False
    context = sys.modules.get("tensorflow.python.eager.context")
    ctx = getattr(context, "_context", None)
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def _jax_started() -> bool:
    """Whether a JAX backend was initialized in this process (by the first computation, not by import)."""
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def _runtime_threads() -> list[str]:
    """Names of this process's threads that a runtime's pools started (Linux; empty elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(RUNTIME_THREAD_PREFIXES):
            names.append(name)
    return names


def fork_unsafe() -> str | None:
    """Why forking is unsafe in this process (``"TensorFlow's runtime is running"``...), or ``None``."""
    if _tf_started():
        return "TensorFlow's runtime is running"
    if _jax_started():
        return "JAX's runtime is running"
    if any(m in sys.modules for m in FORK_UNSAFE_MODULES):
        threads = _runtime_threads()
        if threads:
            return f"runtime threads are running ({threads[0]})"
    return None


def start_method(requested: str | None) -> str:
    """The start method for worker and reader processes, always named (never the platform's default, which
    Python 3.14 changes to ``forkserver`` on Linux): ``requested`` when given; else on Linux ``"forkserver"``
    when forking is unsafe here (:func:`fork_unsafe`) and ``"fork"`` otherwise; elsewhere ``"spawn"`` (macOS'
    and Windows' default: forking there is unsafe with the system's own libraries)."""
    if requested is not None:
        return requested
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver" if fork_unsafe() else "fork"


def _effective(method: str | None) -> str:
    import multiprocessing as mp

    return method or mp.get_start_method(allow_none=False)


@cache
def _guarded_lines(path: str, mtime: float) -> list[tuple[int, int]]:
    """Line ranges of the ``if __name__ == "__main__":`` blocks at the top level of the script ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            out.append((node.lineno, node.end_lineno or node.lineno))
    return out


def _main_frame() -> FrameType | None:
    """The frame running the main script's top-level code, if this call comes from there (main thread)."""
    main = sys.modules.get("__main__")
    if main is None or threading.current_thread() is not threading.main_thread():
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame
        frame = frame.f_back
    return None


def missing_main_guard() -> bool:
    """Whether this call comes from the top level of a main script file outside ``if __name__ ==
    "__main__":`` (directly, or through functions called from there): a ``spawn``/``forkserver`` child,
    importing the script again, would run it again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if not path or not os.path.isfile(path) or (spec is not None and spec.name.endswith("__main__")):
        return False  # python -c, python - < file, a notebook, python -m PACKAGE: no child runs it again
    frame = _main_frame()
    if frame is None or frame.f_code.co_filename != path:
        return False
    try:
        blocks = _guarded_lines(path, os.path.getmtime(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    return not any(lo <= frame.f_lineno <= hi for lo, hi in blocks)


def check_main_guard(method: str | None, what: str) -> None:
    """Refuse to start ``what`` (``"DataLoader workers"``, ``"reader processes"``) by ``spawn`` or
    ``forkserver`` from a script's top level outside the ``__main__`` guard.

    Raises:
        LmdbStoreError: the guard is missing.
    """
    method = _effective(method)
    if method not in ("spawn", "forkserver") or not missing_main_guard():
        return
    why = fork_unsafe()
    because = f" ({why}: forking would hang)" if why else ""
    raise LmdbStoreError(
        f"{what} start by {method}{because}, which imports this script again and would run it again",
        hint='put the training under `if __name__ == "__main__":`',
    )


def start_hint(method: str | None) -> str:
    """What to check when a worker started by ``method`` died at once."""
    method = _effective(method)
    if method in ("spawn", "forkserver"):
        return (
            f"it started by {method}, which imports the main script again: is the training under "
            '`if __name__ == "__main__":`, and is the transform a module-level function? '
            "its traceback is on stderr"
        )
    return "out of memory? a transform that crashed? see its traceback on stderr and the system log"


def needs_main(obj: Any) -> bool:
    """Whether unpickling ``obj`` in a child process may need the main script: its pickle names ``__main__``
    (a function or class defined in the script), or it cannot be pickled here (the child's own error then
    says why).  ``None`` needs nothing."""
    if obj is None:
        return False
    try:
        return b"__main__" in pickle.dumps(obj)
    except Exception:  # any pickling failure: left to the start, which reports it
        return True


@contextlib.contextmanager
def main_script_hidden(method: str | None, *args: Any) -> Iterator[None]:
    """Start processes by ``spawn`` or ``forkserver`` in this block without their running the main script
    again (``multiprocessing`` tells a child to import the script it finds as ``sys.modules["__main__"]``;
    a bare stand-in is there while the block runs) -- unless one of ``args``, the user's objects the
    processes get (a transform), needs the script (:func:`needs_main`).  Other start methods are left as
    they are."""
    if _effective(method) not in ("spawn", "forkserver") or any(needs_main(a) for a in args):
        yield
        return
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def worker_processes(workers: int, cores: int | None = None, available: int | None = None) -> int:
    """The processes to start for ``workers`` asked: at most :data:`WORKERS_PER_CORE` per core and what the
    machine's memory holds at :data:`WORKER_BYTES` each, with a
    :class:`~lmdbstore.util.memory.MemoryBoundWarning` naming ``workers`` when it clips (``workers=100000``
    started that many processes)."""
    cap = WORKERS_PER_CORE * (cores or os.cpu_count() or 1)
    if workers > cap:
        warnings.warn(
            f"workers: {workers:,} worker processes on {cap // WORKERS_PER_CORE} cores would only contend for them; "
            f"using {cap} ({WORKERS_PER_CORE} per core)",
            MemoryBoundWarning,
            stacklevel=3,
        )
        workers = cap
    return clip_count(
        workers, WORKER_BYTES, what="worker processes", parameter="workers", available=available, stacklevel=3
    )
