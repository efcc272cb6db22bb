"""``FastcovGRPOTrainer``: TRL's ``GRPOTrainer`` with fastcov's loss wired in: the fused head's log-probs and
entropies, the rollout's selection (scope ``global``), the importance-sampling weights and the off-policy mask,
``policy_loss`` with TRL's denominators, the entropy controller and its checkpointed state."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from trl import GRPOTrainer

from fastcov.correction import off_policy_sequence_mask, rollout_correction
from fastcov.integrations.trl.config import (
    _CONTROL_FILE,
    _GLOBAL_TOKEN_TYPES,
    _ROW_MEAN_WEIGHT_MODES,
    _SELECTION_KEYS,
    LOSS_TYPE_AGG,
    FastcovGRPOConfig,
    _check_vespo_is_mode,
)
from fastcov.integrations.trl.head import add_fastcov_head, router_aux_loss_function
from fastcov.losses import Selection, aggregate_loss, compute_global_selection, policy_loss


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
