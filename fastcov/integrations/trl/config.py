"""``FastcovGRPOConfig``: TRL's ``GRPOConfig`` with fastcov's options (the loss mode and its settings, taken
from ``LossConfig``'s own fields, the selection scope, the entropy controller), checked at construction, and how
TRL's ``loss_type`` maps onto fastcov's aggregation and modes."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from fastcov.entropy_control import KNOBS, EntropyController
from fastcov.losses import LossConfig

MODES = ("auto", "vanilla", "clip_cov", "kl_cov")
SCOPES = ("microbatch", "global")
LOSS_TYPE_AGG = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "vespo": "token-mean",
}
# loss types that are a fastcov mode of their own (not PPO's clip, so not Clip-Cov / KL-Cov)
LOSS_TYPE_MODE = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
# ... and at importance_sampling_level="sequence" (VESPO's weight is a sequence's at either level)
_SEQUENCE_MODE = {"cispo": "cispo_seq", "sapo": "sapo_seq", "vespo": "vespo"}
# modes whose ratio takes its gradient through the row's mean log-ratio: a per-token weight acts as the row's mean
_ROW_MEAN_WEIGHT_MODES = ("gspo", "sapo_seq")
# loss types whose token normalizer is TRL's num_items_in_batch (the accumulated batch's active tokens)
_GLOBAL_TOKEN_TYPES = ("dapo", "cispo", "vespo")
_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# loss types whose loss is PPO's token clip at importance_sampling_level="token" (what Clip-Cov selects inside)
_TOKEN_CLIP_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "luspo")
_DEFAULTS = LossConfig()
# LossConfig's fields TRL has no option of its own for: FastcovGRPOConfig carries them under their LossConfig names,
# types and defaults (derived from LossConfig, not restated) and hands them to the loss unchanged
LOSS_OPTIONS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef")


def _loss_options() -> type:
    """A dataclass of the ``LOSS_OPTIONS`` fields as LossConfig declares them (a base of FastcovGRPOConfig)."""
    hints = typing.get_type_hints(LossConfig)
    options = dataclasses.make_dataclass("FastcovLossOptions", [
        (name, hints[name], field(default=getattr(_DEFAULTS, name), metadata={"help": f"fastcov LossConfig.{name}"}))
        for name in LOSS_OPTIONS])
    options.__module__ = __name__
    return options


_LossOptions: Any = _loss_options()
_SELECTION_KEYS = ("fastcov_cov_selection", "fastcov_high_entropy_selection")
_CONTROL_FILE = "fastcov_entropy_control.json"


@dataclass
class FastcovGRPOConfig(GRPOConfig, _LossOptions):
    """``trl.GRPOConfig`` plus fastcov's loss options (see the module docstring for the mapping).

    fastcov_loss_mode: "auto" (default) | "vanilla" | "clip_cov" | "kl_cov". "auto" is "clip_cov" where TRL's loss is
        PPO's token clip (loss_type dapo, bnpo, grpo, dr_grpo, luspo at importance_sampling_level="token"): it acts
        from the first step, on-policy too; elsewhere (cispo, sapo, vespo, sequence level) "kl_cov", whose penalty
        acts from the second optimizer step of a rollout batch on.
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov fraction of valid tokens and open covariance band.
    kl_cov_ratio, kl_cov_coef: KL-Cov fraction of valid tokens and β.
    fastcov_scope: "microbatch" | "global".
    fastcov_entropy_control: a target-entropy controller on any knob (a dict, or its JSON), see the module docstring;
        not with use_adaptive_entropy (which is the same controller on entropy_coef with TRL's options).
    """

    fastcov_loss_mode: str = field(default="auto", metadata={"help": "auto | vanilla | clip_cov | kl_cov"})
    fastcov_scope: str = field(default="microbatch", metadata={"help": "microbatch | global"})
    fastcov_entropy_control: dict | str | None = field(
        default=None, metadata={"help": "target-entropy controller: target, knob, rule, init, delta, gain, min, max, "
                                        "gate, inclusive (a dict or JSON)"})

    def __post_init__(self):
        super().__post_init__()
        if self.fastcov_loss_mode not in MODES:
            raise ValueError(f"fastcov_loss_mode must be one of {MODES}, got {self.fastcov_loss_mode!r}")
        if self.fastcov_scope not in SCOPES:
            raise ValueError(f"fastcov_scope must be one of {SCOPES}, got {self.fastcov_scope!r}")
        if self.loss_type not in LOSS_TYPE_AGG:
            raise ValueError(f"loss_type={self.loss_type!r} is not supported by FastcovGRPOConfig; use one of "
                             f"{tuple(LOSS_TYPE_AGG)}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got "
                             f"{self.importance_sampling_level!r}")
        cov_mode = self.fastcov_cov_mode()
        if not self._token_clip() and cov_mode == "clip_cov":
            raise ValueError(f"fastcov_loss_mode='clip_cov' is not supported with loss_type={self.loss_type!r}, "
                             f"importance_sampling_level={self.importance_sampling_level!r}: Clip-Cov selects tokens "
                             "inside PPO's token clip, which CISPO / SAPO / VESPO / GSPO replace; use 'kl_cov' (its "
                             "penalty adds to any loss) or 'vanilla'")
        if cov_mode == "vanilla" and self.fastcov_mode() != "vanilla" and self.fastcov_scope != "microbatch":
            raise ValueError(f"fastcov_scope must be 'microbatch' with the {self.fastcov_mode()} loss and "
                             "fastcov_loss_mode='vanilla' (nothing is selected)")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            _check_vespo_is_mode(self.loss_type, self.vllm_importance_sampling_mode)
            if self.vllm_importance_sampling_mode not in _IS_MODES:
                raise ValueError(f"vllm_importance_sampling_mode must be one of {_IS_MODES}, got "
                                 f"{self.vllm_importance_sampling_mode!r}")
            for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
                value = getattr(self, name)
                if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"{name} must be a ratio > 0 or None, got {value!r}")
            low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
            if low is not None and high is not None and low > high:
                raise ValueError(f"vllm_importance_sampling_clip_min must be ≤ vllm_importance_sampling_clip_max, got "
                                 f"{low} > {high}")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 0):
            raise ValueError(f"off_policy_mask_threshold must be a number ≥ 0 or None, got {threshold!r}")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {value!r}")
        if self.delta is not None and self.loss_type not in LOSS_TYPE_MODE:  # TRL ignores delta for cispo / sapo
            if self.fastcov_mode() == "kl_cov":
                raise ValueError("delta is not supported with fastcov_loss_mode='kl_cov' and a token-level PPO "
                                 f"loss_type ({self.loss_type!r}): KL-Cov replaces PPO's clip, so there is no clipped "
                                 "loss for the dual clip to bound")
            if not self.delta > 1.0 + self._clip_high():
                raise ValueError(f"delta must be > 1 + epsilon_high = {1.0 + self._clip_high()}, got {self.delta}")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        if self.fastcov_scope == "global" and (
            self.steps_per_generation != self.gradient_accumulation_steps or self.num_iterations != 1
        ):
            raise ValueError(
                "fastcov_scope='global' selects once per rollout batch, which must be one optimizer step: it needs "
                f"steps_per_generation == gradient_accumulation_steps and num_iterations == 1, got "
                f"steps_per_generation={self.steps_per_generation}, gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}, num_iterations={self.num_iterations}"
            )
        self.fastcov_loss_config()  # LossConfig validates the ratios, the band and β, naming them
        self.fastcov_entropy_controller()  # the controller validates its options, naming them
        if (cov_mode == "kl_cov" and self.num_iterations == 1
                and self.steps_per_generation == self.gradient_accumulation_steps):
            chosen = "" if self.fastcov_loss_mode == "kl_cov" else f" ('auto' with loss_type={self.loss_type!r})"
            warnings.warn(
                f"fastcov_loss_mode='kl_cov'{chosen} with num_iterations=1 and steps_per_generation == "
                "gradient_accumulation_steps: each rollout batch is one optimizer step from the rollout policy, so "
                "KL-Cov's penalty beta*|log ratio| is 0 (no-op); raise num_iterations or steps_per_generation",
                stacklevel=2)

    def fastcov_entropy_controller(self) -> EntropyController | None:
        """The target-entropy controller of ``use_adaptive_entropy`` (TRL's) or ``fastcov_entropy_control``, or None.

        Raises:
            ValueError: both given, or an option out of range (naming it).
        """
        spec = self.fastcov_entropy_control
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"fastcov_entropy_control: not a JSON object ({exc})") from None
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(f"fastcov_entropy_control must be a dict, got {type(spec).__name__}")
        if spec and self.use_adaptive_entropy:
            raise ValueError("fastcov_entropy_control and use_adaptive_entropy are two controllers; give one")
        if self.use_adaptive_entropy:
            try:
                return EntropyController(self.entropy_target, "entropy_coef", self.entropy_coef, rule="step",
                                         delta=self.entropy_coef_delta, min=self.entropy_coef_min,
                                         max=self.entropy_coef_max, gate=True, inclusive=True)
            except ValueError as exc:
                names = {"target": "entropy_target", "delta": "entropy_coef_delta", "init": "entropy_coef",
                         "min": "entropy_coef_min/entropy_coef_max"}
                word = next((k for k in names if str(exc).startswith(k)), "init")
                raise ValueError(f"{names[word]} (use_adaptive_entropy): {exc}") from None
        if not spec:
            return None
        knob = spec.get("knob", "entropy_coef")
        if knob == "pos_weight":
            raise ValueError("fastcov_entropy_control: knob pos_weight is not available in TRL (no λ re-weighting)")
        modes = KNOBS[knob].modes if knob in KNOBS else None  # an unknown knob: the controller names it below
        if modes is not None and self.fastcov_cov_mode() not in modes:
            raise ValueError(f"fastcov_entropy_control: knob {knob} acts only with fastcov_loss_mode="
                             f"{' / '.join(map(repr, modes))}, not {self.fastcov_loss_mode!r} "
                             f"({self.fastcov_cov_mode()!r})")
        try:
            return EntropyController.from_config(spec, init=getattr(self, knob, None))
        except ValueError as exc:
            raise ValueError(f"fastcov_entropy_control: {exc}") from None

    def _clip_high(self) -> float:
        return float(self.epsilon if self.epsilon_high is None else self.epsilon_high)

    def _token_clip(self) -> bool:
        """TRL's loss is PPO's token clip (what Clip-Cov selects inside and KL-Cov replaces)."""
        return self.loss_type in _TOKEN_CLIP_TYPES and self.importance_sampling_level == "token"

    def fastcov_cov_mode(self) -> str:
        """``fastcov_loss_mode`` with "auto" resolved: "clip_cov" where TRL's loss is PPO's token clip, else
        "kl_cov"; "vanilla" | "clip_cov" | "kl_cov"."""
        if self.fastcov_loss_mode != "auto":
            return self.fastcov_loss_mode
        return "clip_cov" if self._token_clip() else "kl_cov"

    def fastcov_mode(self) -> str:
        """The fastcov loss mode TRL's options pick: "cispo" / "sapo" / "vespo" (loss_type; "cispo_seq" / "sapo_seq"
        at importance_sampling_level="sequence"), "gspo" (importance_sampling_level="sequence"), else
        ``fastcov_cov_mode()``. With KL-Cov and one of the others, KL-Cov's penalty is added to it
        (``fastcov_kl_cov_penalty``)."""
        if self.loss_type in LOSS_TYPE_MODE:
            table = _SEQUENCE_MODE if self.importance_sampling_level == "sequence" else LOSS_TYPE_MODE
            return table[self.loss_type]
        return "gspo" if self.importance_sampling_level == "sequence" else self.fastcov_cov_mode()

    def fastcov_kl_cov_penalty(self) -> bool:
        """KL-Cov on a loss of TRL's that is not PPO's token clip (cispo, sapo, vespo, sequence level): that loss plus
        KL-Cov's penalty β·|log π − log π_old| on the tokens KL-Cov selects (mode "kl_cov_penalty")."""
        return self.fastcov_cov_mode() == "kl_cov" and self.fastcov_mode() != "kl_cov"

    def fastcov_loss_config(self) -> LossConfig:
        """The ``fastcov.LossConfig`` these arguments describe."""
        dual = None if self.delta is None or self.loss_type in LOSS_TYPE_MODE else float(self.delta)
        return LossConfig(
            clip_low=float(self.epsilon),
            clip_high=self._clip_high(),
            dual_clip_c=dual,
            # TRL's CISPO: sg(min(r, epsilon_high)), no lower bound
            cispo_clip_max=self._clip_high() if self.loss_type == "cispo" else _DEFAULTS.cispo_clip_max,
            sapo_tau_pos=float(self.sapo_temperature_pos),
            sapo_tau_neg=float(self.sapo_temperature_neg),
            vespo_k_pos=float(self.vespo_k_pos),
            vespo_lambda_pos=float(self.vespo_lambda_pos),
            vespo_k_neg=float(self.vespo_k_neg),
            vespo_lambda_neg=float(self.vespo_lambda_neg),
            **{name: getattr(self, name) for name in LOSS_OPTIONS},
            high_entropy_fraction=None if self.top_entropy_quantile == 1.0 else float(self.top_entropy_quantile),
            loss_scale_factor=float(self.max_completion_length) if self.loss_type == "dr_grpo" else None,
        )


def _check_vespo_is_mode(loss_type, is_mode) -> None:
    if loss_type == "vespo" and is_mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"vllm_importance_sampling_mode must be 'token_truncate' or 'token_mask' with loss_type="
                         f"'vespo' (as in TRL: VESPO multiplies the per-token ratios into its sequence ratio), got "
                         f"{is_mode!r}")
