"""TRL's rollout-correction options in FastcovGRPOTrainer against TRL 1.16's own GRPOTrainer, end to end.

The vLLM importance-sampling correction (each of the four ``vllm_importance_sampling_mode``s), sequence-level
importance sampling (GSPO), loss_type cispo / sapo / luspo / vespo (cispo and sapo also at sequence level),
``off_policy_mask_threshold`` and
``use_bias_correction_kl``: the same tiny model trained by both trainers for a few plain-SGD steps gives the same
loss at every step and the same update of every parameter. There is no vLLM here: generation is TRL's own
(transformers) path with the sampler's per-token log-probs returned beside the completions, as vLLM returns them,
and ``use_vllm`` set on the trainer after construction. ``steps_per_generation=2`` with one micro-batch per step
makes the second step of each rollout off-policy (its ratios are not 1). Both trainers run, and are compared, by
tests/_trl_harness.py; one config on 2 processes: tests/integrations/e2e/test_integration_trl_correction_e2e.py.
"""

import pytest
import torch
from _trl_harness import check, run, tiny_model

pytest.importorskip("trl")
pytest.importorskip("datasets")


IS_BOUNDS = {"token": dict(vllm_importance_sampling_clip_max=1.04, vllm_importance_sampling_clip_min=0.96),
             "sequence": dict(vllm_importance_sampling_clip_max=1.2, vllm_importance_sampling_clip_min=0.8)}
CASES = {
    **{f"is_{mode}": (True, dict(vllm_importance_sampling_mode=mode, **IS_BOUNDS[mode.split("_")[0]]))
       for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")},
    # GSPO (with the token-level vLLM ratio: TRL's gradient takes each row's mean weight)
    "gspo": (True, dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-3, epsilon_high=4e-3,
                        vllm_importance_sampling_mode="token_truncate", **IS_BOUNDS["token"])),
    "cispo": (False, dict(loss_type="cispo", epsilon_high=1.002)),
    "sapo": (False, dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=5.0)),
    # at sequence level, with the token-level vLLM ratio (SAPO's gradient takes each row's mean weight, CISPO's not)
    "cispo_sequence": (True, dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.002,
                                  vllm_importance_sampling_mode="token_truncate", **IS_BOUNDS["token"])),
    "sapo_sequence": (True, dict(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=2.0,
                                 sapo_temperature_neg=5.0, vllm_importance_sampling_mode="token_truncate",
                                 **IS_BOUNDS["token"])),
    # VESPO folds the vLLM ratio into its sequence ratio (a masked token's ratio counts as 1e-8, which zeroes its
    # sequence's weight: wider bounds leave some sequences to train), and takes the off-policy mask
    "vespo": (True, dict(loss_type="vespo", vespo_k_neg=4.0, vespo_lambda_pos=2.5, off_policy_mask_threshold=0.01,
                         vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.07,
                         vllm_importance_sampling_clip_min=0.93)),
    "vespo_truncate": (True, dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                                  **IS_BOUNDS["token"], beta=0.05)),  # and the bias-corrected KL
    # LUSPO sums each sequence's tokens: a smaller step keeps its updates the size of the others'
    "luspo": (False, dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-3, learning_rate=0.1,
                          beta=0.05)),  # and TRL's bias-corrected KL with the sequence ratio
    # the off-policy mask reads the sampler's log-probs (no vLLM correction); a threshold some sequences exceed
    "off_policy_mask": (False, dict(off_policy_mask_threshold=0.01, loss_type="dapo")),
    "bias_correction_kl": (False, dict(beta=0.1, use_bias_correction_kl=True, loss_type="bnpo")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_correction_option_equals_trl(tmp_path, case):
    vllm, options = CASES[case]
    if not vllm:
        options = dict(vllm_importance_sampling_correction=False, **options)
    model_dir = str(tmp_path / "model")  # a path: TRL loads the reference model (beta > 0) from it
    tiny_model().save_pretrained(model_dir)
    theirs = run("trl", str(tmp_path), model_dir, vllm, options)
    ours = run("fastcov", str(tmp_path), model_dir, vllm, options)
    check(ours, theirs, case)
    if case.startswith("is_"):  # the bounds really act on this rollout
        low, high = (options[f"vllm_importance_sampling_clip_{k}"] for k in ("min", "max"))
        seen = theirs["logs"]
        if case.endswith("mask"):
            assert seen["sampling/importance_sampling_ratio/min"] == 0.0, seen
        else:
            assert seen["sampling/importance_sampling_ratio/min"] == pytest.approx(low) or \
                seen["sampling/importance_sampling_ratio/max"] == pytest.approx(high), seen
        assert "fastcov/rollout_is_mean" in ours["logs"]
    if case == "vespo":  # some tokens' ratios are masked (their sequences' weights fall to ~0), not all
        assert theirs["logs"]["sampling/importance_sampling_ratio/min"] == 0.0, theirs["logs"]
    if case == "off_policy_mask":
        assert ours["logs"]["fastcov/off_policy_masked_fraction"] >= 0.0


def _mutated_policy_loss(real, mutation: str):
    """fastcov's ``policy_loss`` with one real mistake in what it is given: a sign, a token off the mask."""

    def mutated(logprob, old_logprob, advantages, mask, **kwargs):
        if mutation == "sign":  # the first completion's advantage with the wrong sign
            advantages = torch.cat([-advantages[:1], advantages[1:]])
        elif mutation == "mask":  # the first completion's last token left out
            last = int(mask[0].nonzero().max())
            mask = mask.clone()
            mask[0, last] = 0
        return real(logprob, old_logprob, advantages, mask, **kwargs)

    return mutated


def test_a_mutated_loss_fails_the_comparison(tmp_path):
    """The tolerance that passes the comparison above is tight enough to catch a real mistake: VESPO (the case
    whose terms cancel most) with one advantage's sign flipped, one token off the mask, or the β·KL term dropped."""
    import fastcov.integrations.trl.trainer as fastcov_trl  # where the trainer looks its loss functions up

    vllm, options = CASES["vespo_truncate"]
    model_dir = str(tmp_path / "model")
    tiny_model().save_pretrained(model_dir)
    theirs = run("trl", str(tmp_path), model_dir, vllm, options)
    real_aggregate = fastcov_trl.aggregate_loss  # in the TRL integration only the β·KL term goes through it
    for mutation in ("sign", "mask", "no_kl"):
        with pytest.MonkeyPatch.context() as patch:
            if mutation == "no_kl":
                patch.setattr(fastcov_trl, "aggregate_loss", lambda v, *a, **k: 0 * real_aggregate(v, *a, **k))
            else:
                patch.setattr(fastcov_trl, "policy_loss", _mutated_policy_loss(fastcov_trl.policy_loss, mutation))
            ours = run("fastcov", str(tmp_path), model_dir, vllm, options)
        with pytest.raises(AssertionError):
            check(ours, theirs, mutation)


# ---------------------------------------------------------------- the options' checks


@pytest.mark.parametrize("overrides,option", [
    (dict(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_mask"),
     "vllm_importance_sampling_mode"),
    (dict(loss_type="sapo", fastcov_loss_mode="clip_cov"), "fastcov_loss_mode"),
    (dict(use_vllm=True, vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode"),
    (dict(use_vllm=True, vllm_importance_sampling_clip_min=4.0), "vllm_importance_sampling_clip_min"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
])
def test_bad_correction_config_names_the_option(tmp_path, overrides, option):
    from test_integration_trl import make_args

    overrides.setdefault("fastcov_loss_mode", "vanilla")
    with pytest.raises(ValueError, match=option) as info:
        make_args(tmp_path, **overrides)
    assert "\n" not in str(info.value)


def test_trl_options_pick_the_mode(tmp_path):
    from test_integration_trl import make_args

    vllm = make_args(tmp_path, use_vllm=True, fastcov_loss_mode="kl_cov", kl_cov_ratio=0.5,
                     steps_per_generation=2, gradient_accumulation_steps=1)  # TRL's default correction: accepted
    assert vllm.vllm_importance_sampling_correction and vllm.fastcov_mode() == "kl_cov"
    cispo = make_args(tmp_path, loss_type="cispo", fastcov_loss_mode="vanilla", epsilon_high=4.0, delta=2.0)
    assert cispo.fastcov_mode() == "cispo" and cispo.fastcov_loss_config().cispo_clip_max == 4.0
    assert cispo.fastcov_loss_config().dual_clip_c is None  # TRL ignores delta for CISPO
    sapo = make_args(tmp_path, loss_type="sapo", fastcov_loss_mode="vanilla", sapo_temperature_neg=3.0)
    assert sapo.fastcov_mode() == "sapo" and sapo.fastcov_loss_config().sapo_tau_neg == 3.0
    gspo = make_args(tmp_path, importance_sampling_level="sequence", fastcov_loss_mode="vanilla")
    assert gspo.fastcov_mode() == "gspo"
    for loss_type, mode in (("cispo", "cispo_seq"), ("sapo", "sapo_seq"), ("vespo", "vespo")):
        seq = make_args(tmp_path, loss_type=loss_type, importance_sampling_level="sequence", fastcov_loss_mode="vanilla",
                        delta=2.0)  # TRL ignores delta for these loss types
        assert seq.fastcov_mode() == mode and seq.fastcov_loss_config().dual_clip_c is None
    vespo = make_args(tmp_path, loss_type="vespo", fastcov_loss_mode="vanilla", vespo_k_pos=1.5, vespo_lambda_neg=4.0)
    assert (vespo.fastcov_loss_config().vespo_k_pos, vespo.fastcov_loss_config().vespo_lambda_neg) == (1.5, 4.0)
