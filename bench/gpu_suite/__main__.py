"""``python -m bench.gpu_suite``: the GPU validation suite's command line (bench/gpu_suite/cli.py)."""

import sys

from bench.gpu_suite.cli import main

sys.exit(main())
