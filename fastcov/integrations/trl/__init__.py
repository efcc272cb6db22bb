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

The package: ``config`` (``FastcovGRPOConfig``, ``LOSS_TYPE_AGG``, ``LOSS_OPTIONS``), ``head`` (``add_fastcov_head``,
the router's auxiliary loss) and ``trainer`` (``FastcovGRPOTrainer``, the loss wiring). The names other code uses
are here.
"""

from fastcov.integrations._require import require

require("trl", "trl", "'fastcov[trl]'", minimum="1.16", below="2")  # FastcovGRPOConfig reads 1.16's options

# LOSS_OPTIONS, LOSS_TYPE_MODE, MODES, SCOPES, router_aux_loss_function: read by other code, re-exported
from fastcov.integrations.trl.config import LOSS_OPTIONS as LOSS_OPTIONS  # noqa: E402
from fastcov.integrations.trl.config import LOSS_TYPE_AGG, FastcovGRPOConfig  # noqa: E402
from fastcov.integrations.trl.config import LOSS_TYPE_MODE as LOSS_TYPE_MODE  # noqa: E402
from fastcov.integrations.trl.config import MODES as MODES  # noqa: E402
from fastcov.integrations.trl.config import SCOPES as SCOPES  # noqa: E402
from fastcov.integrations.trl.head import add_fastcov_head  # noqa: E402
from fastcov.integrations.trl.head import router_aux_loss_function as router_aux_loss_function  # noqa: E402
from fastcov.integrations.trl.trainer import FastcovGRPOTrainer  # noqa: E402

__all__ = ["FastcovGRPOConfig", "FastcovGRPOTrainer", "add_fastcov_head", "LOSS_TYPE_AGG"]
