"""The GPU suite's workers: the subprocesses ``bench.gpu_suite``'s train part starts, one per run, with
``python -m bench.gpu_worker KIND SPEC_JSON``. ``train`` runs the project's trainer and appends each logged step's
row to the suite's JSONL as it is logged; ``trl`` runs TRL's GRPOTrainer on the same shape. Each ends with its
result as one marked stdout line (bench/_common.py's protocol) and leaves at once."""

from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

from bench import _measure as M
from bench._common import emit_result, fmt, is_oom, short

RESULT_MARK = "@@GPU_SUITE_RESULT "
TRL_MAX_ROWS = 32  # TRL micro-batch rows on the GPU (its loss materialises [rows, tokens, V] logits)


@dataclass(frozen=True)
class StepRows:
    """Where and under which names a train worker appends its step rows: the suite's JSONL and its run."""

    path: str
    run: str
    part: str
    label: str
    size: str
    gpu: str | None


@dataclass(frozen=True)
class TrainSpec:
    """One training run of the suite: the config file and overrides the train and TRL workers share, the steps
    to measure (the first a warm-up), the PPO epochs per step (for update tokens/s), where the step rows go, and
    TRL's output folder."""

    config: str
    overrides: tuple[str, ...]
    steps: int
    rows: StepRows | None = None
    ppo_epochs: int = 1
    output_dir: str | None = None

    def with_(self, **changes) -> TrainSpec:
        if "overrides" in changes:
            changes["overrides"] = tuple(changes["overrides"])
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainSpec:
        fields = json.loads(text)
        rows = fields.get("rows")
        return cls(**{**fields, "overrides": tuple(fields["overrides"]),
                      "rows": StepRows(**rows) if rows is not None else None})


def step_row(spec: TrainSpec, r: dict) -> dict:
    """The suite row of one logged training step (what the worker appends as the step is logged)."""
    where = spec.rows
    assert where is not None, "a step row needs the suite's run"
    f = step_fields(r, spec.ppo_epochs)
    parts = ", ".join(f"{k[5:]} {v:.2f}" for k, v in f.items() if k.startswith("time/") and k != "time/step")
    return {"run": where.run, "part": where.part, "name": f"{where.label} step {f['step']}", "status": "ok",
            "reason": "", "summary": f"{f['time/step']:.2f} s ({parts}); rollout "
            f"{fmt(f['rollout_tokens_per_s'], '.0f')} tok/s, update {fmt(f['update_tokens_per_s'], '.0f')} tok/s"
            + (" [warm-up]" if f["step"] == 1 else ""), "size": where.size, "gpu": where.gpu,
            "at": _dt.datetime.now().isoformat(timespec="seconds"), "warmup": f["step"] == 1, **f}


def step_fields(r: dict, ppo_epochs: int) -> dict:
    """One metrics.jsonl row as the suite records it: the time/* keys, rollout and update tokens/s."""
    tokens = r["tokens_per_s"] * r["time/step"]  # prompt + response tokens of the step's batch
    upd = r.get("time/update")
    return {"step": r["step"], **{k: v for k, v in r.items() if k.startswith("time/")}, "tokens": tokens,
            "tokens_per_s": r["tokens_per_s"], "rollout_tokens_per_s": r.get("tokens_per_s/rollout"),
            "update_tokens_per_s": tokens * ppo_epochs / upd if upd else None,
            **{k: r.get(k) for k in ("response_len", "entropy", "selected_frac", "applied_steps", "kept_groups")}}




class _Measured(Exception):
    """Raised after the last measured step's metrics row: ends the run before a final checkpoint is written."""


def gpu_peaks() -> dict:
    import resource

    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved())
    return out


def train_worker(spec: TrainSpec) -> dict:
    """The project's ``train(cfg)`` for ``spec.steps`` steps; its metrics.jsonl holds the measurements."""
    from fastcov.trainer import train as train_mod
    from fastcov.trainer.config import load_config

    cfg = load_config(spec.config, list(spec.overrides))
    log_row = train_mod.log_durably

    def log_then_stop(run, rec):
        log_row(run, rec)
        if spec.rows is not None and rec.get("step", 0) >= 1 and "time/step" in rec and "tokens_per_s" in rec:
            M.append_jsonl(spec.rows.path, step_row(spec, rec), default=str)  # a later kill keeps it
        if rec.get("step") == spec.steps:
            raise _Measured

    train_mod.log_durably = log_then_stop
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        train_mod.train(cfg)
    except _Measured:
        pass
    return {"wall_s": time.perf_counter() - t0, **gpu_peaks()}


def _step_timer():
    """A transformers TrainerCallback that records each optimizer step's wall time (end to end)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.last, self.times = None, []

        def _now(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            self.times.append(now - self.last)
            self.last = now

    return StepTimer()


def trl_setup(cfg, spec: TrainSpec, tokenizer) -> tuple[dict, object, object]:
    """(GRPOConfig kwargs, prompt dataset, reward function) matching the trainer's batch."""
    import datasets

    from fastcov.trainer.data.synthetic import generate
    from fastcov.trainer.rewards import RewardFn

    t, r, cuda = cfg.trainer, cfg.rollout, torch.cuda.is_available()
    rows = t.prompts_per_step * r.n
    per_micro = max(k for k in range(1, t.prompts_per_step + 1)
                    if t.prompts_per_step % k == 0 and (k * r.n <= TRL_MAX_ROWS or k == 1)) * r.n
    kwargs = dict(output_dir=spec.output_dir, per_device_train_batch_size=per_micro,
                  gradient_accumulation_steps=rows // per_micro, num_generations=r.n,
                  max_completion_length=r.max_new_tokens, temperature=r.temperature, learning_rate=cfg.optim.lr,
                  lr_scheduler_type="constant", max_grad_norm=cfg.optim.grad_clip, max_steps=spec.steps,
                  logging_steps=1, save_strategy="no", report_to="none", seed=t.seed,
                  bf16=cuda, use_cpu=not cuda, beta=0.0, gradient_checkpointing=cfg.model.gradient_checkpointing,
                  disable_tqdm=True, dataloader_num_workers=0)
    problems = generate(t.prompts_per_step * spec.steps, seed=cfg.data.synthetic.seed)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.question()}], add_generation_prompt=True,
                                           tokenize=False) for p in problems]
    data = datasets.Dataset.from_dict({"prompt": texts, "ground_truth": [str(p.answer) for p in problems]})
    reward_fn = RewardFn(cfg.reward.kind, cfg.reward.timeout_s, "inline")

    def math_reward(completions, ground_truth, **kwargs):
        return reward_fn.batch(list(completions), list(ground_truth))

    return kwargs, data, math_reward


def trl_worker(spec: TrainSpec) -> dict:
    """TRL's GRPOTrainer (its own loss and generation) on a fresh model of the trainer config's shape."""
    import trl

    from fastcov.trainer.config import load_config
    from fastcov.trainer.runtime.distributed import pick_device
    from fastcov.trainer.runtime.model import build_model, load_tokenizer

    cfg = load_config(spec.config, list(spec.overrides))
    device = pick_device(cfg.trainer.device)
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "left"
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, device, torch.float32, tokenizer)  # fp32 weights, bf16 autocast on a GPU
    model.config.use_cache = True
    kwargs, data, reward = trl_setup(cfg, spec, tokenizer)
    timer = _step_timer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=trl.GRPOConfig(**kwargs), train_dataset=data,
                              processing_class=tokenizer, callbacks=[timer])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_s": timer.times, "trl": trl.__version__, "rows": cfg.trainer.prompts_per_step * cfg.rollout.n,
            "per_device_train_batch_size": kwargs["per_device_train_batch_size"],
            "setup": {k: v for k, v in kwargs.items() if k != "output_dir"},
            "log": history[-1] if history else None, **gpu_peaks()}


WORKERS = {"train": train_worker, "trl": trl_worker}


def worker_main(kind: str, spec: TrainSpec) -> None:
    """Run one worker (a subprocess of the suite); its last stdout line is RESULT_MARK + JSON ({"ok": ..., ...}).
    It then leaves at once (``os._exit``): the trainer's NCCL group and DeepSpeed engine are not torn down,
    so that no teardown can hang on the device's clock once the result is out."""
    def stopped(signum, frame):  # the suite's SIGTERM at the cap: unwind, so that locks and files are released
        raise SystemExit(f"stopped by signal {signum} (the part's time cap)")

    signal.signal(signal.SIGTERM, stopped)
    try:
        res = {"ok": True, **WORKERS[kind](spec)}
    except BaseException as exc:  # noqa: BLE001 - the parent records it
        res = {"ok": False, "error": short(exc), "oom": is_oom(exc), "traceback": traceback.format_exc(limit=12),
               **gpu_peaks()}
    emit_result(RESULT_MARK, res, default=str)
    sys.stderr.flush()
    os._exit(0 if res["ok"] else 1)


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.gpu_worker KIND SPEC_JSON`` (the suite starts it; it does not return)."""
    kind, spec = sys.argv[1:] if argv is None else argv
    worker_main(kind, TrainSpec.from_json(spec))


if __name__ == "__main__":
    main()
