"""Token-level advantages in the training loop: REINFORCE++ with its KL penalty, and PRIME.

``make_token_advantages(cfg, lm)`` returns None for the outcome-only estimators (grpo, dr_grpo, rloo,
reinforce_pp without ``algo.kl_coef``), else an object whose ``apply`` runs between the old log-probs
(step 4) and the policy update (step 5) and sets ``Sequence.token_advantages`` of every sequence:

* ``reinforce_pp`` with ``algo.kl_coef`` β > 0: the reference log-probs (a frozen copy of the starting
  model), r_t = −β·(log π_old − log π_ref) plus the outcome at the last token, returns to the end,
  normalised over all response tokens of the batch on all ranks (``fastcov.token_advantages``);
* ``prime``: the implicit PRM (trainer/token_level/prime.py) updated on the batch, its token rewards
  β·log(π_rm/π_ref), leave-one-out baselines, returns, whitening over the batch.

``optimal_token_baseline`` needs no model: ``optimal_token_baseline_advantages`` runs after the old log-probs and
the rollout correction (its weights ρ scale the token energies, as verl's ``rollout_is_weights``) and sets
``token_advantages`` from the old log-probs and Σπ² of the same fused pass (``Sequence.old_sum_p2``).

The reference is the model as built at the start of the run (before a resume loads the policy), i.e.
the initial policy, as both papers use. With a LoRA policy it is the policy itself with its adapters
switched off (the frozen base, no second copy; ``bind_policy``); PRIME's reward model is then a copy
that trains its own adapters.
"""

from __future__ import annotations

from typing import Any

import torch

from fastcov import token_advantages as ta
from fastcov.trainer.runtime.distributed import all_reduce_
from fastcov.trainer.runtime.lora import copy_adapter_layout, has_adapters
from fastcov.trainer.runtime.precision import param_dtype


def _pad(rows: list[list[float]], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32, device=device)
    return out


# the estimators whose advantages are per token and set after step 4 (the sequence-level pass uses RLOO as a
# placeholder for them)
TOKEN_LEVEL_ESTIMATORS = ("prime", "optimal_token_baseline")


def optimal_token_baseline_advantages(seqs, device: torch.device) -> dict[str, float]:
    """OTB (``fastcov.token_advantages.optimal_token_baseline``) on this rank's sequences, grouped by prompt
    (``Sequence.group``; a group's sequences are all on one rank): the outcome reward at each response's last
    token, π and Σπ² from step 4, ρ from the rollout correction when it ran. Sets ``token_advantages`` (and the
    sequence's mean as ``advantage``). Returns ``sum_p2`` and ``otb_energy``, the means of Σπ² and of
    w = 1 − 2π + Σπ² over the response tokens of every rank (every rank must call it)."""
    missing = [i for i, s in enumerate(seqs) if s.old_logprob is None or s.old_sum_p2 is None]
    if missing:
        raise ValueError(f"optimal_token_baseline: sequences {missing[:5]} have no old_logprob/old_sum_p2 (step 4)")
    width = max([len(s.response) for s in seqs] + [1])
    mask = torch.zeros((len(seqs), width), dtype=torch.bool, device=device)
    rewards = torch.zeros((len(seqs), width), dtype=torch.float32, device=device)
    for i, s in enumerate(seqs):
        mask[i, : len(s.response)] = True
        if s.response:
            rewards[i, len(s.response) - 1] = s.reward
    old = _pad([s.old_logprob for s in seqs], width, device)
    sum_p2 = _pad([s.old_sum_p2 for s in seqs], width, device)
    weights = (_pad([s.rollout_weight for s in seqs], width, device)
               if seqs and all(s.rollout_weight is not None for s in seqs) else None)
    groups = torch.tensor([s.group for s in seqs], dtype=torch.long, device=device)
    if seqs:
        adv, _ = ta.optimal_token_baseline(rewards, mask, groups, old, sum_p2, weights)
    else:
        adv = torch.zeros_like(rewards)
    for i, s in enumerate(seqs):
        s.token_advantages = adv[i, : len(s.response)].tolist()
        s.advantage = float(adv[i, : len(s.response)].mean()) if s.response else 0.0
    energy = 1.0 - 2.0 * old.double().exp() + sum_p2.double()
    tok = all_reduce_(torch.stack([torch.where(mask, sum_p2.double(), 0.0).sum(), torch.where(mask, energy, 0.0).sum(),
                                   mask.sum().double()]))
    count = tok[2].clamp(min=1)
    return {"sum_p2": float(tok[0] / count), "otb_energy": float(tok[1] / count)}


def prime_keep(rewards: torch.Tensor, n: int, kind: str, low: float, high: float) -> torch.Tensor:
    """PRIME's online filter: bool [num_prompts], True where the group's accuracy is in [low, high]."""
    acc = rewards.view(-1, n).float()
    if kind == "pm1":
        acc = (acc + 1) / 2
    mean = acc.mean(-1)
    return (mean >= low - 1e-9) & (mean <= high + 1e-9)


class TokenAdvantages:
    def __init__(self, cfg, lm: torch.nn.Module):
        from fastcov.trainer.token_level.prime import FrozenModel, ImplicitPRM

        self.cfg = cfg
        a = cfg.algo
        self.prime = a.adv_estimator == "prime"
        # the reference only reads: the policy's dtype rule (bf16 on a GPU); the PRM trains in fp32. A LoRA
        # policy's reference is the policy itself with its adapters off, bound once its engine exists.
        self.ref: Any = (None if has_adapters(lm)
                         else FrozenModel(lm, dtype=param_dtype(cfg.model, next(lm.parameters()).device)))
        self.prm = (ImplicitPRM(lm, a.prime.beta, a.prime.lr, cfg.optim.grad_clip) if self.prime else None)

    def bind_policy(self, engine) -> None:
        """Called with the DeepSpeedPolicy once it wraps the model: a LoRA policy's reference is that
        policy with its adapters switched off (no copy); a full-parameter policy's copy is already taken."""
        from fastcov.trainer.token_level.prime import AdaptersOffReference

        if self.ref is None:
            self.ref = AdaptersOffReference(engine)

    def apply(self, seqs, pad_id: int, device: torch.device, batch_kw: dict) -> dict[str, float]:
        """Set ``token_advantages`` on every sequence of this rank (every rank must call). Returns metrics."""
        cfg, a = self.cfg, self.cfg.algo
        temp = cfg.rollout.temperature
        ref = self.ref.logprobs(seqs, pad_id, device, batch_kw, temp)
        width = max([len(s.response) for s in seqs] + [1])
        mask = torch.zeros((len(seqs), width), dtype=torch.bool, device=device)
        for i, s in enumerate(seqs):
            mask[i, : len(s.response)] = True
        outcome = torch.tensor([s.reward for s in seqs], dtype=torch.float32, device=device)
        ref_t = _pad(ref, width, device)
        metrics: dict[str, float] = {}
        if self.prm is not None:
            p = a.prime
            labels = [float(s.reward > 0) for s in seqs]  # binary 1/0 or pm1 ±1: correct = positive
            if p.update_before_reward:
                metrics.update(self.prm.update(seqs, labels, ref, pad_id, device, batch_kw, temp))
            rm_t = _pad(self.prm.logprobs(seqs, pad_id, device, batch_kw, temp), width, device)
            process = p.beta * (rm_t - ref_t)
            if not p.update_before_reward:
                metrics.update(self.prm.update(seqs, labels, ref, pad_id, device, batch_kw, temp))
            returns = (ta.prime_returns(outcome, process, mask, cfg.rollout.n, p.outcome_coef, p.process_coef)
                       if seqs else torch.zeros_like(mask, dtype=torch.float64))
            tok = all_reduce_(torch.stack([torch.where(mask, process, 0.0).sum().double(),
                                        mask.sum().double()]))
            metrics["process_reward_mean"] = float(tok[0] / tok[1].clamp(min=1))
        else:
            old_t = _pad([s.old_logprob for s in seqs], width, device)
            returns, kl = ta.reinforce_pp_returns(outcome, old_t, ref_t, mask, a.kl_coef)
            tok = all_reduce_(torch.stack([kl.sum(), mask.sum().double()]))
            metrics["kl_ref"] = float(tok[0] / tok[1].clamp(min=1))
        stats = all_reduce_(ta.whiten_stats(returns, mask))
        adv = ta.whiten(returns, mask, stats)
        for i, s in enumerate(seqs):
            s.token_advantages = adv[i, : len(s.response)].tolist()
            s.advantage = float(adv[i, : len(s.response)].mean()) if s.response else 0.0
        return metrics


def _full_copy(lm: torch.nn.Module) -> torch.nn.Module:
    """``lm`` itself, or under ZeRO-3 (parameters created partitioned) an unpartitioned model built from
    ``lm``'s config holding the gathered weights (a full copy on every rank, as the reference needs)."""
    if not any(hasattr(p, "ds_id") for p in lm.parameters()):
        return lm
    import deepspeed
    import transformers.integrations.deepspeed as hf_ds
    from transformers import AutoModelForCausalLM

    with deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None):
        state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    first = next(iter(state.values()))
    held = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()  # build this one unpartitioned
    try:
        full = AutoModelForCausalLM.from_config(lm.config, dtype=first.dtype)
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = held
    if has_adapters(lm):  # the same adapter modules, so that every tensor of ``state`` has a place
        full = copy_adapter_layout(lm, full)
    full.load_state_dict(state)
    return full.to(first.device)


def make_token_advantages(cfg, lm: torch.nn.Module) -> TokenAdvantages | None:
    """``lm``: the policy's model as built (possibly ZeRO-3 partitioned), before DeepSpeed wraps it; call
    ``bind_policy`` with the engine after it does."""
    a = cfg.algo
    if a.adv_estimator == "prime":
        return TokenAdvantages(cfg, _full_copy(lm))
    if a.adv_estimator == "reinforce_pp" and a.kl_coef > 0:  # a LoRA policy needs no copy: no gathering
        return TokenAdvantages(cfg, lm if has_adapters(lm) else _full_copy(lm))
    return None
