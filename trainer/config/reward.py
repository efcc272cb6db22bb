"""The ``reward`` section: the task that scores a response, and the code sandbox's limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fastcov.trainer.config.base import check as _check


@dataclass
class CodeRewardConfig:
    """Limits of the code sandbox (trainer/rewards/sandbox.py) for ``reward.task: code``."""

    cpu_s: float = 2.0  # CPU seconds per test run
    wall_s: float = 6.0  # wall clock per test run, then SIGKILL
    memory_mb: int = 512  # all the program's processes (a cgroup where one can be made), else address space each
    nproc: int = 8  # processes (RLIMIT_NPROC)
    max_output_kb: float = 1024.0  # stdout cap per run
    disk_mb: float = 32.0  # all the program may write, forks included (its work dir is a tmpfs this size)
    # A SandboxFusion /run_code endpoint (e.g. http://host:8080/run_code): programs run there instead.
    sandbox_fusion_url: str | None = None


@dataclass
class RewardConfig:
    # math: the last \boxed{} answer checked with math-verify; code: the response's last code block runs
    # against the prompt's tests (ground_truth = JSON {"inputs", "outputs"}) in a sandbox
    # (trainer/rewards/code_task.py).
    task: str = "math"  # a name in fastcov.trainer.rewards.REWARD_TASKS
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    kind: Literal["binary", "pm1"] = "binary"  # 1/0 or +1/-1
    timeout_s: float = 5.0
    # process: math-verify runs in a worker process that is killed after timeout_s (a hard limit);
    # inline: math-verify's own signal-based limit in the calling thread (faster, softer).
    sandbox: Literal["process", "inline"] = "process"
    # Size of the math-verify worker pool (process sandbox); 0: min(4, CPU count).
    workers: int = 0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _check(self.workers >= 0, "reward.workers", f"must be >= 0 (0 = automatic), got {self.workers}")
        c = self.code
        _check(c.cpu_s > 0 and c.wall_s > 0, "reward.code.cpu_s", "cpu_s and wall_s must be > 0")
        _check(c.memory_mb >= 32, "reward.code.memory_mb", f"must be >= 32, got {c.memory_mb}")
        _check(c.nproc >= 1, "reward.code.nproc", f"must be >= 1, got {c.nproc}")
        _check(c.max_output_kb > 0, "reward.code.max_output_kb", "must be > 0")
        _check(c.disk_mb > 0, "reward.code.disk_mb", f"must be > 0, got {c.disk_mb}")
        _check(c.sandbox_fusion_url is None or c.sandbox_fusion_url.startswith(("http://", "https://")),
               "reward.code.sandbox_fusion_url", "must start with http:// or https://")

