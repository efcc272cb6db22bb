"""``python -m fastcov.trainer.study STUDY.yaml``: the studies' public entry point (the code is
trainer/experiments/study.py)."""

from fastcov.trainer.experiments.demo import reexec_for_reproducible_cpu
from fastcov.trainer.experiments.study import load_study, main  # noqa: F401 - load_study: public

if __name__ == "__main__":
    reexec_for_reproducible_cpu("fastcov.trainer.study")
    raise SystemExit(main())
