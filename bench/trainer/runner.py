"""One arm of one case from the parent: its spec, its subprocess, its row (``summarize``), and a case's set-up."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.trainer.prepare import model_meta, prepare, prepare_model_case, task_data
from bench.trainer.presets import CASE_KIND, CASE_NAMES, EVAL, MODEL_CASES, POOL_K, ROOT, log
from bench.trainer.render import held_out

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
