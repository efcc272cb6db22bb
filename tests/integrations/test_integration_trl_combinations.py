"""TRL options FastcovGRPOTrainer used to refuse, end to end against TRL 1.16's own GRPOTrainer (issue 54).

The pattern is test_integration_trl_correction.py's, and so is the harness (tests/_trl_harness.py): the same saved
tiny model trained by both trainers for four plain-SGD steps (``steps_per_generation=2``: every second step is
off-policy), TRL's transformers generation handing over a stand-in for vLLM's log-probs where ``use_vllm`` is set.
Compared: every step's loss and every parameter's update.

* KL-Cov with loss_type cispo / sapo / vespo and at importance_sampling_level="sequence" (GSPO): TRL has no KL-Cov,
  so the reference is TRL's own loss plus the penalty as the paper defines it, written here from the formula
  (``KLCovReference``: β·|log π − log π_old| on the k = max(1, ⌊ratio·n⌋) tokens of largest
  (A − mean A)(log π − mean log π), weighted like TRL weights a token's loss, normalized like TRL's loss type), on
  the fused log-probs (see ``_trl_with_kl_cov``), over one rollout batch of four optimizer steps.
* top_entropy_quantile < 1 with GSPO and sequence-level SAPO (and at token level): TRL's own entropy mask.
* delta (the dual clip) with GSPO.
* an MoE model (tiny Qwen2-MoE) with TRL's default router_aux_loss_coef=None: the model's own coefficient.
* vllm_importance_sampling_clip_max=None in each of the four vLLM modes, clip_min=None, and both None.
"""

import math

import pytest
import torch
from _trl_harness import STEPS, check, loss_tolerance, run, tiny_model

pytest.importorskip("trl")
pytest.importorskip("datasets")


class KLCovReference:
    """Mixed into TRL's GRPOTrainer: its loss plus KL-Cov's penalty, from the paper's formula (float64 selection)."""

    kl_cov_ratio = 0.25
    kl_cov_coef = 1.0
    penalties: list

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._last_logps = out[0]
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        logps = self._last_logps  # this micro-batch's, with their gradient
        mask = inputs["completion_mask"].to(logps.dtype)
        valid = mask.bool()
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        advantages = inputs["advantages"].to(torch.float64)
        advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).expand(logps.shape)
        # Cov(A, log π) per token, means over the micro-batch's valid tokens; the k largest
        lp = logps.detach().double()
        cov = (advantages - advantages[valid].mean()) * (lp - lp[valid].mean())
        n_valid = int(valid.sum())
        k = max(1, math.floor(self.kl_cov_ratio * n_valid))
        order = torch.argsort(torch.where(valid, cov, -math.inf).flatten(), descending=True, stable=True)
        selected = torch.zeros(cov.numel(), dtype=torch.bool)
        selected[order[:min(k, n_valid)]] = True
        per_token = self.kl_cov_coef * (logps - old).abs() * selected.view_as(logps)
        # the weights TRL puts on a token's loss: its vLLM ratio (token modes; VESPO folds it into its own ratio)
        if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
            per_token = per_token * inputs["importance_sampling_ratio"]
        if self.top_entropy_quantile < 1.0:
            raise NotImplementedError("not needed by these cases")
        accumulation = self.current_gradient_accumulation_steps
        if self.loss_type in ("grpo", "sapo"):
            penalty = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        elif self.loss_type == "bnpo":
            penalty = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        else:  # cispo, dapo, vespo: TRL's num_items_in_batch, rescaled to one accumulation window
            assert self.loss_type in ("cispo", "dapo", "vespo"), self.loss_type
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            penalty = (per_token * mask).sum() / (normalizer * accumulation / self.args.steps_per_generation)
        self.penalties.append(float(penalty.detach()))
        return loss + penalty


def _trl_with_kl_cov(out_dir: str, model, vllm: bool, options: dict) -> dict:
    """``run`` of TRL's loss plus ``KLCovReference``'s penalty; its result also holds each step's ``penalties``."""
    import trl

    from fastcov.integrations.trl import FastcovGRPOTrainer

    # TRL's loss on the fused log-probs (bit for bit the ones fastcov's loss sees; they equal TRL's own within 1e-5,
    # test_integration_trl.py): on-policy steps have log π − log π_old at rounding noise, and |x|'s gradient there is
    # ±β, so the two sides' noise must be the same numbers
    penalties: list[float] = []
    trl_loss = type("TRLLoss", (FastcovGRPOTrainer,), {"_compute_loss": trl.GRPOTrainer._compute_loss})
    trainer_cls = type("TRLLossWithKLCov", (KLCovReference, trl_loss), {"penalties": penalties})
    return {**run("trl+kl_cov", out_dir, model, vllm, options, trainer_cls=trainer_cls), "penalties": penalties}


def _saved_model(tmp_path, moe: bool = False) -> str:
    model_dir = str(tmp_path / "model")
    (tiny_moe() if moe else tiny_model()).save_pretrained(model_dir)
    return model_dir


def tiny_moe(seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2MoeConfig(
        vocab_size=160, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, tie_word_embeddings=False, router_aux_loss_coef=0.05,  # TRL reads the model's coefficient
    )
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float()


IS_TOKEN = dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.04,
                vllm_importance_sampling_clip_min=0.96)
KL_COV = dict(fastcov_loss_mode="kl_cov", kl_cov_ratio=KLCovReference.kl_cov_ratio,
              kl_cov_coef=KLCovReference.kl_cov_coef)

# KL-Cov on the losses with no token clip: (vLLM, options)
KL_COV_CASES = {
    "cispo": (False, dict(loss_type="cispo", epsilon_high=1.002)),
    "sapo": (False, dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=5.0)),
    "vespo": (True, dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                         vllm_importance_sampling_clip_max=1.04, vllm_importance_sampling_clip_min=0.96)),
    # GSPO's row-mean vLLM weight on its own loss, each token's own on the penalty
    "gspo": (True, dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3, epsilon_high=4e-3,
                        **IS_TOKEN)),
    "cispo_sequence": (False, dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.002)),
}


@pytest.mark.parametrize("case", list(KL_COV_CASES))
def test_kl_cov_on_a_loss_without_token_clip_is_that_loss_plus_the_penalty(tmp_path, case):
    """One rollout batch, four optimizer steps (the paper's mini-batches). Only the first is on-policy: there
    log π − log π_old is rounding noise and |x|'s gradient ±β, so a later on-policy step would turn the two sides'
    last-ulp differences into different gradients; off-policy the log-ratios are far from 0 and their signs agree."""
    vllm, options = KL_COV_CASES[case]
    options = dict(steps_per_generation=STEPS, **options)
    if not vllm:
        options = dict(vllm_importance_sampling_correction=False, **options)
    model_dir = _saved_model(tmp_path)
    theirs = _trl_with_kl_cov(str(tmp_path), model_dir, vllm, options)
    ours = run("fastcov", str(tmp_path), model_dir, vllm, {**options, **KL_COV})
    check(ours, theirs, case)
    # the comparison sees the penalty: at noise level on the on-policy step, far above the tolerance on the others
    penalties = theirs["penalties"]
    tolerance = max(loss_tolerance(theirs, step) for step in range(1, STEPS + 1))
    assert penalties[0] < tolerance and min(penalties[1:]) > 100 * tolerance, (penalties, tolerance)
    assert ours["logs"]["fastcov/selected_frac"] > 0


# TRL's own options alone (fastcov_loss_mode="vanilla"): (vLLM, options)
TRL_CASES = {
    # top_entropy_quantile: TRL's mask as per-token weights, each row's mean weight for a sequence ratio
    "gspo_top_entropy": (True, dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3,
                                    epsilon_high=4e-3, top_entropy_quantile=0.5, **IS_TOKEN)),
    "sapo_sequence_top_entropy": (False, dict(loss_type="sapo", importance_sampling_level="sequence",
                                              top_entropy_quantile=0.4)),
    "dapo_top_entropy": (False, dict(loss_type="dapo", top_entropy_quantile=0.3, epsilon=3e-3, epsilon_high=4e-3)),
    # delta with GSPO: the dual clip on the sequence ratio (binding: over one rollout batch of four steps, A < 0
    # rows reach ratios 1.03-1.13)
    "gspo_delta": (False, dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3,
                               epsilon_high=4e-3, delta=1.01, steps_per_generation=STEPS)),
    # no upper vLLM bound, in each mode (with a lower one, so something is truncated or masked)
    **{f"clip_max_none_{mode}": (True, dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=None,
                                            vllm_importance_sampling_clip_min=0.96 if mode.startswith("token") else 0.8))
       for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
    "clip_min_none": (True, dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.04,
                                 vllm_importance_sampling_clip_min=None)),  # TRL's default: no lower bound
    "clip_max_and_min_none": (True, dict(vllm_importance_sampling_mode="token_mask",
                                         vllm_importance_sampling_clip_max=None,
                                         vllm_importance_sampling_clip_min=None)),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_trl_option_equals_trl(tmp_path, case):
    vllm, options = TRL_CASES[case]
    if not vllm:
        options = dict(vllm_importance_sampling_correction=False, **options)
    model_dir = _saved_model(tmp_path)
    theirs = run("trl", str(tmp_path), model_dir, vllm, options)
    ours = run("fastcov", str(tmp_path), model_dir, vllm, options)
    check(ours, theirs, case)
    if "top_entropy" in case:
        assert 0 < ours["logs"]["fastcov/high_entropy_frac"] < 1
    if case == "gspo_delta":  # the dual clip binds: without it TRL's losses differ
        unclipped = run("trl", str(tmp_path / "no_delta"), model_dir, vllm, {**options, "delta": None})
        assert unclipped["losses"] != theirs["losses"]


def test_moe_aux_loss_equals_trl(tmp_path):
    """A tiny Qwen2-MoE under TRL's default router_aux_loss_coef=None: the model's coefficient (0.05) times its
    load-balancing loss, from the fused head's decoder pass, scaled as TRL scales it; router weights train too."""
    model_dir = _saved_model(tmp_path, moe=True)
    options = dict(vllm_importance_sampling_correction=False)
    theirs = run("trl", str(tmp_path), model_dir, False, options)
    ours = run("fastcov", str(tmp_path), model_dir, False, options)
    check(ours, theirs, "moe")
    assert ours["logs"]["aux_loss"] == pytest.approx(theirs["logs"]["aux_loss"], rel=1e-6)
    assert ours["logs"]["aux_loss"] > 0
    gate = [name for name in theirs["updates"] if name.endswith("mlp.gate.weight")]
    assert gate and all(float(theirs["updates"][name].abs().max()) > 0 for name in gate), gate


def test_moe_whose_aux_loss_is_not_reproduced_is_refused():
    from fastcov.integrations.trl import router_aux_loss_function

    class Other(torch.nn.Module):
        num_experts = 4  # no num_experts_per_tok, and no load_balancing_loss_func in this module

    with pytest.raises(ValueError, match="router_aux_loss_coef") as info:
        router_aux_loss_function(Other())
    assert "\n" not in str(info.value)
    assert router_aux_loss_function(tiny_moe()) is not None


# ---------------------------------------------------------------- the default mode


def test_auto_mode_acts_under_trls_defaults(tmp_path):
    """'auto' (the default) is Clip-Cov where TRL's loss is PPO's token clip (dapo, TRL's default), which acts on-policy:
    no warning; KL-Cov on the losses without a token clip (warned where each rollout batch is one step)."""
    import warnings

    from test_integration_trl import make_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = make_args(tmp_path)
        assert (default.fastcov_loss_mode, default.fastcov_cov_mode(), default.fastcov_mode()) == \
            ("auto", "clip_cov", "clip_cov")
        assert not [w for w in caught if "KL-Cov" in str(w.message)]
        for options in (dict(loss_type="cispo"), dict(importance_sampling_level="sequence")):
            args = make_args(tmp_path, **options)
            assert args.fastcov_cov_mode() == "kl_cov" and args.fastcov_kl_cov_penalty()
        warned = [str(w.message) for w in caught if "KL-Cov" in str(w.message)]
        assert len(warned) == 2 and all("'auto'" in m and "\n" not in m for m in warned)
        reused = make_args(tmp_path, loss_type="cispo", steps_per_generation=2)  # the penalty acts: no warning
        assert reused.fastcov_kl_cov_penalty()
        assert len([w for w in caught if "KL-Cov" in str(w.message)]) == 2


@pytest.mark.parametrize("options", [
    dict(loss_type="cispo", fastcov_loss_mode="kl_cov", kl_cov_ratio=0.5),
    dict(importance_sampling_level="sequence", fastcov_loss_mode="kl_cov", kl_cov_ratio=0.5, top_entropy_quantile=0.5),
])
def test_global_scope_with_kl_cov_on_another_loss_trains(tmp_path, options):
    """fastcov_scope="global": the rollout-wide KL-Cov selection (and high-entropy mask) reach the penalty."""
    from test_integration_trl import make_trainer

    trainer = make_trainer(tmp_path, fastcov_scope="global", per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, **options)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True))
    logs = next(row for row in trainer.state.log_history if "fastcov/selected_frac" in row)
    assert 0 < logs["fastcov/selected_frac"] <= 0.5 + 1e-6
    if "top_entropy_quantile" in options:
        assert 0 < logs["fastcov/high_entropy_frac"] < 1
