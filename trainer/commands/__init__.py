"""The `fastcov train`, `fastcov eval`, `fastcov report` and `fastcov push` subcommands (dispatched by fastcov/cli.py):
argument parsing and one-line errors only; the work is done by the rooms they call."""
