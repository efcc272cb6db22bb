"""scope="microbatch" against verl 0.9.1's own core_algos.py (loaded from the wheel by file path).

The wheel sits in ../shared/gpu/wheels/ beside the repository (the CI clone has it there). Only two
files are read from it: verl/trainer/ppo/core_algos.py, loaded with small stub modules for its
verl-internal imports, and verl/utils/torch_functional.py, from which the real ``masked_sum`` and
``masked_mean`` are taken (the rest of that file needs tensordict/transformers).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastcov.covariance import token_covariance
from fastcov.losses import LossConfig, policy_loss, ppo_clipped
from fastcov.selection import select_random_in_band

REPO_ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO_ROOT.parent / "shared" / "gpu" / "wheels"
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _find_wheel() -> Path | None:
    wheels = sorted(WHEEL_DIR.glob("verl-0.9.1-*.whl"))
    return wheels[0] if wheels else None


def _installed_verl() -> Path | None:
    """An installed verl 0.9.1's package directory (``make test-verl``'s environment), found without
    importing it (importing verl pulls ray)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    version = root / "version" / "version"
    return root if version.exists() and version.read_text().strip() == "0.9.1" else None


def _functions_from_source(source: str, names: set[str], namespace: dict) -> None:
    """Execute only the top-level functions ``names`` of ``source`` into ``namespace``."""
    tree = ast.parse(source)
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in body} == names, "verl's torch_functional changed"
    exec(compile(ast.Module(body=body, type_ignores=[]), "verl/utils/torch_functional.py", "exec"), namespace)


@pytest.fixture(scope="module")
def verl_core(tmp_path_factory):
    wheel, installed = _find_wheel(), _installed_verl()
    if wheel is not None:
        root = tmp_path_factory.mktemp("verl091")
        with zipfile.ZipFile(wheel) as archive:
            core_path = Path(archive.extract("verl/trainer/ppo/core_algos.py", root))
            functional_path = Path(archive.extract("verl/utils/torch_functional.py", root))
    elif installed is not None:
        core_path = installed / "trainer" / "ppo" / "core_algos.py"
        functional_path = installed / "utils" / "torch_functional.py"
    else:
        pytest.skip(f"verl 0.9.1 is neither installed nor its wheel in {WHEEL_DIR} (the reference "
                    f"implementation); make test-verl runs this file with verl installed")

    functional = types.ModuleType("verl.utils.torch_functional")
    functional.torch = torch
    _functions_from_source(functional_path.read_text(), {"masked_sum", "masked_mean"}, functional.__dict__)

    def module(name: str, **attrs) -> types.ModuleType:
        stub = types.ModuleType(name)
        stub.__dict__.update(attrs)
        return stub

    class _Unused:  # stand-ins for config classes; core_algos only uses them in isinstance checks
        pass

    stubs = {
        "omegaconf": module("omegaconf", DictConfig=_Unused),
        "verl": module("verl"),
        "verl.utils": module("verl.utils", as_torch_index=None, group_mean_std=None, torch_functional=functional),
        "verl.utils.torch_functional": functional,
        "verl.utils.import_utils": module("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda fn: fn)),
        "verl.trainer": module("verl.trainer"),
        "verl.trainer.config": module("verl.trainer.config", AlgoConfig=_Unused),
        "verl.workers": module("verl.workers"),
        "verl.workers.config": module("verl.workers.config", ActorConfig=_Unused),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_verl091_core_algos", core_path)
        core = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return core


class _VerlConfig(SimpleNamespace):
    def get(self, key, default=None):
        return getattr(self, key, default)


def _verl_config(config: LossConfig, global_batch_info: dict | None = None) -> _VerlConfig:
    return _VerlConfig(
        clip_ratio=config.clip_low,
        clip_ratio_low=config.clip_low,
        clip_ratio_high=config.clip_high,
        clip_ratio_c=config.dual_clip_c if config.dual_clip_c is not None else 3.0,
        policy_loss=SimpleNamespace(
            clip_cov_ratio=config.clip_cov_ratio,
            clip_cov_lb=config.clip_cov_lb,
            clip_cov_ub=config.clip_cov_ub,
            kl_cov_ratio=config.kl_cov_ratio,
            ppo_kl_coef=config.kl_cov_coef,
        ),
        global_batch_info=global_batch_info or {},
    )


def _batch(seed: int, rows: int = 9, cols: int = 37, adv_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    lengths[0] = 0  # one fully masked sequence
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).to(torch.float64)
    logprob = -3.0 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    old_logprob = logprob + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    seq_adv = adv_scale * torch.randn(rows, 1, generator=g, dtype=torch.float64)
    advantages = (seq_adv + 0.5 * torch.randn(rows, cols, generator=g, dtype=torch.float64)) * mask
    return logprob, old_logprob, advantages, mask


def _loss_and_grad(fn, logprob):
    leaf = logprob.clone().requires_grad_(True)
    loss, metrics = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio", [2e-4, 0.02, 0.3])
def test_kl_cov_matches_verl(verl_core, agg, ratio):
    logprob, old_logprob, advantages, mask = _batch(seed=11)
    config = LossConfig(kl_cov_ratio=ratio, kl_cov_coef=0.7)
    ours_loss, ours_grad, metrics = _loss_and_grad(
        lambda lp: policy_loss(lp, old_logprob, advantages, mask, mode="kl_cov", agg=agg, config=config), logprob
    )
    verl_loss, verl_grad, _ = _loss_and_grad(
        lambda lp: verl_core.compute_policy_loss_kl_cov(
            old_logprob, lp, advantages, mask, loss_agg_mode=agg, config=_verl_config(config)
        ),
        logprob,
    )
    torch.testing.assert_close(ours_loss, verl_loss, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-7, atol=1e-12)
    n_valid = int(mask.sum())
    assert round(float(metrics["selected_frac"]) * n_valid) == max(1, int(ratio * n_valid))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio", [0.01, 0.08, 1.0])
def test_clip_cov_matches_verl_given_same_random_order(verl_core, agg, ratio, monkeypatch):
    """With verl's randperm replaced by the identity, verl zeroes the first candidates in row-major
    order; keys = −position make fastcov pick the same tokens, so loss and gradient must agree."""
    logprob, old_logprob, advantages, mask = _batch(seed=5, adv_scale=3.0)
    config = LossConfig(clip_cov_ratio=ratio, clip_low=0.2, clip_high=0.28)
    scores = token_covariance(logprob, advantages, mask)
    keys = -torch.arange(mask.numel(), dtype=torch.int64).reshape(mask.shape)
    exclude = ppo_clipped(logprob, old_logprob, advantages, config)
    selection = select_random_in_band(
        scores, mask, ratio, config.clip_cov_lb, config.clip_cov_ub, exclude=exclude, keys=keys
    )
    ours_loss, ours_grad, metrics = _loss_and_grad(
        lambda lp: policy_loss(
            lp, old_logprob, advantages, mask, mode="clip_cov", agg=agg, config=config, selection=selection
        ),
        logprob,
    )
    monkeypatch.setattr(torch, "randperm", lambda n, *args, **kwargs: torch.arange(n))
    verl_loss, verl_grad, verl_metrics = _loss_and_grad(
        lambda lp: verl_core.compute_policy_loss_clip_cov(
            old_logprob, lp, advantages, mask, loss_agg_mode=agg, config=_verl_config(config)
        ),
        logprob,
    )
    assert selection.sum() > 0
    torch.testing.assert_close(ours_loss, verl_loss, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(float(metrics["selected_frac"]), verl_metrics["actor/pg_clipfrac"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("ratio", [0.01, 0.08, 1.0])
def test_clip_cov_random_selection_has_verls_count_band_and_exclusion(verl_core, ratio):
    logprob, old_logprob, advantages, mask = _batch(seed=8, adv_scale=3.0)
    config = LossConfig(clip_cov_ratio=ratio, clip_low=0.2, clip_high=0.28)
    _, verl_metrics = verl_core.compute_policy_loss_clip_cov(
        old_logprob, logprob, advantages, mask, config=_verl_config(config)
    )
    n_valid = int(mask.sum())
    verl_count = round(verl_metrics["actor/pg_clipfrac"] * (n_valid + 1e-8))

    scores = token_covariance(logprob, advantages, mask)
    candidates = (
        mask.bool()
        & (scores > config.clip_cov_lb)
        & (scores < config.clip_cov_ub)
        & ~ppo_clipped(logprob, old_logprob, advantages, config)
    )
    for seed in range(3):
        selection = select_random_in_band(
            scores,
            mask,
            ratio,
            config.clip_cov_lb,
            config.clip_cov_ub,
            exclude=ppo_clipped(logprob, old_logprob, advantages, config),
            generator=torch.Generator().manual_seed(seed),
        )
        assert int(selection.sum()) == verl_count == min(max(1, int(ratio * n_valid)), int(candidates.sum()))
        assert not (selection & ~candidates).any()
        # the selection policy_loss makes itself has the same count
        _, metrics = policy_loss(
            logprob, old_logprob, advantages, mask, mode="clip_cov", config=config,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        assert round(float(metrics["selected_frac"]) * n_valid) == verl_count


@pytest.mark.parametrize("agg", AGGS)
def test_vanilla_dual_clip_matches_verl(verl_core, agg):
    logprob, old_logprob, advantages, mask = _batch(seed=3)
    noise = torch.randn(logprob.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    old_logprob = logprob - 1.5 * noise  # ratios beyond 3: the dual clip is active on some A < 0 tokens
    config = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    ours = _loss_and_grad(
        lambda lp: policy_loss(lp, old_logprob, advantages, mask, mode="vanilla", agg=agg, config=config), logprob
    )
    theirs = _loss_and_grad(
        lambda lp: verl_core.compute_policy_loss_vanilla(
            old_logprob, lp, advantages, mask, loss_agg_mode=agg, config=_verl_config(config)
        ),
        logprob,
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(float(ours[2]["clipfrac"]), theirs[2]["actor/pg_clipfrac"], rtol=1e-6, atol=0)


def test_global_tokens_equals_verls_batch_num_tokens(verl_core):
    logprob, old_logprob, advantages, mask = _batch(seed=21)
    config = LossConfig(kl_cov_ratio=0.05)
    batch_num_tokens = 3 * int(mask.sum())  # as if this micro-batch were a third of the mini-batch
    ours = _loss_and_grad(
        lambda lp: policy_loss(
            lp, old_logprob, advantages, mask, mode="kl_cov", config=config, global_tokens=batch_num_tokens
        ),
        logprob,
    )
    theirs = _loss_and_grad(
        lambda lp: verl_core.compute_policy_loss_kl_cov(
            old_logprob,
            lp,
            advantages,
            mask,
            config=_verl_config(config, {"dp_size": 1, "batch_num_tokens": batch_num_tokens}),
        ),
        logprob,
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("mode", ["kl_cov", "vanilla"])
@pytest.mark.parametrize("factor", [None, 512, 7.5])
def test_loss_scale_factor_as_verls(verl_core, mode, factor):
    """seq-mean-token-sum-norm divides by loss_scale_factor (verl: global_batch_info), else by the padded length."""
    logprob, old_logprob, advantages, mask = _batch(seed=13)
    config = LossConfig(kl_cov_ratio=0.05, dual_clip_c=3.0 if mode == "vanilla" else None, loss_scale_factor=factor)
    agg = "seq-mean-token-sum-norm"
    ours = _loss_and_grad(
        lambda lp: policy_loss(lp, old_logprob, advantages, mask, mode=mode, agg=agg, config=config), logprob
    )
    verl_fn = getattr(verl_core, f"compute_policy_loss_{mode}")
    theirs = _loss_and_grad(
        lambda lp: verl_fn(old_logprob, lp, advantages, mask, loss_agg_mode=agg,
                           config=_verl_config(config, {"loss_scale_factor": factor})),
        logprob,
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-7, atol=1e-12)
