"""The arms, each run in its own process (``python -m bench.trainer --child SPEC``): fastcov's trainer, TRL's
``GRPOTrainer`` (with fastcov's loss or Liger's kernels), instrumented per rollout batch; ``ForceLong`` makes
one answer of each batch run to max new tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.trainer.prepare import evaluate_both, train_pool
from bench.trainer.presets import CASE_KIND, KL_COV, MODEL_CASES, ROOT

# --------------------------------------------------------------------------- forced answer lengths (case b)


class ForceLong:
    """While ``active``: in each generation call, the first row of the prefill batch emits ``filler`` (a token the
    model never produces: the tokenizer's unknown token) at every step instead of sampling, so it never emits eos
    and runs to max new tokens; every other row samples as usual. The row is followed through the decode steps by
    its last token (``filler``), so it holds in an engine that drops finished rows (fastcov's) and in one that keeps
    them (``generate``). A pre-hook on the model reads the step's input ids, a hook on the LM head edits the last
    position's logits; outside generation (log-probs, training) both do nothing."""

    def __init__(self, model, filler: int):
        self.filler, self.active, self.rows = filler, False, None
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.get_output_embeddings().register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        if not self.active:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            self.rows = None
        elif ids.shape[1] > 1:  # prefill: the batch's first row
            self.rows = ids.new_zeros(ids.shape[0], dtype=bool)
            self.rows[0] = True
        else:
            self.rows = ids[:, -1] == self.filler

    def _post(self, module, inputs, output):
        if not self.active or self.rows is None or not bool(self.rows.any()):
            return None
        out = output.clone()
        last = out[:, -1, :]
        last[self.rows] = torch_min(out.dtype)
        last[self.rows, self.filler] = 0.0
        return out

    def wrap(self, fn):
        def wrapped(*a, **k):
            self.active = True
            try:
                return fn(*a, **k)
            finally:
                self.active, self.rows = False, None
        return wrapped


def torch_min(dtype):
    import torch

    return torch.finfo(dtype).min


# --------------------------------------------------------------------------- the child processes


def peak_rss_mb() -> float:
    from bench import _measure as M

    return (M.hwm_bytes() or 0) / 2**20


def rss_mb() -> float:
    from bench import _measure as M

    return (M.rss_bytes() or 0) / 2**20


def load_tok(path: str):
    """The model directory's tokenizer as fastcov's trainer loads it (``AutoTokenizer`` would substitute
    Qwen2Tokenizer for the demo's word-level tokenizer and drop most of each prompt's words)."""
    from fastcov.trainer.config import ModelConfig
    from fastcov.trainer.runtime.model import load_tokenizer

    return load_tokenizer(ModelConfig(path=path))


def run_fastcov(spec: dict) -> dict:
    """fastcov's trainer (configs/demo.yaml with the bench's settings); per-step phases from its metrics.jsonl."""
    from fastcov.trainer import train as train_module
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import hf as hf_rollout
    from fastcov.trainer.train import train

    p, case = spec["preset"], spec["case"]
    run_dir = Path(spec["work"]) / f"run-{spec['preset_name']}-{case}-fastcov"
    over = [f"model.path={spec['model']}", f"data.train_files=[{train_pool(Path(spec['data']), p)}]",
            f"data.val_files=[{spec['data']}/val.parquet]", f"trainer.run_dir={run_dir}",
            f"trainer.max_steps={p['warmup'] + p['steps']}", f"trainer.prompts_per_step={p['prompts']}",
            f"rollout.n={p['n']}", f"rollout.max_new_tokens={spec['max_new']}",
            f"algo.mini_batches={p['mini_batches']}",
            f"optim.lr={p['lr']}", "trainer.eval_every=0", f"trainer.threads={p['threads']}",
            f"trainer.device={p['device']}", "trainer.save_every=0", "trainer.seed=0", "trainer.progress=false"]
    if p.get("logprob_budget"):  # the old-log-prob pass in cache-sized micro-batches (bench/logprob_profile.py)
        over += [f"trainer.logprob_token_budget={p['logprob_budget']}"]
    if CASE_KIND[case] == "kl_cov":
        over += ["algo.mode=kl_cov", "algo.scope=microbatch", f"algo.loss.kl_cov_ratio={KL_COV['ratio']}",
                 f"algo.loss.kl_cov_coef={KL_COV['coef']}"]
    else:
        over += ["algo.mode=vanilla"]
    if p["device"] == "cuda":
        over += ["model.dtype=bf16"]
    over += MODEL_CASES.get(case, {}).get("config", [])
    cfg = load_config(ROOT / "configs" / "demo.yaml", over)
    original = hf_rollout.HFRolloutEngine.generate
    max_len: list[int] = []  # the longest answer of each rollout batch
    setup_rss: list[float] = []  # RSS as each rollout starts: the first is the set-up's (model, optimizer, data)
    peaks: list[float] = []

    def generate(self, *a, **k):
        setup_rss.append(rss_mb())
        peaks.append(peak_rss_mb())  # the peak so far: through the previous rollout batch
        call = original
        if CASE_KIND[case] == "long":
            if not hasattr(self, "_bench_force"):
                unk = load_tok(spec["model"]).unk_token_id
                self._bench_force = ForceLong(self.model, unk)
            call = self._bench_force.wrap(original)
        out = call(self, *a, **k)
        max_len.append(max((len(x) for x in out.token_ids), default=0))
        return out

    hf_rollout.HFRolloutEngine.generate = generate
    export = train_module.export_final
    before_export: list[float] = []

    def export_final(*a, **k):  # the peak of training, as TRL's is read before its save_model
        before_export.append(peak_rss_mb())
        return export(*a, **k)

    train_module.export_final = export_final
    base = rss_mb()
    t0 = time.perf_counter()
    train(cfg, overwrite=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step" in r]
    end_peak = before_export[-1] if before_export else peak_rss_mb()
    peaks = peaks[1:] + [end_peak]  # batch i's peak: the peak when batch i + 1 starts, the last at the end
    steps = []
    for i, r in enumerate(rows):
        n_rows = p["prompts"] * p["n"]
        gen = r["response_len"] * n_rows
        steps.append({"rollout_s": r["time/rollout"], "logprob_s": r.get("time/old_logprob", 0.0),
                      "update_s": r["time/update"], "total_s": r["time/step"] - r.get("time/save", 0.0),
                      "generated_tokens": gen, "reward": r["reward_mean"], "response_len": r["response_len"],
                      "max_response_len": max_len.pop(0) if max_len else None,
                      "peak_rss_mb": peaks[i] if i < len(peaks) else None})
    peak = end_peak  # before the model's export and the evaluation
    return {"steps": steps, "rss_base_mb": base, "peak_rss_mb": peak, "wall_s": wall,
            "eval_after": evaluate_both(run_dir / "final", Path(spec["data"]), p),
            "rss_setup_mb": setup_rss[0] if setup_rss else None, "optimizer_steps_per_batch": p["mini_batches"],
            "settings": {"algo.mode": "kl_cov" if CASE_KIND[case] == "kl_cov" else "vanilla",
                         "algo.loss_agg": "token-mean",
                         "algo.mini_batches": p["mini_batches"], "rollout.seeding": cfg.rollout.seeding,
                         "algo.scope": cfg.algo.scope, "trainer.packing": cfg.trainer.packing,
                         "trainer.logprob_token_budget": cfg.trainer.logprob_token_budget}}


def run_trl(spec: dict) -> dict:
    """TRL's GRPOTrainer (``trl``), or fastcov's FastcovGRPOTrainer (``trl+fastcov``), with the same settings."""
    import datasets
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    from fastcov.trainer.config import load_config
    from fastcov.trainer.rewards import math_reward

    p, case, who = spec["preset"], spec["case"], spec["trainer"]
    if p["threads"]:
        torch.set_num_threads(p["threads"])
    torch.manual_seed(0)
    tok = load_tok(spec["model"])
    dtype = torch.bfloat16 if p["device"] == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa")
    df = pd.read_parquet(train_pool(Path(spec["data"]), p))
    ds = datasets.Dataset.from_dict({"prompt": [list(m) for m in df["prompt"]],
                                     "truth": [r["ground_truth"] for r in df["reward_model"]]})
    rcfg = load_config(ROOT / "configs" / "demo.yaml", []).reward
    scorer = math_reward(rcfg)

    def reward(completions, truth, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(x) for x in scorer.batch(texts, list(truth))]

    args, cls = trl_args(spec)
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    batches, setup_rss = instrument_trl(trainer, tok, case, p["mini_batches"])
    base = rss_mb()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    S = p["mini_batches"]
    peak = peak_rss_mb()  # before the evaluation
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    return {"steps": batches, "rss_base_mb": base, "peak_rss_mb": peak, "wall_s": wall,
            "eval_after": evaluate_both(final, Path(spec["data"]), p),
            "rss_setup_mb": setup_rss[0] if setup_rss else None, "optimizer_steps_per_batch": S,
            "settings": {"loss_type": "bnpo", "steps_per_generation": S, "per_device_train_batch_size":
                         args.per_device_train_batch_size, "gradient_accumulation_steps": 1,
                         "num_generations": p["n"], "scale_rewards": "group", "beta": 0.0,
                         "use_liger_kernel": bool(args.use_liger_kernel),
                         **({"fastcov_loss_mode": "kl_cov", "fastcov_scope": "microbatch"}
                            if who == "trl+fastcov" else {})}}


def trl_args(spec: dict):
    """(config, trainer class): TRL's options set to match fastcov's (docs/benchmarks.md has the mapping)."""
    p, case, who = spec["preset"], spec["case"], spec["trainer"]
    common = dict(
        output_dir=str(Path(spec["work"]) / f"run-{spec['preset_name']}-{case}-{who}"), use_cpu=p["device"] == "cpu",
        bf16=p["device"] == "cuda", report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
        max_steps=(p["warmup"] + p["steps"]) * p["mini_batches"], learning_rate=p["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch", per_device_train_batch_size=p["prompts"] * p["n"] // p["mini_batches"],
        gradient_accumulation_steps=1, steps_per_generation=p["mini_batches"], num_generations=p["n"],
        num_iterations=1, max_completion_length=spec["max_new"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="bnpo", epsilon=0.2, epsilon_high=0.2, scale_rewards="group", logging_steps=p["mini_batches"],
        dataloader_num_workers=0)
    if who == "trl+fastcov":
        from fastcov.integrations.trl import FastcovGRPOConfig, FastcovGRPOTrainer

        args = FastcovGRPOConfig(**common, fastcov_loss_mode="kl_cov", kl_cov_ratio=KL_COV["ratio"],
                                 kl_cov_coef=KL_COV["coef"], fastcov_scope="microbatch")
        cls = FastcovGRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer

        # trl+liger: transformers swaps in Liger's RMSNorm, SwiGLU and RoPE; the loss stays TRL's (1.16 keeps its
        # own fused LM head and refuses Liger's fused linear cross-entropy)
        args, cls = GRPOConfig(**common, use_liger_kernel=who == "trl+liger"), GRPOTrainer
    return args, cls


def instrument_trl(trainer, tok, case: str, S: int) -> tuple[list[dict], list[float]]:
    """Wraps the trainer's rollout, log-prob and reward methods and adds a callback, so that each rollout batch
    (``S`` optimizer steps) appends its phases' seconds, reward and generated tokens to the returned list; the
    second list gets the RSS as each rollout starts. Case b forces one long answer per rollout (ForceLong)."""
    import torch
    from transformers import TrainerCallback

    batches: list[dict] = []
    cur: dict = {}

    def timed(name, fn, when=lambda: True):
        def wrapped(*a, **k):
            if not when():
                return fn(*a, **k)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapped

    gen = trainer._generate_single_turn
    if CASE_KIND[case] == "long":
        gen = ForceLong(trainer.model, tok.unk_token_id).wrap(gen)
    setup_rss: list[float] = []

    def first_rss(fn):
        def wrapped(*a, **k):
            setup_rss.append(rss_mb())
            return fn(*a, **k)
        return wrapped

    trainer._generate_single_turn = timed("rollout_s", first_rss(gen))
    trainer._get_per_token_logps_and_entropies = timed(
        "logprob_s", trainer._get_per_token_logps_and_entropies, lambda: not torch.is_grad_enabled())
    calc = trainer._calculate_rewards

    def rewards(inputs, prompts, completions, completion_ids_list):
        out = calc(inputs, prompts, completions, completion_ids_list)
        lens = [len(c) for c in completion_ids_list]
        cur.update(reward=float(out.float().mean()), generated_tokens=sum(lens),
                   response_len=sum(lens) / len(lens), max_response_len=max(lens))
        return out

    trainer._calculate_rewards = rewards
    clock = {"t": 0.0}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **k):
            if state.global_step % S == 0:  # the rollout batch's last optimizer step
                now = time.perf_counter()
                row = dict(cur)
                row["total_s"] = now - clock["t"]
                row["update_s"] = row["total_s"] - row.get("rollout_s", 0.0) - row.get("logprob_s", 0.0)
                row.setdefault("logprob_s", 0.0)
                row["peak_rss_mb"] = peak_rss_mb()
                batches.append(row)
                cur.clear()
                clock["t"] = now

    trainer.add_callback(Clock())
    return batches, setup_rss


def child(spec: dict) -> int:
    try:
        res = (run_fastcov if spec["trainer"] == "fastcov" else run_trl)(spec)
    except Exception as exc:  # noqa: BLE001 - an arm that may not run here (Liger off CUDA) records why
        if spec["trainer"] not in MAY_FAIL:
            raise
        import traceback

        res = {"error": f"{type(exc).__name__}: {exc}", "where": failing_frame(exc),
               "traceback": traceback.format_exc(limit=12)}
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


# Arms whose failure is their result (a row with ``error``) rather than the bench's: TRL with Liger's kernels,
# which are Triton kernels (transformers applies Liger's RMSNorm, SwiGLU and RoPE; TRL 1.16 keeps its own fused
# LM head and loss) and need a GPU driver.
MAY_FAIL = ("trl+liger",)


def failing_frame(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``exc``'s traceback outside Python's and Triton's runtime
    (where a peer's code gave up)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/triton/runtime/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    short = f.filename.split("site-packages/")[-1]
    return f"{short}:{f.lineno} in {f.name}"
