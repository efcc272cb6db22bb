"""algo.rollout_correction and the CISPO / GSPO / SAPO modes in the trainer (CPU, the tiny config).

The weights come from each sequence's ``old_logprob`` against its ``sample_logprob`` (``train.correct_rollouts``)
and multiply the per-token loss of every mode (``update_policy``); they do not move Clip-Cov/KL-Cov's selection.
1 rank against 2 under global scope with the correction on: tests/trainer/loop/test_trainer_global_scope.py.
"""

import math
import random

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _fixtures

from fastcov.correction import rollout_correction
from fastcov.trainer import train as train_mod
from fastcov.trainer.config import ConfigError
from fastcov.trainer.controls import rollout_correction_enabled
from fastcov.trainer.runtime.batch import Sequence
from fastcov.trainer.runtime.run_dir import read_metrics


def tiny(tmp_path, *overrides):  # the shared one, into <tmp_path>/run
    return _fixtures.tiny(tmp_path, "run", *overrides)


def test_default_is_off_for_the_hf_engine_and_on_for_vllm(tmp_path):
    assert not rollout_correction_enabled(tiny(tmp_path))
    cfg = tiny(tmp_path)
    cfg.rollout.engine = "vllm"
    assert rollout_correction_enabled(cfg)
    cfg.algo.rollout_correction.enabled = False
    assert not rollout_correction_enabled(cfg)
    assert rollout_correction_enabled(tiny(tmp_path, "algo.rollout_correction.enabled=true"))


@pytest.mark.parametrize("overrides, key", [
    (["algo.rollout_correction.clip_max=0"], "algo.rollout_correction.clip_max"),
    (["algo.rollout_correction.clip_min=3.0"], "algo.rollout_correction.clip_min"),
    (["algo.rollout_correction.level=seq"], "algo.rollout_correction.level"),
    (["algo.rollout_correction.rejection=token_k1"], "algo.rollout_correction.rejection_threshold"),
    (["algo.rollout_correction.rejection=token_k9", "algo.rollout_correction.rejection_threshold=2"],
     "algo.rollout_correction.rejection"),
    (["algo.rollout_correction.rejection=token_k2", "algo.rollout_correction.rejection_threshold=0.1_0.2"],
     "algo.rollout_correction.rejection_threshold"),
    (["algo.rollout_correction.off_policy_mask_threshold=-1"], "algo.rollout_correction.off_policy_mask_threshold"),
    (["algo.mode=cispo", "algo.loss.dual_clip_c=3"], "algo.loss.dual_clip_c"),
    (["algo.mode=cispo", "algo.loss.cispo_clip_max=0"], "algo.loss.cispo_clip_max"),
    (["algo.mode=sapo", "algo.loss.sapo_tau_neg=-1"], "algo.loss.sapo_tau_neg"),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        tiny(tmp_path, *overrides)
    assert str(info.value).startswith(key + ":") and "\n" not in str(info.value)


def test_dual_clip_is_accepted_with_gspo(tmp_path):
    """GSPO's loss is PPO's clip of the sequence ratio, so its dual clip (TRL's delta) applies (mode gspo)."""
    assert tiny(tmp_path, "algo.mode=gspo", "algo.loss.dual_clip_c=3").algo.loss.dual_clip_c == 3.0


def _sequences(seed=0, groups=3, n=4):
    rng = random.Random(seed)
    seqs = []
    for g in range(groups):
        for _ in range(n):
            k = rng.randint(1, 9)
            old = [-rng.random() * 3 for _ in range(k)]
            seqs.append(Sequence([5, 6], [7] * k, [x + rng.gauss(0, 0.15) for x in old], g,
                                 advantage=rng.gauss(0, 1), old_logprob=old))
    return seqs


def test_correct_rollouts_stores_the_librarys_weights_and_logs_verls_metrics(tmp_path):
    cfg = tiny(tmp_path, "algo.rollout_correction.enabled=true", "algo.rollout_correction.level=sequence",
               "algo.rollout_correction.mode=mask", "algo.rollout_correction.clip_max=1.2",
               "algo.rollout_correction.clip_min=0.8", "algo.rollout_correction.rejection=token_k1",
               "algo.rollout_correction.rejection_threshold=1.3",
               "algo.rollout_correction.off_policy_mask_threshold=0.05")
    seqs = _sequences()
    metrics = train_mod.correct_rollouts(seqs, cfg, torch.device("cpu"))
    width = max(len(s.response) for s in seqs)
    old = torch.zeros(len(seqs), width, dtype=torch.float64)
    sampled = torch.zeros_like(old)
    mask = torch.zeros_like(old, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s.response)
        old[i, :n], sampled[i, :n], mask[i, :n] = torch.tensor(s.old_logprob), torch.tensor(s.sample_logprob), True
    expected, _ = rollout_correction(old - sampled, mask, level="sequence", mode="mask", clip_max=1.2, clip_min=0.8)
    expected *= ((old - sampled).abs() <= math.log(1.3)) & mask  # token_k1 at 1.3
    seq_kl = ((sampled - old) * mask).sum(-1) / mask.sum(-1)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    expected *= ((adv >= 0) | (seq_kl <= 0.05))[:, None]
    for i, s in enumerate(seqs):
        torch.testing.assert_close(torch.tensor(s.rollout_weight, dtype=torch.float64),
                                   expected[i, : len(s.response)], rtol=1e-6, atol=1e-7)
    assert 0 < sum(w == 0 for s in seqs for w in s.rollout_weight) < sum(len(s.response) for s in seqs)
    for key in ("rollout_is_mean", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction", "kl", "k3_kl",
                "chi2_token", "chi2_seq", "ppl_ratio", "off_policy_masked_fraction", "rollout_is_oob_ratio"):
        assert math.isfinite(metrics[f"rollout_corr/{key}"]), key


@pytest.mark.parametrize("mode", ["cispo", "sapo", "gspo", "vespo"])
def test_a_step_of_each_mode_with_the_correction_logs_finite_metrics(tmp_path, mode, varied_rewards):
    cfg = tiny(tmp_path, f"algo.mode={mode}", "trainer.max_steps=1", "trainer.eval_every=0",
               "algo.rollout_correction.enabled=true", "algo.rollout_correction.rejection=seq_mean_k3",
               "algo.rollout_correction.rejection_threshold=0.01", "algo.loss.high_entropy_fraction=0.5")
    assert cfg.trainer.packing  # the sequence modes (gspo, vespo) run on packed rows
    last = read_metrics(train_mod.train(cfg) / "metrics.jsonl")[-1]
    corr = {k: v for k, v in last.items() if k.startswith("rollout_corr/")}
    assert len(corr) > 20 and all(math.isfinite(v) for v in corr.values())
    # the HF engine samples from the policy itself: its weights are 1 up to rounding
    assert abs(corr["rollout_corr/rollout_is_mean"] - 1) < 1e-3 and corr["rollout_corr/kl"] < 1e-3
    assert math.isfinite(last["loss"]) and last["applied_steps"] >= 1
