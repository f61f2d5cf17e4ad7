"""What every command of the ``lmdbstore`` CLI shares: errors as one line (and with ``--json`` one JSON error
object on stdout), output (human lines, or with ``--json`` only JSON on stdout), the ``--json`` and
``--progress`` options, option parsing.

The defaults the commands show come from :mod:`lmdbstore.config`; :data:`WRITER`, :data:`LOADER` and
:data:`TRAIN` are the default configurations whose fields the options default to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Annotated, Any

import typer

from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig
from lmdbstore.errors import LmdbStoreError, clip, unwrap_worker_message
from lmdbstore.version import __version__

__all__ = [
    "LOADER",
    "MAX_ERROR_CHARS",
    "TRAIN",
    "WRITER",
    "JsonOption",
    "Output",
    "ProgressOption",
    "cli_errors",
    "error_json",
    "fail",
    "or_list",
    "parse_names",
    "parse_shape",
    "parse_weights",
    "report_dict",
    "require_torch",
    "show_version",
    "to_json",
]

#: Longest error line the CLI prints (messages are short by construction; this is a backstop).
MAX_ERROR_CHARS = 1000

#: The default configurations: the options of ``ingest``, ``train``, ``eval`` and ``demo`` default to their fields.
WRITER = WriterConfig()
LOADER = LoaderConfig()
TRAIN = TrainConfig()


#: ``--json``: only JSON on stdout; the human lines go to stderr.
JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout (the human lines go to stderr).")]
#: ``--progress/--no-progress``: bars on stderr; by default only when stderr is a terminal.
ProgressOption = Annotated[
    bool | None,
    typer.Option("--progress/--no-progress", help="Show progress bars (default: when stderr is a terminal)."),
]


class Output:
    """Where a command's output goes: human lines on stdout, or with ``--json`` on stderr, leaving stdout to
    the one JSON document :meth:`result` prints (nothing else, so ``json.loads`` of stdout works)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def say(self, text: str) -> None:
        """A human line (stdout; stderr under ``--json``)."""
        typer.echo(text, err=self.as_json)

    def result(self, obj: Any) -> None:
        """The command's JSON document (under ``--json`` only)."""
        if self.as_json:
            typer.echo(to_json(obj))


def report_dict(report: Any) -> dict[str, Any]:
    """A report dataclass as a dict, with its ``samples_per_s`` when it has one."""
    assert is_dataclass(report) and not isinstance(report, type)
    out = asdict(report)
    if hasattr(report, "samples_per_s"):
        out["samples_per_s"] = report.samples_per_s
    return out


def require_torch(command: str) -> None:
    """Stop with one line naming the extra to install when torch is missing (``train``, ``eval``, ``demo``).

    Raises:
        LmdbStoreError: torch cannot be imported.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise LmdbStoreError(
            f"{command} needs PyTorch, which is not installed", hint="pip install 'lmdbstore[torch]'"
        ) from None


def error_json(line: str, exc: BaseException | None, code: int) -> dict[str, Any]:
    """The JSON error object ``--json`` prints on stdout: ``error`` (what went wrong), ``path`` and ``hint``
    (``null`` when unknown), ``kind`` (the error's class) and ``exit_code``."""
    if isinstance(exc, LmdbStoreError):
        return {
            "error": clip(unwrap_worker_message(exc.message), MAX_ERROR_CHARS),
            "path": exc.path,
            "hint": exc.hint,
            "kind": type(exc).__name__,
            "exit_code": code,
        }
    kind = type(exc).__name__ if exc is not None else "Error"
    return {"error": line, "path": None, "hint": None, "kind": kind, "exit_code": code}


def fail(msg: str, code: int = 1, exc: BaseException | None = None, *, as_json: bool = False) -> None:
    """Print ``error: MSG`` as one clipped line on stderr -- and with ``as_json`` (``--json``) the error as one
    JSON object on stdout (:func:`error_json`) -- and exit with status ``code``."""
    line = clip(unwrap_worker_message(str(msg)), MAX_ERROR_CHARS)
    typer.echo(f"error: {line}", err=True)  # one line
    if as_json:
        typer.echo(to_json(error_json(line, exc, code)))
    raise typer.Exit(code)


@contextmanager
def cli_errors(code: int = 1, *, as_json: bool = False) -> Iterator[None]:
    """Turn deliberate errors (``LmdbStoreError``, ``ValueError``, ``IndexError``) into one line on stderr and
    exit status ``code`` (default 1); Ctrl-C into one line and status 130.  With ``as_json`` (the command's
    ``--json``) also one JSON error object on stdout."""
    try:
        yield
    except LmdbStoreError as exc:
        fail(str(exc), code, exc, as_json=as_json)
    except (ValueError, IndexError) as exc:
        fail(str(exc), code, exc, as_json=as_json)
    except KeyboardInterrupt as exc:
        msg = "interrupted; committed batches are kept (rerun the same command to resume)"
        fail(msg, 130, exc, as_json=as_json)


def to_json(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as valid JSON: non-finite floats (a NaN loss, say) become ``null``."""
    from lmdbstore.util.jsonsafe import json_safe

    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def parse_shape(text: str) -> tuple[int, ...]:
    """``--sample-shape 25,25`` as a tuple.

    Raises:
        ValueError: a part is not an integer.
    """
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sample-shape must be comma-separated sizes such as 25,25, got {text!r}") from None


def parse_weights(text: str | None) -> tuple[float, ...] | None:
    """``--weights 0.7,0.3`` as a tuple of numbers; ``None`` without the option.

    Raises:
        ValueError: a part is not a number.
    """
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--weights must be comma-separated numbers such as 0.7,0.3, got {text!r}") from None


def parse_names(text: str | None) -> list[str] | None:
    """A comma-separated list of names (``--classes a,b``), stripped; ``None`` for no option or an empty one."""
    return [c.strip() for c in text.split(",")] if text else None


def or_list(items: tuple[str, ...] | list[str]) -> str:
    """``a, b or c``: choices in help texts."""
    return f"{', '.join(items[:-1])} or {items[-1]}" if len(items) > 1 else "".join(items)


def show_version(value: bool) -> None:
    """``--version``: print the version and exit."""
    if value:
        typer.echo(f"lmdbstore {__version__}")
        raise typer.Exit()
