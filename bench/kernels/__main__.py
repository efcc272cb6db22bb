"""``python -m bench.kernels``: the kernel benchmark's command line (bench/kernels/cli.py)."""

import sys

from bench.kernels.cli import main

sys.exit(main())
