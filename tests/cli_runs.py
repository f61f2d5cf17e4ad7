"""``lmdbstore ARGS`` inside a process that ``torchrun`` started, as ``torchrun ... -m lmdbstore ARGS`` runs it, for
the rank scripts of test_ddp.py and test_multinode.py: one launch (three or four interpreters importing torch)
serves several runs and checks.  Each run's stdout and stderr go to files of its own, redirected at the file
descriptors (what C code prints is caught too); a run that fails ends the process with its exit status (torchrun
then stops the other ranks rather than leaving them waiting in a collective)."""

from __future__ import annotations

import os
import sys


def cli(name: str, argv: list[str], tag: str) -> None:
    """Run ``lmdbstore ARGV``, its outputs to ``NAME.TAG.out`` and ``NAME.TAG.err`` in the current directory."""
    from lmdbstore_cli.main import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    argv0 = sys.argv
    with open(f"{name}.{tag}.out", "w") as out, open(f"{name}.{tag}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["lmdbstore", *argv]
        code: object = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            sys.argv = argv0
    if code:
        sys.exit(f"{name} ({tag}) exited with {code}")
