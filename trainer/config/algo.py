"""The ``algo`` section: the advantage estimator, the policy loss (``algo.loss``: fastcov.losses.LossConfig itself),
DAPO's filter, PPO epochs and mini-batches, and its sub-sections (PRIME, the rollout correction, the entropy
controls, Jin et al.'s λ schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fastcov.losses import LossConfig
from fastcov.trainer.config.base import check as _check
from fastcov.trainer.config.correction import RolloutCorrectionConfig
from fastcov.trainer.config.entropy import EntropyAdvantageConfig, EntropyControlConfig, PosWeightConfig

if TYPE_CHECKING:
    from fastcov.schedules import PositiveWeightSchedule


@dataclass
class PrimeConfig:
    """PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"): an implicit PRM trained
    online with the cross-entropy loss on outcome labels; token rewards beta * log(pi_rm / pi_ref).
    Used when ``algo.adv_estimator: prime`` (trainer/token_level/prime.py; docs/papers.md)."""

    beta: float = 0.05  # implicit reward scale
    lr: float = 1.0e-6  # reward-model learning rate (AdamW)
    outcome_coef: float = 1.0  # weight of the outcome reward's RLOO return
    process_coef: float = 1.0  # weight of the implicit process rewards' RLOO return
    # The reward model is updated on each batch's rollouts before (true: the paper's order) or after
    # (false) the process rewards are computed from it.
    update_before_reward: bool = True
    # Keep prompts whose rollout accuracy is in [acc_low, acc_high] (PRIME's online filter).
    acc_filter: bool = True
    acc_low: float = 0.2
    acc_high: float = 0.8

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        pr = self
        _check(pr.beta > 0, "algo.prime.beta", f"must be > 0, got {pr.beta}")
        _check(pr.lr > 0, "algo.prime.lr", f"must be > 0, got {pr.lr}")
        _check(pr.outcome_coef >= 0 and pr.process_coef >= 0, "algo.prime.outcome_coef", "coefficients must be >= 0")
        _check(0 <= pr.acc_low <= pr.acc_high <= 1, "algo.prime.acc_low", "need 0 <= acc_low <= acc_high <= 1")


def _trainer_loss() -> LossConfig:
    # check_finite off: the trainer checks the loss itself, and a non-finite one skips the step instead of raising
    return LossConfig(check_finite=False)


@dataclass
class AlgoConfig:
    # prime: outcome + implicit process rewards, token-level (algo.prime); reinforce_pp with algo.kl_coef > 0:
    # REINFORCE++ with its token-level KL penalty (trainer/token_level/advantages.py); optimal_token_baseline:
    # verl's OTB, per-token baselines from the old log-probs and Σπ² of the fused pass.
    # a name in fastcov.advantages.ESTIMATORS, or prime / optimal_token_baseline (token-level)
    adv_estimator: str = "grpo"
    # REINFORCE++'s KL penalty in the reward: r_t = -kl_coef * (log pi_old - log pi_ref)(t), the outcome reward
    # added at the last token, returns summed to the end and normalised over the batch's tokens. 0 = off.
    kl_coef: float = 0.0
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    mode: str = "vanilla"  # a name in fastcov.losses.MODES: vanilla, clip_cov, kl_cov, or one registered
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # global: Clip-Cov/KL-Cov statistics and selection over the whole mini-batch on all data-parallel
    # ranks (independent of the micro-batch split and the rank count); microbatch: per micro-batch and
    # rank, like verl 0.9.1 (for comparison).
    scope: Literal["global", "microbatch"] = "global"
    # The loss's hyperparameters: fastcov.losses.LossConfig itself, its fields, defaults and ranges (clip range,
    # Clip-Cov / KL-Cov, CISPO / SAPO / VESPO, entropy bonus, advantage weights, high-entropy tokens, cov_score).
    # λ (pos_adv_weight) is replaced by algo.pos_weight's schedule when it is enabled.
    loss: LossConfig = field(default_factory=_trainer_loss)
    # Jin et al.'s lambda on the loss of tokens with A > 0, on a schedule (PosWeightConfig; off: loss.pos_adv_weight)
    pos_weight: PosWeightConfig = field(default_factory=PosWeightConfig)
    # DAPO dynamic sampling (verl's algorithm.filter_groups): drop prompt groups whose rewards are all equal
    # and, while fewer than trainer.prompts_per_step groups are kept, generate another batch of prompts, up
    # to max_gen_batches batches per step (0 = until full, as verl's max_num_gen_batches <= 0); a full batch
    # is cut to prompts_per_step groups, a batch still short after max_gen_batches trains on what it has.
    dapo_filter: bool = False
    max_gen_batches: int = 1
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    entropy_advantage: EntropyAdvantageConfig = field(default_factory=EntropyAdvantageConfig)

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key. algo.loss's ranges are
        LossConfig's own (checked when it is built); below, the trainer's narrower ones."""
        a, loss = self, self.loss
        # clip_low = 1 opens the lower clip (ratio >= 0 always), as the paper's Clip-Cov runs do
        _check(0 <= loss.clip_low <= 1, "algo.loss.clip_low", f"must be in [0, 1], got {loss.clip_low}")
        for name in ("pos_adv_weight", "neg_adv_weight"):
            v = getattr(loss, name)
            _check(0 <= v <= 1, f"algo.loss.{name}", f"must be in [0, 1], got {v}")
        a.pos_weight.validate()
        _check(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        _check(a.mini_batches >= 1, "algo.mini_batches", "must be >= 1")
        _check(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
        _check(a.kl_coef == 0 or a.adv_estimator == "reinforce_pp", "algo.kl_coef",
               "the token-level KL penalty is REINFORCE++'s: set algo.adv_estimator=reinforce_pp (or kl_coef 0)")
        a.prime.validate()
        _check(a.max_gen_batches >= 0, "algo.max_gen_batches",
               f"must be >= 0 (0 = until full), got {a.max_gen_batches}")
        _check(a.max_gen_batches == 1 or a.dapo_filter, "algo.max_gen_batches",
               "refilling only applies to DAPO's filter: set algo.dapo_filter=true (or max_gen_batches 1)")


def positive_weight_schedule(a: AlgoConfig) -> PositiveWeightSchedule:
    """The lambda schedule an ``algo`` section with ``pos_weight.enabled: true`` describes."""
    return a.pos_weight.schedule()
