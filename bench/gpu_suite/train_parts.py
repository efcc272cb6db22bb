"""The training parts: train (the project's trainer, then TRL), vllm, trainer (``bench.trainer``), memory
(``bench.memory_sweep``) and extra (the large kernels, an offloaded and a LoRA step)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench._common import fmt as _fmt
from bench.gpu_suite.kernel_parts import kernels_run
from bench.gpu_suite.presets import EXTRA_KERNELS, GIB, TRAIN_COMMON, TRAIN_CONFIG, TRAIN_EXTRA, TRAIN_FULL, TRAIN_SMOKE
from bench.gpu_suite.runner import Proc, Suite, guarded
from bench.gpu_worker import StepRows, TrainSpec, step_fields
from bench.kernels import read_jsonl

# =========================================================================== part: train


def train_spec(s: Suite, part: str = "train", label: str = "fastcov", extra: tuple[str, ...] = ()) -> TrainSpec:
    """The config file, overrides and step count the train worker and the TRL worker share, and where the
    worker appends its step rows (the suite's JSONL, as each step is logged)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = TRAIN_FULL if s.size == "full" else TRAIN_SMOKE
    # one step more than measured: the run stops after the last measured row, before any final checkpoint
    overrides = TRAIN_COMMON + size + list(extra) + [f"trainer.max_steps={s.steps + 1}", f"trainer.device={device}"]
    return TrainSpec(config=str(TRAIN_CONFIG), overrides=tuple(overrides), steps=s.steps,
                     rows=StepRows(path=str(s.path), run=s.run_id, part=part, label=label, size=s.size, gpu=s.gpu))


def plan_prediction(spec: TrainSpec) -> dict:
    """``fastcov.plan.plan_recipe`` of the run's config on this one GPU (80 GiB without one), in GiB."""
    from fastcov.plan import plan_recipe
    from fastcov.trainer.config import load_config

    cfg = load_config(spec.config, list(spec.overrides))
    gib = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0
    plan = plan_recipe(cfg, gpus=1, gpu_memory_gib=gib).to_dict()
    keys = ("peak", "training_total", "rollout_total", "parameters", "gradients", "optimizer_states", "activations",
            "logits_fused", "zero3_gathered", "rollout_weights", "rollout_kv_cache", "rollout_during_training")
    return {**{f"{k}_gib": plan[k] / GIB for k in keys}, "fits": plan["fits"], "engine": plan["rollout_engine"],
            "ppo_epochs": cfg.algo.ppo_epochs}


def part_train(s: Suite) -> None:
    if s.size == "full" and not torch.cuda.is_available():
        for name in ("fastcov trainer", "trl GRPOTrainer"):
            s.record("train", name, "unavailable", "needs CUDA (--size tiny runs the same path on CPU)")
        return
    spec = train_run(s, "train", "fastcov")
    if s.size == "rehearse":
        s.record("train", "trl GRPOTrainer", "unavailable", "not run in the rehearsal (TRL is not in the GPU image)")
        return
    guarded(s, "train", "trl GRPOTrainer", lambda s: part_trl(s, spec))


def train_run(s: Suite, part: str, label: str, extra: tuple[str, ...] = ()) -> TrainSpec:
    """One trainer worker: its step rows come from the worker as each step is logged; then the summary row."""
    spec = train_spec(s, part, label, extra)
    plan = plan_prediction(spec)
    spec = spec.with_(ppo_epochs=plan["ppo_epochs"])
    with tempfile.TemporaryDirectory(prefix="gpu-suite-train-") as tmp:
        spec = spec.with_(overrides=[*spec.overrides, f"trainer.run_dir={tmp}/run"])
        # on CPU: DeepSpeed's CPU accelerator, and the trainer's kernels not under the rehearsal's interpreter
        proc = s.run([sys.executable, "-m", "bench.gpu_worker", "train", spec.to_json()],
                     {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu", "TRITON_INTERPRET": "0"})
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        rows = [r for r in (read_jsonl(metrics) if metrics.is_file() else []) if r.get("step", 0) >= 1]
    s.rows += [r for r in read_jsonl(s.path) if r.get("run") == s.run_id and r.get("part") == part
               and r.get("name", "").startswith(f"{label} step ")]  # the worker's rows, for the table
    record_train(s, spec, proc, rows, plan, part, label)
    return spec


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def record_train(s: Suite, spec: TrainSpec, proc: Proc, rows: list[dict], plan: dict, part: str = "train",
                 label: str = "fastcov") -> None:
    """The run's summary row (its step rows are the worker's): medians after the warm-up, peak memory, plan."""
    res = proc.result() or {}
    steps = [step_fields(r, plan["ppo_epochs"]) for r in rows]
    measured = [f for f in steps if f["step"] > 1] or steps
    keys = sorted({k for f in measured for k in f if k.startswith("time/")})
    med = {k: _median(measured, k) for k in keys + ["rollout_tokens_per_s", "update_tokens_per_s", "tokens"]}
    peak = res.get("peak_allocated_bytes")
    peak_gib = peak / GIB if peak is not None else None
    status = ("ok" if res.get("ok") and len(steps) == spec.steps else "timeout" if proc.timed_out
              else "OOM" if res.get("oom") else "error")
    reason = "" if status == "ok" else (res.get("error") or f"worker exited {proc.rc}: {proc.tail(4)}")
    summary = (f"median of {len(measured)} step(s) after warm-up: {_fmt(med.get('time/step'), '.2f')} s/step, rollout "
               f"{_fmt(med['rollout_tokens_per_s'], '.0f')} tok/s, update {_fmt(med['update_tokens_per_s'], '.0f')} "
               f"tok/s; peak GPU {_fmt(peak_gib, '.1f')} GiB (plan {plan['peak_gib']:.1f} GiB)")
    s.record(part, f"{label} trainer", status, reason, summary, steps_measured=[f["step"] for f in measured],
             medians=med, peak_gpu_bytes=peak, peak_gpu_gib=peak_gib,
             peak_reserved_bytes=res.get("peak_reserved_bytes"), peak_rss_bytes=res.get("peak_rss_bytes"),
             plan=plan, plan_peak_gib=plan["peak_gib"],
             measured_over_plan=peak_gib / plan["peak_gib"] if peak_gib is not None else None,
             overrides=list(spec.overrides), config=spec.config, wall_s=proc.wall_s, returncode=proc.rc,
             traceback=res.get("traceback"))


def part_trl(s: Suite, spec: TrainSpec) -> None:
    """TRL's own GRPOTrainer on the same model shape, prompts, group size and completion length (one worker)."""
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        s.record("train", "trl GRPOTrainer", "unavailable", f"{missing[0]} not installed")
        return
    with tempfile.TemporaryDirectory(prefix="gpu-suite-trl-") as tmp:
        proc = s.run([sys.executable, "-m", "bench.gpu_worker", "trl", spec.with_(output_dir=tmp).to_json()])
    res = proc.result() or {}
    times = res.get("step_s") or []
    measured = times[1:] or times
    status = ("ok" if res.get("ok") and times else "timeout" if proc.timed_out else "OOM" if res.get("oom")
              else "error")
    reason = "" if status == "ok" else (res.get("error") or f"worker exited {proc.rc}: {proc.tail(4)}")
    med = statistics.median(measured) if measured else None
    peak = res.get("peak_allocated_bytes")
    summary = (f"median step {_fmt(med, '.2f')} s over {len(measured)} step(s) after warm-up "
               f"({res.get('rows')} completions, {res.get('per_device_train_batch_size')} per micro-batch); "
               f"peak GPU {_fmt(peak / GIB if peak is not None else None, '.1f')} GiB")
    s.record("train", "trl GRPOTrainer", status, reason, summary, step_s=times, median_step_s=med,
             peak_gpu_bytes=peak, trl=res.get("trl"), setup=res.get("setup"), log=res.get("log"),
             wall_s=proc.wall_s, traceback=res.get("traceback"))


# =========================================================================== part: vllm


def part_vllm(s: Suite) -> None:
    """``python -m bench.vllm_smoke`` per size: generation tokens/s, weight sync s and GB/s, log-prob parity."""
    if importlib.util.find_spec("vllm") is None:
        s.record("vllm", "vllm_smoke", "unavailable", "vllm not installed")
        return
    if not torch.cuda.is_available():
        s.record("vllm", "vllm_smoke", "unavailable", "needs CUDA")
        return
    for size in ("tiny",) if s.size == "smoke" else ("tiny", "7b"):
        proc = s.run([sys.executable, "-m", "bench.vllm_smoke", "--size", size, "--out", str(s.dir)],
                     {"VLLM_USE_FLASHINFER_SAMPLER": "0"})
        record_vllm(s, size, proc)


def record_vllm(s: Suite, size: str, proc: Proc) -> None:
    res = proc.last_json()
    if res is None:
        status = "timeout" if proc.timed_out else "error"
        s.record("vllm", f"vllm_smoke {size}", status, f"exited {proc.rc}: {proc.tail(6)}", wall_s=proc.wall_s)
        return
    gen_s = (res.get("engine_stats") or {}).get("generate_s")
    tokens = ((res.get("parity_before") or {}).get("vs_bf16_policy") or {}).get("n")
    gen_tps = tokens / gen_s if tokens and gen_s else None
    syncs = res.get("sync_s") or []
    gib_s = res.get("sync_gib_per_s")
    parity = {k: res.get(k) for k in ("parity_before", "after_step", "parity_generate_after_sync")}
    failed = [k for k, ok in (res.get("checks") or {}).items() if not ok]
    summary = (f"{res.get('params', 0) / 1e9:.2f}B params; sync {_fmt(syncs[-1] if syncs else None, '.3f')} s "
               f"({_fmt(res.get('sync_gib'), '.2f')} GiB, {_fmt(gib_s * GIB / 1e9 if gib_s else None, '.1f')} GB/s)"
               + (f"; generate {gen_tps:.0f} tok/s" if gen_tps else "")
               + (f"; parity max {res['parity_before']['vs_bf16_policy']['max']:.3f} nats"
                  if res.get("parity_before") else ""))
    s.record("vllm", f"vllm_smoke {size}", "ok" if res.get("ok") else "fail", "failed: " + ", ".join(failed)
             if failed else "", summary, vllm=res.get("vllm"), generate_tokens=tokens, generate_s=gen_s,
             generate_tokens_per_s=gen_tps, sync_s=syncs, sync2_s=res.get("sync2_s"), sync_gib=res.get("sync_gib"),
             sync_gib_per_s=gib_s, sync_gb_per_s=gib_s * GIB / 1e9 if gib_s else None, parity=parity,
             checks=res.get("checks"), result_json=str(s.dir / f"vllm-smoke-{size}.json"), wall_s=proc.wall_s)


# =========================================================================== part: trainer


def peer_bench_can_run(s: Suite, part: str, name: str) -> bool:
    """Whether a part that runs TRL beside fastcov (trainer, memory) can: TRL installed, and CUDA at full size.
    Records the part ``unavailable`` when it cannot."""
    if importlib.util.find_spec("trl") is None:
        s.record(part, name, "unavailable", "trl not installed")
        return False
    if s.size == "full" and not torch.cuda.is_available():
        s.record(part, name, "unavailable", "needs CUDA")
        return False
    return True


def part_trainer(s: Suite) -> None:
    """``python -m bench.trainer --preset gpu-1.5b`` (full size; ``tiny`` otherwise): fastcov's trainer against
    TRL's GRPOTrainer at Qwen2.5-1.5B's decoder shape. Not in the default order: TRL is not in the GPU image and
    the run alone needs most of one call (``--parts trainer --budget 420``)."""
    if not peer_bench_can_run(s, "trainer", "bench.trainer"):
        return
    full = s.size == "full"
    out = s.dir / "trainer.jsonl"
    proc = s.run([sys.executable, "-m", "bench.trainer", "--preset", "gpu-1.5b" if full else "tiny",
                  "--cases", "a,b,c" if full else "a", "--work", str(s.dir / "bench-trainer"), "--jsonl", str(out)])
    rows = read_jsonl(out) if out.is_file() else []
    status = "ok" if proc.rc == 0 and rows else ("timeout" if proc.timed_out else "error")
    summary = "; ".join(f"{r['case']} {r['trainer']} {r['step_s']:.3f} s/step" for r in rows)
    s.record("trainer", "bench.trainer", status, "" if status == "ok" else f"exited {proc.rc}: {proc.tail(6)}",
             summary, rows=str(out), wall_s=proc.wall_s)


# =========================================================================== part: memory


def part_memory(s: Suite) -> None:
    """``python -m bench.memory_sweep --preset gpu-1.5b`` (full size; ``tiny`` otherwise): one row per arm with the
    peak memory at each answer length and the first length it ran out of memory at. Not in the default order:
    TRL is not in the GPU image (``--parts memory --budget 480``)."""
    if not peer_bench_can_run(s, "memory", "bench.memory_sweep"):
        return
    full = s.size == "full"
    out = s.dir / "memory.jsonl"
    before = len(read_jsonl(out)) if out.is_file() else 0
    arms = ["fastcov", "trl", "trl+liger"]
    if not torch.cuda.is_available():
        arms.remove("trl+liger")
        s.record("memory", "trl+liger peak memory", "unavailable", "Liger-Kernel's Triton kernels need CUDA")
    proc = s.run([sys.executable, "-m", "bench.memory_sweep", "--preset", "gpu-1.5b" if full else "tiny",
                  "--arms", ",".join(arms), "--work", str(s.dir / "bench-trainer"), "--jsonl", str(out)])
    rows = (read_jsonl(out) if out.is_file() else [])[before:]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        key = "peak_gpu_mb" if any("peak_gpu_mb" in r for r in mine) else "peak_rss_mb"
        points = "; ".join(f"{r['length']}: " + (f"{r[key] / 1024:.2f} GiB" if r["status"] == "ok" and r.get(key)
                                                  else r["status"]) for r in mine)
        ran = [r for r in mine if r["status"] == "ok"]
        bad = [r for r in mine if r["status"] in ("error", "timeout")]
        status = "ok" if ran and not bad else ("error" if bad else "OOM")
        s.record("memory", f"{arm} peak memory", status, bad[0].get("error", "")[:300] if bad else "",
                 points, points=mine, rows=str(out))
    if not rows:
        s.record("memory", "bench.memory_sweep", "timeout" if proc.timed_out else "error",
                 f"exited {proc.rc}: {proc.tail(6)}", wall_s=proc.wall_s)


# =========================================================================== part: extra


def part_extra(s: Suite) -> None:
    """What runs only when time is left: the kernels at N 65536, then a training step with the optimizer
    offloaded, one with LoRA adapters and one with asynchronous rollouts (each beside the plan's estimate, like the
    train part)."""
    name, preset, extra = EXTRA_KERNELS[s.size]
    kernels_run(s, "extra", name, preset, extra)
    if s.size == "full" and not torch.cuda.is_available():
        s.record("extra", "training steps", "unavailable", "needs CUDA")
        return
    for label, overrides in TRAIN_EXTRA.items():
        if s.part_left() <= 0:
            s.record("extra", f"{label} trainer", "not reached", "the part's time cap or the run's --budget is spent")
        elif label == "lora" and importlib.util.find_spec("peft") is None:
            s.record("extra", f"{label} trainer", "unavailable", "peft not installed (no wheel in .whl)")
        else:
            guarded(s, "extra", f"{label} trainer", lambda s, label=label, o=overrides: train_run(s, "extra", label,
                                                                                                 tuple(o)))
