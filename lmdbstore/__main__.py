"""``python -m lmdbstore ...`` runs the command line (also what ``torchrun ... -m lmdbstore train ...`` starts)."""

from lmdbstore_cli.main import main

if __name__ == "__main__":
    main()
