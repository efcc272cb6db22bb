"""What one step of the loop hands the next (trainer/train.py): typed records instead of positional lists, and the
step's metrics row with its phase timer.

``Collected`` (steps 1-3) → ``OldLogprobStats`` (step 4) → ``UpdateStats`` (step 5) → ``StepSums`` (step 7, the
sums over all ranks the metrics row divides). ``StepRow`` is the step's metrics row as the steps fill it, in the
order they run, and the wall time of each phase (``time/*``, as verl's ``marked_timer``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from fastcov.trainer.runtime.batch import Sequence
from fastcov.trainer.runtime.distributed import all_sum
from fastcov.trainer.timeline import timeline_span

# policy_loss metrics averaged over the update's tokens; its "entropy" is logged as "update_entropy"
# ("entropy" is the rollout-token mean of the pre-update policy).
LOSS_METRICS = ("ppo_kl", "clipfrac", "selected_frac", "selected_pos_adv", "selected_prob", "selected_cov",
                "cov_mean", "cov_max", "entropy")
LOSS_METRIC_NAMES = {"entropy": "update_entropy"}
# summed like LOSS_METRICS, logged only as sel/* ratios: the overlap of a random control with the covariance
# rule's pick (policy_loss), and the selected tokens' relative position in their response (global scope)
SELECTION_DIAGNOSTICS = ("selected_and_ref", "selected_or_ref", "selected_pos")


@dataclass
class Collected:
    """Steps 1-3 on this rank: its kept sequences (advantages set), the global ids of the kept prompt groups (the
    same list on every rank, ordered rank by rank so ``update_policy``'s rank order is global order), and what the
    metrics need about everything generated this step (kept or not)."""

    seqs: list[Sequence]
    kept_groups: list[int]
    prompts: list[list[int]]
    token_ids: list[list[int]]
    rewards: list[float]
    n_generated: int  # response tokens generated on this rank
    gen_batches: int  # batches generated (DAPO's refill: more than one)


class OldLogprobStats(NamedTuple):
    """Step 4 on this rank: the pre-update policy's entropy summed over the response tokens, their number, and
    Σ / max |policy log-prob − rollout engine's log-prob| over them (the rollout mismatch, a diagnostic)."""

    entropy_sum: float
    tokens: float
    gap_sum: float
    gap_max: float


@dataclass
class UpdateStats:
    """What step 5 reports: loss and ``LOSS_METRICS`` sums (weighted by micro-batch tokens) on this rank,
    optimizer steps applied / skipped (agreed over ranks), gradient norms, mini-batches per epoch, the lr."""

    loss_sum: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_tokens: int = 0
    applied_steps: int = 0
    skipped_steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    n_mini: int = 1
    lr: float = 0.0


class StepSums(NamedTuple):
    """Step 7: this step's totals, summed over all ranks (``reduced``), that the metrics row divides."""

    reward: float  # Σ reward over every generated response
    responses: float  # generated responses
    response_tokens: float  # their tokens
    entropy: float  # OldLogprobStats.entropy_sum
    scored_tokens: float  # OldLogprobStats.tokens (kept responses)
    logprob_gap: float  # OldLogprobStats.gap_sum
    prompt_tokens: float  # the prompts' tokens, one per response
    update_tokens: float  # UpdateStats.metric_tokens
    loss: float  # UpdateStats.loss_sum

    @classmethod
    def reduced(cls, col: Collected, old: OldLogprobStats, upd: UpdateStats, device: torch.device) -> StepSums:
        """The totals over all ranks (one all-reduce; every rank must call it)."""
        local = [sum(col.rewards), len(col.rewards), sum(len(x) for x in col.token_ids), old.entropy_sum, old.tokens,
                 old.gap_sum, sum(len(p) for p in col.prompts), float(upd.metric_tokens), upd.loss_sum]
        return cls(*all_sum(local, device))


@dataclass
class StepRow:
    """One step's row of metrics.jsonl as the steps fill it (its keys in the order the steps run), the wall time of
    its phases (logged last as ``time/<phase>``) and when the step started."""

    metrics: dict[str, Any]
    times: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "reward": 0.0})
    started: float = field(default_factory=time.perf_counter)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the wall time of the ``with`` block to ``times[phase]`` (a phase run several times a step adds up)
        and puts it on trainer.timeline's time axis."""
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + t1 - t0
        timeline_span("trainer", phase, t0, t1)
