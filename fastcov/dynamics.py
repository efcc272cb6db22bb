"""Entropy dynamics of a tabular softmax policy: the first-order theory.

Theory (Cui et al. 2025, arXiv 2505.22617, §3), for one state with logits z ∈ R^K, π = softmax(z),
H(z) = −Σ_a π_a log π_a.  Differentiating, ∂H/∂z_a = −π_a (log π_a + H), so for any logit change Δz

    ΔH = −Σ_a π_a (log π_a + H) Δz_a + O(|Δz|²) = −Cov_{a∼π}(log π(a), Δz(a)) + O(|Δz|²)     (Lemma 1)

(the covariance form holds because Σ_a π_a (log π_a + H) = 0, i.e. log π_a + H is log π_a centred
under π).  Two update rules for the tabular softmax, advantages A(a) (any vector for NPG; for PG
the gradient below is the exact gradient of E_π[A]):

* vanilla policy gradient, step η:  Δz_a = η·∂E_π[A]/∂z_a = η·π_a (A(a) − E_π[A]), hence

      ΔH ≈ −η·Cov_{a∼π}(log π(a), π(a)·(A(a) − E_π[A]))                                      (Theorem 1)

  which is the paper's −η·Cov(log π, π·A) whenever A is centred under π (A = Q − V);
* natural policy gradient, step η:  Δz_a = η·A(a) (softmax is shift invariant, so any baseline
  drops out), hence

      ΔH ≈ −η·Cov_{a∼π}(log π(a), A(a))                                                       (Theorem 2)

:func:`predicted_entropy_change` implements these three right-hand sides exactly as written;
:func:`policy_gradient_step` gives the Δz they assume, so H(z + Δz) − H(z) can be compared with
the prediction (the gap is O(η²), i.e. the relative gap is O(η)).

The tabular GRPO simulator that measures these predictions over whole runs is the repository's
bench/tabular_dynamics.py, its figure ``python -m bench.tabular_figure`` (both were here up to 0.4).

Everything here works in the dtype of the logits; use float64 to compare with actual changes at small η.
"""

from __future__ import annotations

import torch

from fastcov._moved import moved_attribute

__all__ = [
    "UPDATES",
    "check_logits",
    "policy_entropy",
    "logprob_covariance",
    "predicted_entropy_change",
    "policy_gradient_step",
]

UPDATES = ("vanilla", "natural")


def check_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    """``logits`` if it is a floating-point tensor [..., K], K >= 1; else a TypeError/ValueError naming ``name``."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., K] with K >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {logits.dtype}")
    return logits


def policy_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = −Σ_a π_a log π_a of π = softmax(logits) over the last dim: [..., K] -> [...] (same dtype)."""
    logp = torch.log_softmax(check_logits(logits), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprob_covariance(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Cov_{a∼π}(log π(a), values(a)) per row, π = softmax(logits): [..., K], [..., K] -> [...].

    Computed in centred form Σ_a π_a (log π_a − E_π log π)(v_a − E_π v).
    """
    check_logits(logits)
    if values.shape != logits.shape:
        raise ValueError(f"values must have the shape of logits {tuple(logits.shape)}, got {tuple(values.shape)}")
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    lc = logp - (p * logp).sum(-1, keepdim=True)
    vc = values - (p * values).sum(-1, keepdim=True)
    return (p * lc * vc).sum(-1)


def _check_update(update: str) -> str:
    if update not in UPDATES:
        raise ValueError(f"update must be one of {', '.join(UPDATES)}, got {update!r}")
    return update


def policy_gradient_step(logits: torch.Tensor, advantages: torch.Tensor, lr: float, *,
                         update: str = "natural") -> torch.Tensor:
    """The exact tabular logit change Δz [..., K] of one policy-gradient step of size ``lr``.

    ``update="vanilla"``: Δz = lr·π ⊙ (A − E_π[A])  (gradient of E_π[A] w.r.t. the logits);
    ``update="natural"``: Δz = lr·A.
    ``advantages`` has the shape of ``logits`` (one value per action).
    """
    check_logits(logits)
    _check_update(update)
    if advantages.shape != logits.shape:
        raise ValueError(f"advantages must have the shape of logits {tuple(logits.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if update == "natural":
        return lr * advantages
    p = torch.softmax(logits, dim=-1)
    return lr * p * (advantages - (p * advantages).sum(-1, keepdim=True))


def predicted_entropy_change(logits: torch.Tensor, delta_logits: torch.Tensor | None = None, *,
                             advantages: torch.Tensor | None = None, lr: float | None = None,
                             update: str = "natural") -> torch.Tensor:
    """First-order entropy change of a softmax policy, per row: [..., K] -> [...].

    Give exactly one of
      * ``delta_logits`` (Δz, shape of ``logits``): Lemma 1, −Cov_π(log π, Δz);
      * ``advantages`` (A, shape of ``logits``) and ``lr`` (η):
          ``update="natural"``: Theorem 2, −η·Cov_π(log π, A);
          ``update="vanilla"``: Theorem 1, −η·Cov_π(log π, π ⊙ (A − E_π[A]))
          (= −η·Cov_π(log π, π ⊙ A) when E_π[A] = 0).
    Output dtype is that of ``logits``; use float64 to compare with actual changes at small η.
    """
    check_logits(logits)
    if (delta_logits is None) == (advantages is None):
        raise ValueError("give exactly one of delta_logits or advantages")
    if delta_logits is not None:
        if lr is not None:
            raise ValueError("lr is only used with advantages; scale delta_logits yourself")
        return -logprob_covariance(logits, delta_logits)
    if lr is None:
        raise ValueError("lr is required with advantages")
    assert advantages is not None  # exactly one of delta_logits or advantages
    return -logprob_covariance(logits, policy_gradient_step(logits, advantages, lr, update=update))



# The simulator and its figure, here up to 0.4 -> where they are now (in a checkout of the repository).
_MOVED = {
    **dict.fromkeys(("TabularProblem", "DynamicsConfig", "DynamicsRun", "simulate", "grpo_advantages",
                     "TABULAR_LOSS_OVERRIDES"), "bench.tabular_dynamics"),
    **dict.fromkeys(("compare_methods", "plot_runs", "DEFAULT_METHODS"), "bench.tabular_figure"),
}


def __getattr__(name: str) -> object:
    return moved_attribute(__name__, name, _MOVED)


if __name__ == "__main__":
    raise SystemExit("python -m fastcov.dynamics moved out of the library: python -m bench.tabular_figure, "
                     "from a checkout of fastcov")
