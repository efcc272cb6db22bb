"""fastcov inside verl (run by `make test-verl` in .venv-verl, which has verl 0.9.1; skipped elsewhere)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is installed only in .venv-verl (make test-verl)")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from fastcov import LossConfig, linear_logprob_entropy, policy_loss  # noqa: E402
from fastcov.integrations import verl as fastcov_verl  # noqa: E402


def test_verl_finds_the_losses_through_its_plugin_entry_point():
    code = ("import verl; from verl.trainer.ppo.core_algos import get_policy_loss_fn; "
            "print(get_policy_loss_fn('fastcov_kl_cov').__name__, get_policy_loss_fn('fastcov_clip_cov').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["fastcov_kl_cov", "fastcov_clip_cov"]


def _verl_config(**policy):
    policy_loss_cfg = SimpleNamespace(clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=2.0, kl_cov_ratio=0.05,
                                      ppo_kl_coef=0.5, **policy)
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                           policy_loss=policy_loss_cfg, global_batch_info={})


def _batch(seed=0, rows=6, cols=20):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(cols)[None] < torch.randint(3, cols + 1, (rows, 1), generator=g)).float()
    logprob = (-3 * torch.rand(rows, cols, generator=g, dtype=torch.float64)).requires_grad_()
    old = logprob.detach() + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols) * mask
    return logprob, old, adv.contiguous(), mask


@pytest.mark.parametrize("name,mode", [("fastcov_vanilla", "vanilla"), ("fastcov_kl_cov", "kl_cov")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_registered_losses_equal_fastcov_direct_calls(name, mode, agg):
    fn = core_algos.get_policy_loss_fn(name)
    config = _verl_config()
    logprob, old, adv, mask = _batch()
    loss, metrics = fn(old, logprob, adv, mask, agg, config)
    (grad,) = torch.autograd.grad(loss, logprob)
    direct_cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_cov_ratio=0.05, kl_cov_coef=0.5,
                            clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=2.0)
    direct, _ = policy_loss(logprob, old, adv, mask, mode=mode, agg=agg, scope="global", config=direct_cfg,
                            global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum())
    (direct_grad,) = torch.autograd.grad(direct, logprob)
    torch.testing.assert_close(loss, direct)
    torch.testing.assert_close(grad, direct_grad)
    assert all(k.startswith("actor/") and isinstance(v, float) for k, v in metrics.items())


def test_kl_cov_equals_verls_own_on_one_process():
    """One process, one call: fastcov's global scope and verl's kl_cov select the same tokens."""
    config = _verl_config()
    config.policy_loss.loss_mode = "kl_cov"
    logprob, old, adv, mask = _batch(seed=3)
    ours, _ = core_algos.get_policy_loss_fn("fastcov_kl_cov")(old, logprob, adv, mask, "token-mean", config)
    theirs, _ = core_algos.get_policy_loss_fn("kl_cov")(old, logprob, adv, mask, "token-mean", config)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy_drop_in(reduction):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 16, generator=g).requires_grad_()
    weight = torch.randn(101, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 101, (3, 7), generator=g)
    logprobs, entropy = fastcov_verl.linear_cross_entropy(hidden, weight, labels, 0.8, reduction)
    ref = linear_logprob_entropy(hidden, weight, labels, temperature=0.8)
    expected = {"none": ref.logprob, "sum": ref.logprob.sum(), "mean": ref.logprob.mean()}[reduction]
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, ref.entropy)
    with pytest.raises(ValueError, match="reduction"):
        fastcov_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "max")
