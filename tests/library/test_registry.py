"""One registry for what users extend by name; the trainer's config asks it, so a mode registered in a
module listed under trainer.imports trains from YAML like a built-in one."""

import sys
import textwrap

import pytest

from fastcov.registry import Registry

pytest.importorskip("yaml")
from _fixtures import TINY  # noqa: E402


def test_registry_add_get_check():
    reg = Registry("widget")
    reg.add("a", 1)

    @reg.register("b")
    def b():
        return 2

    assert reg.get("b") is b and reg.names() == ("a", "b") and "a" in reg and len(reg) == 2
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", 3)
    reg.add("a", 3, override=True)
    with pytest.raises(ValueError, match=r"widget must be one of \('a', 'b'\), got 'c'"):
        reg.get("c")
    with pytest.raises(TypeError, match="non-empty str"):
        reg.add("", 1)


def test_losses_advantages_and_reward_tasks_share_it():
    from fastcov.advantages import ESTIMATORS
    from fastcov.losses import MODES
    from fastcov.trainer.rewards import REWARD_TASKS

    assert {"vanilla", "clip_cov", "kl_cov"} <= set(MODES.names())
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ESTIMATORS.names())
    assert {"math", "code"} <= set(REWARD_TASKS.names())
    assert all(isinstance(r, Registry) for r in (MODES, ESTIMATORS, REWARD_TASKS))


def test_a_user_registered_mode_trains_from_yaml(tmp_path, monkeypatch):
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.run_dir import read_metrics

    (tmp_path / "my_losses.py").write_text(textwrap.dedent('''
        from fastcov.losses import register, vanilla_loss

        CALLS = []

        @register("half_vanilla", override=True)
        def half_vanilla(logprob, old_logprob, advantages, selected, config):
            CALLS.append(logprob.shape)
            return 0.5 * vanilla_loss(logprob, old_logprob, advantages, selected, config)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(TINY, [f"trainer.run_dir={tmp_path / 'run'}", "reward.sandbox=inline",
                                            "trainer.imports=[my_losses]", "algo.mode=half_vanilla",
                                            "trainer.max_steps=1", "trainer.eval_every=0"])
    run = train_mod.train(cfg)
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 1
    assert sys.modules["my_losses"].CALLS, "the registered loss was used"


@pytest.mark.parametrize("override,match", [
    ("algo.mode=kl_cvo", r"algo.mode: unknown mode 'kl_cvo' \(did you mean 'kl_cov'\?\); registered: .*vanilla"),
    ("algo.adv_estimator=grop", r"algo.adv_estimator: unknown advantage estimator 'grop' \(did you mean 'grpo'\?\)"),
    ("reward.task=maths", r"reward.task: unknown reward task 'maths' \(did you mean 'math'\?\)"),
    ("trainer.imports=[no_such_module_x]", r"trainer.imports\[0\]: cannot import 'no_such_module_x'"),
])
def test_unknown_names_are_one_line_errors_that_list_the_registry(override, match):
    from fastcov.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [override])


def test_rollout_engines_are_a_registry_the_config_checks():
    from fastcov.trainer.config import ConfigError, load_config
    from fastcov.trainer.rollout import ROLLOUT_ENGINES

    assert {"hf", "vllm"} <= set(ROLLOUT_ENGINES.names())
    with pytest.raises(ConfigError, match=r"rollout\.engine: unknown rollout engine 'mine'"):
        load_config("configs/tiny.yaml", ["rollout.engine=mine"])
    ROLLOUT_ENGINES.add("mine", lambda *a, **k: None)
    try:
        assert load_config("configs/tiny.yaml", ["rollout.engine=mine"]).rollout.engine == "mine"
    finally:
        ROLLOUT_ENGINES._entries.pop("mine")
