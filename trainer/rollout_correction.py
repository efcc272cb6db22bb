"""Step 4b of the loop (``algo.rollout_correction``): the rollout correction's weights, per sequence, from the
policy's old log-probs against the rollout engine's (fastcov/correction.py computes them)."""

from __future__ import annotations

import math

import torch

from fastcov.trainer.config import Config
from fastcov.trainer.runtime.batch import Sequence, sequence_tensors
from fastcov.trainer.runtime.distributed import all_reduce_, all_sum


def correct_rollouts(seqs: list[Sequence], cfg: Config, device: torch.device) -> dict[str, float]:
    """Step 4b (algo.rollout_correction): each sequence's ``rollout_weight`` from its ``old_logprob`` against the
    rollout's ``sample_logprob``: the importance weights, times 0 where rejection or the off-policy sequence mask
    drop a token. Returns the ``rollout_corr/*`` metrics (verl's names) over all ranks: token-weighted means of
    the ranks' values, and the maximum / minimum of the ranks' ``*_max`` / ``*_min``. Every rank must call it.

    ``algo.rollout_correction.bypass`` (verl's bypass mode): the weights are the masks alone and ``old_logprob``
    becomes the rollout's log-probs, so the PPO ratio is π / π_rollout; the importance metrics are still logged.

    The weights are per sequence (no statistic crosses sequences), so they do not depend on the number of ranks
    or the micro-batch split, and they multiply the per-token loss after the Clip-Cov/KL-Cov selection: they do
    not change which tokens are selected (a rejected token stays in the denominators and may be selected).
    """
    from fastcov.correction import mismatch_metrics, off_policy_sequence_mask, rollout_correction, rollout_rejection

    rc = cfg.algo.rollout_correction
    width = max((len(s.response) for s in seqs), default=0)
    n_tokens = sum(len(s.response) for s in seqs)
    if n_tokens:
        per_seq = sequence_tensors(seqs, width, device)
        mask, old = per_seq["mask"], per_seq["old_logprob"].double()
        sampled = torch.zeros_like(old)
        for i, s in enumerate(seqs):
            sampled[i, : len(s.sample_logprob)] = torch.tensor(s.sample_logprob, dtype=torch.float64)
    else:  # no token on this rank: a neutral one-token batch keeps the metric names and the collectives in step
        mask, old, sampled = torch.ones((1, 1), dtype=torch.bool), torch.zeros((1, 1)), torch.zeros((1, 1))
        per_seq = {"advantages": torch.zeros((1, 1))}
    log_ratio = old - sampled
    weights, metrics = rollout_correction(log_ratio, mask, level=rc.level, mode=rc.mode, clip_max=rc.clip_max,
                                          clip_min=rc.clip_min)
    keep_masks = []
    if rc.rejection is not None:
        keep, rs_metrics = rollout_rejection(log_ratio, mask, rc.rejection, rc.rejection_threshold)
        weights, metrics = weights * keep, {**metrics, **rs_metrics}
        keep_masks.append(keep)
    if rc.off_policy_mask_threshold is not None:
        keep, op_metrics = off_policy_sequence_mask(log_ratio, per_seq["advantages"].to(log_ratio.dtype), mask,
                                                    rc.off_policy_mask_threshold)
        weights, metrics = weights * keep, {**metrics, **op_metrics}
        keep_masks.append(keep)
    metrics.update(mismatch_metrics(old, sampled, mask))
    if rc.bypass:  # verl's bypass mode: the ratio against the rollout holds the importance weight; masks stay
        weights = torch.ones_like(weights)
        for keep in keep_masks:
            weights = weights * keep
    if n_tokens:
        for i, s in enumerate(seqs):
            s.rollout_weight = weights[i, : len(s.response)].float().tolist()
            if rc.bypass:
                s.old_logprob = list(s.sample_logprob)
    names = sorted(metrics)
    values = [float(metrics[k]) for k in names]
    sums = all_sum([n_tokens] + [v * n_tokens for v in values], device)
    pairs = list(zip(names, values, strict=True))
    highs = all_reduce_(torch.tensor([v if k.endswith("_max") else -math.inf for k, v in pairs],
                                     dtype=torch.float64, device=device), "max").tolist()
    lows = all_reduce_(torch.tensor([-v if k.endswith("_min") else -math.inf for k, v in pairs],
                                    dtype=torch.float64, device=device), "max").tolist()
    out = {}
    for k, total, high, low in zip(names, sums[1:], highs, lows, strict=True):
        value = high if k.endswith("_max") else -low if k.endswith("_min") else total / max(sums[0], 1)
        out[f"rollout_corr/{k}"] = value
    return out
