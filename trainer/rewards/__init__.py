"""The rewards room: verifiable rewards for the trainer and for `fastcov eval`, one task per module.

    math_task.py   the last \\boxed{} answer, exact as a rational or math-verify-equivalent (``RewardFn``)
    code_task.py   the last code block run against the prompt's tests (``CodeRewardFn``), the code data format
    sandbox.py     the process sandbox that code answers run in (with _sandbox_launcher.py)

``reward.task`` names an entry of ``REWARD_TASKS``: a factory that takes the config's ``reward`` section and
returns a ``RewardTask``. Training and evaluation both dispatch through it, so a task a user registers
(``REWARD_TASKS.add("name", factory)`` in a module listed under ``trainer.imports``) trains and evaluates
like a built-in one. (``reward.sandbox`` is the math checker's isolation, a pool of math-verify worker
processes or inline; the code sandbox's limits are ``reward.code.*``.)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fastcov.registry import Registry
from fastcov.trainer.rewards.math_task import (  # noqa: F401 - the math task's public names
    MAX_ANSWER_CHARS,
    RewardFn,
    VerifyPool,
    as_rational,
    extract_boxed,
    quick_verdict,
)


@runtime_checkable
class RewardTask(Protocol):
    """What the trainer and the evaluation ask of a reward task. ``timeouts``: checks that hit a limit."""

    timeouts: int

    def check_batch(self, responses: list[str], truths: list[str]) -> list[bool]:
        """Correct or not, per (response, ground truth)."""

    def batch(self, responses: list[str], truths: list[str]) -> list[float]:
        """The rewards of a batch (1/0 or ±1 by ``reward.kind``)."""

    def final_answer(self, response: str) -> str | None:
        """The answer a response gives, compared across samples for the diversity metrics."""

    def close(self) -> None:
        """Release worker processes or connections."""


REWARD_TASKS: Registry = Registry("reward task")


@REWARD_TASKS.register("math")
def math_reward(rcfg) -> RewardTask:
    """The last \\boxed{} answer, exact as a rational or math-verify-equivalent to the ground truth."""
    return RewardFn(rcfg.kind, rcfg.timeout_s, rcfg.sandbox, rcfg.workers)


@REWARD_TASKS.register("code")
def code_reward(rcfg) -> RewardTask:
    """The answer's code run against the prompt's tests in a sandbox (trainer/rewards/code_task.py)."""
    from fastcov.trainer.rewards.code_task import CodeRewardFn

    return CodeRewardFn.from_config(rcfg)
