"""``python -m fastcov.trainer.demo``: the demo's public entry point (the code is trainer/experiments/demo.py)."""

from fastcov.trainer.experiments.demo import main, reexec_for_reproducible_cpu

if __name__ == "__main__":
    reexec_for_reproducible_cpu("fastcov.trainer.demo")
    raise SystemExit(main())
