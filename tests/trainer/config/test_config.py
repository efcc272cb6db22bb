"""Config loading: YAML + dotlist overrides onto dataclasses; every bad key or value is named."""


import pytest
from _fixtures import ROOT, TINY  # noqa: E402

from fastcov.trainer.config import ConfigError, load_config

DEMO = ROOT / "configs" / "demo.yaml"


def test_shipped_configs_load():
    tiny = load_config(TINY)
    assert tiny.model.arch["model_type"] == "qwen2"
    demo = load_config(DEMO)
    assert demo.algo.mode == "vanilla" and demo.trainer.max_steps > 0


def test_overrides_apply_and_parse_yaml_values():
    cfg = load_config(TINY, ["algo.mode=kl_cov", "trainer.max_steps=50", "optim.lr=1e-5",
                             "optim.betas=[0.9, 0.95]", "algo.loss.dual_clip_c=3", "data.val_files=[a.parquet]"])
    assert cfg.algo.mode == "kl_cov"
    assert cfg.trainer.max_steps == 50
    assert cfg.optim.lr == pytest.approx(1e-5)  # "1e-5" is a YAML string; float fields accept it
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.algo.loss.dual_clip_c == 3.0 and isinstance(cfg.algo.loss.dual_clip_c, float)
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
    ("algo.loss.clip_cov_ratio=0", "algo.loss.clip_cov_ratio"),
    ("algo.loss.clip_cov_lb=9", "algo.loss.clip_cov_lb"),
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
    """The config.yaml a run writes (run_log.open_run_files) reads back to an equal Config."""
    import contextlib

    from fastcov.trainer.runtime.run_log import open_run_files

    cfg = load_config(TINY, ["algo.mode=kl_cov"])
    with contextlib.ExitStack() as closing:
        open_run_files(tmp_path, cfg.to_dict(), cfg.trainer, None, closing)
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_every_loss_hyperparameter_reaches_the_loss():
    """Every LossConfig field is a key of algo.loss, and arrives in the LossConfig of an update unchanged (λ from its
    schedule); a field added to LossConfig is a config key with no other change."""
    import dataclasses

    from fastcov.losses import LossConfig
    from fastcov.trainer.controls import loss_config

    values = dict(clip_low=0.11, clip_high=0.31, dual_clip_c=3.5, clip_cov_ratio=0.013, clip_cov_lb=0.7,
                  clip_cov_ub=4.2, kl_cov_ratio=0.021, kl_cov_coef=0.9, entropy_coef=0.004,
                  pos_adv_weight=0.6, neg_adv_weight=0.8, high_entropy_fraction=0.25, cov_score="vocab",
                  cispo_clip_max=4.5, cispo_clip_min=0.3, sapo_tau_pos=1.2, sapo_tau_neg=1.7, vespo_k_pos=1.5,
                  vespo_lambda_pos=2.5, vespo_k_neg=3.5, vespo_lambda_neg=1.5, loss_scale_factor=7.0,
                  check_finite=True)
    assert set(values) == {f.name for f in dataclasses.fields(LossConfig)}, "a new LossConfig field needs a value here"
    cfg = load_config(TINY, [f"algo.loss.{k}={v}" for k, v in values.items()])
    assert isinstance(cfg.algo.loss, LossConfig)
    step = loss_config(cfg.algo, pos_adv_weight=0.45)
    for name, value in values.items():
        assert getattr(step, name) == (0.45 if name == "pos_adv_weight" else value), name
    assert load_config(TINY).algo.loss.check_finite is False  # the trainer's default: a non-finite loss skips


def test_the_old_flat_loss_keys_still_work_with_one_line_naming_the_new_key(tmp_path):
    """algo.<field> (0.5.0 and earlier) reads as algo.loss.<field>, in a file and as an override (which still wins
    over the file's new key), each with the one-line FutureWarning the pos_weight move uses."""
    with pytest.warns(FutureWarning) as seen:
        old = load_config(TINY, ["algo.kl_cov_coef=0.7", "algo.cov_score=random"])
    assert [str(w.message) for w in seen] == ["algo.kl_cov_coef is deprecated: use algo.loss.kl_cov_coef",
                                              "algo.cov_score is deprecated: use algo.loss.cov_score"]
    assert old == load_config(TINY, ["algo.loss.kl_cov_coef=0.7", "algo.loss.cov_score=random"])
    assert old.algo.loss.clip_cov_lb == -5.0  # the file's own algo.loss keys stay
    flat = tmp_path / "flat.yaml"
    head, _, tail = TINY.read_text().partition("  loss:\n")
    lines = tail.split("\n")
    end = next(i for i, line in enumerate(lines) if not line.startswith("    "))
    flat.write_text(head + "\n".join([line[2:] for line in lines[:end]] + lines[end:]))
    assert "  clip_cov_lb: -5.0" in flat.read_text()
    with pytest.warns(FutureWarning) as seen:
        assert load_config(flat) == load_config(TINY)
    assert [str(w.message) for w in seen] == [f"algo.{k} is deprecated: use algo.loss.{k}"
                                              for k in ("clip_cov_ratio", "clip_cov_lb", "kl_cov_ratio")]
    with pytest.raises(ConfigError, match=r"^algo\.clip_low: renamed algo\.loss\.clip_low, which is set too"):
        load_config(TINY, ["algo.clip_low=0.1", "algo.loss.clip_low=0.3"])
    both = tmp_path / "both.yaml"
    both.write_text(TINY.read_text().replace("  loss:\n", "  kl_cov_ratio: 0.3\n  loss:\n"))
    with pytest.raises(ConfigError, match=r"^algo\.kl_cov_ratio: renamed algo\.loss\.kl_cov_ratio"):
        load_config(both)


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
    (["algo.loss.clip_cov_lb=2", "algo.loss.clip_cov_ub=1"], "algo.loss.clip_cov_lb"),
    (["algo.loss.cispo_clip_min=9"], "algo.loss.cispo_clip_min"),
    (["algo.loss.cispo_clip_max=0"], "algo.loss.cispo_clip_max"),
    (["algo.loss.sapo_tau_neg=0"], "algo.loss.sapo_tau_neg"),
    (["algo.loss.kl_cov_ratio=2"], "algo.loss.kl_cov_ratio"),
    (["algo.loss.high_entropy_fraction=0"], "algo.loss.high_entropy_fraction"),
    (["algo.loss.dual_clip_c=1"], "algo.loss.dual_clip_c"),
    (["algo.loss.clip_low=1.5"], "algo.loss.clip_low"),  # the trainer's bound, narrower than LossConfig's
    (["algo.loss.neg_adv_weight=2"], "algo.loss.neg_adv_weight"),
])
def test_loss_ranges_are_losscfgs_and_name_the_algo_key(overrides, named):
    with pytest.raises(ConfigError, match="^" + named.replace(".", r"\.") + ":"):
        load_config(TINY, overrides)


def test_a_refusal_names_the_key_the_config_sets():
    """LossConfig refuses a pair of bounds in one message naming both: the key named is the one that was set (the
    defaults' clip_cov_lb 1 against the clip_cov_ub given)."""
    with pytest.raises(ConfigError, match=r"^algo\.loss\.clip_cov_ub: clip_cov_lb must be < clip_cov_ub, got "):
        load_config(None, ["algo.loss.clip_cov_ub=0.5"])


def test_the_old_names_of_the_config_module_still_import_with_a_warning():
    import fastcov.trainer.config as config
    from fastcov.trainer import controls

    for name in ("loss_config", "entropy_controller", "rollout_correction_enabled"):
        with pytest.warns(FutureWarning, match=rf"^fastcov\.trainer\.config\.{name} is deprecated: use "
                                               rf"fastcov\.trainer\.controls\.{name}$"):
            assert getattr(config, name) is getattr(controls, name)
    with pytest.warns(FutureWarning, match="LOSS_FIELDS is deprecated"):
        assert "clip_low" in config.LOSS_FIELDS
    with pytest.raises(AttributeError):
        config.no_such_name  # noqa: B018


def test_offload_activations_is_checked_with_the_trainer_section_not_lora():
    with pytest.raises(ConfigError, match=r"^trainer\.offload_activations:"):
        load_config(TINY, ["trainer.offload_activations=true"])
    load_config(TINY, ["trainer.offload_activations=true", "model.gradient_checkpointing=true"])
