"""``python -m fastcov``: the ``fastcov`` command (fastcov/cli.py)."""

if __name__ == "__main__":
    from fastcov.cli import main

    raise SystemExit(main())
