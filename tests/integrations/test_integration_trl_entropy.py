"""TRL's entropy options in FastcovGRPOTrainer: the static entropy bonus equals TRL's loss, the controller on KL-Cov's
β trains and is checkpointed, the options are checked in one line each. The adaptive rule against TRL's own
GRPOTrainer on 2 processes: tests/integrations/e2e/test_integration_trl_entropy_e2e.py."""

import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")


def test_static_entropy_bonus_matches_trl_loss(tmp_path):
    """entropy_coef ≠ 0 without the controller: TRL's bonus, mean H over the loss tokens / GA steps."""
    import torch
    import trl
    from test_integration_trl import make_trainer, padded_batch

    trainer = make_trainer(tmp_path, fastcov_loss_mode="vanilla", loss_type="bnpo", entropy_coef=0.05)
    trainer.current_gradient_accumulation_steps = 2
    ids, mask, keep = padded_batch(rows=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    p = ids.shape[1] - keep
    inputs = {"prompt_ids": ids[:, :p], "prompt_mask": mask[:, :p], "completion_ids": ids[:, p:],
              "completion_mask": mask[:, p:], "advantages": torch.randn(4, generator=gen),
              "old_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=gen),
              "num_items_in_batch": mask[:, p:].sum() * 2}
    trainer.model.train()
    from fastcov.integrations.trl import FastcovGRPOTrainer

    ours = FastcovGRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    theirs = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    without = trainer.args.entropy_coef
    trainer.args.entropy_coef = 0.0
    plain = FastcovGRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    trainer.args.entropy_coef = without
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert abs(float((ours - plain).detach())) > 1e-3  # the bonus is really there


def test_controller_on_kl_cov_coef_trains_logs_and_checkpoints(tmp_path):
    from test_integration_trl import make_trainer

    control = {"target": 50.0, "knob": "kl_cov_coef", "rule": "proportional", "gain": 0.5, "min": 0.1, "max": 8.0}
    trainer = make_trainer(tmp_path, fastcov_loss_mode="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=1.0, max_steps=2,
                           fastcov_entropy_control=json.dumps(control), save_strategy="steps", save_steps=2)
    ctl = trainer._fastcov_ctl
    assert ctl.value == 1.0 and ctl.knob == "kl_cov_coef"
    trainer.train()
    # H ≈ 5 nats ≪ 50: each step scales β by exp(0.5 · (50 − H) / 50) ≈ 1.57, up to max
    assert ctl.updates == 2 and 2.0 < ctl.value <= 8.0
    logged = [row["fastcov/entropy_control/value"] for row in trainer.state.log_history
              if "fastcov/entropy_control/value" in row]
    assert logged[-1] == pytest.approx(ctl.value)
    saved = json.loads((tmp_path / "checkpoint-2" / "fastcov_entropy_control.json").read_text())
    assert saved == ctl.state_dict()
    fresh = make_trainer(tmp_path / "again", fastcov_loss_mode="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=1.0,
                         fastcov_entropy_control=control)
    fresh._fastcov_load_control(str(tmp_path / "checkpoint-2"))
    assert fresh._fastcov_ctl.state_dict() == ctl.state_dict()


def test_on_policy_kl_cov_warns_in_one_line(tmp_path):
    import warnings

    from test_integration_trl import make_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_args(tmp_path, fastcov_loss_mode="kl_cov")
        make_args(tmp_path, fastcov_loss_mode="kl_cov", steps_per_generation=2)
        make_args(tmp_path, fastcov_loss_mode="clip_cov")
    msgs = [str(w.message) for w in caught if "KL-Cov" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "num_iterations" in msgs[0]
