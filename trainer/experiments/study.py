"""Run a study: several arms (config overrides) from one base config and one start, then one report.

    python -m fastcov.trainer.study configs/studies/jin-reweight.yaml [--out DIR] [--arms a,b] [--seeds 0,1]
        [--jobs 2] [KEY=VALUE ...]

A study file (YAML)::

    title: GRPO vs GRPO + positive-advantage re-weighting vs KL-Cov
    base: configs/demo.yaml              # a shipped config, or a path of your own
    out: runs/study-jin                  # report.md, plots and one run directory per arm
    setup: demo                          # write the demo's task and warm-start its tiny model first
    common: [trainer.eval_k=4]           # overrides for every arm
    arms:
      grpo: [algo.mode=vanilla]
      grpo_reweight: [algo.mode=vanilla, algo.pos_weight.enabled=true]
      kl_cov: [algo.mode=kl_cov]

``seeds: [0, 1, 2]`` trains every arm once per seed (``trainer.seed``; run directories ``<out>/<arm>/seed<s>``)
and reports mean ± 95% confidence intervals across seeds, the gap of each arm to ``grpo`` with its interval,
the selection diagnostics, the entropy law's 15% holdout on ``grpo`` and ``entropy_bands.png``
(``trainer/experiments/study_report.py``); ``pass_k`` (default 8) picks the pass@k column; ``contrasts: ["kl_cov -
kl_cov_random"]`` adds those arm-to-arm gaps (an arm against its control). ``setup: demo`` runs steps
1-2 of ``make demo`` into ``<out>/data`` and ``<out>/sft`` (``--reuse-sft`` keeps
an existing warm-start model) and points every arm at them, and after training evaluates the start model and
every run on ``<out>/data/harder.parquet`` (problems with one operation more than training; the report's
own table); ``task: {max_ops: 3, style_weights: [...]}`` changes
that task and warm-start as the demo's ``--max-ops``, ``--max-value`` and ``--style-weights`` do;
``setup: none`` leaves model and data to the base config and overrides. Command-line KEY=VALUE overrides
apply to every arm, after the study's own. ``selection_contrasts: ["kl_cov_0.1 - kl_cov_random_0.1"]``
pairs a covariance-selected arm with its random-token control: the report then has a section per pair (the
method and ratio read from the arm's config), the overlap of the control with the covariance pick, what the
selected tokens are, and ``selection.png`` (selection − random against the ratio); such a study keeps the
per-seed layout ``<out>/<arm>/seed<s>`` even for one seed, so a smoke run reports the same way.
Each arm trains with ``--overwrite`` semantics (an earlier run is moved aside, never deleted).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from fastcov.trainer.experiments.configs import resolve_config
from fastcov.trainer.experiments.runs import train_runs


def load_study(path: str | Path) -> dict:
    import yaml

    from fastcov.errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"study file {str(p)!r} does not exist")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("arms"), dict) or not data["arms"]:
        raise UserError(f"{p}: a study needs 'arms', a mapping of name -> list of KEY=VALUE overrides")
    for key in data:
        if key not in ("title", "base", "out", "setup", "task", "common", "arms", "notes", "seeds", "pass_k",
                       "contrasts", "selection_contrasts", "target", "headline"):
            raise UserError(f"{p}: unknown study key {key!r} (title, base, out, setup, task, common, arms, notes, "
                            "seeds, pass_k, contrasts, selection_contrasts, target, headline)")
    target = data.get("target")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0):
        raise UserError(f"{p}: target must be a positive number (nats per response token), got {target!r}")
    headline = data.get("headline")
    if headline is not None and (target is None or not isinstance(headline, list) or not headline
                                 or not all(a in data["arms"] for a in headline)):
        raise UserError(f"{p}: headline is a list of arms (drawn beside the controller that held the target best) "
                        f"and needs a target, got {headline!r}")
    seeds = data.get("seeds", [None])
    if not isinstance(seeds, list) or not seeds or not all(s is None or (isinstance(s, int) and s >= 0) for s in seeds):
        raise UserError(f"{p}: seeds must be a non-empty list of non-negative ints, got {seeds!r}")
    if data.get("setup", "none") not in ("demo", "none"):
        raise UserError(f"{p}: setup must be 'demo' or 'none', got {data.get('setup')!r}")
    data["task"] = _task(p, data)
    for name, over in data["arms"].items():
        if not isinstance(over, list) or not all(isinstance(o, str) and "=" in o for o in over):
            raise UserError(f"{p}: arms.{name} must be a list of KEY=VALUE strings")
    for key in ("contrasts", "selection_contrasts"):
        for c in data.get(key) or []:
            pair = _contrast(c)
            if len(pair) != 2 or not all(x in data["arms"] for x in pair):
                raise UserError(f"{p}: {key} entries are 'ARM - ARM' with both arms in 'arms', got {c!r}")
    return data


def _task(p: Path, data: dict) -> dict:
    """The study's ``task`` (setup: demo only) with the demo's defaults filled in: max_ops, max_value,
    style_weights (one non-negative weight per answer style, positive sum)."""
    from fastcov.errors import UserError
    from fastcov.trainer.experiments.demo import MAX_OPS, MAX_VALUE, SFTConfig, style_weights_error

    task = data.get("task") or {}
    if task and data.get("setup") != "demo":
        raise UserError(f"{p}: task applies to setup: demo only (setup is {data.get('setup', 'none')!r})")
    if not isinstance(task, dict):
        raise UserError(f"{p}: task must be a mapping (max_ops, max_value, style_weights), got {task!r}")
    unknown = set(task) - {"max_ops", "max_value", "style_weights"}
    if unknown:
        raise UserError(f"{p}: unknown task key {sorted(unknown)[0]!r} (max_ops, max_value, style_weights)")
    out = {"max_ops": task.get("max_ops", MAX_OPS), "max_value": task.get("max_value", MAX_VALUE),
           "style_weights": list(task.get("style_weights", SFTConfig.style_weights))}
    for key in ("max_ops", "max_value"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
            raise UserError(f"{p}: task.{key} must be a positive int, got {out[key]!r}")
    if (problem := style_weights_error(out["style_weights"])) is not None:
        raise UserError(f"{p}: task.style_weights: {problem}, got {out['style_weights']!r}")
    return out


def _contrast(entry) -> tuple[str, ...]:
    """A study's contrast entry 'ARM - OTHER' as (ARM, OTHER); anything else gives a tuple of another length."""
    return tuple(x.strip() for x in entry.split(" - ")) if isinstance(entry, str) else ()


def _resolve(path: str) -> str:
    return str(resolve_config(path))


def _parser() -> argparse.ArgumentParser:
    from fastcov.trainer.experiments import demo

    ap = argparse.ArgumentParser(prog="python -m fastcov.trainer.study", description=__doc__.splitlines()[0])
    ap.add_argument("study", help="study YAML (see configs/studies/)")
    ap.add_argument("--out", default=None, help="output directory (default: the study's 'out')")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    ap.add_argument("--sft-steps", type=int, default=None, help="setup: demo: warm-start steps")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=demo.N_VAL, help="held-out prompts (default %(default)s)")
    ap.add_argument("--reuse-sft", action="store_true", help="setup: demo: keep an existing warm-start model")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds, replacing the study's")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: write the report again from the runs already in --out")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs in --out that finished (all their steps and a final model) and their "
                         "evaluations on the harder split; train and evaluate the rest (a study that was stopped)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs trained at once, each in its own process (default 1; on CPU at most the core "
                         "count over trainer.threads)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every arm")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_intermixed_args(argv)
    from fastcov.trainer.experiments.demo import set_up_process

    set_up_process(0)  # the runs set their own threads (trainer.threads)
    from fastcov.errors import UserError
    from fastcov.trainer.config import load_config
    from fastcov.trainer.experiments.report import write_report
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
        notes: list[str] = []  # what the report says about how this invocation ran
        t_start = time.perf_counter()
        if study.get("setup") == "demo":
            setup = _demo_setup(out, args, study["task"])
        seeds = study.get("seeds", [None])
        if args.seeds:
            try:
                seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
            except ValueError:
                raise UserError(f"--seeds: expected comma-separated ints, got {args.seeds!r}") from None
        multi = len(seeds) > 1 or bool(study.get("selection_contrasts"))
        runs = [(a, sd) for a in arms for sd in seeds]  # arm-major: one arm's seeds back to back

        def run_dir(a, sd):
            return out / a / f"seed{sd}" if multi else out / a

        cfgs = {(a, sd): load_config(base, setup + list(study.get("common") or []) + list(study["arms"][a])
                                     + [f"trainer.run_dir={run_dir(a, sd)}"]
                                     + ([f"trainer.seed={sd}"] if sd is not None else []) + list(args.overrides))
                for a, sd in runs}
    except UserError as exc:
        print(f"study: {exc}", file=sys.stderr)
        return 2
    if args.report_only:
        run_dirs = {(a, sd): run_dir(a, sd) for a, sd in runs}
        missing = [str(d) for d in run_dirs.values() if not (d / "metrics.jsonl").is_file()]
        if missing:
            print(f"study: --report-only: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
            return 2
        total, timings = _previous_times(out)
        if set(timings) != set(arms):  # not recorded for these arms: the runs' own step times
            timings = {a: sum(_seconds_of(run_dirs[(a, sd)]) for sd in seeds) for a in arms}
    else:
        kept = {key: run_dir(*key) for key in runs if args.resume and _finished(run_dir(*key), cfgs[key])}
        run_dirs, timings = _train_the_rest(runs, kept, cfgs, multi, args.jobs, train, out)
        timings = {a: timings[a] for a in arms}
        if study.get("setup") == "demo":
            from fastcov.trainer.experiments.demo import evaluate_harder_runs

            evaluate_harder_runs(run_dirs, cfgs, out / "data" / "harder.parquet", out / "sft" / "model", "study",
                                 keep=set(kept))
        total = time.perf_counter() - t_start
        notes += _resumed_note(len(kept), len(runs))
    if multi:
        return _seed_report(study, args, out, base, arms, seeds, run_dirs, timings, total, cfgs, notes)
    report_dirs = [run_dirs[(a, seeds[0])] for a in arms]
    pre = (f"Study `{os.path.relpath(args.study)}` on `{os.path.relpath(base)}`; wall time {_wall(total)} ("
           + ", ".join(f"{a} {s:.0f}s" for a, s in timings.items()) + ").")
    if study.get("notes"):
        pre += "\n\n" + str(study["notes"]).strip()
    report, _ = write_report(report_dirs, out, study.get("title", "fastcov study"), pre)
    print(report.read_text())
    print(f"[study] report: {report}")
    return 0


def _demo_setup(out: Path, args, task: dict) -> list[str]:
    """``setup: demo``: the demo's task and warm-start model in ``out`` (nothing written with
    --report-only; an existing model kept with --reuse-sft), and the overrides that point every arm at them.
    ``task`` is the study's (``_task``): the problems' size and the warm-start's mix of answer styles."""
    from fastcov.trainer.experiments import demo

    data_dir, sft_dir = out / "data", out / "sft"
    if not args.report_only:
        demo.write_task(data_dir, args.n_train, args.n_val, task["max_ops"], task["max_value"], seed=0)
        if not (args.reuse_sft and (sft_dir / "model" / "config.json").exists()):
            steps = args.sft_steps if args.sft_steps is not None else demo.SFTConfig.steps
            print(f"[study] warm-start: supervised training of the demo's tiny Qwen2 ({steps} steps)", flush=True)
            scfg = demo.SFTConfig(steps=steps, style_weights=tuple(float(x) for x in task["style_weights"]))
            demo.warm_start(sft_dir, data_dir, scfg, task["max_ops"], task["max_value"])
    return [f"model.path={sft_dir / 'model'}", f"data.train_files=[{data_dir / 'train.parquet'}]",
            f"data.val_files=[{data_dir / 'val.parquet'}]"]


def _previous_times(out: Path) -> tuple[float | None, dict[str, float]]:
    """The wall time and per-arm seconds the study that trained the runs in ``out`` recorded (study.json)."""
    import json

    try:
        data = json.loads((out / "study.json").read_text())
        return float(data["wall_s"]), {a: float(v) for a, v in data.get("arm_seconds", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, {}


_DISPLAY_ONLY = {"trainer.progress"}  # settings that change what a run shows, not what it trains


def _train_the_rest(runs, kept: dict, cfgs: dict, multi: bool, jobs: int, train, out: Path) -> tuple[dict, dict]:
    """Train every run of ``runs`` not in ``kept`` (key -> the finished run's directory, ``--resume``); the run
    directories of all of them in ``runs``' order, and the seconds per arm (a kept run's: its steps' own time, as
    ``--report-only`` counts them)."""
    if kept:
        print(f"[study] --resume: {len(kept)} of {len(runs)} runs finished in {out}, kept: "
              + ", ".join(f"{a}/seed{sd}" if multi else a for a, sd in kept), flush=True)
    todo = [key for key in runs if key not in kept]
    run_dirs, timings = train_runs(todo, cfgs, multi, max(1, jobs), train) if todo else ({}, {})
    for (a, sd), d in kept.items():
        run_dirs[(a, sd)] = d
        timings[a] = timings.get(a, 0.0) + _seconds_of(d)
    return {key: run_dirs[key] for key in runs}, timings


def _resumed_note(kept: int, runs: int) -> list[str]:
    """The report's line on runs ``--resume`` kept (none: no line)."""
    return [f"Resumed (--resume): {kept} of {runs} runs were trained by an earlier invocation and kept; the wall "
            "time is this invocation's, and a kept run's seconds are the sum of its steps' time."] if kept else []


def _finished(run_dir: Path, cfg) -> bool:
    """Whether ``run_dir`` holds a finished run of ``cfg``: metrics up to its last step, the final model, and a
    recorded config that agrees with ``cfg`` on every setting both have (a setting added to the trainer since the
    run was trained is not a difference; ``_DISPLAY_ONLY`` ones are not compared)."""
    from fastcov.trainer.runtime.lora import is_adapter_dir
    from fastcov.trainer.runtime.run_dir import last_step

    final = run_dir / "final"
    if not ((run_dir / "metrics.jsonl").is_file() and last_step(run_dir / "metrics.jsonl") >= cfg.trainer.max_steps
            and ((final / "config.json").is_file() or is_adapter_dir(final))):
        return False
    import yaml

    from fastcov.trainer.config import MOVED_KEYS

    # a run of an earlier version recorded some settings under keys that have moved since
    recorded = {MOVED_KEYS.get(k, k): v for k, v in _flat(_recorded_config(run_dir)).items()}
    wanted = _flat(yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg))))
    differ = sorted(k for k in set(recorded) & set(wanted) if k not in _DISPLAY_ONLY and recorded[k] != wanted[k])
    if differ:
        print(f"[study] --resume: {run_dir} finished with other settings ({', '.join(differ[:3])}"
              f"{', ...' if len(differ) > 3 else ''}), trained again", flush=True)
    return not differ


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested config mapping as {"section.key": value}."""
    out: dict = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _wall(total: float | None) -> str:
    return "unknown" if total is None else f"{total:.0f}s"


def _seconds_of(run_dir: Path) -> float:
    """A finished run's training time: the sum of its steps' ``time/step`` (evaluations not included)."""
    from fastcov.trainer.experiments.report import read_rows

    return sum(r.get("time/step", 0.0) for r in read_rows(run_dir / "metrics.jsonl"))


def _selection_pairs(study: dict, arms, seeds, cfgs: dict, run_dirs: dict | None = None) -> list[dict]:
    """The study's ``selection_contrasts`` among the arms run, each with what its arm's config says: the method
    (algo.mode), its ratio (clip_cov_ratio or kl_cov_ratio), prompts per step and the control's cov_score. The
    config is the one the first seed's run recorded (``<run>/config.yaml``, so ``--report-only`` reports what
    was trained, whatever its own overrides), else the study's."""
    def settings(arm: str) -> dict:
        cfg = cfgs[(arm, seeds[0])]
        algo, trainer = dataclasses.asdict(cfg.algo), dataclasses.asdict(cfg.trainer)
        recorded = _recorded_config(run_dirs[(arm, seeds[0])]) if run_dirs else {}
        done = recorded.get("algo") or {}  # a run of 0.5.0 or earlier recorded the loss keys flat in algo
        return {**algo, **algo["loss"], **done, **(done.get("loss") or {}),
                "prompts_per_step": (recorded.get("trainer") or trainer).get("prompts_per_step")}

    pairs = []
    for entry in study.get("selection_contrasts") or []:
        arm, control = _contrast(entry)
        if arm not in arms or control not in arms:
            continue
        a = settings(arm)
        ratio = a["clip_cov_ratio"] if a["mode"] == "clip_cov" else a["kl_cov_ratio"]
        pairs.append({"arm": arm, "control": control, "method": a["mode"], "ratio": ratio,
                      "prompts": a["prompts_per_step"], "control_score": settings(control)["cov_score"]})
    return pairs


def _recorded_config(run_dir: Path) -> dict:
    """A run's recorded config (``<run>/config.yaml``) as a plain mapping; {} when it has none."""
    import yaml

    try:
        data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _seed_report(study, args, out: Path, base: str, arms, seeds, run_dirs, timings, total, cfgs,
                 notes: list[str] | None = None) -> int:
    """report.md, study.json and entropy_bands.png of a multi-seed study (mean ± 95% CI across seeds); with
    ``selection_contrasts`` also the selection section and selection.png."""
    import json

    from fastcov.trainer.experiments.study_report import (
        best_controller,
        plot_bands,
        plot_harder,
        plot_headline,
        plot_selection,
        plot_target,
        run_numbers,
        selection_section,
        study_tables,
        target_holding,
        write_curves,
    )

    pass_k = int(study.get("pass_k", 8))
    numbers = {a: [run_numbers(run_dirs[(a, sd)], pass_k) for sd in seeds] for a in arms}
    contrasts = [(a, b) for a, b in map(_contrast, study.get("contrasts") or [])]  # pairs: checked on load
    lines, summary = study_tables(numbers, pass_k, contrasts=[c for c in contrasts if all(a in numbers for a in c)])
    plot = plot_bands(numbers, out / "entropy_bands.png")
    curves = write_curves(numbers, seeds, out / "curves.csv")
    head = [f"# {study.get('title', 'fastcov study')}", "",
            f"Study `{os.path.relpath(args.study)}` on `{os.path.relpath(base)}`, seeds {seeds}; wall time "
            f"{_wall(total)} (" + ", ".join(f"{a} {s:.0f}s" for a, s in timings.items()) + ").",
            "Mean ± 95% confidence interval across seeds (Student's t; Welch's for differences). "
            "Entropy end: mean of the last 10% of steps. pass@k / mean@k: the last evaluation.", ""]
    head += [n for note in notes or [] for n in (note, "")]
    if study.get("notes"):
        head += [str(study["notes"]).strip(), ""]
    bars = plot_harder(summary["harder"], out / "harder.png") if "harder" in summary else None
    if study.get("target") is not None:
        target = float(study["target"])
        held, summary["target_holding"] = target_holding(numbers, target)
        target_plot = plot_target(numbers, target, out / "entropy_target.png")
        picture = ["", f"![entropy against the target]({target_plot.name})"] if target_plot else []
        best = best_controller(numbers, summary["target_holding"])
        headline = [a for a in study.get("headline") or [] if a in numbers]
        if headline and best is not None:
            summary["best_controller"] = best
            shown = headline + ([best] if best not in headline else [])
            figure = plot_headline(numbers, target, shown, out / "entropy_headline.png",
                                   f"Rollout entropy against the target {target:g}: " + ", ".join(shown)
                                   + f"\n(line: mean over {len(seeds)} seeds, band: min-max)")
            picture += ["", f"The controller whose mean |H − target| was lowest: **{best}**."] + (
                ["", f"![{', '.join(shown)} against the target]({figure.name})"] if figure else [])
        lines = held + picture + [""] + lines
    pairs = _selection_pairs(study, arms, seeds, cfgs, run_dirs)
    if pairs:
        lines += selection_section(numbers, pairs, pass_k, summary)
        sel_plot = plot_selection(summary["selection"], out / "selection.png", summary["selection_labels"])
        lines += ["", f"![selection − random against the ratio]({sel_plot.name})"] if sel_plot else []
    body = head + lines + (["", f"![entropy across seeds]({plot.name})"] if plot else []) + (
        ["", f"![problems with one operation more]({bars.name})"] if bars else []) + (
        ["", f"Every run's curve (entropy, rollout accuracy, the controller's value per step): `{curves.name}`."])
    (out / "report.md").write_text("\n".join(body) + "\n")
    summary.update(seeds=seeds, pass_k=pass_k, wall_s=total, arm_seconds=timings,
                   runs={f"{a}/seed{sd}": str(run_dirs[(a, sd)]) for a, sd in run_dirs})
    (out / "study.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print("\n".join(body))
    print(f"[study] report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    from fastcov.trainer.experiments.demo import reexec_for_reproducible_cpu

    reexec_for_reproducible_cpu("fastcov.trainer.experiments.study")
    raise SystemExit(main())
