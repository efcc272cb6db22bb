"""Token-level advantages: REINFORCE++ with its KL penalty in the reward, and PRIME's implicit process rewards.

Pure functions of tensors. Shapes: ``B`` sequences, ``T`` response positions (right padded); ``mask``
bool/0-1 [B, T] marks the response tokens (each row's valid tokens are a prefix); per-token inputs are
float [B, T] (values outside the mask are ignored); ``outcome`` float [B]. Results are float32 [B, T],
0 outside the mask. Sequences of one prompt are contiguous groups of ``n`` rows (as in
``fastcov.advantages``).

REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning LLMs")::

    r_t = −β·kl_t  (+ outcome at the last response token)     kl_t = log π_old(y_t) − log π_ref(y_t)   (k1)
    G_t = Σ_{s ≥ t} r_s                                       (γ = 1)
    A_t = (G_t − mean) / (std + eps)                          mean, std over every response token of the batch

PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards")::

    process reward  p_t = β·(log π_rm(y_t) − log π_ref(y_t))       (the implicit PRM)
    PRM loss        L = BCE(σ(Σ_t p_t), outcome ∈ {0, 1})           (cross-entropy on the outcome label)
    returns         G_t = c_p·Σ_{s ≥ t} (p_s − b_i) + c_o·(o_i − mean_{j ≠ i} o_j)
                    b_i = mean over the other samples j of the group of (mean_t p^j_t)   (leave-one-out)
    A_t = whiten(G_t) over the batch's response tokens

Optimal Token Baseline (OTB; verl 0.9.1's ``optimal_token_baseline``, Li 2025, "The Optimal Token Baseline")::

    w_t = 1 − 2·π_t + Σ_a π_t(a)²  (= ‖e_y − π_t‖², the logit-gradient proxy; × ρ_t² with rollout weights ρ)
    W_t = Σ_{s ≤ t} w_s            (the realized energy up to t)
    G_t = Σ_{s ≥ t} r_s            (returns)
    B_t = Σ_i G^i_t·W^i_t / (Σ_i W^i_t + eps)    over the sequences i of the group still running at t
    A_t = G_t − B_t                 (B = 0 for a group of one)

π_t is the sampled token's probability under the policy that scored the rollout (the old log-probs) and Σπ² its
distribution's mass on the mode, both from one fused pass: ``linear_logprob_entropy(..., sum_p2=True)``.

``whiten_stats`` / ``whiten`` split the normalisation so that data-parallel ranks can sum the three
statistics (Σx, Σx², count) before normalising.
"""

from __future__ import annotations

import torch

from fastcov.advantages import group_index

__all__ = [
    "kl_penalty",
    "leave_one_out",
    "optimal_token_baseline",
    "prime_ce_loss",
    "prime_returns",
    "reinforce_pp_returns",
    "reverse_cumsum",
    "whiten",
    "whiten_stats",
]


def _mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask.to(torch.bool)


def reverse_cumsum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{s ≥ t} x_s over each row's valid tokens; [B, T] → [B, T] float64, 0 outside the mask."""
    m = _mask(mask, x)
    v = torch.where(m, x.to(torch.float64), 0.0)
    return torch.where(m, v.flip(-1).cumsum(-1).flip(-1), 0.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate between the sampling policy and the reference. k1: log π − log π_ref (the
    published REINFORCE++ penalty); k3: exp(ref − logp) − 1 − (ref − logp) (≥ 0, lower variance)."""
    m = _mask(mask, logp)
    d = (logp - ref_logp).to(torch.float64)
    if kind == "k1":
        kl = d
    elif kind == "k3":
        kl = torch.expm1(-d) + d
    else:
        raise ValueError(f"kind must be 'k1' or 'k3', got {kind!r}")
    return torch.where(m, kl, 0.0)


def _last_token(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the last valid token of each row (none for an empty row)."""
    m = mask.to(torch.bool)
    lengths = m.sum(-1)
    idx = (lengths - 1).clamp(min=0)
    out = torch.zeros_like(m)
    rows = torch.arange(m.shape[0], device=m.device)
    out[rows, idx] = lengths > 0
    return out


def reinforce_pp_returns(outcome: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float, kind: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ returns before normalisation. Returns (G [B, T] float64, kl [B, T] float64)."""
    m = _mask(mask, logp)
    if outcome.shape != (m.shape[0],):
        raise ValueError(f"outcome must be [B]={m.shape[0]}, got {tuple(outcome.shape)}")
    kl = kl_penalty(logp, ref_logp, m, kind)
    reward = -kl_coef * kl + torch.where(_last_token(m), outcome.to(torch.float64)[:, None], 0.0)
    return reverse_cumsum(reward, m), kl


def whiten_stats(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [3]: (Σx, Σx², count) over the masked entries (sum these over ranks before ``whiten``)."""
    m = _mask(mask, x)
    v = x.to(torch.float64)[m]
    return torch.stack([v.sum(), (v * v).sum(), torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device)])


def whiten(x: torch.Tensor, mask: torch.Tensor, stats: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean)/(std + eps) with the masked mean and unbiased std (from ``stats`` when given: the batch
    over all ranks); float32 [B, T], 0 outside the mask."""
    m = _mask(mask, x)
    s = whiten_stats(x, m) if stats is None else stats.to(torch.float64)
    total, sq, count = (float(v) for v in s)
    if count < 1:
        return torch.zeros_like(x, dtype=torch.float32)
    mean = total / count
    var = max(0.0, (sq - count * mean * mean) / max(count - 1.0, 1.0))
    out = (x.to(torch.float64) - mean) / (var ** 0.5 + eps)
    return torch.where(m, out, 0.0).to(torch.float32)


def leave_one_out(values: torch.Tensor, n: int) -> torch.Tensor:
    """For contiguous groups of ``n``: the mean of the other members' values ([B] → [B] float64)."""
    if values.dim() != 1 or values.numel() % n or n < 2:
        raise ValueError(f"need a 1-D tensor whose length divides into groups of n >= 2, got "
                         f"{tuple(values.shape)} and n={n}")
    v = values.to(torch.float64).view(-1, n)
    return ((v.sum(-1, keepdim=True) - v) / (n - 1)).reshape(-1)


def prime_returns(outcome: torch.Tensor, process: torch.Tensor, mask: torch.Tensor, n: int,
                  outcome_coef: float = 1.0, process_coef: float = 1.0) -> torch.Tensor:
    """PRIME's returns (see the module docstring) before normalisation: float64 [B, T].

    ``outcome``: [B] outcome rewards; ``process``: [B, T] implicit token rewards β·log(π_rm/π_ref).
    """
    m = _mask(mask, process)
    lengths = m.sum(-1).clamp(min=1).to(torch.float64)
    seq_mean = torch.where(m, process.to(torch.float64), 0.0).sum(-1) / lengths
    baseline = leave_one_out(seq_mean, n)
    proc = reverse_cumsum(process.to(torch.float64) - baseline[:, None], m)
    out_adv = outcome.to(torch.float64) - leave_one_out(outcome, n)
    return torch.where(m, process_coef * proc + outcome_coef * out_adv[:, None], 0.0)


def prime_ce_loss(rm_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit PRM's cross-entropy loss (mean over sequences) and its scores β·Σ_t log(π_rm/π_ref) [B].

    Gradients flow into ``rm_logp`` only. ``labels``: [B] outcome in {0, 1}.
    """
    m = _mask(mask, rm_logp).to(rm_logp.dtype)
    score = beta * ((rm_logp - ref_logp.detach()) * m).sum(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(score, labels.to(score.dtype))
    return loss, score.detach()


def optimal_token_baseline(token_rewards: torch.Tensor, mask: torch.Tensor, groups, old_logprob: torch.Tensor,
                           sum_p2: torch.Tensor, weights: torch.Tensor | None = None, *,
                           handle_zero_tail: bool = False, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB's per-token advantages and returns (see the module docstring): verl 0.9.1's
    ``compute_optimal_token_baseline_advantage`` as a function of tensors, vectorised over the groups.

    Args:
        token_rewards: float [B, T], the reward of each response token (an outcome reward at the last one).
        mask: bool or 0/1 [B, T], the response tokens (each row's a prefix).
        groups: int n (contiguous groups of n rows) or integer ids [B] (``fastcov.advantages.group_index``).
        old_logprob: float [B, T], log π of each sampled token (its probability π_t = exp of it).
        sum_p2: float [B, T], Σ_a π(a)² of each token's distribution (``linear_logprob_entropy(sum_p2=True)``).
        weights: optional float [B, T] rollout importance weights ρ; w_t is scaled by ρ_t² (verl's
            ``rollout_is_weights``).
        handle_zero_tail: zero the baseline of a group's longest sequence past the second longest's length, when
            one sequence alone is the longest (verl's option; its TIR variant turns it on).
        eps: added to the group's Σ W (verl's ``epsilon``).

    Returns:
        (advantages, returns): float32 [B, T] each; advantages are 0 outside the mask, returns as verl's
        (reward-to-go of the masked rewards).
    """
    m = _mask(mask, token_rewards)
    for name, t in (("old_logprob", old_logprob), ("sum_p2", sum_p2)) + ((("weights", weights),) if weights is not None
                                                                         else ()):
        if t.shape != token_rewards.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(token_rewards.shape)}")
    rows, width = token_rewards.shape
    index, num_groups = group_index(groups, rows, token_rewards.device)
    f64 = torch.float64
    valid = m.to(f64)
    returns = (token_rewards.to(f64) * valid).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * old_logprob.to(f64).exp() + sum_p2.to(f64)
    if weights is not None:
        w = w * weights.to(f64) ** 2
    energy = (w * valid).cumsum(-1)
    num = torch.zeros((num_groups, width), dtype=f64, device=returns.device)
    den = torch.zeros_like(num)
    num.index_add_(0, index, returns * energy * valid)
    den.index_add_(0, index, energy * valid)
    size = torch.bincount(index, minlength=num_groups)
    baseline = torch.where((size > 1)[index, None], (num / (den + eps))[index], 0.0)
    if handle_zero_tail:
        lengths = m.sum(-1)
        longest = torch.zeros(num_groups, dtype=lengths.dtype, device=lengths.device).scatter_reduce(
            0, index, lengths, reduce="amax")
        at_longest = lengths == longest[index]
        n_longest = torch.bincount(index, weights=at_longest.to(f64), minlength=num_groups)
        shorter = torch.where(at_longest, torch.zeros_like(lengths), lengths)
        second = torch.zeros_like(longest).scatter_reduce(0, index, shorter, reduce="amax")
        alone = at_longest & (n_longest[index] == 1) & (size[index] > 1)
        tail = alone[:, None] & (torch.arange(width, device=m.device)[None, :] >= second[index, None])
        baseline = torch.where(tail, 0.0, baseline)
    advantages = (returns - baseline) * valid
    return advantages.to(torch.float32), returns.to(torch.float32)
