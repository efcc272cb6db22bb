"""Step 7 of the loop: the step's metrics row, reduced over all ranks, and the timer of the step's phases.

``UpdateStats`` is what step 5 (``update_policy``) reports for it; ``timed`` adds a phase's wall time to the
step's ``time/*`` entries (as verl's ``marked_timer``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from fastcov.trainer import entropy_control
from fastcov.trainer.runtime.distributed import all_reduce_, all_sum
from fastcov.trainer.start import Run
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
class UpdateStats:
    """What step 5 reports: loss and ``LOSS_METRICS`` sums (weighted by micro-batch tokens) on this rank,
    optimizer steps applied / skipped (agreed over ranks), gradient norms, mini-batches per epoch."""

    loss_sum: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_tokens: int = 0
    applied_steps: int = 0
    skipped_steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    n_mini: int = 1


@contextlib.contextmanager
def timed(times: dict[str, float], key: str) -> Iterator[None]:
    """Adds the wall time of the ``with`` block to ``times[key]`` (a phase run several times a step adds up)."""
    t0 = time.perf_counter()
    yield
    t1 = time.perf_counter()
    times[key] = times.get(key, 0.0) + t1 - t0
    timeline_span("trainer", key, t0, t1)


def step_metrics(run: Run, rewards: list[float], prompts: list[list[int]], token_ids: list[list[int]],
                 upd: UpdateStats, old: list[float], lr: float, rec: dict) -> float:
    """Step 7: the step's metrics over all ranks into ``rec``; returns the prompt + response tokens.
    ``rewards``, ``prompts``, ``token_ids``: everything this rank generated this step (kept or not);
    ``old``: ``compute_old_logprobs``'s sums; ``lr``: the update's learning rate."""
    cfg, a = run.cfg, run.cfg.algo
    # rollout.async: staleness, queue depth (its dropped samples go into the counters logged below)
    async_rec = run.source.step_metrics() if run.source is not None else {}
    resp_lens = [len(x) for x in token_ids]
    (r_sum, r_n, len_sum, e_sum, tk_sum, d_sum, p_sum, m_n, l_sum) = all_sum(
        [sum(rewards), len(rewards), sum(resp_lens), *old[:3], sum(len(p) for p in prompts),
         float(upd.metric_tokens), upd.loss_sum], run.device)
    # rollout/policy mismatch (diagnostics only): max and mean |rollout log-prob - policy's| over all ranks
    d_max = all_reduce_(torch.tensor([old[3]], dtype=torch.float64, device=run.device), "max").item()
    mvals = all_sum([upd.metric_sums.get(k, 0.0) for k in LOSS_METRICS], run.device)
    reward = r_sum / max(r_n, 1)
    rec.update({
        "reward_mean": reward, "acc_mean": reward if cfg.reward.kind == "binary" else (reward + 1) / 2,
        "entropy": e_sum / max(tk_sum, 1), "response_len": len_sum / max(r_n, 1),
        "rollout_logprob_diff": d_sum / max(tk_sum, 1), "rollout_logprob_diff_mean": d_sum / max(tk_sum, 1),
        "rollout_logprob_diff_max": d_max, "loss": l_sum / max(a.ppo_epochs * upd.n_mini, 1),
        "lr": lr, "grad_norm": float(np.mean(upd.grad_norms)) if upd.grad_norms else None,
        "applied_steps": upd.applied_steps,
        **{LOSS_METRIC_NAMES.get(k, k): v / max(m_n, 1) for k, v in zip(LOSS_METRICS, mvals, strict=True)},
        **run.counters, **async_rec,
    })
    sel = rec["selected_frac"]
    if a.mode == "clip_cov" and sel == 0 and run.rank == 0 and not run.warned["empty_band"]:
        run.warned["empty_band"] = True
        warnings.warn(
            f"step {run.step}: Clip-Cov selected no token: no selection score fell in the band "
            f"({a.loss.clip_cov_lb:g}, {a.loss.clip_cov_ub:g}) (cov_score={a.loss.cov_score}: "
            f"mean {rec['cov_mean']:.3g}, "
            f"max {rec['cov_max']:.3g} this step); widen algo.loss.clip_cov_lb/clip_cov_ub to the scores' scale "
            "(said once per run)", stacklevel=1)
    if sel > 0:  # which tokens Clip-Cov/KL-Cov acted on: advantage sign, probability, covariance
        rec["sel/tokens_per_update"] = sel * m_n / max(a.ppo_epochs * upd.n_mini, 1)
        rec["sel/pos_adv_share"] = rec["selected_pos_adv"] / sel
        rec["sel/mean_prob"] = rec["selected_prob"] / sel
        rec["sel/mean_cov"] = rec["selected_cov"] / sel
    rec.update(selection_diagnostics(run, upd, sel, m_n))
    if run.lam_sched is not None:
        run.lam_sched.step(entropy=rec["entropy"])
    entropy_control.after_step(run.entropy_ctl, rec["entropy"], rec)  # entropy_control/value, /error
    return p_sum + len_sum


def selection_diagnostics(run: Run, upd: UpdateStats, sel: float, m_n: float) -> dict:
    """sel/mean_pos (global scope: the selected tokens' mean relative position in their response) and, for a
    random control, sel/jaccard_vs_cov: |control ∩ c_t's pick| / |control ∪ c_t's pick|, pooled over the step."""
    a = run.cfg.algo
    both, either, pos = all_sum([upd.metric_sums.get(k, 0.0) for k in SELECTION_DIAGNOSTICS], run.device)
    out = {}
    if sel > 0 and a.scope == "global":
        out["sel/mean_pos"] = pos / (sel * max(m_n, 1))
    if a.loss.cov_score in ("random", "random_matched") and either > 0:
        out["sel/jaccard_vs_cov"] = both / either
    return out

