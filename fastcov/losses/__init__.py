"""Policy-gradient losses with entropy control: vanilla PPO/GRPO/DAPO clip, Clip-Cov and KL-Cov.

Per token (r = exp(logp − old_logp); the formulas of docs/design.md §4)::

    vanilla   ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)),  optionally min(ℓ, −A·c) where A < 0
    clip_cov  ℓ = vanilla ℓ · (1 − sel),  sel = min(k, #candidates) random tokens with lb < c_t < ub
              among valid tokens PPO did not already clip
    kl_cov    ℓ = −A·r + β·|logp − old_logp|·sel,  sel = the k tokens with the largest c_t
    kl_cov_penalty  ℓ = β·|logp − old_logp|·sel (KL-Cov's penalty alone, to add to another mode's loss)
    k = max(1, ⌊ratio · n_valid⌋)

Modes are short pure functions ``(logprob, old_logprob, advantages, selected, config) -> [B, T]``
kept in a registry; a mode that needs selected tokens registers a selector with it. Users add modes
with ``@fastcov.losses.register("name")``.

Scope. ``scope="microbatch"`` computes the covariance means, k and the selection inside the call,
on this rank only, like verl 0.9.1 ``loss_mode=clip_cov|kl_cov``. ``scope="global"`` computes them
over the whole mini-batch and every rank of ``group``: either in the call itself (when each rank
passes its whole mini-batch in one call) or, for gradient accumulation over micro-batches, once per
mini-batch with ``compute_global_selection`` whose ``Selection.rows(...)`` slices are passed to each
micro-batch call as ``selection=``. The aggregation divides by the mini-batch totals
``global_tokens`` / ``global_seqs``, so the gradients of all micro-batch calls on all ranks *sum* to
the gradient of one unsplit call. (A data-parallel wrapper that averages gradients over ranks needs
the loss multiplied by the world size, as verl does with ``dp_size``.)

The package: ``config`` (``LossConfig``, ``Selection``), ``modes`` (the registry and the PPO-clip family:
vanilla, Clip-Cov, KL-Cov), ``aggregate`` (``loss_agg``), ``token_selection`` (which tokens a penalty reaches,
``compute_global_selection``) and ``policy`` (``policy_loss``). The names other code uses are here.
"""

# segment_index, COV_SCORES, RANDOM_CONTROLS, CovScore, MODES, SelectorFn, TokenLossFn: names of the single-file
# losses.py that other code reads, re-exported (``X as X``) but not in __all__
from fastcov.losses.aggregate import aggregate_loss
from fastcov.losses.aggregate import segment_index as segment_index
from fastcov.losses.config import AGGREGATIONS, SCOPES, LossConfig, Selection, SelectionInputs
from fastcov.losses.config import COV_SCORES as COV_SCORES
from fastcov.losses.config import RANDOM_CONTROLS as RANDOM_CONTROLS
from fastcov.losses.config import CovScore as CovScore
from fastcov.losses.modes import MODES as MODES
from fastcov.losses.modes import (
    PolicyLossMode,
    available_modes,
    clip_cov_loss,
    dual_clip,
    get_policy_loss,
    kl_cov_loss,
    kl_cov_penalty,
    ppo_clip_terms,
    ppo_clipped,
    register,
    vanilla_loss,
)
from fastcov.losses.modes import SelectorFn as SelectorFn
from fastcov.losses.modes import TokenLossFn as TokenLossFn
from fastcov.losses.policy import policy_loss
from fastcov.losses.token_selection import compute_global_selection

__all__ = ["AGGREGATIONS", "SCOPES", "LossConfig", "PolicyLossMode", "Selection", "SelectionInputs", "aggregate_loss",
           "available_modes", "clip_cov_loss", "compute_global_selection", "dual_clip", "get_policy_loss",
           "kl_cov_loss", "kl_cov_penalty", "policy_loss", "ppo_clip_terms", "ppo_clipped", "register", "vanilla_loss"]
