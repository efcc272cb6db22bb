"""Peak memory of one rollout batch's training against answer length, at Qwen2.5's 151,936-token vocabulary:
fastcov's trainer, TRL's GRPOTrainer and TRL with ``use_liger_kernel=True``.

    python -m bench.memory_sweep                          # CPU: 256 -> 4,096 tokens per answer, capped at 24 GiB
    python -m bench.memory_sweep --preset tiny --limit-gb 4 --lengths 8,16    # the smoke run (seconds)
    python -m bench.memory_sweep --preset gpu-1.5b        # CUDA: Qwen2.5-1.5B's shape (gpu_suite part `memory`)
    python -m bench.memory_sweep --plot bench/results/cpu-2core/memory-<date>.jsonl --out-png docs/img/memory.png

Each point (arm, length) is one process that trains on one rollout batch the way the trainer does it, with the
generation replaced by answers of exactly ``length`` random tokens (no eos), so that every answer has the same
length and no time goes to sampling: fastcov's trainer (its old-log-prob pass and update, ``train``), TRL's
``GRPOTrainer`` (``_generate_single_turn`` replaced; its fused LM head and loss). The batch is one prompt of the
demo's task with ``rows`` answers, one optimizer step over all of them in one micro-batch in both trainers
(fastcov's token budgets set to the whole batch; TRL's ``per_device_train_batch_size`` = rows). The model is
bench/real_vocab.py's shape for the preset at random initialisation (memory does not depend on the weights),
built from config once into ``<work>/memory-<preset>/model``.

Peak memory: on CPU the process's VmHWM (its peak resident set, imports included) after the step, the model's
export excluded; the process runs under RLIMIT_DATA = ``--limit-gb`` (default 24 GiB, the CI machine's memory), so
an arm that would need more fails its allocation instead of waking the kernel's OOM killer; on CUDA
``torch.cuda.max_memory_allocated`` (the RSS beside it), and the GPU's own memory is the limit. An arm that runs
out at one length is not run at longer ones. One JSON line per point goes to
``<out>/<device>/memory-<date>.jsonl``; ``--plot`` draws peak memory against length, one line per arm, the limit
as a horizontal line and the first length each arm ran out at as a cross.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("fastcov", "trl", "trl+liger")
GIB = 2**30
PRESETS: dict[str, dict] = {
    # bench/real_vocab.py's CPU model (Qwen2.5-0.5B's tied 151,936 x 896 head, 2 layers), fp32, 4 answers per step
    "cpu": dict(device="cpu", rows=4, lengths=[256, 512, 1024, 2048, 4096], limit_gb=24.0, threads=2,
                checkpointing=False, timeout=3600.0),
    "tiny": dict(device="cpu", rows=2, lengths=[8, 16], limit_gb=4.0, threads=1, checkpointing=False,
                 timeout=600.0),
    # Qwen2.5-1.5B's shape and vocabulary, bf16, 8 answers per step, activation checkpointing in both trainers
    "gpu-1.5b": dict(device="cuda", rows=8, lengths=[256, 1024, 4096, 8192, 16384], limit_gb=0.0, threads=0,
                     checkpointing=True, timeout=300.0),
}
PROMPT_INDEX = 0  # the demo task's first training prompt


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(work: Path, preset: str) -> Path:
    """A randomly initialised model of bench/real_vocab.py's shape for ``preset`` and its tokenizer, once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import real_vocab

    path = work / f"memory-{preset}" / "model"
    if (path / "config.json").is_file():
        return path
    tok = real_vocab.build_tokenizer()
    cfg = dict(real_vocab.arch(preset, real_vocab.VOCAB))
    model_type = cfg.pop("model_type")
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **cfg, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                  bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def answers(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` answers of ``length`` random token ids in [4, vocab): no special token, so none ends early."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


# --------------------------------------------------------------------------- the child: one point


def peak_now(device: str) -> dict:
    from bench import _measure as M

    out = {"peak_rss_mb": (M.hwm_bytes() or 0) / 2**20}
    if device == "cuda":
        import torch

        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_fastcov(spec: dict) -> dict:
    """fastcov's trainer for one rollout batch of fixed-length answers; the peak before its model export."""
    from fastcov.trainer import train as train_module
    from fastcov.trainer.config import load_config
    from fastcov.trainer.rollout import hf as hf_rollout
    from fastcov.trainer.rollout.base import RolloutBatch

    rows, length, vocab = spec["rows"], spec["length"], spec["vocab"]
    budget = rows * (spec["prompt_len"] + length)
    over = [f"model.path={spec['model']}", f"data.train_files=[{spec['data']}]", f"trainer.run_dir={spec['run_dir']}",
            "trainer.max_steps=1", "trainer.prompts_per_step=1", f"rollout.n={rows}",
            f"rollout.max_new_tokens={length}", "algo.mini_batches=1", "algo.mode=vanilla", "trainer.eval_every=0",
            "trainer.save_every=0", "trainer.seed=0", "trainer.progress=false", f"trainer.device={spec['device']}",
            f"trainer.threads={spec['threads']}", f"trainer.micro_token_budget={budget}",
            f"trainer.logprob_token_budget={budget}", "data.val_files=[]"]
    if spec["device"] == "cuda":
        over += ["model.dtype=bf16"]
    if spec["checkpointing"]:
        over += ["model.gradient_checkpointing=true"]
    cfg = load_config(ROOT / "configs" / "demo.yaml", over)

    def generate(self, prompts, sampling, generator=None):
        toks = answers(len(prompts), length, vocab, seed=1)
        return RolloutBatch(toks, [[-12.0] * length for _ in toks])

    hf_rollout.HFRolloutEngine.generate = generate
    alternate_rewards()
    seen: dict = {}

    def no_export(*a, **k):  # the sweep measures training, not writing the model out
        seen.update(peak_now(spec["device"]))

    train_module.export_final = no_export
    t0 = time.perf_counter()
    train_module.train(cfg, overwrite=True)
    return {**(seen or peak_now(spec["device"])), "seconds": time.perf_counter() - t0}


def alternate_rewards() -> None:
    """The trainer's reward function scores answers 0, 1, 0, 1, ... (as the TRL arm's does), so that a group's
    advantages are not all zero: random answers would all score 0."""
    from fastcov.trainer import start

    registry = start.REWARD_TASKS
    build = registry.get

    class Alternating:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def batch(self, texts, truths):
            return [float(i % 2) for i in range(len(texts))]

    class Registry:
        def get(self, name):
            return lambda rcfg: Alternating(build(name)(rcfg))

        def __getattr__(self, name):
            return getattr(registry, name)

    start.REWARD_TASKS = Registry()


def run_trl(spec: dict) -> dict:
    """TRL's GRPOTrainer (with Liger's kernels for ``trl+liger``) for one rollout batch of fixed-length answers."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from bench.trainer import load_tok

    rows, length, vocab = spec["rows"], spec["length"], spec["vocab"]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    tok = load_tok(spec["model"])
    cuda = spec["device"] == "cuda"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    ds = datasets.Dataset.from_dict({"prompt": [spec["prompt"]] * rows})
    args = GRPOConfig(output_dir=spec["run_dir"], use_cpu=not cuda, bf16=cuda, report_to="none", save_strategy="no",
                      seed=0, disable_tqdm=True, max_steps=1, learning_rate=1e-6, per_device_train_batch_size=rows,
                      gradient_accumulation_steps=1, steps_per_generation=1, num_generations=rows,
                      max_completion_length=length, temperature=1.0, top_k=0, beta=0.0, loss_type="bnpo",
                      logging_steps=1, dataloader_num_workers=0, gradient_checkpointing=spec["checkpointing"],
                      use_liger_kernel=spec["arm"] == "trl+liger")

    def reward(completions, **kw):
        return [float(i % 2) for i in range(len(completions))]

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (answers(len(prompt_ids), length, vocab, 1), None)
    t0 = time.perf_counter()
    trainer.train()
    return {**peak_now(spec["device"]), "seconds": time.perf_counter() - t0}


def child(spec: dict) -> int:
    if spec["limit_gb"] and spec["device"] == "cpu":
        import resource

        cap = int(spec["limit_gb"] * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        res = (run_fastcov if spec["arm"] == "fastcov" else run_trl)(spec)
        res["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the point's result says what stopped it
        from bench._common import is_oom
        from bench.trainer import failing_frame

        # on CPU, RLIMIT_DATA makes torch's allocator (or Python's) fail its allocation
        oom = is_oom(exc) or isinstance(exc, MemoryError) or "can't allocate memory" in str(exc)
        res = {"status": "OOM" if oom else "error", "error": f"{type(exc).__name__}: {exc}"[:2000],
               "where": failing_frame(exc), **peak_now(spec["device"])}
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


# --------------------------------------------------------------------------- the parent


def run_point(arm: str, length: int, p: dict, preset: str, work: Path, model: Path, data: Path,
              prompt: list, prompt_len: int) -> dict:
    """One (arm, length) point in its own process; its result, with ``killed`` when the process died."""
    tag = f"{preset}-{arm.replace('+', '_')}-{length}"
    result = work / f"memory-{tag}.json"
    result.unlink(missing_ok=True)
    spec = {"arm": arm, "length": length, "rows": p["rows"], "vocab": _vocab(model), "model": str(model),
            "data": str(data / "train.parquet"), "prompt": prompt, "prompt_len": prompt_len, "device": p["device"],
            "threads": p["threads"], "checkpointing": p["checkpointing"], "limit_gb": p["limit_gb"],
            "run_dir": str(work / f"memory-run-{tag}"), "result": str(result)}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", p["device"])}
    if arm == "trl+liger":  # Liger's Triton kernels as a user runs them, not under the test suite's interpreter
        env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.memory_sweep", "--child", json.dumps(spec)], cwd=ROOT,
                              env=env, timeout=p["timeout"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        tail, rc = proc.stdout[-2000:], proc.returncode
    except subprocess.TimeoutExpired as exc:
        tail, rc = (exc.stdout or b"")[-2000:].decode(errors="replace"), None
    if result.is_file():
        res = json.loads(result.read_text())
    elif rc is None:
        res = {"status": "timeout", "error": f"stopped after {p['timeout']:.0f} s"}
    else:  # no result: the process died (rc -9: the kernel's OOM killer, or a signal from outside)
        res = {"status": "OOM" if rc == -9 else "error", "error": f"exit {rc}: {tail[-600:]}", "killed": rc == -9}
    return {"bench": "memory_sweep", "preset": preset, "arm": arm, "length": length, "rows": p["rows"],
            "tokens": p["rows"] * (prompt_len + length), "prompt_len": prompt_len, "device": p["device"],
            "limit_gb": p["limit_gb"], "checkpointing": p["checkpointing"], "wall_s": time.perf_counter() - t0,
            **res}


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def first_prompt(model: Path, data: Path) -> tuple[list, int]:
    """(the chat messages of the demo task's first training prompt, its length in tokens)."""
    import pandas as pd

    from bench.trainer import load_tok

    messages = [dict(m) for m in pd.read_parquet(data / "train.parquet")["prompt"].iloc[PROMPT_INDEX]]
    ids = load_tok(str(model)).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return messages, len(ids)


def plot(rows: list[dict], out: Path) -> Path:
    """Peak memory (GiB) against answer length, one line per arm; the limit dashed, the lengths an arm ran out
    at as crosses, the errors it could not run at listed in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = any(r["device"] == "cuda" for r in rows)
    key = "peak_gpu_mb" if gpu else "peak_rss_mb"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in ARMS:
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["length"])
        ok = [r for r in mine if r["status"] == "ok"]
        if ok:
            ax.plot([r["length"] for r in ok], [r[key] / 1024 for r in ok], marker="o", label=arm)
        out_at = [r for r in mine if r["status"] == "OOM"]
        if out_at:
            ax.plot([out_at[0]["length"]], [ax.get_ylim()[1] if not out_at[0].get(key) else out_at[0][key] / 1024],
                    marker="x", markersize=10, linestyle="none", color="black",
                    label=f"{arm}: out of memory at {out_at[0]['length']}")
        if mine and not ok and not out_at:
            ax.plot([], [], linestyle="none", label=f"{arm}: did not run ({mine[0].get('error', '')[:40]}…)")
    limit = next((r["limit_gb"] for r in rows if r.get("limit_gb")), 0)
    if limit and not gpu:
        ax.axhline(limit * GIB / 2**30, linestyle="--", color="grey", label=f"limit {limit:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per answer")
    ax.set_ylabel("peak GPU memory, GiB" if gpu else "peak RSS, GiB")
    ax.set_title(f"one rollout batch at vocabulary 151,936 ({rows[0]['rows']} answers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--lengths", default=None, help="tokens per answer, comma-separated (the preset's by default)")
    ap.add_argument("--rows", type=int, default=None, help="answers per rollout batch (the preset's by default)")
    ap.add_argument("--limit-gb", type=float, default=None, help="CPU: RLIMIT_DATA of each point's process in GiB "
                    "(the preset's by default; 0: none)")
    ap.add_argument("--work", default="runs/bench-trainer", help="where the model and the demo task go")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--jsonl", default=None, help="where the lines go (default <out>/<device>/memory-<date>.jsonl)")
    ap.add_argument("--plot", default=None, metavar="JSONL", help="only draw the plot of a results file")
    ap.add_argument("--out-png", default=None, help="where --plot writes (default: beside the JSONL)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(json.loads(args.child))
    if args.plot is not None:
        src = Path(args.plot)
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        print(plot(rows, Path(args.out_png) if args.out_png else src.with_suffix(".png")))
        return 0
    import torch

    from bench import _measure as M
    from bench.trainer import task_data

    p = dict(PRESETS[args.preset])
    if args.lengths:
        p["lengths"] = [int(x) for x in args.lengths.split(",") if x.strip()]
    if args.rows:
        p["rows"] = args.rows
    if args.limit_gb is not None:
        p["limit_gb"] = args.limit_gb
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    if p["device"] == "cuda" and not torch.cuda.is_available():
        log("[bench.memory_sweep] preset needs CUDA; none here")
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = M.env_info(torch.device(p["device"]))
    out = Path(args.jsonl) if args.jsonl else (Path(args.out) / env["device_slug"] /
                                               f"memory-{_dt.date.today().isoformat()}.jsonl")
    data = task_data(work)
    model = build_model(work, args.preset)
    prompt, prompt_len = first_prompt(model, data)
    meta = {"machine": env["device_name"], "torch": torch.__version__,
            "command": "python -m bench.memory_sweep " + " ".join(argv if argv is not None else sys.argv[1:])}
    t_all = time.perf_counter()
    for arm in arms:
        ran_out = None
        for length in sorted(p["lengths"]):
            if ran_out is not None:
                row = {"bench": "memory_sweep", "preset": args.preset, "arm": arm, "length": length,
                       "rows": p["rows"], "device": p["device"], "limit_gb": p["limit_gb"], "status": "skipped",
                       "error": f"ran out of memory at {ran_out} tokens per answer"}
            else:
                log(f"[bench.memory_sweep] {arm}, {length} tokens per answer x {p['rows']} ...")
                row = run_point(arm, length, p, args.preset, work, model, data, prompt, prompt_len)
                peak = row.get("peak_gpu_mb", row.get("peak_rss_mb"))
                log(f"[bench.memory_sweep] {arm} {length}: {row['status']}, peak {peak or 0:.0f} MB"
                    + (f" ({row.get('error', '')[:200]})" if row["status"] != "ok" else "")
                    + f" in {row['wall_s']:.0f}s")
                if row["status"] == "OOM":
                    ran_out = length
            M.append_jsonl(out, {**meta, **row})
            if row["status"] in ("error", "timeout") and length == min(p["lengths"]):
                break  # an arm that cannot run here (Liger off CUDA) is not tried at longer lengths
    log(f"[bench.memory_sweep] done in {time.perf_counter() - t_all:.0f}s; lines in {out}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("preset") == args.preset and r.get("rows") == p["rows"]]
    if rows:
        log(f"[bench.memory_sweep] plot: {plot(rows, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
