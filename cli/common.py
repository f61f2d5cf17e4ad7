"""What every command of the ``lmdbstore`` CLI shares: errors as one line (and with ``--json`` one JSON error
object on stdout), output (human lines, or with ``--json`` only JSON on stdout), shared options, option parsing.
"""

import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Annotated, Any, ClassVar

import typer
from typer.core import TyperCommand

from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig
from lmdbstore.errors import LmdbStoreError, TrainingInterrupted, clip, unwrap_worker_message
from lmdbstore.version import __version__

__all__ = [
    "LOADER",
    "Command",
    "MAX_ERROR_CHARS",
    "TRAIN",
    "WRITER",
    "PARAM_FLAGS",
    "JsonOption",
    "ModelArgOption",
    "ModelOption",
    "Output",
    "ProgressOption",
    "cli_errors",
    "error_json",
    "fail",
    "flag_names",
    "or_list",
    "parse_model_args",
    "parse_names",
    "parse_shape",
    "parse_weights",
    "refuse_given",
    "report_dict",
    "require_torch",
    "show_version",
    "stop_on_ctrl_c",
    "to_json",
]

#: Longest error line the CLI prints (messages are short by construction; this is a backstop).
MAX_ERROR_CHARS = 1000

#: The default configurations: the options of ``ingest``, ``train``, ``eval`` and ``demo`` default to their fields.
WRITER = WriterConfig()
LOADER = LoaderConfig()
TRAIN = TrainConfig()


#: Titles of the help panels of :class:`Command`.
DATA, MODEL, OPTIMISATION, VALIDATION, CHECKPOINTS, DEVICES, OUTPUT = (
    "Data", "Model", "Optimisation", "Validation", "Checkpoints", "Workers and devices", "Output"
)  # fmt: skip


class Command(TyperCommand):
    """A command whose help names its arguments as ``STORES...`` (not by their Python type) and lists its options
    in the panels a subclass names in :attr:`panels` (parameter names by panel title; the others: "Options")."""

    panels: ClassVar[dict[str, tuple[str, ...]]] = {}

    @staticmethod
    def _name(p: Any) -> str:
        return str(p.name).upper() + ("..." if p.nargs == -1 else "")

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        args = [p for p in self.get_params(ctx) if p.param_type_name == "argument"]
        return [self.options_metavar or "", *(self._name(p) if p.required else f"[{self._name(p)}]" for p in args)]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        panels: dict[str, list[tuple[str, str]]] = {title: [] for title in ("Arguments", *self.panels, "Options")}
        panel_of = {name: title for title, names in self.panels.items() for name in names}
        for p in self.get_params(ctx):
            if (row := p.get_help_record(ctx)) is not None:
                arg = p.param_type_name == "argument"
                panel = "Arguments" if arg else panel_of.get(p.name, "Options")
                panels.setdefault(panel, []).append((self._name(p), row[1]) if arg else row)
        for title, rows in panels.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


#: ``--json``: only JSON on stdout; the human lines go to stderr.
JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout (the human lines go to stderr).")]
#: ``--progress/--no-progress``: bars on stderr; by default only when stderr is a terminal.
ProgressOption = Annotated[
    bool | None,
    typer.Option("--progress/--no-progress", help="Show progress bars (default: when stderr is a terminal)."),
]


#: ``--model``: the user's model factory (``train``, ``eval``).
ModelOption = Annotated[
    str | None,
    typer.Option(
        metavar="FILE.py:FUNCTION",
        help="Your own model: FILE.py:FUNCTION or MODULE:FUNCTION, called as FUNCTION(in_shape, classes, "
        "**model_args) and returning a torch.nn.Module (default: the built-in CNN).",
    ),
]
#: ``--model-arg k=v`` (repeated): the factory's keyword arguments.
ModelArgOption = Annotated[
    list[str] | None,
    typer.Option(
        metavar="NAME=VALUE",
        help="Keyword argument of the --model factory (repeat it); VALUE is read as JSON when it is a number, "
        "true/false/null or a quoted string, else as a string.",
    ),
]

#: The library's parameter names (as its messages and hints write them: ``name=`` or ``name=True``/``name=VALUE``)
#: and the flag of each: :func:`flag_names` puts the flags in every line the CLI prints.  A command whose flag
#: for a parameter differs passes its own to :func:`cli_errors` (``export``: ``overwrite`` is ``--force``).
PARAM_FLAGS: dict[str, str] = {
    "allow_disjoint_classes": "--allow-disjoint-classes",
    "allow_nonfinite": "--allow-nonfinite",
    "balanced": "--balanced",
    "batch_size": "--batch",
    "cast": "--cast",
    "checkpoint_every": "--checkpoint-every",
    "classes": "--classes",
    "compile": "--compile",
    "compression": "--compression",
    "dtype": "--dtype",
    "epochs": "--epochs",
    "label": "--label",
    "model": "--model",
    "model_args": "--model-arg",
    "out_dir": "--out",
    "overwrite": "--overwrite",
    "resume": "--resume",
    "sample_shape": "--sample-shape",
    "seed": "--seed",
    "shuffle": "--shuffle",
    "val_fraction": "--val-fraction",
    "width": "--width",
    "workers": "--workers",
    "x_key": "--x-key",
    "y_key": "--y-key",
}


def flag_names(text: str, flags: Mapping[str, str] | None = None) -> str:
    """``text`` with the library's parameter names turned into the CLI's flags (``flags``: a command's own, over
    :data:`PARAM_FLAGS`): ``allow_nonfinite=True`` -> ``--allow-nonfinite``, ``label=CLASS`` -> ``--label CLASS``."""
    table = {**PARAM_FLAGS, **(flags or {})}
    pattern = (
        r"(?<![\w./-])("
        + "|".join(map(re.escape, sorted(table, key=len, reverse=True)))
        + r")=(True\b|[A-Za-z0-9](?:[^\s;:)=]*[A-Za-z0-9])?)?"
    )

    def swap(m: re.Match[str]) -> str:
        value = m.group(2)
        flag = table[m.group(1)]
        return flag if not value or value == "True" else f"{flag} {value}"

    return re.sub(pattern, swap, text)


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
    """Stop with one line (``LmdbStoreError``) naming the extra to install when torch is missing."""
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


def fail(
    msg: str,
    code: int = 1,
    exc: BaseException | None = None,
    *,
    as_json: bool = False,
    flags: Mapping[str, str] | None = None,
) -> None:
    """Print ``error: MSG`` as one clipped line on stderr -- and with ``as_json`` (``--json``) the error as one
    JSON object on stdout (:func:`error_json`) -- and exit with status ``code``.  Parameter names become the
    CLI's flags (:func:`flag_names`, with the command's own ``flags``)."""
    line = clip(flag_names(unwrap_worker_message(str(msg)), flags), MAX_ERROR_CHARS)
    typer.echo(f"error: {line}", err=True)  # one line
    if as_json:
        obj = error_json(line, exc, code)
        for key in ("error", "hint"):
            if isinstance(obj.get(key), str):
                obj[key] = flag_names(obj[key], flags)
        typer.echo(to_json(obj))
    raise typer.Exit(code)


#: What Ctrl-C says by default: the ingest's resume rule.
INGEST_INTERRUPTED = "interrupted; committed batches are kept (rerun the same command to resume)"


@contextmanager
def cli_errors(
    code: int = 1,
    *,
    as_json: bool = False,
    interrupted: str = INGEST_INTERRUPTED,
    flags: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """Turn deliberate errors (``LmdbStoreError``, ``ValueError``, ``IndexError``) into one line on stderr and
    exit status ``code`` (default 1); Ctrl-C into one line (``interrupted``) and status 130, and so a training
    run stopped by Ctrl-C (:class:`~lmdbstore.errors.TrainingInterrupted`).  With ``as_json`` (the command's
    ``--json``) also one JSON error object on stdout.  ``flags``: the command's own flags of library parameters
    where they differ from :data:`PARAM_FLAGS`."""
    try:
        yield
    except TrainingInterrupted as exc:
        fail(str(exc), 130, exc, as_json=as_json, flags=flags)
    except (LmdbStoreError, ValueError, IndexError) as exc:
        fail(str(exc), code, exc, as_json=as_json, flags=flags)
    except KeyboardInterrupt as exc:
        fail(interrupted, 130, exc, as_json=as_json, flags=flags)


@contextmanager
def stop_on_ctrl_c(say: Callable[[str], None]) -> Iterator[Callable[[], bool] | None]:
    """For ``train``: the first Ctrl-C asks the run to stop after the step it is in (it writes a checkpoint
    there), the second stops at once.  Yields the ``stop`` callback :func:`lmdbstore.train` polls, or ``None``
    where the handler cannot be set (not the main thread) or must not be (under torchrun: every rank would stop
    at a step of its own).  The previous SIGINT handler is back when the block ends."""
    if threading.current_thread() is not threading.main_thread() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        yield None
        return
    asked = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()
        say("stopping after this step, with a checkpoint (Ctrl-C again to stop at once)")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield asked.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def to_json(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as valid JSON: non-finite floats (a NaN loss, say) become ``null``."""
    from lmdbstore.util.jsonsafe import json_safe

    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def parse_shape(text: str) -> tuple[int, ...]:
    """``--sample-shape 25,25`` as a tuple (``ValueError``: a part is not an integer)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sample-shape must be comma-separated sizes such as 25,25, got {text!r}") from None


def parse_weights(text: str | None) -> tuple[float, ...] | None:
    """``--weights 0.7,0.3`` as a tuple of numbers, ``None`` without the option (``ValueError``: not a number)."""
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--weights must be comma-separated numbers such as 0.7,0.3, got {text!r}") from None


def parse_model_args(items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """Repeated ``--model-arg NAME=VALUE`` as ``(name, value)`` pairs: VALUE as JSON when it is a JSON scalar
    (``32``, ``0.1``, ``true``, ``null``, ``"text"``), else the text itself (``ValueError``: no ``=``, a name twice)."""
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--model-arg must be NAME=VALUE, got {item!r}")
        if name in out:
            raise ValueError(f"--model-arg {name} is given twice")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        out[name] = value if value is None or isinstance(value, (bool, int, float, str)) else text
    return tuple(out.items())


def parse_names(text: str | None) -> list[str] | None:
    """A comma-separated list of names (``--classes a,b``), stripped; ``None`` for no option or an empty one."""
    return [c.strip() for c in text.split(",")] if text else None


def refuse_given(ctx: typer.Context, names: tuple[str, ...] | list[str], why: str) -> None:
    """Refuse, in one line (``ValueError`` naming its flag), the first of the options ``names`` (parameter names)
    given on the command line: an option that does not apply is an error, never silently ignored."""
    for name in names:
        source = ctx.get_parameter_source(name)  # an enum of the click Typer runs on (it may vendor its own)
        if getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT"):
            param = next((p for p in ctx.command.params if p.name == name), None)
            flag = max(getattr(param, "opts", []) or [f"--{name.replace('_', '-')}"], key=len)
            raise ValueError(f"{flag} does not apply {why}")


def or_list(items: tuple[str, ...] | list[str]) -> str:
    """``a, b or c``: choices in help texts."""
    return f"{', '.join(items[:-1])} or {items[-1]}" if len(items) > 1 else "".join(items)


def show_version(value: bool) -> None:
    """``--version``: print the version and exit."""
    if value:
        typer.echo(f"lmdbstore {__version__}")
        raise typer.Exit()
