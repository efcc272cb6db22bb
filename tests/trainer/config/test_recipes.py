"""The paper-reproduction recipes load, validate and carry the paper's hyperparameters (docs/design.md §6)."""

import pathlib

import pytest

from fastcov.trainer.config import ConfigError, load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"
RECIPES = {
    "qwen2.5-7b-grpo": ("vanilla", 5e-7),
    "qwen2.5-7b-clip-cov": ("clip_cov", 5e-7),
    "qwen2.5-7b-kl-cov": ("kl_cov", 5e-7),
    "qwen2.5-32b-grpo": ("vanilla", 1e-6),
    "qwen2.5-32b-kl-cov": ("kl_cov", 1e-6),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_matches_the_paper(name):
    cfg = load_config(CONFIGS / f"{name}.yaml", ["model.path=/models/x", "data.train_files=[/d/train.parquet]"])
    mode, lr = RECIPES[name]
    assert cfg.algo.mode == mode and cfg.optim.lr == lr
    assert cfg.model.path == "/models/x" and cfg.data.train_files == ["/d/train.parquet"]
    assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.algo.mini_batches) == (256, 8, 8)
    assert cfg.rollout.max_new_tokens == 8192 and cfg.rollout.temperature == 1.0
    assert cfg.algo.loss_agg == "token-mean" and cfg.algo.loss.entropy_coef == 0 and cfg.optim.grad_clip == 1.0
    assert cfg.algo.scope == "global" and cfg.trainer.zero_stage == 3
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm_tensor_parallel_size == 2
    if mode == "clip_cov":
        assert (cfg.algo.loss.clip_cov_ratio, cfg.algo.loss.clip_cov_lb, cfg.algo.loss.clip_cov_ub) == (2e-4, 1.0, 5.0)
        assert cfg.algo.loss.clip_low == cfg.algo.loss.clip_high == 1.0
    if mode == "kl_cov":
        assert cfg.algo.loss.kl_cov_ratio == (2e-3 if "7b" in name else 2e-4) and cfg.algo.loss.kl_cov_coef == 1.0


def test_recipe_overrides_are_validated():
    with pytest.raises(ConfigError, match="algo.loss.kl_cov_ratio"):
        load_config(CONFIGS / "qwen2.5-7b-kl-cov.yaml", ["algo.loss.kl_cov_ratio=-1"])
