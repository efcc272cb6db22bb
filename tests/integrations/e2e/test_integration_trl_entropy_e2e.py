"""TRL's adaptive entropy control (use_adaptive_entropy, Skywork-OR1's rule) in FastcovGRPOTrainer against TRL 1.16's
own GRPOTrainer, 2 CPU processes (gloo, DDP): the same coefficient after every optimizer step and the same per-rank
losses, over 6 optimizer steps of 2 accumulated micro-batches each (the static bonus, KL-Cov's β under the controller
and the options' checks: tests/integrations/test_integration_trl_entropy.py)."""

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
