"""Run a study: several arms (config overrides) from one base config and one start, then one report.

    python -m fastcov.trainer.study configs/studies/jin-reweight.yaml [--out DIR] [--arms a,b] [KEY=VALUE ...]

A study file (YAML)::

    title: GRPO vs GRPO + positive-advantage re-weighting vs KL-Cov
    base: configs/demo.yaml              # relative to the repository root (or absolute)
    out: runs/study-jin                  # report.md, plots and one run directory per arm
    setup: demo                          # write the demo's task and warm-start its tiny model first
    common: [trainer.eval_k=4]           # overrides for every arm
    arms:
      grpo: [algo.mode=vanilla]
      grpo_reweight: [algo.mode=vanilla, algo.pos_weight_schedule=true]
      kl_cov: [algo.mode=kl_cov]

``setup: demo`` runs steps 1-2 of ``make demo`` into ``<out>/data`` and ``<out>/sft`` (``--reuse-sft`` keeps
an existing warm-start model) and points every arm at them; ``setup: none`` leaves model and data to the
base config and overrides. Command-line KEY=VALUE overrides apply to every arm, after the study's own.
Each arm trains with ``--overwrite`` semantics (an earlier run is moved aside, never deleted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_study(path: str | Path) -> dict:
    import yaml

    from fastcov.cli import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"study file {str(p)!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("arms"), dict) or not data["arms"]:
        raise UserError(f"{p}: a study needs 'arms', a mapping of name -> list of KEY=VALUE overrides")
    for key in data:
        if key not in ("title", "base", "out", "setup", "common", "arms", "notes"):
            raise UserError(f"{p}: unknown study key {key!r} (title, base, out, setup, common, arms, notes)")
    if data.get("setup", "none") not in ("demo", "none"):
        raise UserError(f"{p}: setup must be 'demo' or 'none', got {data.get('setup')!r}")
    for name, over in data["arms"].items():
        if not isinstance(over, list) or not all(isinstance(o, str) and "=" in o for o in over):
            raise UserError(f"{p}: arms.{name} must be a list of KEY=VALUE strings")
    return data


def _resolve(path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() or p.exists() else ROOT / p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastcov.trainer.study", description=__doc__.splitlines()[0])
    ap.add_argument("study", help="study YAML (see configs/studies/)")
    ap.add_argument("--out", default=None, help="output directory (default: the study's 'out')")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    ap.add_argument("--sft-steps", type=int, default=None, help="setup: demo: warm-start steps")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=128)
    ap.add_argument("--reuse-sft", action="store_true", help="setup: demo: keep an existing warm-start model")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every arm")
    args = ap.parse_intermixed_args(argv)
    if not os.environ.get("DS_ACCELERATOR"):
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
    from fastcov.cli import UserError
    from fastcov.trainer.config import load_config
    from fastcov.trainer.report import write_report
    from fastcov.trainer.train import train

    try:
        study = load_study(args.study)
        arms = list(study["arms"])
        if args.arms:
            wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
            for a in wanted:
                if a not in study["arms"]:
                    raise UserError(f"--arms: unknown arm {a!r} (the study has {', '.join(arms)})")
            arms = wanted
        out = Path(args.out or study.get("out") or "runs/study")
        base = _resolve(study.get("base", "configs/demo.yaml"))
        setup: list[str] = []
        t_start = time.perf_counter()
        if study.get("setup") == "demo":
            from fastcov.trainer import demo

            data_dir, sft_dir = out / "data", out / "sft"
            demo.write_task(data_dir, args.n_train, args.n_val, 2, 9, seed=0)
            if not (args.reuse_sft and (sft_dir / "model" / "config.json").exists()):
                steps = args.sft_steps if args.sft_steps is not None else demo.SFTConfig.steps
                print(f"[study] warm-start: supervised training of the demo's tiny Qwen2 ({steps} steps)", flush=True)
                demo.warm_start(sft_dir, data_dir, demo.SFTConfig(steps=steps), 2, 9)
            setup = [f"model.path={sft_dir / 'model'}", f"data.train_files=[{data_dir / 'train.parquet'}]",
                     f"data.val_files=[{data_dir / 'val.parquet'}]"]
        cfgs = {a: load_config(base, setup + list(study.get("common") or []) + list(study["arms"][a])
                               + [f"trainer.run_dir={out / a}"] + list(args.overrides)) for a in arms}
    except UserError as exc:
        print(f"study: {exc}", file=sys.stderr)
        return 2
    run_dirs, timings = [], {}
    for a in arms:
        print(f"[study] training {a} (mode {cfgs[a].algo.mode}, {cfgs[a].trainer.max_steps} steps)", flush=True)
        t0 = time.perf_counter()
        run_dirs.append(train(cfgs[a], overwrite=True))
        timings[a] = time.perf_counter() - t0
    total = time.perf_counter() - t_start
    pre = (f"Study `{os.path.relpath(args.study)}` on `{os.path.relpath(base)}`; wall time {total:.0f}s ("
           + ", ".join(f"{a} {s:.0f}s" for a, s in timings.items()) + ").")
    if study.get("notes"):
        pre += "\n\n" + str(study["notes"]).strip()
    report, _ = write_report(run_dirs, out, study.get("title", "fastcov study"), pre)
    print(report.read_text())
    print(f"[study] report: {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
