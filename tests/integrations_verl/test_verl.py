"""fastcov inside verl (run by `make test-verl` in .venv-verl, which has verl 0.9.1; skipped elsewhere).

Every registered loss is compared with verl's own loss of the same name on the same inputs and the same
``ActorConfig``, for every ``loss_agg_mode`` verl accepts and several ``global_batch_info`` settings (what verl's
``ppo_loss`` fills in: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).
"""

import ast
import inspect
import subprocess
import sys

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is installed only in .venv-verl (make test-verl)")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.config import actor as verl_actor_config  # noqa: E402

from fastcov import linear_logprob_entropy  # noqa: E402
from fastcov.covariance import token_covariance  # noqa: E402
from fastcov.integrations import verl as fastcov_verl  # noqa: E402
from fastcov.losses import LossConfig, ppo_clipped  # noqa: E402
from fastcov.selection import draw_seed, random_keys  # noqa: E402


def _verl_agg_modes() -> list[str]:
    """The list ``valid_loss_agg_modes`` in verl's ActorConfig, read from its source."""
    tree = ast.parse(inspect.getsource(verl_actor_config))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "valid_loss_agg_modes" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    raise AssertionError("verl's ActorConfig has no valid_loss_agg_modes list any more")


AGGS = _verl_agg_modes()
# what verl's ppo_loss puts into config.global_batch_info before calling the policy loss
BATCH_INFOS = {
    "legacy-empty": {},
    "one-rank": {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None},
    "factor-512": {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": 512},
    "microbatch-of-3": {"dp_size": 1, "batch_num_tokens": 700, "global_batch_size": 27, "loss_scale_factor": 100},
    "dp-2": {"dp_size": 2, "batch_num_tokens": 1400, "global_batch_size": 54, "loss_scale_factor": 64},
}


def test_verl_has_the_aggregations_we_cover():
    assert set(AGGS) == {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                         "seq-mean-token-sum-norm"}


def test_verl_finds_the_losses_through_its_plugin_entry_point():
    code = ("import verl; from verl.trainer.ppo.core_algos import get_policy_loss_fn as g; "
            "print(*[g(n).__name__ for n in ('fastcov_kl_cov', 'fastcov_clip_cov', 'fastcov_clip_cov_dual_clip', "
            "'fastcov_vanilla')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["fastcov_kl_cov", "fastcov_clip_cov", "fastcov_clip_cov_dual_clip", "fastcov_vanilla"]


def _config(agg, info, **policy):
    policy_cfg = dict(clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=2.0, kl_cov_ratio=0.05, ppo_kl_coef=0.5)
    policy_cfg.update(policy)
    config = ActorConfig(strategy="fsdp", loss_agg_mode=agg, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                         rollout_n=1, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         policy_loss=PolicyLossConfig(**policy_cfg))
    config.global_batch_info.update(info)
    return config


def _batch(seed=0, rows=9, cols=48, spread=0.3):
    """fp64 batch: variable lengths, one empty row, padding filled with garbage, ratios up to e^(±3·spread·...)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, cols + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = torch.arange(cols)[None] < lengths[:, None]
    logprob = -3 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old = logprob + spread * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64) + 0.5 * torch.randn(rows, cols, generator=g,
                                                                                      dtype=torch.float64)
    adv = torch.where(mask, adv, 7.0)
    old = torch.where(mask, old, -50.0)
    return logprob, old, adv, mask


def _run(fn, logprob, old, adv, mask, agg, config, **kwargs):
    leaf = logprob.clone().requires_grad_(True)
    loss, metrics = fn(old, leaf, adv, mask, agg, config, **kwargs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


def _assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-15)
    for key, value in theirs[2].items():  # verl's metrics, same names and values
        assert ours[2][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key  # verl counts in fp32


def _same_order_randperm(logprob, old, adv, mask, config, generator_seed):
    """A torch.randperm for verl's clip_cov that orders its candidates (row-major, as verl lists them) by the
    random keys fastcov draws after torch.manual_seed(generator_seed): both then zero the same tokens."""
    cfg = fastcov_verl.loss_config_from_verl(config)
    torch.manual_seed(generator_seed)
    keys = random_keys(mask.shape, mask.device, draw_seed(None, mask.device))
    scores = token_covariance(logprob, adv, mask)
    candidates = (mask & (scores > cfg.clip_cov_lb) & (scores < cfg.clip_cov_ub)
                  & ~ppo_clipped(logprob, old, adv, cfg))
    order = torch.argsort(-keys[candidates], stable=True)

    def randperm(n, *args, **kwargs):
        assert n == int(candidates.sum()), "verl and fastcov disagree on the Clip-Cov candidates"
        return order.clone()

    return randperm, candidates, keys


@pytest.mark.parametrize("info", list(BATCH_INFOS), ids=list(BATCH_INFOS))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,verl_name", [("fastcov_vanilla", "vanilla"), ("fastcov_kl_cov", "kl_cov")])
def test_registered_loss_equals_verls_own(name, verl_name, agg, info):
    logprob, old, adv, mask = _batch(seed=3, spread=1.5)  # ratios beyond clip_ratio_c on some A < 0 tokens
    config = _config(agg, BATCH_INFOS[info])
    ours = _run(core_algos.get_policy_loss_fn(name), logprob, old, adv, mask, agg, config)
    theirs = _run(core_algos.get_policy_loss_fn(verl_name), logprob, old, adv, mask, agg, config)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("info", list(BATCH_INFOS), ids=list(BATCH_INFOS))
@pytest.mark.parametrize("agg", AGGS)
def test_clip_cov_equals_verls_own_with_the_same_random_order(agg, info, monkeypatch):
    logprob, old, adv, mask = _batch(seed=5, spread=1.5)
    config = _config(agg, BATCH_INFOS[info], clip_cov_ratio=0.08)
    randperm, candidates, _ = _same_order_randperm(logprob, old, adv, mask, config, generator_seed=11)
    # dual clip active on some candidates' neighbours: the loss would differ if fastcov_clip_cov applied it
    ratio = torch.exp(logprob - old)
    assert bool(((adv < 0) & (ratio > 3.0) & mask).any()) and int(candidates.sum()) > 3
    torch.manual_seed(11)
    ours = _run(core_algos.get_policy_loss_fn("fastcov_clip_cov"), logprob, old, adv, mask, agg, config)
    monkeypatch.setattr(torch, "randperm", randperm)
    theirs = _run(core_algos.get_policy_loss_fn("clip_cov"), logprob, old, adv, mask, agg, config)
    _assert_same(ours, theirs)
    assert ours[2]["actor/fastcov/selected_frac"] == pytest.approx(theirs[2]["actor/pg_clipfrac"])


@pytest.mark.parametrize("agg", AGGS)
def test_clip_cov_dual_clip_is_clip_cov_plus_verls_dual_clip(agg, monkeypatch):
    logprob, old, adv, mask = _batch(seed=5, spread=1.5)
    config = _config(agg, BATCH_INFOS["factor-512"], clip_cov_ratio=0.08)
    randperm, candidates, keys = _same_order_randperm(logprob, old, adv, mask, config, generator_seed=4)
    torch.manual_seed(4)
    ours = _run(core_algos.get_policy_loss_fn("fastcov_clip_cov_dual_clip"), logprob, old, adv, mask, agg, config)
    # the same tokens zeroed as verl's clip_cov (identical random order), then verl's vanilla dual clip
    cfg = fastcov_verl.loss_config_from_verl(config)
    k = min(max(1, int(cfg.clip_cov_ratio * int(mask.sum()))), int(candidates.sum()))
    order = torch.argsort(torch.where(candidates, -keys, torch.iinfo(torch.int64).max).flatten(), stable=True)
    selected = torch.zeros(mask.numel(), dtype=torch.bool)
    selected[order[:k]] = True
    selected = selected.view(mask.shape)

    def expected(leaf):
        ratio = torch.exp(leaf - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * 3.0), loss) * (~selected)
        return core_algos.agg_loss(loss, mask, agg, **config.global_batch_info)

    leaf = logprob.clone().requires_grad_(True)
    ref = expected(leaf)
    (ref_grad,) = torch.autograd.grad(ref, leaf)
    torch.testing.assert_close(ours[0], ref.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours[1], ref_grad, rtol=1e-12, atol=1e-15)
    monkeypatch.setattr(torch, "randperm", randperm)
    plain = _run(core_algos.get_policy_loss_fn("clip_cov"), logprob, old, adv, mask, agg, config)
    assert abs(float(plain[0] - ours[0])) > 1e-6  # the dual clip changes this batch's loss
    assert ours[2]["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("name,verl_name", [("fastcov_vanilla", "vanilla"), ("fastcov_kl_cov", "kl_cov"),
                                            ("fastcov_clip_cov", "clip_cov")])
def test_rollout_correction_weights_as_verl(name, verl_name, monkeypatch):
    logprob, old, adv, mask = _batch(seed=8)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    config = _config("seq-mean-token-sum-norm", BATCH_INFOS["factor-512"])
    torch.manual_seed(0)
    ours = _run(core_algos.get_policy_loss_fn(name), logprob, old, adv, mask, "seq-mean-token-sum-norm", config,
                rollout_is_weights=weights)
    if verl_name == "clip_cov":
        monkeypatch.setattr(torch, "randperm", _same_order_randperm(logprob, old, adv, mask, config, 0)[0])
    theirs = _run(core_algos.get_policy_loss_fn(verl_name), logprob, old, adv, mask, "seq-mean-token-sum-norm",
                  config, rollout_is_weights=weights)
    _assert_same(ours, theirs)


def test_issue_18_case_loss_scale_factor_512():
    """seq-mean-token-sum-norm with loss_scale_factor 512 on responses of length 48 divides by 512, not 48."""
    logprob, old, adv, mask = _batch(seed=1)
    config = _config("seq-mean-token-sum-norm", BATCH_INFOS["factor-512"])
    ours, _ = core_algos.get_policy_loss_fn("fastcov_kl_cov")(old, logprob, adv, mask, "seq-mean-token-sum-norm",
                                                               config)
    theirs, _ = core_algos.get_policy_loss_fn("kl_cov")(old, logprob, adv, mask, "seq-mean-token-sum-norm", config)
    config.global_batch_info["loss_scale_factor"] = None
    by_length, _ = core_algos.get_policy_loss_fn("fastcov_kl_cov")(old, logprob, adv, mask,
                                                                    "seq-mean-token-sum-norm", config)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours * 512, by_length * 48)


def test_config_mapping():
    config = _config("token-mean", {})
    assert fastcov_verl.loss_config_from_verl(config).dual_clip_c is None
    assert fastcov_verl.loss_config_from_verl(config, dual_clip=True).dual_clip_c == 3.0
    mapped = fastcov_verl.loss_config_from_verl(config)
    assert (mapped.clip_low, mapped.clip_high, mapped.kl_cov_coef, mapped.clip_cov_ratio) == (0.2, 0.28, 0.5, 0.05)
    assert isinstance(mapped, LossConfig)


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
