"""TRL: GRPO with fastcov's fused log-probs/entropies and its Clip-Cov / KL-Cov / vanilla policy losses.

    pip install 'fastcov[trl]'                  # trl>=1.16,<2 (checked at import, in one line)
    from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer
    args = FastcovGRPOConfig(output_dir="out", fastcov_loss_mode="kl_cov", kl_cov_ratio=2e-3, steps_per_generation=8)
    trainer = FastcovGRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds)
    trainer.train()     # logs fastcov/selected_frac, fastcov/cov_mean, fastcov/clipfrac, fastcov/ppo_kl, ...

Tested with trl 1.16. The trainer overrides three hooks of ``trl.GRPOTrainer`` (and, to checkpoint the
target-entropy controller, ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``) and nothing else:

* ``_get_per_token_logps_and_entropies``: log π(y_t) and H_t of the completion tokens, [B, C] fp32, from
  the decoder's last hidden state and ``lm_head.weight`` through ``fastcov.linear_logprob_entropy``
  (no [B, T, V] logits; TRL's ``temperature``; only the last ``logits_to_keep`` positions are scored).
  The decoder runs inside the model's forward (a ``fastcov_logits_to_keep=`` keyword this module adds to
  the policy's and reference model's forward), so DDP / accelerate wrappers see a normal forward.
* ``_compute_loss``: ``fastcov.policy_loss`` with the configured mode; TRL's KL-to-reference term when
  ``beta != 0``; TRL's entropy bonus and adaptive entropy control (below); an MoE model's load-balancing loss;
  fastcov's metrics go to TRL's ``_metrics`` under ``fastcov/<name>``.
* ``_generate_and_score_completions`` (``fastcov_scope="global"`` only): computes the Clip-Cov / KL-Cov
  selection once per rollout batch over every data-parallel rank (``fastcov.compute_global_selection``)
  and hands each micro-batch its rows.

Mapping of TRL's options (``FastcovGRPOConfig``)::

    fastcov_loss_mode "auto" (default) -> "clip_cov" where the loss is PPO's token clip (loss_type dapo, bnpo, grpo,
                              dr_grpo, luspo at token level: it acts on-policy too), else "kl_cov" (its penalty acts
                              from a rollout batch's second optimizer step on; warned where there is none)
    epsilon, epsilon_high  -> LossConfig.clip_low, clip_high      (PPO clip of vanilla, clip_cov and gspo)
    delta                  -> LossConfig.dual_clip_c              (> 1 + epsilon_high; token level and GSPO; not with
                              kl_cov at token level, which has no clip)
    top_entropy_quantile   -> TRL's own entropy mask (get_high_entropy_mask), a per-token loss weight (a row's mean
                              with GSPO / sapo_seq); fastcov_scope "global": LossConfig.high_entropy_fraction
    router_aux_loss_coef   -> TRL's: an MoE model's load-balancing loss (TRL's default None: the model's coefficient),
                              from the fused forward's router logits (``router_aux_loss_function``), / GA steps
    loss_type "dapo"       -> agg "token-mean", denominator = TRL's (active tokens of the accumulated batch)
              "bnpo"       -> agg "token-mean" over the micro-batch, / gradient_accumulation_steps
              "grpo"       -> agg "seq-mean-token-mean" over the micro-batch's B rows, / gradient_accumulation_steps
              "dr_grpo"    -> agg "seq-mean-token-sum-norm", loss_scale_factor = max_completion_length, / GA steps
              "luspo"      -> agg "seq-mean-token-sum" over the micro-batch's B rows, / gradient_accumulation_steps
              "cispo"      -> mode "cispo" (cispo_clip_max = epsilon_high, no lower bound), normalized like "dapo"
              "sapo"       -> mode "sapo" (tau = sapo_temperature_pos / _neg), normalized like "grpo"
              "vespo"      -> mode "vespo" (k, lambda = vespo_k_pos / _lambda_pos for A >= 0, _neg below),
                              normalized like "dapo"; the vLLM ratio (token modes) enters its sequence ratio, as TRL's
    importance_sampling_level "sequence" -> mode "gspo" (GSPO; loss_type grpo, bnpo, dr_grpo, dapo or luspo),
                              "cispo_seq" / "sapo_seq" (loss_type cispo / sapo), "vespo" (VESPO's ratio is a
                              sequence's at either level; the level changes only the bias-corrected KL)
    beta                   -> TRL's k3 KL to the reference model, aggregated like the policy loss; with
                              use_bias_correction_kl (TRL's default) × the ratio to the old policy (GSPO's sequence
                              ratio at sequence level)
    fastcov_loss_mode "kl_cov" with cispo, sapo, vespo or sequence level -> that mode's loss plus mode "kl_cov_penalty"
                              (β·|log π − log π_old| on KL-Cov's tokens, each token's own weight, the same aggregation)

Rollout correction (TRL's options, TRL's behaviour; ``fastcov.correction``), as per-token weights of the policy loss::

    vllm_importance_sampling_correction   with use_vllm (TRL's default: on): fastcov.rollout_correction of
    vllm_importance_sampling_mode         log π_old − log π_sampler (TRL's sampling_per_token_logps; NaN → ratio 1),
    vllm_importance_sampling_clip_max/min token_* or sequence_* (summed), *_truncate (clamp) or *_mask (zero outside)
    off_policy_mask_threshold             fastcov.correction.off_policy_sequence_mask: drop a sequence with A < 0
                                          whose mean log π_sampler − log π exceeds it (π_old without the sampler's
                                          log-probs)

With GSPO and sapo_seq, a per-token weight acts as its row's mean weight, as in TRL (whose sequence ratio takes its
gradient through the row's mean). With VESPO the vLLM ratio is not a weight: its log joins the old log-probs (in
float64), so VESPO's w is π / π_sampler (truncated or masked as TRL's ratio is), as in TRL.
fastcov bounds the exponents of its ratios (±20; GSPO's log-ratio ≤ 10), TRL does not:
the two differ only past those bounds. The losses, the rollout weights' mean (``fastcov/rollout_is_mean``) and the
masked share (``fastcov/off_policy_masked_fraction``) are logged.

Entropy bonus and adaptive entropy (TRL's options, TRL's behaviour; ``fastcov.entropy_control.EntropyController``)::

    entropy_coef                 TRL's bonus: loss −= coef · (mean H over the micro-batch's loss tokens) / GA steps
    use_adaptive_entropy         TRL's controller (Skywork-OR1's): after each optimizer step, with H the mean entropy
    entropy_target,              of the step's loss tokens over all processes, coef ← min(coef + entropy_coef_delta,
    entropy_coef_delta,          entropy_coef_max) if H ≤ entropy_target, else max(coef − delta, entropy_coef_min);
    entropy_coef_min/max         the bonus applies only while the last H ≤ entropy_target (none before the first step)
    fastcov_entropy_control      the same controller on another knob or rule: a dict with algo.entropy_control's keys
                                 (target, knob: kl_cov_coef | kl_cov_ratio | clip_cov_ratio | entropy_coef, rule,
                                 init, delta, gain, min, max, gate, inclusive), measured as use_adaptive_entropy is

With ``top_entropy_quantile`` < 1 the bonus and the measurement cover the tokens the high-entropy mask keeps (TRL's
own mask; the rollout-wide selection with ``fastcov_scope="global"``). The controller's state is saved with each
checkpoint (``fastcov_entropy_control.json``) and restored on resume; ``entropy_coef`` (the coefficient) or
``fastcov/entropy_control/value`` (another knob) is logged at every optimizer step.

Refused (ValueError naming the option): cispo, sapo, vespo or importance_sampling_level "sequence" with
fastcov_loss_mode "clip_cov" (it selects tokens inside PPO's token clip; "kl_cov" adds its penalty instead), or with
"vanilla" and fastcov_scope "global" (nothing to select); vespo with a sequence_* vLLM mode (TRL refuses it too);
multimodal inputs, an MoE model whose aux loss is not transformers' load_balancing_loss_func, FSDP (the fused kernel
reads ``lm_head.weight`` whole in its backward).

LoRA: pass ``peft_config=peft.LoraConfig(...)`` as to ``GRPOTrainer``. TRL wraps the policy in a PeftModel; the
fused head runs on its base model's decoder (adapters active), only the adapters train, and with ``beta > 0`` the
reference log-probs are the same model's with the adapters disabled (TRL's ``disable_adapter()``), not a second
copy. Keep ``lm_head`` out of ``target_modules``: the fused kernel needs the head as a plain ``nn.Linear``.

DeepSpeed ZeRO-3: the head's weight (and bias) are registered as external parameters of the policy (and of the
reference model), so ZeRO-3 gathers them for the forward that runs the fused kernel and again for its backward
(``add_fastcov_head(..., zero3=True)``); ZeRO-1/2 and DDP need nothing.

Scope. ``"microbatch"`` (default) selects inside each ``_compute_loss`` call on each rank, like verl's
``loss_mode=clip_cov|kl_cov``. ``"global"`` selects over the whole rollout batch of all ranks of the world
process group (covariance means, k and the top-k / random pick), so the selection no longer depends on
``per_device_train_batch_size`` or the GPU count. It needs each rollout batch to be one optimizer step
(``steps_per_generation == gradient_accumulation_steps``, ``num_iterations == 1``: TRL's default), so the
policy that scores the selection is the one that generated it; it costs one extra no-grad forward per
rollout when TRL has not computed the old log-probs itself. Loss denominators are TRL's in both scopes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fastcov.correction import off_policy_sequence_mask, rollout_correction
from fastcov.entropy_control import KNOBS, EntropyController
from fastcov.integrations._require import require
from fastcov.losses import LossConfig, Selection, aggregate_loss, compute_global_selection, policy_loss

require("trl", "trl", "'fastcov[trl]'", minimum="1.16", below="2")  # FastcovGRPOConfig reads 1.16's options
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastcov.integrations.transformers import (  # noqa: E402
    FastcovCausalLMOutput,
    decoder_and_head,
    fused_logprob_entropy,
)

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


def add_fastcov_head(model, temperature: float = 1.0, impl: str = "auto", zero3: bool = False):
    """Give ``model``'s forward a ``fastcov_logits_to_keep=K`` keyword (in place; returns ``model``).

    ``model(input_ids=[B, T], attention_mask=[B, T], fastcov_logits_to_keep=K)`` runs the decoder and returns a
    ``FastcovCausalLMOutput`` whose ``logprob`` / ``entropy`` are [B, K] fp32: log π(input_ids[:, t] | < t) and the
    entropy at that step, for the last K positions t, 0 where attention_mask is 0 — TRL's
    ``_get_per_token_logps_and_entropies`` values. Only the last K + 1 hidden states reach the fused kernel, and the
    logits are never formed. Without the keyword the forward is unchanged (generation, TRL's own fused head).

    ``zero3=True`` (the model is, or will be, partitioned by DeepSpeed ZeRO-3): the fused kernel reads the head's
    weight (and bias) outside the head module's own forward, where ZeRO-3 would leave it partitioned (an empty
    tensor). They are registered as external parameters of ``model`` (``deepspeed.zero.register_external_parameter``),
    so DeepSpeed gathers them whole for the forward of ``model`` and again for its backward, and reduce-scatters
    their gradients like any other parameter's.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the HF model
    _, head = decoder_and_head(base)  # refuse non-Linear heads and logit transforms now, not at the first step
    if zero3:
        from deepspeed.runtime.zero import register_external_parameter

        # on the outermost module: DeepSpeed's engine calls it (PEFT's wrappers call base.forward directly, which
        # fires no hooks of base); a tied head is the input embedding, and stays gathered while model is running
        for param in (head.weight, head.bias):
            if param is not None:
                register_external_parameter(model, param)
    inner = base.forward

    @functools.wraps(inner)
    def forward(*args, fastcov_logits_to_keep=None, **kwargs):
        if fastcov_logits_to_keep is None:
            return inner(*args, **kwargs)
        if args:
            raise TypeError("the fastcov head takes keyword arguments only (input_ids=..., attention_mask=...)")
        keep = int(fastcov_logits_to_keep)
        input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
        if not 0 < keep < input_ids.shape[1]:
            raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {keep}")
        decoder, head = decoder_and_head(base)  # looked up per call: wrappers may replace the modules
        dropped = ("labels", "return_dict", "output_hidden_states", "output_attentions", "num_items_in_batch")
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in dropped}
        kwargs["use_cache"] = False
        decoded = decoder(**kwargs)
        aux_loss = None
        if kwargs.get("output_router_logits"):  # an MoE model's load-balancing loss over every position, as its own
            aux_loss = router_aux_loss_function(base)(decoded.router_logits, attention_mask)
        hidden = decoded.last_hidden_state[:, -keep - 1:]
        labels = input_ids[:, -keep - 1:].masked_fill(attention_mask[:, -keep - 1:] == 0, -100)
        with torch.autocast(hidden.device.type, enabled=False):
            stats = fused_logprob_entropy(base, hidden.to(head.weight.dtype), labels, temperature=temperature,
                                          impl=impl)
        assert stats.entropy is not None  # computed unless entropy=False
        return FastcovCausalLMOutput(logprob=stats.logprob[:, 1:], entropy=stats.entropy[:, 1:], aux_loss=aux_loss)

    base.forward = forward
    return model


def router_aux_loss_function(model):
    """``f(router_logits, attention_mask) -> aux_loss``: the load-balancing loss ``model`` (an MoE causal LM, unwrapped)
    adds to its own output, from its decoder's router logits: its modeling module's ``load_balancing_loss_func`` with
    its ``num_experts`` and ``num_experts_per_tok``, as transformers' MoE causal LMs compute ``aux_loss``.

    Raises:
        ValueError: naming router_aux_loss_coef, for a model whose aux loss is computed otherwise.
    """
    loss_func = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if loss_func is None or not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"router_aux_loss_coef: {type(model).__name__} does not compute its MoE load-balancing loss "
                         "as load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, "
                         "attention_mask), which the fused head reproduces; set router_aux_loss_coef=0")
    return functools.partial(_aux_loss, loss_func, experts, top_k)


def _aux_loss(loss_func, experts, top_k, router_logits, attention_mask):
    return loss_func(router_logits, experts, top_k, attention_mask)


class FastcovGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-probs/entropies come from fastcov's fused kernel and whose loss is
    ``fastcov.policy_loss`` (``args``: a ``FastcovGRPOConfig``). Same constructor as ``GRPOTrainer``."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        if not isinstance(args, FastcovGRPOConfig):
            raise TypeError(f"args must be a FastcovGRPOConfig, got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if self.is_fsdp_enabled:
            raise ValueError("FSDP is not supported by FastcovGRPOTrainer (use DDP or DeepSpeed ZeRO-1/2/3)")
        self._fastcov_config = self.args.fastcov_loss_config()
        self._fastcov_mode = self.args.fastcov_mode()
        self._fastcov_penalty = self.args.fastcov_kl_cov_penalty()
        self._fastcov_ctl = self.args.fastcov_entropy_controller()
        self._fastcov_window = None  # [Σ H, tokens] of the current accumulation window (the controller's measurement)
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        zero3 = plugin is not None and plugin.zero_stage == 3
        add_fastcov_head(self.model, self.temperature, zero3=zero3)
        if self.aux_loss_enabled:  # the MoE load-balancing loss: refuse a model whose loss the head cannot give now
            model = self.model
            router_aux_loss_function(model.get_base_model() if hasattr(model, "get_base_model") else model)
        if self.ref_model is not None:
            add_fastcov_head(self.accelerator.unwrap_model(self.ref_model), self.temperature, zero3=zero3)

    # ------------------------------------------------------------------ hook 1: fused log-probs and entropies

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """input_ids, attention_mask: [B, P + C]; logits_to_keep = C. Returns (logps [B, C], entropies [B, C] or
        None, the MoE load-balancing loss or None), fp32, zero where attention_mask is 0, computed in chunks of
        ``batch_size`` rows (the aux loss is the chunks' mean, as TRL's)."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(f"FastcovGRPOTrainer supports text-only causal LMs; got multimodal inputs {given}")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                out = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                            fastcov_logits_to_keep=logits_to_keep, **extra)
            logps.append(out.logprob)
            entropies.append(out.entropy)
            aux.append(out.aux_loss)
        aux_loss = torch.stack(aux).mean() if compute_aux_loss else None
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, aux_loss

    # ------------------------------------------------------------------ hook 2: the rollout-wide selection

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.args.fastcov_scope == "global":
            selection = self._fastcov_rollout_selection(output)
            output[_SELECTION_KEYS[0]] = selection.cov
            output[_SELECTION_KEYS[1]] = selection.high_entropy
        return output

    def _fastcov_group(self):
        if self.accelerator.num_processes > 1:
            return torch.distributed.group.WORLD
        return None

    def _fastcov_rollout_selection(self, output) -> Selection:
        """Selection (bool [B, C] masks) over this rank's rollout batch and, with several processes, all ranks'."""
        mode = "train" if self.model.training else "eval"
        completion_ids = output["completion_ids"]
        mask = _loss_mask(output)
        logprob = output.get("old_per_token_logps")
        need_entropy = self._fastcov_config.high_entropy_fraction is not None
        entropy = None
        if logprob is None or need_entropy:
            args = self.args
            batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
            with torch.no_grad():
                logps, entropy, _ = self._get_per_token_logps_and_entropies(
                    self.model, torch.cat([output["prompt_ids"], completion_ids], dim=1),
                    torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1), completion_ids.size(1),
                    batch_size=batch_size, compute_entropy=need_entropy,
                )
            logprob = logps if logprob is None else logprob
        advantages = _per_token(output["advantages"], logprob)
        return compute_global_selection(
            logprob, logprob, advantages, mask, mode=self.args.fastcov_cov_mode(), config=self._fastcov_config,
            entropy=entropy, group=self._fastcov_group(),
        )

    # ------------------------------------------------------------------ hook 3: the loss

    def _compute_loss(self, model, inputs):
        """fastcov.policy_loss on one micro-batch (+ β·KL to the reference when beta ≠ 0), scaled like TRL's."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
        )
        mask = _loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        advantages = _per_token(inputs["advantages"], logps)
        loss_mode = self._fastcov_mode
        scope = self.args.fastcov_scope
        selection = None
        if scope == "global":
            selection = Selection(inputs.get(_SELECTION_KEYS[0]), inputs.get(_SELECTION_KEYS[1]))
        weights, extra_metrics = self._fastcov_rollout_weights(inputs, logps, old, mask)
        mode_old = old  # the policy loss's old log-probs (VESPO's fold the sampler ratio in; the KL's do not)
        if isinstance(weights, tuple):
            # TRL's VESPO multiplies the sampler ratio into its sequence ratio w instead of the loss: fold its log
            # into the old log-probs (log w = Σ log π − log π_old + log ratio) and keep only the off-policy mask
            weights, is_weights = weights
            # (in float64: π_old's log-probs are ~log 1/V, and an fp32 sum would round the ratios' logs away)
            log_is = torch.where(mask != 0, is_weights.clamp(min=1e-8).log().clamp(max=20.0), 0.0)
            mode_old = old.double() - log_is.double()
        high = self._fastcov_high_entropy(entropies, mask, selection)
        if high is not None:  # TRL's entropy mask multiplies the per-token loss, as a weight here
            extra_metrics["high_entropy_frac"] = _masked_mean(high.to(logps.dtype), mask)
            weights = high.to(logps.dtype) if weights is None else weights * high
        token_weights = weights  # each token's own weight: KL-Cov's penalty takes these
        if weights is not None and loss_mode in _ROW_MEAN_WEIGHT_MODES:
            # TRL's sequence ratio takes its gradient through the row's mean log-ratio, so a per-token weight acts
            # as the row's mean weight (same loss, same gradient); fastcov's GSPO / sapo_seq are the per-token form
            rows = (weights * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
            weights = rows.expand_as(weights) * (mask != 0)

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        agg = LOSS_TYPE_AGG[self.loss_type]
        global_tokens = global_seqs = None
        scale = 1.0 / accumulation
        if self.loss_type in _GLOBAL_TOKEN_TYPES:  # TRL's normalizer: the accumulated batch's active tokens/process
            global_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                global_tokens = global_tokens * accumulation / self.args.steps_per_generation
            scale = 1.0
        elif self.loss_type == "bnpo":
            global_tokens = mask.sum()
        else:  # grpo, sapo, dr_grpo, luspo: mean over the micro-batch's rows, empty ones included
            global_seqs = mask.shape[0]
        config, ctl = self._fastcov_config, self._fastcov_ctl
        if ctl is not None and ctl.knob != "entropy_coef":
            config = dataclasses.replace(config, **{ctl.knob: ctl.applied})
        config = dataclasses.replace(config, high_entropy_fraction=None)  # the high-entropy mask is in the weights
        cov = None if selection is None else Selection(selection.cov)
        common = dict(agg=agg, scope=scope, config=config, entropy=entropies, global_tokens=global_tokens,
                      global_seqs=global_seqs, group=self._fastcov_group() if scope == "global" else None)
        loss, metrics = policy_loss(logps, mode_old, advantages, mask, mode=loss_mode, selection=cov, weights=weights,
                                    **common)
        if self._fastcov_penalty:  # KL-Cov on another loss: its penalty on the tokens it selects, added
            penalty, selected = policy_loss(logps, old, advantages, mask, mode="kl_cov_penalty", selection=cov,
                                            weights=token_weights, **common)
            loss = loss + penalty
            metrics.update({name: value for name, value in selected.items() if name.startswith("selected")})
        metrics.update(extra_metrics)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.args.use_bias_correction_kl:  # TRL's: × the ratio to the old policy (GSPO's at sequence level)
                log_ratio = logps - old
                if self.importance_sampling_level == "sequence":
                    log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
                per_token_kl = per_token_kl * torch.exp(log_ratio)
            loss = loss + self.beta * aggregate_loss(
                per_token_kl, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                loss_scale_factor=self._fastcov_config.loss_scale_factor,
            )
            metrics["kl"] = _masked_mean(per_token_kl, mask)
        self._log_fastcov_metrics(mode, metrics, entropies, mask)
        loss = loss * scale
        if self.args.entropy_coef != 0.0 or ctl is not None:
            loss = self._fastcov_entropy_control(mode, loss, entropies, mask if high is None else mask * high,
                                                 accumulation)
        if self.aux_loss_enabled:  # TRL's: the MoE load-balancing loss, scaled for gradient accumulation
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        return loss

    def _fastcov_high_entropy(self, entropies, mask, selection):
        """bool [B, C] of the tokens ``top_entropy_quantile`` keeps (None at 1): in microbatch scope TRL's own mask
        (``get_high_entropy_mask``: entropy ≥ the quantile over every process's loss tokens), in global scope the
        rollout-wide selection (``compute_global_selection``)."""
        if self._fastcov_config.high_entropy_fraction is None:
            return None
        if selection is not None:
            return selection.high_entropy
        return self.get_high_entropy_mask(entropies.detach(), mask, 1.0 - self.top_entropy_quantile)

    def _fastcov_rollout_weights(self, inputs, logps, old, mask):
        """Per-token loss weights [B, C] (or None) and their metrics: TRL's vLLM importance-sampling correction
        (``fastcov.rollout_correction`` of log π_old − log π_sampler, NaN sampler log-probs → ratio 1) times TRL's
        off-policy sequence mask (``fastcov.correction.off_policy_sequence_mask`` of log π − log π_sampler, or of
        log π − log π_old without the sampler's log-probs). With VESPO the weights are a pair (the off-policy mask or
        None, the sampler ratio), which ``_compute_loss`` folds into VESPO's sequence ratio as TRL does."""
        weights, metrics = None, {}
        valid = mask != 0
        if not bool(valid.any()):  # nothing to weight (and TRL's weights multiply nothing)
            return weights, metrics
        sampling = inputs.get("sampling_per_token_logps")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            if sampling is None:
                raise ValueError("vllm_importance_sampling_correction needs the sampler's log-probs "
                                 "(sampling_per_token_logps), which this rollout did not return")
            level, how = self.vllm_importance_sampling_mode.split("_")
            clip_max = self.vllm_importance_sampling_clip_max
            log_ratio = torch.nan_to_num((old - sampling) * mask, nan=0.0)
            weights, is_metrics = rollout_correction(
                log_ratio, valid, level=level, mode=how, clip_max=None if clip_max is None else float(clip_max),
                clip_min=self.vllm_importance_sampling_clip_min)
            metrics["rollout_is_mean"] = is_metrics["rollout_is_mean"]
        vespo_ratio = None
        if self._fastcov_mode == "vespo" and weights is not None:
            _check_vespo_is_mode(self.loss_type, self.vllm_importance_sampling_mode)
            weights, vespo_ratio = None, weights
        if self.off_policy_mask_threshold is not None:
            reference = old if sampling is None else sampling
            log_ratio = torch.nan_to_num(logps.detach() - reference, nan=0.0)
            keep, mask_metrics = off_policy_sequence_mask(log_ratio, inputs["advantages"].to(log_ratio.dtype), valid,
                                                          float(self.off_policy_mask_threshold))
            metrics.update(mask_metrics)
            keep = keep.to(logps.dtype)
            weights = keep if weights is None else weights.to(logps.dtype) * keep
        if vespo_ratio is not None:
            weights = (weights, vespo_ratio)
        return weights, metrics

    def _fastcov_entropy_control(self, mode, loss, entropies, effective, accumulation):
        """TRL's entropy bonus (``entropy_coef`` or the controller's coefficient) over ``effective`` (the loss tokens
        the high-entropy mask keeps) and, in training, the controller's window measurement and its update at each
        optimizer step (``GRPOTrainer._compute_loss``'s rule)."""
        ctl = self._fastcov_ctl
        controls_coef = ctl is not None and ctl.knob == "entropy_coef"
        if controls_coef or self.args.entropy_coef != 0.0:
            coef = ctl.applied if controls_coef else self.args.entropy_coef
            bonus = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            loss = loss - coef * bonus
        if ctl is None or mode != "train":
            return loss
        stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
        self._fastcov_window = stats if self._fastcov_window is None else self._fastcov_window + stats
        if self.accelerator.sync_gradients:  # the optimizer step's boundary: all processes' window, then update
            totals = self.accelerator.reduce(self._fastcov_window, reduction="sum")
            ctl.update((totals[0] / totals[1].clamp(min=1.0)).item())
            self._fastcov_window = None
            if ctl.knob == "entropy_coef":
                self.entropy_coef, self._last_world_entropy = ctl.value, ctl.last_entropy  # TRL's attributes
                self._metrics[mode]["entropy_coef"].append(ctl.value)
            else:
                self._metrics[mode]["fastcov/entropy_control/value"].append(ctl.value)
        return loss

    # ------------------------------------------------------------------ the controller's state in checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._fastcov_ctl is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            step = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            with open(os.path.join(self._get_output_dir(trial=trial), step, _CONTROL_FILE), "w") as f:
                json.dump(self._fastcov_ctl.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        self._fastcov_load_control(checkpoint)

    def _fastcov_load_control(self, checkpoint) -> None:
        """The controller's state from checkpoint directory ``checkpoint`` (if it holds one)."""
        if self._fastcov_ctl is not None and checkpoint is not None:
            path = os.path.join(checkpoint, _CONTROL_FILE)
            if os.path.exists(path):
                with open(path) as f:
                    self._fastcov_ctl.load_state_dict(json.load(f))

    def _log_fastcov_metrics(self, mode, metrics, entropies, mask) -> None:
        names = list(metrics)
        local = torch.stack([metrics[name].detach().float() for name in names])
        values = self.accelerator.reduce(local, reduction="mean").tolist()
        for name, value in zip(names, values, strict=True):
            self._metrics[mode]["kl" if name == "kl" else f"fastcov/{name}"].append(value)
        totals = torch.stack([(entropies.detach() * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())


def _check_vespo_is_mode(loss_type, is_mode) -> None:
    if loss_type == "vespo" and is_mode not in ("token_truncate", "token_mask"):
        raise ValueError(f"vllm_importance_sampling_mode must be 'token_truncate' or 'token_mask' with loss_type="
                         f"'vespo' (as in TRL: VESPO multiplies the per-token ratios into its sequence ratio), got "
                         f"{is_mode!r}")


def _loss_mask(inputs) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """TRL's advantages, [B] or [B, C], as [B, C] float like ``like``."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return advantages.to(like.dtype).expand_as(like)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values.detach() * mask).sum() / mask.sum().clamp(min=1.0)


__all__ = ["FastcovGRPOConfig", "FastcovGRPOTrainer", "add_fastcov_head", "LOSS_TYPE_AGG"]
