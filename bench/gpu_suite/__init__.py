"""One entry point for the GPU validation run: kernel correctness, the kernel benchmark, a training step, pytest.

    python -m bench.gpu_suite --parts correctness,kernels,train,pytest,extra [--out DIR] [--size full|smoke|rehearse]
    python -m bench.gpu_suite --part {correctness,kernels,train,pytest,extra,vllm,all} ...

``bench/gpu_run.sh`` is the one device call that drives it (wheels, install, versions, then the parts in
order under one ``--budget``); see bench/README.md. Each part reuses the project's own tools and records
what they measured, one JSON line per measurement, appended and fsynced as it finishes (a time limit loses
nothing already measured), in ``<out>/<gpu>/suite-<date>.jsonl`` (``--flat``: ``<out>/run.jsonl``, the
kernel cases in ``<out>/kernels.jsonl``). Every invocation first records the environment (GPU, driver, CUDA,
package versions, commit); after each part the ``.md`` summary is rewritten from the JSONL, and a short
table is printed last.

  correctness  ``bench/correctness_gpu.py``'s cases (bf16 vs float64, forward and backward) at the Qwen2.5-7B
               and -32B heads: fastcov's Triton path with the naive bf16 path beside it
  kernels      ``python -m bench.kernels`` in subprocesses: ``--preset gpu-run`` with fastcov's Triton path and
               naive first; then ``--preset gpu-run-switches``: Σπ², the per-token temperature and the soft cap
               beside the base call at the 7B head and at Liger's CuTe anchor shape (D 4096, V 131072, N 16384,
               with liger-entropy); then ``gpu-run`` with the peers (compiled naive, Liger, CCE, verl), each
               beside the same-run cuBLAS floor; the configs the autotuner picked beside the compile report's
               predictions.
               The part fails when any fastcov row is not ok (unavailable included)
  train        the project's trainer (GRPO + KL-Cov, ZeRO-3, HF rollouts, the built-in synthetic task) for
               ``--steps`` steps (the first one counted as warm-up) in a subprocess that writes each step's
               row as it is logged: seconds per step part, rollout and update tokens/s, peak GPU memory beside
               ``fastcov.plan.plan_recipe``'s prediction; then one TRL ``GRPOTrainer`` run, if trl is installed
  pytest       ``FASTCOV_POISON=1 pytest -m gpu`` on the named files (``GPU_TEST_FILES``): counts, failures
  extra        only when its whole cap is left: the kernels at N 65536, a training step with the optimizer
               offloaded, and one with LoRA
  vllm         ``python -m bench.vllm_smoke``; not in the default run (vLLM takes six staging calls)
  trainer      ``python -m bench.trainer --preset gpu-1.5b``: fastcov's trainer against TRL; not in the default run
  memory       ``python -m bench.memory_sweep --preset gpu-1.5b``: peak GPU memory of one rollout batch against
               answer length at Qwen2.5-1.5B's shape and vocabulary, fastcov / TRL / TRL + Liger; not in the
               default run (TRL is not in the GPU image)

``--size full`` (the default, alias ``1.5b``) is the GPU run. ``--size smoke`` (alias ``tiny``) runs the same
code paths at toy sizes, on CPU too. ``--size rehearse`` is what ``gpu_run.sh --rehearse`` runs on CPU: toy
shapes, the Triton path under ``TRITON_INTERPRET=1``, the same order, caps and budget. Without CUDA the parts
that need it record ``unavailable`` rows. A part that raises is recorded as an ``error`` row with its message
and the next part still runs; a part the budget does not reach says ``not reached``.

The code, in the shape of bench/kernels/: ``presets`` (what each part runs, per size), ``runner``
(subprocesses, ``Suite``, the environment record), ``kernel_parts`` and ``train_parts`` (the parts),
``render`` (the summary) and ``cli`` (the command line, ``PARTS``, ``run_part``). The names other code uses are here.
"""

from bench.gpu_suite.cli import PARTS, InjectedCrash, build_parser, main, parse_parts, record_setup, run_part
from bench.gpu_suite.kernel_parts import (
    autotune_rows,
    compile_predictions,
    correctness_cases,
    gpu_pytest,
    kernels_jsonl,
    kernels_run,
    part_correctness,
    part_kernels,
    part_pytest,
    pytest_counts,
    record_autotune,
    record_correctness_case,
)
from bench.gpu_suite.presets import (
    BAD_STATUSES,
    COMMIT_ENV,
    COMPILE_REPORT,
    CORRECTNESS,
    EXTRA_KERNELS,
    GIB,
    GPU_TEST_FILES,
    KERNEL_RUNS,
    NEEDS_WHOLE_CAP,
    PACKAGES,
    PART_CAPS,
    PARTS_ORDER,
    QWEN25_15B_ARCH,
    REPO,
    RUN_ORDER,
    SIZE_ALIASES,
    TRAIN_COMMON,
    TRAIN_CONFIG,
    TRAIN_EXTRA,
    TRAIN_FULL,
    TRAIN_SMOKE,
)
from bench.gpu_suite.render import print_table, render_md, write_md
from bench.gpu_suite.runner import (
    TERM_GRACE_S,
    Proc,
    Suite,
    driver_version,
    env_summary,
    environment,
    git_commit,
    guarded,
    log,
    make_suite,
    package_version,
    run_cmd,
)
from bench.gpu_suite.train_parts import (
    part_extra,
    part_memory,
    part_train,
    part_trainer,
    part_trl,
    part_vllm,
    plan_prediction,
    record_train,
    record_vllm,
    train_run,
    train_spec,
)

__all__ = ["BAD_STATUSES", "COMMIT_ENV", "COMPILE_REPORT", "CORRECTNESS", "EXTRA_KERNELS", "GIB", "GPU_TEST_FILES",
           "InjectedCrash", "KERNEL_RUNS", "NEEDS_WHOLE_CAP", "PACKAGES", "PARTS", "PARTS_ORDER", "PART_CAPS", "Proc",
           "QWEN25_15B_ARCH", "REPO", "RUN_ORDER", "SIZE_ALIASES", "Suite", "TERM_GRACE_S", "TRAIN_COMMON",
           "TRAIN_CONFIG", "TRAIN_EXTRA", "TRAIN_FULL", "TRAIN_SMOKE", "autotune_rows", "build_parser",
           "compile_predictions", "correctness_cases", "driver_version", "env_summary", "environment", "git_commit",
           "gpu_pytest", "guarded", "kernels_jsonl", "kernels_run", "log", "main", "make_suite", "package_version",
           "parse_parts", "part_correctness", "part_extra", "part_kernels", "part_memory", "part_pytest", "part_train",
           "part_trainer", "part_trl", "part_vllm", "plan_prediction", "print_table", "pytest_counts",
           "record_autotune", "record_correctness_case", "record_setup", "record_train", "record_vllm", "render_md",
           "run_cmd", "run_part", "train_run", "train_spec", "write_md"]
