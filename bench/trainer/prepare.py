"""What both trainers start from, built once into ``--work``: the task's data, the warm-started model (or a
case's real one), the training pool, and the evaluation of a model on the pool and on held-out prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.trainer.presets import CASE_NAMES, EVAL, MODEL_CASES, POOL_K, log


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
