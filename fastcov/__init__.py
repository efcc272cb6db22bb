"""fastcov: fused vocabulary kernels and entropy-controlled policy losses for RL on reasoning LLMs.

Importing this package never imports deepspeed, vllm or transformers.
"""

from fastcov import advantages, correction, losses, metrics, policy_modes, selection, token_advantages
from fastcov.advantages import (
    broadcast_to_tokens,
    dapo_filter,
    dr_grpo,
    entropy_advantage,
    get_advantage,
    grpo,
    register_advantage,
    reinforce_pp,
    rloo,
)
from fastcov.correction import mismatch_metrics, off_policy_sequence_mask, rollout_correction, rollout_rejection
from fastcov.covariance import token_covariance, token_covariance_and_keys
from fastcov.dynamics import DynamicsConfig, DynamicsRun, TabularProblem, predicted_entropy_change, simulate
from fastcov.entropy_control import EntropyController, all_rank_entropy
from fastcov.law import EntropyLaw, fit_entropy_law
from fastcov.log import configure as _configure_logging
from fastcov.losses import (
    LossConfig,
    Selection,
    aggregate_loss,
    available_modes,
    compute_global_selection,
    get_policy_loss,
    policy_loss,
)
from fastcov.losses import register as register_policy_loss
from fastcov.ops import LogprobEntropy, VocabParallel, linear_logprob_entropy, logprob_entropy_from_logits
from fastcov.schedules import PositiveWeightSchedule
from fastcov.selection import select_random_in_band, select_top_covariance

_configure_logging()  # fastcov's own messages: the "fastcov" logger, rank 0, FASTCOV_LOG_LEVEL (fastcov/log.py)

# The one place the version is written (pyproject.toml reads it); semantic versioning, CHANGELOG.md.
__version__ = "0.4.0"

__all__ = [
    "LogprobEntropy",
    "VocabParallel",
    "linear_logprob_entropy",
    "logprob_entropy_from_logits",
    "LossConfig",
    "Selection",
    "aggregate_loss",
    "available_modes",
    "compute_global_selection",
    "get_policy_loss",
    "policy_loss",
    "register_policy_loss",
    "rollout_correction",
    "rollout_rejection",
    "off_policy_sequence_mask",
    "mismatch_metrics",
    "correction",
    "policy_modes",
    "token_covariance",
    "token_covariance_and_keys",
    "select_top_covariance",
    "select_random_in_band",
    "get_advantage",
    "register_advantage",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "dapo_filter",
    "broadcast_to_tokens",
    "entropy_advantage",
    "PositiveWeightSchedule",
    "EntropyController",
    "all_rank_entropy",
    "EntropyLaw",
    "fit_entropy_law",
    "predicted_entropy_change",
    "TabularProblem",
    "DynamicsConfig",
    "DynamicsRun",
    "simulate",
    "advantages",
    "losses",
    "metrics",
    "selection",
    "token_advantages",
]
