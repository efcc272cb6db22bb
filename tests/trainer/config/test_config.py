"""Config loading: YAML + dotlist overrides onto dataclasses; every bad key or value is named."""


import pytest
from _fixtures import ROOT, TINY  # noqa: E402

from fastcov.trainer.config import ConfigError, load_config, save_config

DEMO = ROOT / "configs" / "demo.yaml"


def test_shipped_configs_load():
    tiny = load_config(TINY)
    assert tiny.model.arch["model_type"] == "qwen2"
    demo = load_config(DEMO)
    assert demo.algo.mode == "vanilla" and demo.trainer.max_steps > 0


def test_overrides_apply_and_parse_yaml_values():
    cfg = load_config(TINY, ["algo.mode=kl_cov", "trainer.max_steps=50", "optim.lr=1e-5",
                             "optim.betas=[0.9, 0.95]", "algo.dual_clip_c=3", "data.val_files=[a.parquet]"])
    assert cfg.algo.mode == "kl_cov"
    assert cfg.trainer.max_steps == 50
    assert cfg.optim.lr == pytest.approx(1e-5)  # "1e-5" is a YAML string; float fields accept it
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.algo.dual_clip_c == 3.0 and isinstance(cfg.algo.dual_clip_c, float)
    assert cfg.data.val_files == ["a.parquet"]


@pytest.mark.parametrize("override, named", [
    ("algo.mdoe=kl_cov", "algo.mdoe"),
    ("trainer.nope=1", "trainer.nope"),
    ("bogus.x=1", "bogus"),
    ("algo.mode=clip_cvo", "algo.mode"),
    ("trainer.max_steps=ten", "trainer.max_steps"),
    ("trainer.max_steps=1.5", "trainer.max_steps"),
    ("trainer.progress=maybe", "trainer.progress"),
    ("optim.lr=-1", "optim.lr"),
    ("optim.lr=fast", "optim.lr"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("trainer.zero_stage=4", "trainer.zero_stage"),
    ("algo.clip_cov_ratio=0", "algo.clip_cov_ratio"),
    ("algo.clip_cov_lb=9", "algo.clip_cov_lb"),
    ("rollout.n=1", "rollout.n"),
    ("optim.betas=[0.9]", "optim.betas"),
    ("model.arch=null", "model.path"),  # no model at all (model.path=X alone replaces the arch: test_cli.py)
])
def test_bad_configs_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY, [override])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(TINY, ["algo.mode"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  arch: {model_type: qwen2}\n  tokenizer: builtin:arith\n  colour: red\n"
                   "data: {synthetic: {enabled: true}}\n")
    with pytest.raises(ConfigError, match=r"model\.colour"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["algo.mode=kl_cov"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_every_loss_hyperparameter_reaches_the_loss():
    """Each LossConfig field the algo section carries arrives in the trainer's LossConfig unchanged."""
    import dataclasses

    from fastcov.losses import LossConfig
    from fastcov.trainer.config import AlgoConfig
    from fastcov.trainer.train import loss_config

    shared = {f.name for f in dataclasses.fields(LossConfig)} & {f.name for f in dataclasses.fields(AlgoConfig)}
    assert shared >= {"clip_low", "clip_high", "clip_cov_ratio", "kl_cov_ratio", "kl_cov_coef", "cov_score"}
    values = dict(clip_low=0.11, clip_high=0.31, dual_clip_c=3.5, clip_cov_ratio=0.013, clip_cov_lb=0.7,
                  clip_cov_ub=4.2, kl_cov_ratio=0.021, kl_cov_coef=0.9, entropy_coef=0.004,
                  pos_adv_weight=0.6, neg_adv_weight=0.8, high_entropy_fraction=0.25, cov_score="vocab",
                  cispo_clip_max=4.5, cispo_clip_min=0.3, sapo_tau_pos=1.2, sapo_tau_neg=1.7, vespo_k_pos=1.5,
                  vespo_lambda_pos=2.5, vespo_k_neg=3.5, vespo_lambda_neg=1.5)
    assert set(values) == shared, "a new shared field needs a value here"
    cfg = loss_config(AlgoConfig(**values), pos_adv_weight=0.45)
    for name, value in values.items():
        assert getattr(cfg, name) == (0.45 if name == "pos_adv_weight" else value), name
    assert cfg.check_finite is False


def test_the_old_flat_pos_weight_keys_still_work_with_one_line_naming_the_new_key():
    with pytest.warns(FutureWarning) as seen:
        old = load_config(TINY, ["algo.pos_weight_schedule=true", "algo.pos_weight_kind=stage",
                                 "algo.pos_weight_stages=[[0, 0.5], [2, 0.9]]"])
    assert [str(w.message) for w in seen] == [f"algo.pos_weight_{k} is deprecated: use algo.pos_weight.{n}"
                                              for k, n in (("schedule", "enabled"), ("kind", "kind"),
                                                           ("stages", "stages"))]
    new = load_config(TINY, ["algo.pos_weight.enabled=true", "algo.pos_weight.kind=stage",
                             "algo.pos_weight.stages=[[0, 0.5], [2, 0.9]]"])
    assert old == new and new.algo.pos_weight.stages == [(0, 0.5), (2, 0.9)]
    with pytest.raises(ConfigError, match=r"^algo\.pos_weight_delta: renamed algo\.pos_weight\.delta"):
        load_config(TINY, ["algo.pos_weight_delta=0.1", "algo.pos_weight.delta=0.2"])


@pytest.mark.parametrize("overrides, named", [
    (["algo.pos_weight.delta=2"], "algo.pos_weight.delta"),
    (["algo.pos_weight.target_entropy=-1"], "algo.pos_weight.target_entropy"),
    (["algo.pos_weight.kind=constant", "algo.pos_weight.init=3"], "algo.pos_weight.init"),
    (["algo.pos_weight.kind=stage", "algo.pos_weight.stages=[[1, 0.5]]"], "algo.pos_weight.stages"),
    (["algo.pos_weight.kind=epoch"], "algo.pos_weight.values"),
    (["algo.pos_weight.kind=epoch", "algo.pos_weight.values=[0.5]"], "algo.pos_weight.steps_per_epoch"),
])
def test_a_bad_pos_weight_schedule_names_its_key(overrides, named):
    with pytest.raises(ConfigError, match="^" + named.replace(".", r"\.") + ":"):
        load_config(TINY, ["algo.pos_weight.enabled=true", *overrides])


@pytest.mark.parametrize("overrides, named", [
    (["algo.clip_cov_lb=2", "algo.clip_cov_ub=1"], "algo.clip_cov_lb"),
    (["algo.cispo_clip_min=9"], "algo.cispo_clip_min"),
    (["algo.cispo_clip_max=0"], "algo.cispo_clip_max"),
    (["algo.sapo_tau_neg=0"], "algo.sapo_tau_neg"),
    (["algo.kl_cov_ratio=2"], "algo.kl_cov_ratio"),
    (["algo.high_entropy_fraction=0"], "algo.high_entropy_fraction"),
    (["algo.dual_clip_c=1"], "algo.dual_clip_c"),
    (["algo.clip_low=1.5"], "algo.clip_low"),  # the trainer's bound, narrower than LossConfig's
    (["algo.neg_adv_weight=2"], "algo.neg_adv_weight"),
])
def test_loss_ranges_are_losscfgs_and_name_the_algo_key(overrides, named):
    with pytest.raises(ConfigError, match="^" + named.replace(".", r"\.") + ":"):
        load_config(TINY, overrides)


def test_the_algo_section_carries_every_losscfg_field_with_its_default():
    import dataclasses

    from fastcov.losses import LossConfig
    from fastcov.trainer.config import LOSS_FIELDS, AlgoConfig

    algo = AlgoConfig()
    assert set(LOSS_FIELDS) == {f.name for f in dataclasses.fields(LossConfig)} - {"loss_scale_factor", "check_finite"}
    assert all(getattr(algo, k) == getattr(LossConfig(), k) for k in LOSS_FIELDS)


def test_offload_activations_is_checked_with_the_trainer_section_not_lora():
    with pytest.raises(ConfigError, match=r"^trainer\.offload_activations:"):
        load_config(TINY, ["trainer.offload_activations=true"])
    load_config(TINY, ["trainer.offload_activations=true", "model.gradient_checkpointing=true"])
