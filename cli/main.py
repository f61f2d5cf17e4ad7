"""The ``lmdbstore`` command line, a thin Typer layer over the library: every command (one group a ``cmd_*``
module) parses its options, calls the library and prints; this module assembles them into :data:`app` and is the
console script's entry point, :func:`main`.
"""

import sys
from typing import Annotated

import typer
from typer.exceptions import TyperException

from . import cmd_export, cmd_ingest, cmd_inspect, cmd_train, cmd_viz
from .common import Command, error_json, show_version, to_json

__all__ = ["app", "main"]

app = typer.Typer(
    name="lmdbstore",
    help=(
        "Store tens of millions of small training samples in LMDB and train a PyTorch CNN on them.\n\n"
        "Typical flow: `lmdbstore ingest STORE data.npz`, `lmdbstore stats STORE`, "
        "`lmdbstore train STORE --batch 4096`.  `lmdbstore demo` runs all of it on built-in synthetic data."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=show_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    pass


# the commands, in the order `lmdbstore --help` lists them
app.command(cls=Command)(cmd_ingest.ingest)
app.command(cls=Command)(cmd_inspect.stats)
app.command(cls=Command)(cmd_inspect.verify)
app.command(cls=Command)(cmd_ingest.synth)
app.command(cls=cmd_train.TrainCommand)(cmd_train.train)
app.command("eval", cls=Command)(cmd_train.eval_cmd)
app.command(cls=Command)(cmd_train.demo)
app.command(cls=Command)(cmd_export.export)
app.command(cls=Command)(cmd_export.copy)
app.command(cls=Command)(cmd_viz.show)
app.command(cls=Command)(cmd_viz.plot)


def main() -> None:
    """Console-script entry point.  Errors of the command line itself (an unknown option, a missing
    argument: exit status 2) are printed as Click prints them, and with ``--json`` also as one JSON error
    object on stdout, like every other error."""
    try:
        code = app(standalone_mode=False)
    except TyperException as exc:  # Click's usage errors
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        else:
            typer.echo(f"Error: {exc.format_message()}", err=True)
        if "--json" in sys.argv[1:]:
            typer.echo(to_json(error_json(exc.format_message(), exc, exc.exit_code)))
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
