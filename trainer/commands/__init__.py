"""The `fastcov train`, `eval`, `report`, `push` and `plan` subcommands (dispatched by fastcov/cli.py):
argument parsing and one-line errors only; the work is done by the rooms they call."""
