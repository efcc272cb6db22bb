"""``python -m fastcov.trainer.demo_real``: `make demo-real`'s entry point (the code is
trainer/experiments/demo_real.py)."""

from fastcov.trainer.experiments.demo import reexec_for_reproducible_cpu
from fastcov.trainer.experiments.demo_real import main

if __name__ == "__main__":
    reexec_for_reproducible_cpu("fastcov.trainer.demo_real")
    raise SystemExit(main())
