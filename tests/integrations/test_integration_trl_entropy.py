"""TRL's adaptive entropy control (use_adaptive_entropy, Skywork-OR1's rule) in FastcovGRPOTrainer against TRL 1.16's
own GRPOTrainer, 2 CPU processes (gloo, DDP): the same coefficient after every optimizer step and the same per-rank
losses, over 6 optimizer steps of 2 accumulated micro-batches each; the controller on KL-Cov's β trains and is
checkpointed; the options are checked in one line each."""

import json
import math

import pytest
from _agreement import fp32_loss_tolerance
from _dist import free_port, read_rank_reports, report_rank, spawn_ranks

pytest.importorskip("trl")
pytest.importorskip("datasets")

WORLD = 2
STEPS = 6
PROMPTS = ["12+7=", "3*4=", "9-5=", "20/4=", "8+8=", "6*7=", "1+1=", "5*5="]
# the tiny model's mean entropy wanders around this value over the first steps: the rule moves both ways
TARGET = 5.06885
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.004, entropy_coef_min=0.002,
                entropy_coef_max=0.02, entropy_target=TARGET)


def _run(kind: str, model_dir: str, out_dir: str) -> dict:
    import datasets
    import trl
    from _trl_harness import recording_trainer, reward_digits, tiny_tokenizer

    from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer

    base, config_cls = (trl.GRPOTrainer, trl.GRPOConfig) if kind == "trl" else (FastcovGRPOTrainer, FastcovGRPOConfig)
    losses, scales, coefs = [], [], []

    class Recording(recording_trainer(base, losses, scales)):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.model.training and self.accelerator.sync_gradients:
                coefs.append(float(self.entropy_coef))  # after the optimizer step's update
            return loss

    extra = dict(fastcov_loss_mode="vanilla") if kind == "fastcov" else {}
    args = config_cls(
        output_dir=f"{out_dir}/{kind}", use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0,
        max_steps=STEPS, logging_steps=1, learning_rate=0.05, lr_scheduler_type="constant", optim="sgd",
        max_grad_norm=1e6, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, loss_type="dapo", disable_tqdm=True, dataloader_num_workers=0,
        accelerator_config={"use_configured_state": True}, **ADAPTIVE, **extra,
    )
    trainer = Recording(model=model_dir, reward_funcs=reward_digits, args=args,
                        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=tiny_tokenizer())
    trainer.train()
    entropies = [row["entropy"] for row in trainer.state.log_history if "entropy" in row]
    return dict(losses=losses, scales=scales, coefs=coefs, entropies=entropies)


def _two_process_body(model_dir: str, out_dir: str) -> dict:
    """One rank of the 2-process case (run by ``report_rank``): TRL's run, then fastcov's."""
    from accelerate import PartialState

    PartialState(backend="gloo", cpu=True)
    return {kind: _run(kind, model_dir, out_dir) for kind in ("trl", "fastcov")}


@pytest.mark.slow
def test_adaptive_entropy_equals_trl_on_two_processes(tmp_path):
    from _trl_harness import tiny_model

    model_dir = str(tmp_path / "model")
    tiny_model().save_pretrained(model_dir)
    spawn_ranks(report_rank, (WORLD, free_port(), str(tmp_path), _two_process_body, model_dir, str(tmp_path)), WORLD)
    for rank, res in enumerate(read_rank_reports(tmp_path, WORLD)):
        trl, ours = res["trl"], res["fastcov"]
        assert len(trl["coefs"]) == STEPS and len(trl["losses"]) == 2 * STEPS, trl
        steps = [b - a for a, b in zip([ADAPTIVE["entropy_coef"]] + trl["coefs"], trl["coefs"], strict=False)]
        assert any(s > 0 for s in steps) and any(s < 0 for s in steps), (trl["coefs"], trl["entropies"])
        assert ours["coefs"] == pytest.approx(trl["coefs"], rel=1e-6, abs=0), (rank, ours["coefs"], trl["coefs"])
        # a micro-batch's loss after the optimizer steps before it: fp32 rounding of its terms, one share per step
        for i, (a, b, (tokens, scale)) in enumerate(zip(ours["losses"], trl["losses"], trl["scales"], strict=True)):
            tol = fp32_loss_tolerance(tokens, scale, i // 2 + 1)
            assert abs(a - b) <= tol, (rank, i, ours["losses"], trl["losses"], tol)
        assert all(math.isfinite(x) for x in ours["losses"])


# ---------------------------------------------------------------- one process


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
