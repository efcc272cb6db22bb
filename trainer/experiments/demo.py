"""`make demo`: GRPO vs Clip-Cov vs KL-Cov on a tiny model, on CPU, in minutes.

1. writes the synthetic arithmetic task (runs/demo/data/{train,val}.parquet) and harder.parquet, held-out
   problems with one operation more than any training problem;
2. builds a tiny Qwen2-architecture model and its offline tokenizer, and warm-starts it with a short
   supervised run on worked solutions in four styles (runs/demo/sft/model), so that it answers some
   problems right and has real entropy over how to answer;
3. trains GRPO (vanilla loss), Clip-Cov and KL-Cov from that same start and seed with configs/demo.yaml
   (runs/demo/<algo>/metrics.jsonl);
4. evaluates the start model and each run's end on harder.parquet (pass@8, mean@8; <algo>/harder_eval.json);
5. writes runs/demo/report.md and the plots (entropy.png, val_acc.png, law.png) and prints a summary.

Running it again is safe: each algorithm's earlier run directory is moved aside to
``runs/demo/<algo>.old-<time>`` (trainer --overwrite), nothing is deleted.

    python -m fastcov.trainer.demo [--out runs/demo] [--algos grpo,clip_cov,kl_cov] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fastcov.trainer.data.synthetic import SOLUTION_STYLES
from fastcov.trainer.experiments.configs import shipped_config

ALGOS = {"grpo": "vanilla", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}

# MKL, ATen's vectorized kernels and oneDNN each pick a code path by the CPU's vector width (AVX-512 and AMX
# on many Intel CPUs, AVX2 on AMD's), the paths round differently, and RL turns a last-bit difference into
# a different run. ATen and oneDNN are pinned to their AVX2 paths. MKL (torch's fp32 GEMM) is pinned to its
# COMPATIBLE branch, the one MKL keeps the same on every x86-64 CPU: its AVX2 branch exists on Intel CPUs
# only, and elsewhere MKL silently falls back to its own dispatch (docs/reproducibility.md: with MKL_CBWR=AVX2
# the warm start differed between an AMD EPYC and an Intel Xeon; COMPATIBLE costs the demo ~20 s of GEMM
# time in its warm start). Values the user already set are kept.
REPRODUCIBLE_CPU_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (/proc/cpuinfo), or the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def reproducible_cpu_env(environ: dict[str, str], machine: str, cpu_flags: set[str]) -> dict[str, str] | None:
    """The environment to re-run with so the CPU numbers don't depend on the CPU model, or None when
    there is nothing to add (all set already, not x86-64, no AVX2, or FASTCOV_NATIVE_CPU=1)."""
    if machine.lower() not in ("x86_64", "amd64") or "avx2" not in cpu_flags:
        return None
    if environ.get("FASTCOV_NATIVE_CPU") == "1" or all(k in environ for k in REPRODUCIBLE_CPU_ENV):
        return None
    return {**REPRODUCIBLE_CPU_ENV, **environ}


def reexec_for_reproducible_cpu(module: str) -> None:
    """Re-execute ``python -m module`` once with REPRODUCIBLE_CPU_ENV added: torch reads these variables
    when it loads, so they cannot be set from inside a process that has imported it."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return
    env = reproducible_cpu_env(dict(os.environ), platform.machine(), flags)
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)

# Held-out prompts of the demo task. 512, not 128: pass@8 and mean@8 differences of a few points are then
# measurable (SE of a mean over 512 prompts ≈ 0.01-0.02). The validation questions are excluded from the
# training and warm-start problems, so this number also fixes the problems both are drawn from.
N_VAL = 512
# The demo task's size: operations per problem (1 to MAX_OPS) and the largest operand.
MAX_OPS, MAX_VALUE = 2, 9

# The tiny model: ~0.2M parameters; the vocabulary is the task's ~130 word/digit tokens.
ARCH = dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, rope_theta=10000.0)


@dataclass
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    n_problems: int = 4000
    seed: int = 0
    # torch CPU threads while warm-starting (restored after): the model must not depend on the core count.
    threads: int = 1
    # Styles are sampled with these weights; the mix is the entropy RL starts from.
    style_weights: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)


def style_weights_error(weights) -> str | None:
    """Why ``weights`` is not a warm-start mix of the answer styles (one non-negative number per entry of
    SOLUTION_STYLES, with a positive sum), or None when it is one."""
    ok = (len(weights) == len(SOLUTION_STYLES) and all(isinstance(w, (int, float)) and w >= 0 for w in weights)
          and sum(weights) > 0)
    return None if ok else (f"expected {len(SOLUTION_STYLES)} non-negative numbers with a positive sum "
                            f"({'/'.join(SOLUTION_STYLES)})")


def write_task(data_dir: Path, n_train: int, n_val: int, max_ops: int, max_value: int, seed: int) -> None:
    """train.parquet (1 to ``max_ops`` operations), val.parquet (``n_val`` held-out problems of the same kind)
    and harder.parquet (``n_val`` problems with ``max_ops + 1`` operations) in ``data_dir``."""
    from fastcov.trainer.data.synthetic import write_task as _write

    data_dir.mkdir(parents=True, exist_ok=True)
    _write(str(data_dir / "train.parquet"), str(data_dir / "val.parquet"), n_train, n_val, seed,
           1, max_ops, max_value, harder_path=str(data_dir / "harder.parquet"))


# The second evaluation, of the start model and of each run's end: the held-out problems with one operation
# more than any training problem (harder.parquet), 8 samples per prompt at T = 0.6 as in the study's pass@k.
HARDER_K, HARDER_TEMPERATURE = 8, 0.6


def evaluate_harder(run_dir: Path, start_model: Path, data_file: Path, seed: int, max_new_tokens: int,
                    cache: dict | None = None, threads: int = 1) -> dict:
    """pass@8, mean@8 and distinct answers per prompt on ``data_file`` of ``start_model`` ("start") and of the
    run's final model ("end"), sampled with the run's seed on ``threads`` torch threads; also written to
    ``<run_dir>/harder_eval.json``. ``cache`` holds the start model's numbers by seed and response length: every
    arm of a seed starts from the same model and samples the same way."""
    import json

    import torch

    from fastcov.trainer.evaluation import evaluate_model

    def numbers(model: Path) -> dict:
        res = evaluate_model(str(model), [str(data_file)], k=HARDER_K, temperature=HARDER_TEMPERATURE,
                             max_new_tokens=max_new_tokens, seed=seed, sample_all=True)
        return {"prompts": res["prompts"], f"pass@{HARDER_K}": res[f"val_pass@{HARDER_K}"],
                f"mean@{HARDER_K}": res[f"val_mean@{HARDER_K}"], "distinct_answers": res.get("val_distinct_answers")}

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = {} if cache is None else cache
        key = (str(start_model), seed, max_new_tokens)
        if key not in cache:
            cache[key] = numbers(start_model)
        out = {"data": str(data_file), "k": HARDER_K, "temperature": HARDER_TEMPERATURE, "seed": seed,
               "start": cache[key], "end": numbers(Path(run_dir) / "final")}
    finally:
        torch.set_num_threads(threads_before)
    (Path(run_dir) / "harder_eval.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def evaluate_harder_runs(run_dirs: dict, cfgs: dict, data_file: Path, start_model: Path, tag: str,
                         keep: set | None = None) -> dict:
    """``evaluate_harder`` for every run of ``run_dirs`` (key -> run directory; ``cfgs`` has the same keys), each
    sampled with its run's seed and threads; {} when ``data_file`` does not exist (a task written before it had one).
    A run whose key is in ``keep`` and that was already evaluated on ``data_file`` keeps its ``harder_eval.json``."""
    from fastcov.trainer.runtime.lora import is_adapter_dir

    if not data_file.is_file():
        return {}
    print(f"[{tag}] evaluating the start model and every run on {data_file} ({HARDER_K} samples per prompt)",
          flush=True)
    cache: dict = {}
    out = {}
    for key, d in run_dirs.items():
        final = Path(d) / "final"
        if not ((final / "config.json").is_file() or is_adapter_dir(final)):  # stopped before its export
            print(f"[{tag}] {d}: no final model, not evaluated on {data_file.name}", flush=True)
            continue
        if key in (keep or ()) and (earlier := _earlier_harder(Path(d), data_file)) is not None:
            out[key] = earlier
            continue
        out[key] = evaluate_harder(d, start_model, data_file, cfgs[key].trainer.seed, cfgs[key].rollout.max_new_tokens,
                                   cache, max(1, cfgs[key].trainer.threads))
    return out


def _earlier_harder(run_dir: Path, data_file: Path) -> dict | None:
    """The run's ``harder_eval.json`` when it holds an evaluation on ``data_file``, else None."""
    import json

    try:
        earlier = json.loads((run_dir / "harder_eval.json").read_text())
    except (OSError, ValueError):
        return None
    return earlier if isinstance(earlier, dict) and earlier.get("data") == str(data_file) else None


def harder_lines(harder: dict[str, dict], ops: int) -> list[str]:
    """The demo's table of the harder split (start model, then each algorithm) and what it shows."""
    k = HARDER_K
    if not harder:
        return []
    first = next(iter(harder.values()))
    trained = "1" if ops == 2 else "1 or 2" if ops == 3 else f"1 to {ops - 1}"
    lines = [f"Held-out problems with {ops} operations (training problems have {trained}), {first['end']['prompts']} "
             f"prompts, {k} samples each at T = {HARDER_TEMPERATURE}:", "",
             f"| model | pass@{k} | mean@{k} | answers per prompt |", "|---|---:|---:|---:|"]
    rows = [("start model", first["start"])] + [(name, h["end"]) for name, h in harder.items()]
    for name, r in rows:
        da = r.get("distinct_answers")
        lines.append(f"| {name} | {r[f'pass@{k}']:.3f} | {r[f'mean@{k}']:.3f} | "
                     f"{'—' if da is None else f'{da:.2f}'} |")
    g = harder.get("grpo")
    if g:
        lost = g["start"][f"pass@{k}"] - g["end"][f"pass@{k}"]
        lines += ["", f"- GRPO's pass@{k} on these problems went {g['start'][f'pass@{k}']:.3f} → "
                  f"{g['end'][f'pass@{k}']:.3f} ({'lost' if lost > 0 else 'gained'} {abs(lost):.3f})."]
        for name, h in harder.items():
            if name != "grpo":
                gap = h["end"][f"pass@{k}"] - g["end"][f"pass@{k}"]
                mgap = h["end"][f"mean@{k}"] - g["end"][f"mean@{k}"]
                lines.append(f"- {name} − GRPO: pass@{k} {gap:+.3f}, mean@{k} {mgap:+.3f} (one seed; "
                             "`make study` gives intervals).")
    return lines


def warm_start(out_dir: Path, data_dir: Path, scfg: SFTConfig, max_ops: int, max_value: int,
               arch: dict | None = None, device: str = "cpu") -> dict:
    """Supervised warm-start of a fresh tiny Qwen2 (``arch``: its config, the demo's ARCH by default) on worked
    solutions, on ``device``; saves an HF model dir. Runs on ``scfg.threads`` torch threads, so the model is the
    same on any machine."""
    import torch

    threads_before = torch.get_num_threads()
    if scfg.threads > 0:
        torch.set_num_threads(scfg.threads)
    try:
        return _warm_start(out_dir, data_dir, scfg, max_ops, max_value, arch, device)
    finally:
        torch.set_num_threads(threads_before)


def _warm_start(out_dir: Path, data_dir: Path, scfg: SFTConfig, max_ops: int, max_value: int,
                arch: dict | None = None, device: str = "cpu") -> dict:
    import torch

    from fastcov.trainer.config import ModelConfig
    from fastcov.trainer.data import synthetic
    from fastcov.trainer.data.loading import read_parquet
    from fastcov.trainer.runtime.model import PolicyModel, build_model

    torch.manual_seed(scfg.seed)
    rng = random.Random(scfg.seed)
    tok = synthetic.build_tokenizer()
    val_q = {row["messages"][0]["content"] for row in read_parquet(data_dir / "val.parquet")}
    problems = synthetic.generate(scfg.n_problems, scfg.seed + 555, 1, max_ops, max_value, exclude=val_q)
    model = build_model(ModelConfig(arch=dict(arch or ARCH), tokenizer="builtin:arith"), torch.device(device),
                        torch.float32, tok)
    policy = PolicyModel(model).train()
    opt = torch.optim.AdamW(policy.parameters(), lr=scfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / scfg.steps))
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def encode(p, style):
        prompt = tok.apply_chat_template([{"role": "user", "content": p.question()}],
                                         add_generation_prompt=True, tokenize=False)
        pids = tok(prompt, add_special_tokens=False)["input_ids"]
        rids = tok(synthetic.solution(p, style), add_special_tokens=False)["input_ids"] + [eos]
        return pids, rids

    t0 = time.perf_counter()
    loss_v = float("nan")
    for _ in range(scfg.steps):
        batch = [encode(rng.choice(problems), rng.choices(synthetic.SOLUTION_STYLES, scfg.style_weights)[0])
                 for _ in range(scfg.batch_size)]
        L = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((len(batch), L), pad)
        att = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (p, r) in enumerate(batch):
            n = len(p) + len(r)
            ids[i, :n] = torch.tensor(p + r)
            att[i, :n] = 1
            labels[i, len(p) - 1 : n - 1] = torch.tensor(r)
        ids, att, labels = ids.to(device), att.to(device), labels.to(device)
        out = policy(ids, att, labels, entropy=False)
        mask = labels != -100
        loss = -(out.logprob * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
    model_dir = out_dir / "model"
    model.config.use_cache = True  # type: ignore[union-attr]  # a Hugging Face model (nn.Module types its attributes)
    model.save_pretrained(model_dir)  # type: ignore[operator]
    tok.save_pretrained(model_dir)
    return {"sft_loss": loss_v, "sft_seconds": time.perf_counter() - t0, "sft_steps": scfg.steps}


def verdict(summaries: list[dict]) -> str:
    """Plain statements of what the numbers show (whatever they show)."""
    by = {s["name"]: s for s in summaries}
    lines = []
    g = by.get("grpo")
    if g and g["final_entropy"] is not None:
        h0 = g["first_entropy"]
        lines.append(f"- GRPO entropy went {h0:.3f} → {g['final_entropy']:.3f} nats/token "
                     f"({'collapsed' if g['final_entropy'] < 0.5 * h0 else 'did not collapse'} "
                     f"by the 'below half of the start' yardstick; end = the mean of the last 10% of steps).")
        for name in ("clip_cov", "kl_cov"):
            s = by.get(name)
            if s and s["final_entropy"] is not None and g["final_entropy"] > 0:
                ratio = s["final_entropy"] / g["final_entropy"]
                lines.append(f"- {name} end entropy {s['final_entropy']:.3f} = {ratio:.2f}× GRPO's "
                             f"({'higher' if ratio > 1.1 else 'not clearly higher'}).")
        for s in summaries:
            if s["final_val_acc"] is not None:
                lines.append(f"- {s['name']}: validation accuracy {s['initial_val_acc']:.3f} → "
                             f"{s['final_val_acc']:.3f} (best {s['best_val_acc']:.3f}).")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fastcov.trainer.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--config", default=str(shipped_config("demo.yaml")))
    ap.add_argument("--algos", default="grpo,clip_cov,kl_cov")
    ap.add_argument("--sft-steps", type=int, default=SFTConfig.steps)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=N_VAL, help="held-out prompts (default %(default)s)")
    ap.add_argument("--max-ops", type=int, default=MAX_OPS)
    ap.add_argument("--max-value", type=int, default=MAX_VALUE)
    ap.add_argument("--style-weights", default=",".join(str(w) for w in SFTConfig.style_weights),
                    help="warm-start mix of the answer styles " + "/".join(SOLUTION_STYLES) + " (comma-separated)")
    ap.add_argument("--reuse-sft", action="store_true", help="keep an existing warm-start model")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for the warm-start and the RL runs (trainer.threads); the numbers "
                         "do not depend on the machine's core count (default 1)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="RL runs trained at once, each in its own process (default 0: all of them; on 2 cores three "
                         "1-thread runs share the cores with no idle tail); the numbers do not depend on it")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every RL run")
    return ap


def print_summary(summaries: list[dict]) -> None:
    """The table `make demo` prints (entropy, validation accuracy, the fitted law) and the verdict."""
    print("\n[demo] summary")
    print(f"{'algo':<10} {'entropy first→end':>22} {'val acc init→final':>20} {'fit a, b, R², ceiling':>34}")
    for s in summaries:
        law = s["law"]
        fit = (f"{law.a:.3g}, {law.b:.3g}, {law.r2:.2f}, {law.ceiling:.3f}" if law else "n/a")
        print(f"{s['name']:<10} {s['first_entropy']:>10.3f} → {s['final_entropy']:<9.3f} "
              f"{s['initial_val_acc']:>8.3f} → {s['final_val_acc']:<8.3f} {fit:>34}")
    print(verdict(summaries))


def _checked(ap: argparse.ArgumentParser, args) -> tuple[list[str], tuple[float, ...]]:
    """The algorithms and the warm-start's style weights from the command line; a usage error names the flag."""
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    for a in algos:
        if a not in ALGOS:
            ap.error(f"--algos: unknown algorithm {a!r} (choose from {', '.join(ALGOS)})")
    try:
        style_weights = tuple(float(w) for w in args.style_weights.split(","))
    except ValueError:
        ap.error(f"--style-weights: expected comma-separated numbers, got {args.style_weights!r}")
    if (problem := style_weights_error(style_weights)) is not None:
        ap.error(f"--style-weights: {problem}, got {args.style_weights!r}")
    return algos, style_weights


def set_up_process(threads: int) -> None:
    """What a study's launcher does first: DeepSpeed on the CPU where there is no GPU (unless DS_ACCELERATOR says
    otherwise) and ``threads`` torch threads (0: torch's default)."""
    import torch

    if not os.environ.get("DS_ACCELERATOR") and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if threads > 0:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    import torch

    set_up_process(args.threads)
    if not torch.cuda.is_available():
        print(f"[demo] CPU: {cpu_model()}; code paths: ATen {torch.backends.cpu.get_cpu_capability()}, "
              f"MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}, {args.threads} thread(s) per run")
    from fastcov.trainer.config import ConfigError, load_config
    from fastcov.trainer.experiments.report import write_report
    from fastcov.trainer.experiments.runs import train_runs
    from fastcov.trainer.train import train

    algos, style_weights = _checked(ap, args)
    out = Path(args.out)
    data_dir, sft_dir = out / "data", out / "sft"
    t_start = time.perf_counter()

    write_task(data_dir, args.n_train, args.n_val, args.max_ops, args.max_value, seed=0)
    if args.reuse_sft and (sft_dir / "model" / "config.json").exists():
        sft = {"sft_seconds": 0.0, "sft_steps": "reused"}
    else:
        print(f"[demo] warm-start: supervised training of a tiny Qwen2 ({args.sft_steps} steps)", flush=True)
        sft = warm_start(sft_dir, data_dir, SFTConfig(steps=args.sft_steps, style_weights=style_weights,
                                                      threads=args.threads), args.max_ops, args.max_value)
        print(f"[demo] warm-start done: loss {sft['sft_loss']:.3f} in {sft['sft_seconds']:.0f}s", flush=True)

    cfgs = {}
    for algo in algos:
        overrides = [
            f"model.path={sft_dir / 'model'}",
            f"data.train_files=[{data_dir / 'train.parquet'}]",
            f"data.val_files=[{data_dir / 'val.parquet'}]",
            f"algo.mode={ALGOS[algo]}",
            f"trainer.run_dir={out / algo}",
            f"trainer.threads={args.threads}",
        ] + list(args.overrides)
        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        cfgs[(algo, None)] = cfg
    jobs = args.jobs if args.jobs > 0 else len(algos)
    print(f"[demo] training {', '.join(algos)} ({jobs} at a time)", flush=True)
    # a second `make demo` moves the previous runs aside (runs/demo/<algo>.old-<time>), never deletes them
    done, timings = train_runs([(a, None) for a in algos], cfgs, False, jobs, train, tag="demo")
    run_dirs = [done[(a, None)] for a in algos]

    from fastcov.trainer.experiments.report import summarize

    summaries = [summarize(d) for d in run_dirs]
    harder = evaluate_harder_runs(done, cfgs, data_dir / "harder.parquet", sft_dir / "model", "demo")
    extra = harder_lines({a: harder[(a, None)] for a in algos if (a, None) in harder}, args.max_ops + 1)
    total = time.perf_counter() - t_start
    pre = (
        "Tiny Qwen2 (2 layers, hidden 96) warm-started on arithmetic word problems, then RL from the same "
        f"start and seed with `{os.path.relpath(args.config)}`. Wall time {total:.0f}s "
        f"(warm-start {sft['sft_seconds']:.0f}s; " + ", ".join(f"{a} {s:.0f}s" for a, s in timings.items())
        + ").\n\n" + verdict(summaries) + ("\n\n" + "\n".join(extra) if extra else "")
    )
    report, summaries = write_report(run_dirs, out, "fastcov demo: GRPO vs Clip-Cov vs KL-Cov", pre)
    print_summary(summaries)
    if extra:
        print("\n" + "\n".join(extra))
    print(f"[demo] report: {report}  plots: {out}/entropy.png {out}/val_acc.png {out}/law.png")
    print(f"[demo] wall time {total:.0f}s")
    return 0


if __name__ == "__main__":
    reexec_for_reproducible_cpu("fastcov.trainer.experiments.demo")
    raise SystemExit(main())
