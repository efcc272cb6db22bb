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
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import _measure as M
from bench._common import fmt as _fmt
from bench._common import is_oom, read_result, short
from bench._common import log as _log
from bench.gpu_worker import RESULT_MARK, StepRows, TrainSpec, step_fields
from bench.kernels import jsonl_path as kernels_jsonl_path
from bench.kernels import read_jsonl, render_jsonl_md

REPO = Path(__file__).resolve().parent.parent
PARTS_ORDER = ("correctness", "kernels", "train", "pytest", "extra", "vllm", "trainer", "memory")
RUN_ORDER = ("correctness", "kernels", "train", "pytest", "extra")  # --part all, and gpu_run.sh
SIZE_ALIASES = {"full": "full", "1.5b": "full", "smoke": "smoke", "tiny": "smoke", "rehearse": "rehearse"}
BAD_STATUSES = ("error", "fail", "timeout", "OOM")
GIB = 2**30
# Seconds each part may take (its subprocesses are stopped there), per size; the run's --budget bounds them all.
# "extra" starts only when its whole cap is left ("only if time remains").
PART_CAPS = {
    "full": {"correctness": 50, "kernels": 200, "train": 100, "pytest": 45, "extra": 120, "vllm": 400,
             "trainer": 420, "memory": 480},
    "smoke": {"correctness": 120, "kernels": 300, "train": 300, "pytest": 300, "extra": 300, "vllm": 300,
              "trainer": 300, "memory": 300},
    "rehearse": {"correctness": 40, "kernels": 60, "train": 60, "pytest": 60, "extra": 600, "vllm": 60,
                 "trainer": 300, "memory": 300},
}
NEEDS_WHOLE_CAP = ("extra",)
# the files `pytest -m gpu` runs (the GPU-marked tests; collecting all of tests/ costs ~20 s)
GPU_TEST_FILES = ("tests/kernels/test_linear_logprob_entropy.py", "tests/kernels/test_head_switches.py",
                  "tests/library/test_selection.py")
COMMIT_ENV = "FASTCOV_COMMIT"  # the commit id when the tree travels without .git
# (module, distribution) whose versions the environment record holds; null where not installed
PACKAGES = (("triton", "triton"), ("transformers", "transformers"), ("deepspeed", "deepspeed"),
            ("liger_kernel", "liger-kernel"), ("cut_cross_entropy", "cut-cross-entropy"), ("verl", "verl"),
            ("vllm", "vllm"), ("trl", "trl"), ("accelerate", "accelerate"), ("datasets", "datasets"),
            ("peft", "peft"), ("setuptools", "setuptools"), ("numpy", "numpy"), ("pyarrow", "pyarrow"))
# correctness_gpu per size: one argument list per head (7B, 32B); a few cases each, fastcov's Triton path
# with the naive bf16 path beside it
CORRECTNESS = {
    "full": [["--n", "4096", "--d", "3584", "--v", "152064", "--impls", "triton", "naive", "--temperatures", "1.0"],
             ["--n", "4096", "--d", "5120", "--v", "152064", "--impls", "triton", "naive", "--temperatures", "0.6",
              "--no-bias-case"]],
    "smoke": [["--n", "1024", "--d", "512", "--v", "32064", "--rows", "128", "--vocab-rows", "512"]],
    # float16: Triton 3.9's CPU interpreter returns garbage for the kernels in bfloat16 (fp16 and fp32 agree with
    # float64 to 2e-6); the bf16 path is the GPU's to check
    "rehearse": [["--n", "64", "--d", "32", "--v", "300", "--rows", "8", "--vocab-rows", "16", "--peaked-rows", "4",
                  "--chunk", "32", "--impls", "triton", "naive", "--temperatures", "1.0", "--dtype", "float16"],
                 ["--n", "48", "--d", "48", "--v", "200", "--rows", "8", "--vocab-rows", "16", "--peaked-rows", "4",
                  "--chunk", "16", "--impls", "triton", "naive", "--temperatures", "0.6", "--no-bias-case",
                  "--dtype", "float16"]],
}
# bench.kernels per size: (name, preset, extra options), in order
KERNEL_RUNS = {
    "full": [("fastcov", "gpu-run", ["--impls", "fastcov-triton", "naive"]),
             ("switches", "gpu-run-switches", []),
             ("peers", "gpu-run", ["--impls", "naive", "naive-compile", "liger", "cce", "verl"])],
    "smoke": [("smoke", "smoke", [])],
    "rehearse": [("fastcov", "rehearse", ["--impls", "fastcov-triton", "naive", "--isolate", "never"]),
                 ("peers", "rehearse", ["--impls", "naive", "liger", "cce", "verl", "--isolate", "never"])],
}
EXTRA_KERNELS = {"full": ("large", "gpu-run-large", []),
                 "smoke": ("large", "smoke", []), "rehearse": ("large", "rehearse", ["--isolate", "never"])}
COMPILE_REPORT = REPO / "bench" / "results" / "compile" / "fastcov.jsonl"
# the trainer: configs/tiny.yaml plus these (both sizes), then the size's own
TRAIN_CONFIG = REPO / "configs" / "tiny.yaml"
TRAIN_COMMON = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false", "trainer.zero_stage=3",
                "reward.sandbox=inline", "rollout.engine=hf", "algo.adv_estimator=grpo", "algo.mode=kl_cov"]
QWEN25_15B_ARCH = ("{model_type: qwen2, hidden_size: 1536, intermediate_size: 8960, num_hidden_layers: 28, "
                   "num_attention_heads: 12, num_key_value_heads: 2, vocab_size: 151936, tie_word_embeddings: true, "
                   "max_position_embeddings: 4096, rope_theta: 1000000.0, rms_norm_eps: 1.0e-6}")
# Qwen2.5-1.5B's shape, random weights, the synthetic task; KL-Cov as configs/qwen2.5-7b-kl-cov.yaml has it.
# 32 prompts x 8 rollouts x up to 256 new tokens: one HF generation batch (token_budget), about 77k tokens per
# step in 16k-token micro-batches, two optimizer steps per rollout batch.
TRAIN_FULL = [f"model.arch={QWEN25_15B_ARCH}", "model.gradient_checkpointing=true", "data.synthetic.n_train=512",
              "trainer.prompts_per_step=32", "rollout.n=8", "rollout.max_new_tokens=256",
              "rollout.token_budget=131072", "trainer.micro_token_budget=16384", "algo.mini_batches=2",
              "algo.loss.kl_cov_ratio=2.0e-3", "algo.loss.kl_cov_coef=1.0", "algo.loss_agg=token-mean",
              "optim.lr=5.0e-7"]
TRAIN_SMOKE: list[str] = []  # tiny.yaml's model and batch as they are
# the extra part's training steps: the train part's run with the optimizer offloaded, then with LoRA adapters
TRAIN_EXTRA = {"offload": ["trainer.offload_optimizer=true"],
               "lora": ["model.lora_rank=16", "model.lora_alpha=32", "model.lora_dropout=0.0"],
               # the HF engine in its own process on the same GPU, generating while the policy trains (docs/async.md)
               "one_step": ["rollout.async=one_step"]}


def log(msg: str) -> None:
    _log(msg, "[gpu_suite] ")


# =========================================================================== subprocesses


@dataclass
class Proc:
    """A finished (or stopped) subprocess: exit status, output, wall time."""

    rc: int | None
    out: str
    err: str
    wall_s: float
    timed_out: bool = False

    def tail(self, lines: int = 12) -> str:
        text = [ln for ln in (self.err + "\n" + self.out).splitlines() if ln.strip() and RESULT_MARK not in ln]
        return "\n".join(text[-lines:])

    def result(self) -> dict | None:
        """The worker's result: its last RESULT_MARK line (bench/gpu_worker.py)."""
        return read_result(self.out, RESULT_MARK)

    def last_json(self) -> dict | None:
        """The last stdout line that is a JSON object (bench/vllm_smoke.py's result)."""
        for line in reversed(self.out.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return None


def run_cmd(cmd: list[str], timeout: float, env: dict | None = None) -> Proc:
    """Run ``cmd`` in the repository root in its own process group; past ``timeout`` the whole group is
    killed (a benchmark's own case processes too) and what it printed so far is kept."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    t0 = time.perf_counter()
    if timeout <= 0:
        return Proc(None, "", "not started: the suite's --budget is spent", 0.0, timed_out=True)
    p = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **group)
    try:
        out, err = p.communicate(timeout=timeout)
        return Proc(p.returncode, out, err, time.perf_counter() - t0)
    except subprocess.TimeoutExpired:
        # SIGTERM first: a worker's `finally` blocks run (torch's JIT-build lock, which DeepSpeed takes to build
        # its ops, is released; a SIGKILL mid-build leaves a lock every later run waits on); then SIGKILL
        out, err = _stop_group(p, grace=TERM_GRACE_S)
        return Proc(p.returncode, out or "", (err or "") + f"\nstopped after {timeout:.0f} s",
                    time.perf_counter() - t0, timed_out=True)


TERM_GRACE_S = 5.0


def _stop_group(p: subprocess.Popen, grace: float) -> tuple[str, str]:
    """SIGTERM to ``p``'s process group, SIGKILL after ``grace`` seconds; what it printed."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return p.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


# =========================================================================== the run


@dataclass
class Suite:
    """One invocation: where its rows go, its size, its time budget, and the rows it recorded."""

    out: Path
    size: str  # full | smoke | rehearse
    steps: int
    timeout: float  # per subprocess
    deadline: float | None  # time.monotonic() by which everything must be done
    gpu: str | None
    slug: str
    date: str
    run_id: str
    rows: list[dict] = field(default_factory=list)
    flat: bool = False  # rows in <out>/run.jsonl, kernel cases in <out>/kernels.jsonl (gpu_run.sh: what comes back)
    caps: dict[str, float] = field(default_factory=dict)  # seconds per part (PART_CAPS, --cap)
    reserve: float = 15.0  # seconds of the budget kept for the summary
    part: str | None = None  # the part running now
    part_deadline: float | None = None  # time.monotonic() by which the running part must end
    faults: dict[str, str] = field(default_factory=dict)  # rehearsal only: part -> "crash" | "hang"

    @property
    def dir(self) -> Path:
        return self.out if self.flat else self.out / self.slug

    @property
    def path(self) -> Path:
        return self.out / "run.jsonl" if self.flat else self.dir / f"suite-{self.date}.jsonl"

    @property
    def scratch(self) -> Path:
        """Where the tools' own reports go: outside <out> when flat (the device call returns 8 files)."""
        if not self.flat:
            return self.dir
        path = Path(tempfile.gettempdir()) / f"gpu-suite-{self.run_id}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def part_left(self) -> float:
        """Seconds the running part may still take: its cap, and the budget less the summary's reserve."""
        cap = float("inf") if self.part_deadline is None else self.part_deadline - time.monotonic()
        return min(cap, self.left() - self.reserve)

    def record(self, part: str, name: str, status: str, reason: str = "", summary: str = "", **fields) -> dict:
        row = {"run": self.run_id, "part": part, "name": name, "status": status, "reason": reason,
               "summary": summary, "size": self.size, "gpu": self.gpu,
               "at": _dt.datetime.now().isoformat(timespec="seconds"), **fields}
        M.append_jsonl(self.path, row, default=str)
        self.rows.append(row)
        log(f"{part} / {name}: {status} {summary or reason}".rstrip())
        return row

    def run(self, cmd: list[str], env: dict | None = None) -> Proc:
        """A subprocess bounded by --timeout, the running part's cap and what is left of --budget (less the
        summary's reserve). Under an injected ``hang`` fault (the rehearsal) the command is a stand-in that
        writes one row and then sleeps until it is stopped."""
        if self.faults.get(self.part or "") == "hang":
            row = json.dumps({"run": self.run_id, "part": self.part, "name": "hang (injected)", "status": "partial",
                              "reason": "", "summary": "written before the injected hang", "size": self.size,
                              "gpu": self.gpu})
            cmd = [sys.executable, "-c", "import os, sys, time\nwith open(sys.argv[1], 'a') as f:\n"
                   "    f.write(sys.argv[2] + '\\n'); f.flush(); os.fsync(f.fileno())\ntime.sleep(3600)",
                   str(self.path), row]
        return run_cmd(cmd, min(self.timeout, self.part_left()), env)


def make_suite(args) -> Suite:
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    out = Path(args.out)
    out = out if out.is_absolute() else Path.cwd() / out
    now = _dt.datetime.now()
    size = SIZE_ALIASES[args.size]
    caps = {**PART_CAPS[size], **dict(args.cap or [])}
    return Suite(out=out, size=size, steps=args.steps, timeout=args.timeout,
                 deadline=time.monotonic() + args.budget if args.budget > 0 else None, gpu=gpu,
                 slug=M.slugify(gpu) if gpu else "cpu", date=now.date().isoformat(),
                 run_id=f"{now:%Y%m%dT%H%M%S.%f}-{os.getpid()}", flat=args.flat, caps=caps,
                 reserve=8.0 if size == "rehearse" else 15.0, faults=dict(args.fault or []))


# =========================================================================== environment


def package_version(module: str, dist: str) -> str | None:
    """The installed version of ``dist`` if ``module`` can be found (nothing is imported), else None."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.metadata.version(dist)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML: the driver stays unknown
        return None


def git_commit() -> str | None:
    """HEAD of the checkout; where the tree travelled without .git, $FASTCOV_COMMIT (the device call sets it)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == REPO.resolve():
            return lines[1]  # not a repository above the tree
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(COMMIT_ENV, "").strip() or None


def environment(s: Suite, argv: list[str]) -> dict:
    """The environment record's fields: GPU, driver, CUDA, Python, package versions, command, commit."""
    props = torch.cuda.get_device_properties(0) if s.gpu else None
    versions = {"torch": torch.__version__, **{dist: package_version(mod, dist) for mod, dist in PACKAGES}}
    return {"gpu_name": s.gpu, "gpu_memory_gib": props.total_memory / GIB if props else None,
            "capability": f"{props.major}.{props.minor}" if props else None,
            "driver": driver_version() if s.gpu else None, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(), "versions": versions,
            "command": "python -m bench.gpu_suite " + " ".join(argv), "commit": git_commit(), "jsonl": str(s.path)}


def env_summary(env: dict) -> str:
    v = env["versions"]
    head = (f"{env['gpu_name']} ({env['gpu_memory_gib']:.0f} GiB, sm {env['capability']}), driver {env['driver']}, "
            f"CUDA {env['cuda']}" if env["gpu_name"] else "CPU (no CUDA)")
    return head + "; " + ", ".join(f"{k} {v[k] or '—'}" for k in v)


# =========================================================================== part: correctness


def part_correctness(s: Suite) -> None:
    """correctness_gpu's cases at each head of CORRECTNESS[size]; on CPU only in the rehearsal (the Triton path
    under the interpreter)."""
    if not torch.cuda.is_available() and s.size != "rehearse":
        s.record("correctness", "correctness_gpu", "unavailable", "needs CUDA")
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for head in CORRECTNESS[s.size]:
        guarded(s, "correctness", "correctness_gpu", lambda s, head=head: correctness_cases(s, device, tuple(head)))


def correctness_cases(s: Suite, device: torch.device | None = None, extra: tuple[str, ...] = ()) -> None:
    """bench/correctness_gpu.py's cases through its own functions, one row per (case, implementation).
    ``device`` (default CUDA) and ``extra`` (correctness_gpu options: the shape, impls, temperatures) let the
    rehearsal and a CPU test drive it."""
    from bench import correctness_gpu as C

    argv = ["--out", str(s.scratch)] + list(extra)
    args = C.parse_args(argv)
    device = device or torch.device("cuda")
    if device.type == "cuda":
        C.check_environment(args.impls)
    dtype = getattr(torch, args.dtype)
    report = C.report_header(args, argv, s.gpu or "cpu")
    cases = [(t, False) for t in args.temperatures] + ([] if args.no_bias_case else [(args.temperatures[-1], True)])
    for ci, (temperature, with_bias) in enumerate(cases):
        if s.part_left() <= 0:
            s.record("correctness", f"T={temperature}" + (" bias" if with_bias else ""), "not reached",
                     "the part's time cap or the run's --budget is spent")
            continue
        case = C.build_case(args, ci, temperature, with_bias, dtype, device)
        for impl in args.impls:
            entry = C.check_impl(impl, case)
            report["cases"].append(entry)
            record_correctness_case(s, entry, args)
            torch.cuda.empty_cache()
        del case
        torch.cuda.empty_cache()
    fused = [e for e in report["cases"] if not e["baseline_only"]]
    ran = len(fused) == len(cases) * len([i for i in args.impls if i != "naive"])
    report["passed"] = ran and all(e["status"] == "ok" and not e.get("failures") for e in fused)
    path = C.write_report(report, s.scratch, s.gpu or "cpu")
    s.record("correctness", "correctness_gpu", "ok" if report["passed"] else "fail",
             "" if ran else "not every case ran",
             summary=f"{sum(e['status'] == 'ok' and not e.get('failures') for e in fused)}/{len(fused)} fastcov "
                     f"cases within tolerance (N {args.n}, D {args.d}, V {args.v}, {args.dtype})",
             report=str(path), shape={"n": args.n, "d": args.d, "v": args.v, "dtype": args.dtype})


def record_correctness_case(s: Suite, entry: dict, args) -> None:
    name = f"{entry['impl']} T={entry['temperature']}" + (" bias" if entry["bias"] else "")
    if entry["status"] != "ok":
        s.record("correctness", name, entry["status"], entry.get("reason", ""), impl=entry["impl"])
        return
    m = entry["errors"]
    errs = {q: m[q]["max_abs" if q in ("logprob", "entropy") else "max_rel"] for q in m}
    status = "ok" if entry["baseline_only"] or entry["passed"] else "fail"
    summary = (f"logp {errs['logprob']:.1e}, H {errs['entropy']:.1e}, dh rel {errs['dhidden']:.1e}, "
               f"dW rel {errs['dweight']:.1e}" + (f", db rel {errs['dbias']:.1e}" if "dbias" in errs else "")
               + f" ({entry['seconds_fwd_bwd']:.2f} s)" + (" baseline, no tolerance" if entry["baseline_only"] else ""))
    s.record("correctness", name, status, "; ".join(entry["failures"]), summary, impl=entry["impl"],
             temperature=entry["temperature"], bias=entry["bias"], max_errors=errs, invariants=entry["invariants"],
             seconds_fwd_bwd=entry["seconds_fwd_bwd"], shape={"n": args.n, "d": args.d, "v": args.v})


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def pytest_counts(output: str) -> dict[str, int]:
    """{"passed": 3, "deselected": 500, ...} from pytest's last summary line ("error" counted as "errors")."""
    for line in reversed(output.splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts: dict[str, int] = {}
            for n, what in found:
                key = {"error": "errors", "warning": "warnings"}.get(what, what)
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def part_pytest(s: Suite) -> None:
    """``pytest -m gpu`` on GPU_TEST_FILES (named files: collecting all of tests/ costs ~20 s)."""
    gpu_pytest(s, GPU_TEST_FILES)


def gpu_pytest(s: Suite, targets: tuple[str, ...] = GPU_TEST_FILES) -> None:
    """``FASTCOV_POISON=1 pytest -m gpu -q`` on ``targets`` in a subprocess: counts, the failing tests, the output's
    tail. A run in which no test passed is no pass: ``unavailable`` without CUDA (the tests skip), else ``fail``."""
    missing = [t for t in targets if not (REPO / t.split("::")[0]).exists() and not Path(t).exists()]
    if missing:
        s.record("pytest", "pytest -m gpu", "error", f"no such test file: {missing[0]}")
        return
    proc = s.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider", *targets],
                 {"FASTCOV_POISON": "1"})
    counts = pytest_counts(proc.out)
    failed = [ln for ln in proc.out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    if proc.timed_out:
        status, reason = "timeout", proc.tail(3)
    elif counts.get("failed") or counts.get("errors"):
        status, reason = "fail", "; ".join(failed[:5])
    elif proc.rc not in (0, 5):
        status, reason = "error", f"pytest exited {proc.rc}: " + proc.tail(3)
    elif not counts.get("passed"):
        status, reason = (("fail", "no GPU test ran") if torch.cuda.is_available()
                          else ("unavailable", "needs CUDA (the GPU tests skip)"))
    else:
        status, reason = "ok", ""
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({proc.wall_s:.0f} s)"
    s.record("pytest", "pytest -m gpu", status, reason, summary, counts=counts, returncode=proc.rc,
             targets=list(targets), failed=failed[:50], tail=proc.tail(30), wall_s=proc.wall_s)


# =========================================================================== part: kernels


def part_kernels(s: Suite) -> None:
    """``python -m bench.kernels`` for each of KERNEL_RUNS[size] (fastcov and naive first, then the peers), each
    case line appended to the kernels JSONL as its shape finishes; then the autotuner's picks."""
    for name, preset, extra in KERNEL_RUNS[s.size]:
        kernels_run(s, "kernels", name, preset, extra)
    record_autotune(s, "kernels")


def kernels_jsonl(s: Suite) -> Path:
    if s.flat:
        return s.out / "kernels.jsonl"
    cuda = torch.cuda.is_available()
    return kernels_jsonl_path(s.out, {"device_slug": M.device_slug(torch.device("cuda" if cuda else "cpu"))}, s.date)


def kernels_run(s: Suite, part: str, name: str, preset: str, extra: list[str]) -> None:
    """One ``bench.kernels`` subprocess: a row with its cases' statuses and fastcov's figures. The row fails when
    any fastcov case is not ok (an unavailable or missing Triton path is no pass)."""
    from bench.kernels import PRESETS

    cuda = torch.cuda.is_available()
    if PRESETS[preset]["device"] == "cuda" and not cuda:
        s.record(part, f"{name}: preset {preset}", "unavailable", "needs CUDA (--size smoke runs the smoke preset)")
        return
    lines = kernels_jsonl(s)
    before = len(read_jsonl(lines)) if lines.is_file() else 0
    proc = s.run([sys.executable, "-m", "bench.kernels", "--preset", preset, "--out", str(s.scratch),
                  "--jsonl", str(lines), *extra])
    cases = read_jsonl(lines)[before:] if lines.is_file() else []
    if lines.is_file():  # bench.kernels writes it at the end of a preset; a run stopped on its cap does not
        lines.with_suffix(".md").write_text(render_jsonl_md(read_jsonl(lines)))
    statuses: dict[str, int] = {}
    for c in cases:
        statuses[c["status"]] = statuses.get(c["status"], 0) + 1
    fastcov = [c for c in cases if c["impl"].startswith("fastcov")]
    fused = [{k: c.get(k) for k in ("impl", "group", "n", "fwd_ms", "fb_ms", "fwd_pct_floor", "fb_pct_floor",
                                    "floor_fb_ms", "speedup_fb", "fb_peak_bytes", "check")}
             for c in fastcov if c["status"] == "ok"]
    summary = f"{len(cases)} cases ({', '.join(f'{n} {k}' for k, n in statuses.items())})" + "".join(
        f"; {f['impl']} {f['group']} N={f['n']}: fwd+bwd {_fmt(f['fb_ms'], '.2f')} ms, "
        f"{_fmt(f['fb_pct_floor'], '.0f')}% of floor, {_fmt(f['speedup_fb'], '.2f')}x naive" for f in fused)
    not_ok = [f"{c['impl']} {c['group']} N={c['n']}: {c['status']}: {c.get('reason') or '-'}"
              for c in fastcov if c["status"] != "ok"]
    if proc.timed_out:
        status, reason = "timeout", f"stopped after {proc.wall_s:.0f} s with {len(cases)} cases: {proc.tail(2)}"
    elif proc.rc != 0 or not cases:
        status, reason = "error", f"bench.kernels exited {proc.rc}: {proc.tail(4)}"
    elif not_ok:
        status, reason = "fail", "; ".join(not_ok[:4])
    else:
        status, reason = "ok", ""
    s.record(part, f"{name}: preset {preset}", status, reason, summary, preset=preset, results_jsonl=str(lines),
             cases=len(cases), statuses=statuses, fastcov=fused, returncode=proc.rc, wall_s=proc.wall_s,
             command=" ".join(["python -m bench.kernels --preset", preset, *extra]))


def compile_predictions(arch: str, path: Path = COMPILE_REPORT) -> dict[tuple[str, str, str], dict]:
    """The compile report's rows for ``arch`` (``sm_90a``) with no switches on: (kernel, dtype, config) -> row."""
    if not path.is_file():
        return {}
    out = {}
    for r in read_jsonl(path):
        sw = r.get("switch") or {}
        if r.get("arch") == arch and not sw.get("HAS_BIAS") and not sw.get("COV") and not sw.get("TOPK"):
            out[(r["kernel"], r["dtype"], r["config"])] = r
    return out


def autotune_rows(cases: list[dict], arch: str, predictions: dict) -> list[dict]:
    """One entry per (shape, kernel) the autotuner picked a config for, beside what the compile report
    predicted for that config on ``arch`` (registers, spills, shared memory, tensor-core path, compile s)."""
    out = []
    for c in cases:
        for pick in c.get("autotune") or []:
            # Triton appends every tensor argument's dtype to the key: the first is the hidden states' (the last,
            # the top-k indices', is int32 whatever the input)
            dtype = next((str(k).removeprefix("torch.") for k in pick["key"] if str(k).startswith("torch.")),
                         c.get("dtype"))
            pred = predictions.get((pick["kernel"], dtype, pick["config"]))
            out.append({"group": c["group"], "n": c["n"], "kernel": pick["kernel"], "key": pick["key"],
                        "config": pick["config"], "dtype": dtype, "in_report": pred is not None,
                        **{k: (pred or {}).get(k) for k in ("registers", "spill_stores", "spill_loads", "smem",
                                                            "tensor_cores", "compile_s")}})
    return out


def record_autotune(s: Suite, part: str) -> None:
    """The configs fastcov-triton's autotuners picked (from the kernel case lines) beside the compile report."""
    lines = kernels_jsonl(s)
    cases = [c for c in (read_jsonl(lines) if lines.is_file() else []) if c.get("impl") == "fastcov-triton"
             and c.get("autotune")]
    if not torch.cuda.is_available():
        s.record(part, "autotune picks", "unavailable", "no autotuning off CUDA (the interpreter runs fixed tiles)")
        return
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{10 * major + minor}" + ("a" if major >= 9 else "")
    rows = autotune_rows(cases, arch, compile_predictions(arch))
    if not rows:
        s.record(part, "autotune picks", "error", "no fastcov-triton case recorded an autotuned config")
        return
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    summary = "; ".join(f"{r['kernel'].rsplit('.', 1)[-1]} {r['group']} N={r['n']}: {r['config']} "
                        f"({_fmt(r['registers'], 'd')} regs, {_fmt(r['spill_stores'], 'd')} B spilled predicted)"
                        for r in rows)
    s.record(part, "autotune picks", "fail" if spilled else "ok",
             f"{len(spilled)} picked config(s) predicted to spill" if spilled else "", summary, arch=arch, picks=rows,
             compile_report=str(COMPILE_REPORT))


# =========================================================================== part: train


def train_spec(s: Suite, part: str = "train", label: str = "fastcov", extra: tuple[str, ...] = ()) -> TrainSpec:
    """The config file, overrides and step count the train worker and the TRL worker share, and where the
    worker appends its step rows (the suite's JSONL, as each step is logged)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = TRAIN_FULL if s.size == "full" else TRAIN_SMOKE
    # one step more than measured: the run stops after the last measured row, before any final checkpoint
    overrides = TRAIN_COMMON + size + list(extra) + [f"trainer.max_steps={s.steps + 1}", f"trainer.device={device}"]
    return TrainSpec(config=str(TRAIN_CONFIG), overrides=tuple(overrides), steps=s.steps,
                     rows=StepRows(path=str(s.path), run=s.run_id, part=part, label=label, size=s.size, gpu=s.gpu))


def plan_prediction(spec: TrainSpec) -> dict:
    """``fastcov.plan.plan_recipe`` of the run's config on this one GPU (80 GiB without one), in GiB."""
    from fastcov.plan import plan_recipe
    from fastcov.trainer.config import load_config

    cfg = load_config(spec.config, list(spec.overrides))
    gib = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0
    plan = plan_recipe(cfg, gpus=1, gpu_memory_gib=gib).to_dict()
    keys = ("peak", "training_total", "rollout_total", "parameters", "gradients", "optimizer_states", "activations",
            "logits_fused", "zero3_gathered", "rollout_weights", "rollout_kv_cache", "rollout_during_training")
    return {**{f"{k}_gib": plan[k] / GIB for k in keys}, "fits": plan["fits"], "engine": plan["rollout_engine"],
            "ppo_epochs": cfg.algo.ppo_epochs}


def part_train(s: Suite) -> None:
    if s.size == "full" and not torch.cuda.is_available():
        for name in ("fastcov trainer", "trl GRPOTrainer"):
            s.record("train", name, "unavailable", "needs CUDA (--size tiny runs the same path on CPU)")
        return
    spec = train_run(s, "train", "fastcov")
    if s.size == "rehearse":
        s.record("train", "trl GRPOTrainer", "unavailable", "not run in the rehearsal (TRL is not in the GPU image)")
        return
    guarded(s, "train", "trl GRPOTrainer", lambda s: part_trl(s, spec))


def train_run(s: Suite, part: str, label: str, extra: tuple[str, ...] = ()) -> TrainSpec:
    """One trainer worker: its step rows come from the worker as each step is logged; then the summary row."""
    spec = train_spec(s, part, label, extra)
    plan = plan_prediction(spec)
    spec = spec.with_(ppo_epochs=plan["ppo_epochs"])
    with tempfile.TemporaryDirectory(prefix="gpu-suite-train-") as tmp:
        spec = spec.with_(overrides=[*spec.overrides, f"trainer.run_dir={tmp}/run"])
        # on CPU: DeepSpeed's CPU accelerator, and the trainer's kernels not under the rehearsal's interpreter
        proc = s.run([sys.executable, "-m", "bench.gpu_worker", "train", spec.to_json()],
                     {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu", "TRITON_INTERPRET": "0"})
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        rows = [r for r in (read_jsonl(metrics) if metrics.is_file() else []) if r.get("step", 0) >= 1]
    s.rows += [r for r in read_jsonl(s.path) if r.get("run") == s.run_id and r.get("part") == part
               and r.get("name", "").startswith(f"{label} step ")]  # the worker's rows, for the table
    record_train(s, spec, proc, rows, plan, part, label)
    return spec


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def record_train(s: Suite, spec: TrainSpec, proc: Proc, rows: list[dict], plan: dict, part: str = "train",
                 label: str = "fastcov") -> None:
    """The run's summary row (its step rows are the worker's): medians after the warm-up, peak memory, plan."""
    res = proc.result() or {}
    steps = [step_fields(r, plan["ppo_epochs"]) for r in rows]
    measured = [f for f in steps if f["step"] > 1] or steps
    keys = sorted({k for f in measured for k in f if k.startswith("time/")})
    med = {k: _median(measured, k) for k in keys + ["rollout_tokens_per_s", "update_tokens_per_s", "tokens"]}
    peak = res.get("peak_allocated_bytes")
    peak_gib = peak / GIB if peak is not None else None
    status = ("ok" if res.get("ok") and len(steps) == spec.steps else "timeout" if proc.timed_out
              else "OOM" if res.get("oom") else "error")
    reason = "" if status == "ok" else (res.get("error") or f"worker exited {proc.rc}: {proc.tail(4)}")
    summary = (f"median of {len(measured)} step(s) after warm-up: {_fmt(med.get('time/step'), '.2f')} s/step, rollout "
               f"{_fmt(med['rollout_tokens_per_s'], '.0f')} tok/s, update {_fmt(med['update_tokens_per_s'], '.0f')} "
               f"tok/s; peak GPU {_fmt(peak_gib, '.1f')} GiB (plan {plan['peak_gib']:.1f} GiB)")
    s.record(part, f"{label} trainer", status, reason, summary, steps_measured=[f["step"] for f in measured],
             medians=med, peak_gpu_bytes=peak, peak_gpu_gib=peak_gib,
             peak_reserved_bytes=res.get("peak_reserved_bytes"), peak_rss_bytes=res.get("peak_rss_bytes"),
             plan=plan, plan_peak_gib=plan["peak_gib"],
             measured_over_plan=peak_gib / plan["peak_gib"] if peak_gib is not None else None,
             overrides=list(spec.overrides), config=spec.config, wall_s=proc.wall_s, returncode=proc.rc,
             traceback=res.get("traceback"))


def part_trl(s: Suite, spec: TrainSpec) -> None:
    """TRL's own GRPOTrainer on the same model shape, prompts, group size and completion length (one worker)."""
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        s.record("train", "trl GRPOTrainer", "unavailable", f"{missing[0]} not installed")
        return
    with tempfile.TemporaryDirectory(prefix="gpu-suite-trl-") as tmp:
        proc = s.run([sys.executable, "-m", "bench.gpu_worker", "trl", spec.with_(output_dir=tmp).to_json()])
    res = proc.result() or {}
    times = res.get("step_s") or []
    measured = times[1:] or times
    status = ("ok" if res.get("ok") and times else "timeout" if proc.timed_out else "OOM" if res.get("oom")
              else "error")
    reason = "" if status == "ok" else (res.get("error") or f"worker exited {proc.rc}: {proc.tail(4)}")
    med = statistics.median(measured) if measured else None
    peak = res.get("peak_allocated_bytes")
    summary = (f"median step {_fmt(med, '.2f')} s over {len(measured)} step(s) after warm-up "
               f"({res.get('rows')} completions, {res.get('per_device_train_batch_size')} per micro-batch); "
               f"peak GPU {_fmt(peak / GIB if peak is not None else None, '.1f')} GiB")
    s.record("train", "trl GRPOTrainer", status, reason, summary, step_s=times, median_step_s=med,
             peak_gpu_bytes=peak, trl=res.get("trl"), setup=res.get("setup"), log=res.get("log"),
             wall_s=proc.wall_s, traceback=res.get("traceback"))


# =========================================================================== part: vllm


def part_vllm(s: Suite) -> None:
    """``python -m bench.vllm_smoke`` per size: generation tokens/s, weight sync s and GB/s, log-prob parity."""
    if importlib.util.find_spec("vllm") is None:
        s.record("vllm", "vllm_smoke", "unavailable", "vllm not installed")
        return
    if not torch.cuda.is_available():
        s.record("vllm", "vllm_smoke", "unavailable", "needs CUDA")
        return
    for size in ("tiny",) if s.size == "smoke" else ("tiny", "7b"):
        proc = s.run([sys.executable, "-m", "bench.vllm_smoke", "--size", size, "--out", str(s.dir)],
                     {"VLLM_USE_FLASHINFER_SAMPLER": "0"})
        record_vllm(s, size, proc)


def record_vllm(s: Suite, size: str, proc: Proc) -> None:
    res = proc.last_json()
    if res is None:
        status = "timeout" if proc.timed_out else "error"
        s.record("vllm", f"vllm_smoke {size}", status, f"exited {proc.rc}: {proc.tail(6)}", wall_s=proc.wall_s)
        return
    gen_s = (res.get("engine_stats") or {}).get("generate_s")
    tokens = ((res.get("parity_before") or {}).get("vs_bf16_policy") or {}).get("n")
    gen_tps = tokens / gen_s if tokens and gen_s else None
    syncs = res.get("sync_s") or []
    gib_s = res.get("sync_gib_per_s")
    parity = {k: res.get(k) for k in ("parity_before", "after_step", "parity_generate_after_sync")}
    failed = [k for k, ok in (res.get("checks") or {}).items() if not ok]
    summary = (f"{res.get('params', 0) / 1e9:.2f}B params; sync {_fmt(syncs[-1] if syncs else None, '.3f')} s "
               f"({_fmt(res.get('sync_gib'), '.2f')} GiB, {_fmt(gib_s * GIB / 1e9 if gib_s else None, '.1f')} GB/s)"
               + (f"; generate {gen_tps:.0f} tok/s" if gen_tps else "")
               + (f"; parity max {res['parity_before']['vs_bf16_policy']['max']:.3f} nats"
                  if res.get("parity_before") else ""))
    s.record("vllm", f"vllm_smoke {size}", "ok" if res.get("ok") else "fail", "failed: " + ", ".join(failed)
             if failed else "", summary, vllm=res.get("vllm"), generate_tokens=tokens, generate_s=gen_s,
             generate_tokens_per_s=gen_tps, sync_s=syncs, sync2_s=res.get("sync2_s"), sync_gib=res.get("sync_gib"),
             sync_gib_per_s=gib_s, sync_gb_per_s=gib_s * GIB / 1e9 if gib_s else None, parity=parity,
             checks=res.get("checks"), result_json=str(s.dir / f"vllm-smoke-{size}.json"), wall_s=proc.wall_s)


# =========================================================================== part: trainer


def part_trainer(s: Suite) -> None:
    """``python -m bench.trainer --preset gpu-1.5b`` (full size; ``tiny`` otherwise): fastcov's trainer against
    TRL's GRPOTrainer at Qwen2.5-1.5B's decoder shape. Not in the default order: TRL is not in the GPU image and
    the run alone needs most of one call (``--parts trainer --budget 420``)."""
    if importlib.util.find_spec("trl") is None:
        s.record("trainer", "bench.trainer", "unavailable", "trl not installed")
        return
    full = s.size == "full"
    if full and not torch.cuda.is_available():
        s.record("trainer", "bench.trainer", "unavailable", "needs CUDA")
        return
    out = s.dir / "trainer.jsonl"
    proc = s.run([sys.executable, "-m", "bench.trainer", "--preset", "gpu-1.5b" if full else "tiny",
                  "--cases", "a,b,c" if full else "a", "--work", str(s.dir / "bench-trainer"), "--jsonl", str(out)])
    rows = read_jsonl(out) if out.is_file() else []
    status = "ok" if proc.rc == 0 and rows else ("timeout" if proc.timed_out else "error")
    summary = "; ".join(f"{r['case']} {r['trainer']} {r['step_s']:.3f} s/step" for r in rows)
    s.record("trainer", "bench.trainer", status, "" if status == "ok" else f"exited {proc.rc}: {proc.tail(6)}",
             summary, rows=str(out), wall_s=proc.wall_s)


# =========================================================================== part: memory


def part_memory(s: Suite) -> None:
    """``python -m bench.memory_sweep --preset gpu-1.5b`` (full size; ``tiny`` otherwise): one row per arm with the
    peak memory at each answer length and the first length it ran out of memory at. Not in the default order:
    TRL is not in the GPU image (``--parts memory --budget 480``)."""
    if importlib.util.find_spec("trl") is None:
        s.record("memory", "bench.memory_sweep", "unavailable", "trl not installed")
        return
    full = s.size == "full"
    if full and not torch.cuda.is_available():
        s.record("memory", "bench.memory_sweep", "unavailable", "needs CUDA")
        return
    out = s.dir / "memory.jsonl"
    before = len(read_jsonl(out)) if out.is_file() else 0
    arms = ["fastcov", "trl", "trl+liger"]
    if not torch.cuda.is_available():
        arms.remove("trl+liger")
        s.record("memory", "trl+liger peak memory", "unavailable", "Liger-Kernel's Triton kernels need CUDA")
    proc = s.run([sys.executable, "-m", "bench.memory_sweep", "--preset", "gpu-1.5b" if full else "tiny",
                  "--arms", ",".join(arms), "--work", str(s.dir / "bench-trainer"), "--jsonl", str(out)])
    rows = (read_jsonl(out) if out.is_file() else [])[before:]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        key = "peak_gpu_mb" if any("peak_gpu_mb" in r for r in mine) else "peak_rss_mb"
        points = "; ".join(f"{r['length']}: " + (f"{r[key] / 1024:.2f} GiB" if r["status"] == "ok" and r.get(key)
                                                  else r["status"]) for r in mine)
        ran = [r for r in mine if r["status"] == "ok"]
        bad = [r for r in mine if r["status"] in ("error", "timeout")]
        status = "ok" if ran and not bad else ("error" if bad else "OOM")
        s.record("memory", f"{arm} peak memory", status, bad[0].get("error", "")[:300] if bad else "",
                 points, points=mine, rows=str(out))
    if not rows:
        s.record("memory", "bench.memory_sweep", "timeout" if proc.timed_out else "error",
                 f"exited {proc.rc}: {proc.tail(6)}", wall_s=proc.wall_s)


# =========================================================================== part: extra


def part_extra(s: Suite) -> None:
    """What runs only when time is left: the kernels at N 65536, then a training step with the optimizer
    offloaded, one with LoRA adapters and one with asynchronous rollouts (each beside the plan's estimate, like the
    train part)."""
    name, preset, extra = EXTRA_KERNELS[s.size]
    kernels_run(s, "extra", name, preset, extra)
    if s.size == "full" and not torch.cuda.is_available():
        s.record("extra", "training steps", "unavailable", "needs CUDA")
        return
    for label, overrides in TRAIN_EXTRA.items():
        if s.part_left() <= 0:
            s.record("extra", f"{label} trainer", "not reached", "the part's time cap or the run's --budget is spent")
        elif label == "lora" and importlib.util.find_spec("peft") is None:
            s.record("extra", f"{label} trainer", "unavailable", "peft not installed (no wheel in .whl)")
        else:
            guarded(s, "extra", f"{label} trainer", lambda s, label=label, o=overrides: train_run(s, "extra", label,
                                                                                                 tuple(o)))


# =========================================================================== running parts, output


PARTS = {"correctness": part_correctness, "kernels": part_kernels, "train": part_train, "pytest": part_pytest,
         "extra": part_extra, "vllm": part_vllm, "trainer": part_trainer, "memory": part_memory}


def guarded(s: Suite, part: str, name: str, fn) -> None:
    """``fn(s)``; whatever it raises becomes an error (or OOM) row named ``name``, with its message, and the run
    goes on."""
    try:
        fn(s)
    except Exception as exc:  # noqa: BLE001
        s.record(part, name, "OOM" if is_oom(exc) else "error", short(exc), traceback=traceback.format_exc(limit=8))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except SystemExit as exc:  # correctness_gpu.die(): its message, not only the status
        message = getattr(exc, "message", None)
        s.record(part, name, "error", f"exited {exc.code}" + (f": {message}" if message else ""))


class InjectedCrash(RuntimeError):
    """The rehearsal's ``--fault PART=crash``: the part raises at its start."""


def _crash(s: Suite) -> None:
    raise InjectedCrash(f"injected crash of part {s.part}")


def run_part(s: Suite, part: str) -> None:
    """One part under its cap; ``not reached`` when the budget cannot start it (for ``extra``: its whole cap)."""
    cap = s.caps.get(part, float("inf"))
    need = cap if part in NEEDS_WHOLE_CAP else min(cap, 30.0 if s.size != "rehearse" else 5.0)
    if s.left() - s.reserve < need:
        s.record(part, "part", "not reached", f"{s.left():.0f} s of the run's --budget left, the part needs "
                 f"{need:.0f} s" + (" (it runs only when its whole cap is left)" if part in NEEDS_WHOLE_CAP else ""))
    else:
        log(f"part {part} (size {s.size}, cap {cap:.0f} s, {s.left():.0f} s of the budget left)")
        s.part, s.part_deadline = part, time.monotonic() + cap
        t0 = time.monotonic()
        try:
            guarded(s, part, "part", _crash if s.faults.get(part) == "crash" else PARTS[part])
        finally:
            s.part, s.part_deadline = None, None
        s.record(part, "part time", "info", summary=f"{time.monotonic() - t0:.0f} s of a {cap:.0f} s cap",
                 wall_s=time.monotonic() - t0, cap_s=cap)
    write_md(s.path)


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or "—"


def render_md(rows: list[dict], source: str = "") -> str:
    """The summary: the last environment record, then per part the rows of the last run that ran it."""
    envs = [r for r in rows if r.get("part") == "env"]
    env = envs[-1] if envs else None
    lines = [f"# GPU validation suite — {(env or {}).get('gpu_name') or 'CPU'} — {(env or {}).get('at', '')[:10]}",
             ""]
    if env:
        lines += [f"Environment: {_cell(env.get('summary'))}.", "", f"Command: `{env.get('command')}`; commit "
                  f"{env.get('commit') or 'unknown'}." + (f" Rows: `{source}`." if source else ""), ""]
    for part in ("setup", *PARTS_ORDER):
        mine = [r for r in rows if r.get("part") == part]
        if not mine:
            continue
        last = [r for r in mine if r.get("run") == mine[-1].get("run")]
        lines += [f"## {part}", "", f"run {last[0].get('run')}, size {last[0].get('size')}", "",
                  "| measurement | status | result |", "|---|---|---|"]
        for r in last:
            text = r.get("summary") if r["status"] == "ok" else "; ".join(
                x for x in (r.get("reason"), r.get("summary")) if x)
            lines.append(f"| {_cell(r['name'])} | {r['status']} | {_cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def write_md(jsonl: Path) -> Path:
    md = jsonl.with_suffix(".md")
    md.write_text(render_md(read_jsonl(jsonl) if jsonl.is_file() else [], str(jsonl)))
    return md


def print_table(rows: list[dict], width: int = 100) -> None:
    body = [(r["part"], r["name"], r["status"], " ".join(str(r.get("summary") if r["status"] == "ok" else
                                                             (r.get("reason") or r.get("summary"))).split()))
            for r in rows if r["part"] != "env"]
    w = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(("part", "measurement", "status"))]
    print(f"{'part':<{w[0]}}  {'measurement':<{w[1]}}  {'status':<{w[2]}}  result")
    for part, name, status, text in body:
        print(f"{part:<{w[0]}}  {name:<{w[1]}}  {status:<{w[2]}}  {text[:width] + ('…' if len(text) > width else '')}")


# =========================================================================== CLI


def _part_seconds(text: str) -> tuple[str, float]:
    part, _, secs = text.partition("=")
    if part not in PARTS_ORDER:
        raise argparse.ArgumentTypeError(f"unknown part {part!r} (parts: {', '.join(PARTS_ORDER)})")
    try:
        return part, float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cap {text!r}: seconds must be a number (PART=SECONDS)") from None


def _part_fault(text: str) -> tuple[str, str]:
    part, _, kind = text.partition("=")
    if part not in PARTS_ORDER or kind not in ("crash", "hang"):
        raise argparse.ArgumentTypeError(f"--fault {text!r}: PART=crash or PART=hang, PART one of "
                                         f"{', '.join(PARTS_ORDER)}")
    return part, kind


def parse_parts(text: str) -> list[str]:
    """``correctness,kernels`` -> the parts in the order given; ``all`` -> RUN_ORDER."""
    if text == "all":
        return list(RUN_ORDER)
    parts = [x for x in text.replace(" ", ",").split(",") if x]
    unknown = [x for x in parts if x not in PARTS_ORDER]
    if unknown or not parts:
        raise ValueError(f"unknown part {unknown[0]!r}" if unknown else "no part named")
    return list(dict.fromkeys(parts))


def record_setup(s: Suite, path: Path) -> None:
    """gpu_run.sh's setup steps (wheels, install), one ``status<TAB>name<TAB>message`` line each, as rows."""
    if not path.is_file():
        s.record("setup", "setup log", "error", f"no setup log at {path}")
        return
    for line in path.read_text().splitlines():
        status, _, rest = line.partition("\t")
        name, _, message = rest.partition("\t")
        if status:
            s.record("setup", name or "step", status, message if status != "ok" else "", message if status == "ok"
                     else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS_ORDER, "all"], help="one part (all: correctness, kernels, train, "
                   "pytest, extra in turn)")
    p.add_argument("--parts", help=f"parts in the order to run them, comma-separated ({', '.join(PARTS_ORDER)}) "
                   "or all")
    p.add_argument("--out", default="bench/results", help="results folder (default bench/results; on the "
                   "device machine $OUT)")
    p.add_argument("--flat", action="store_true", help="write <out>/run.jsonl, run.md, kernels.jsonl, kernels.md "
                   "and nothing else under <out> (the device call returns at most 8 files)")
    p.add_argument("--size", choices=sorted(SIZE_ALIASES), default="full",
                   help="full (= 1.5b, the GPU run), smoke (= tiny: toy sizes, CPU too) or rehearse (gpu_run.sh "
                   "--rehearse: toy sizes on CPU, the Triton path under the interpreter)")
    p.add_argument("--steps", type=int, default=3, help="training steps, the first one a warm-up (default 3)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per subprocess (default 540)")
    p.add_argument("--budget", type=float, default=570.0,
                   help="seconds for the whole invocation, summary included (default 570; 0: no limit)")
    p.add_argument("--cap", type=_part_seconds, action="append", metavar="PART=SECONDS",
                   help="a part's time cap, replacing PART_CAPS[size] (repeatable)")
    p.add_argument("--fault", type=_part_fault, action="append", metavar="PART=crash|hang",
                   help="rehearsal only: make a part raise at its start, or its subprocess hang until stopped")
    p.add_argument("--setup", metavar="TSV", help="gpu_run.sh's setup log: recorded as setup rows")
    p.add_argument("--render", metavar="JSONL", help="only write the markdown of a suite .jsonl (next to it)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.render:
        print(write_md(Path(args.render)))
        return 0
    if bool(args.part) == bool(args.parts):
        p.error("name the parts: --part PART or --parts A,B,... (or --render)")
    try:
        parts = parse_parts(args.parts) if args.parts else parse_parts(args.part)
    except ValueError as exc:
        p.error(f"--parts: {exc} (parts: {', '.join(PARTS_ORDER)})")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.fault and SIZE_ALIASES[args.size] != "rehearse":
        p.error("--fault is for the rehearsal only (--size rehearse)")
    s = make_suite(args)
    env = environment(s, argv)
    s.record("env", "environment", "ok", summary=env_summary(env), **env)
    if args.setup:
        record_setup(s, Path(args.setup))
    for part in parts:
        run_part(s, part)
    print(f"rows: {s.path}\nsummary: {s.path.with_suffix('.md')}")
    print_table(s.rows)
    return 1 if any(r["status"] in BAD_STATUSES for r in s.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
