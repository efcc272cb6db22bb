"""fastcov: fused vocabulary kernels and entropy-controlled policy losses for RL on reasoning LLMs.

The top level holds what another framework's loop calls (``__all__``): the fused kernel and its result,
the policy loss and its settings, the two registries, the global selection, the rollout correction and
the entropy controller. The rest lives in the sub-modules that own it, each imported here:
``fastcov.advantages``, ``fastcov.token_advantages``, ``fastcov.losses``, ``fastcov.policy_modes``,
``fastcov.correction``, ``fastcov.selection``, ``fastcov.covariance``, ``fastcov.schedules``,
``fastcov.entropy_control``, ``fastcov.law``, ``fastcov.dynamics`` and ``fastcov.metrics`` (docs/api.md).
A name that used to be exported here still resolves, with a FutureWarning naming its module (``_MOVED``).

Importing this package never imports deepspeed, vllm or transformers.
"""

from fastcov import (  # noqa: F401 - the sub-modules are the library's other public surfaces (docs/api.md)
    advantages,
    correction,
    covariance,
    dynamics,
    entropy_control,
    law,
    losses,
    metrics,
    policy_modes,
    schedules,
    selection,
    token_advantages,
)
from fastcov._moved import moved_attribute as _moved_attribute
from fastcov.advantages import get_advantage, register_advantage
from fastcov.correction import rollout_correction
from fastcov.entropy_control import EntropyController
from fastcov.log import configure as _configure_logging
from fastcov.losses import (
    LossConfig,
    Selection,
    available_modes,
    compute_global_selection,
    get_policy_loss,
    policy_loss,
)
from fastcov.losses import register as register_policy_loss
from fastcov.ops import LogprobEntropy, VocabParallel, linear_logprob_entropy, logprob_entropy_from_logits

_configure_logging()  # fastcov's own messages: the "fastcov" logger, rank 0, FASTCOV_LOG_LEVEL (fastcov/log.py)

# The one place the version is written (pyproject.toml reads it); semantic versioning, CHANGELOG.md.
__version__ = "0.5.0"

__all__ = [
    "linear_logprob_entropy",
    "logprob_entropy_from_logits",
    "LogprobEntropy",
    "VocabParallel",
    "policy_loss",
    "LossConfig",
    "register_policy_loss",
    "get_policy_loss",
    "available_modes",
    "register_advantage",
    "get_advantage",
    "compute_global_selection",
    "Selection",
    "rollout_correction",
    "EntropyController",
]

# Names exported here up to 0.4 -> the module that owns them. ``fastcov.NAME`` and ``from fastcov import NAME``
# still give the object, with a one-line FutureWarning naming its home (tests/library/test_public_api.py).
_MOVED = {
    **dict.fromkeys(("grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo_filter", "broadcast_to_tokens",
                     "entropy_advantage"), "fastcov.advantages"),
    **dict.fromkeys(("aggregate_loss",), "fastcov.losses"),
    **dict.fromkeys(("rollout_rejection", "off_policy_sequence_mask", "mismatch_metrics"), "fastcov.correction"),
    **dict.fromkeys(("token_covariance", "token_covariance_and_keys"), "fastcov.covariance"),
    **dict.fromkeys(("select_top_covariance", "select_random_in_band"), "fastcov.selection"),
    **dict.fromkeys(("PositiveWeightSchedule",), "fastcov.schedules"),
    **dict.fromkeys(("all_rank_entropy",), "fastcov.entropy_control"),
    **dict.fromkeys(("EntropyLaw", "fit_entropy_law"), "fastcov.law"),
    **dict.fromkeys(("predicted_entropy_change",), "fastcov.dynamics"),
    # the tabular GRPO simulator left the library: bench/tabular_dynamics.py, in a checkout of the repository
    **dict.fromkeys(("TabularProblem", "DynamicsConfig", "DynamicsRun", "simulate"), "bench.tabular_dynamics"),
}


def __getattr__(name: str) -> object:
    """A name that left ``__all__``: the object from its new home, with a FutureWarning naming it."""
    return _moved_attribute("fastcov", name, _MOVED)
