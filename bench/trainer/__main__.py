"""``python -m bench.trainer``: the trainer benchmark's command line (bench/trainer/cli.py)."""

import sys

from bench.trainer.cli import main

sys.exit(main())
