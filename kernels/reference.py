"""Float64 materialized reference for the fused vocabulary kernel: the definition tests compare against.

It builds the full N×V logits, so use it only at test sizes (or on a subset of rows).
"""

from __future__ import annotations

import torch


def reference_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              bias: torch.Tensor | None = None, temperature: float | torch.Tensor = 1.0,
                              ignore_index: int = -100, softcap: float | None = None) -> dict[str, torch.Tensor]:
    """Float64 outputs of docs/design.md §3 from the full logits, differentiable w.r.t. the (float64) inputs.

    hidden [N, D], weight [V, D], bias [V] or None, labels [N] int64; ``temperature`` a float or [N] (one per
    row); ``softcap`` caps the logits as cap·tanh(z/cap) before the temperature (Gemma 2). Returns a dict of
    [N] float64 tensors: logprob, entropy, logsumexp, vocab_cov (κ = Cov_{a∼π}(log π(a), e_y(a) − π(a)), from
    its definition), sum_p2 (Σ_a π(a)², no gradient), and log_probs [N, V] (all of log π, for top-k checks).
    """
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double().reshape(-1, 1)
    else:
        z = z / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    probs = log_probs.exp()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    logprob = log_probs.gather(-1, safe[:, None])[:, 0]
    entropy = -(probs * log_probs).sum(-1)
    # κ from its definition: E[log π · X] − E[log π]·E[X] with X = e_y − π
    x = torch.nn.functional.one_hot(safe, weight.shape[0]).double() - probs
    e_logp_x = (probs * log_probs * x).sum(-1)
    kappa = e_logp_x - (probs * log_probs).sum(-1) * (probs * x).sum(-1)
    zero = torch.zeros_like(logprob)
    return {
        "logprob": torch.where(valid, logprob, zero),
        "entropy": torch.where(valid, entropy, zero),
        "logsumexp": torch.logsumexp(z, dim=-1),
        "vocab_cov": torch.where(valid, kappa, zero).detach(),
        "sum_p2": torch.where(valid, (probs * probs).sum(-1), zero).detach(),
        "log_probs": log_probs,
    }
