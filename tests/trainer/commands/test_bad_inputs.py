"""Bad inputs, table-driven: every user mistake ends in one line naming what to fix, and changes nothing.

Each case builds its inputs under tmp_path, snapshots the directory tree (paths, sizes, contents), runs
one CLI command in-process (``fastcov.cli.main(argv)``, stderr captured) or one Python API call, and
asserts: the CLI exits 2 with exactly one stderr line that matches the expected message and holds no
traceback (the API raises the expected exception type and message), and the tree is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _fixtures import TINY  # noqa: E402

TORN_STATE = '{"step": 1,'




# ------------------------------------------------------------------------------------------ fixtures

def _row(content="mia has 3 pens .", truth="3"):
    return {"data_source": "synthetic_arith", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


def _parquet(path: Path, rows) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return path


def _data_run(tmp: Path, data_file: Path, *extra: str) -> list[str]:
    """`fastcov train` on tiny.yaml with the user's data file instead of the synthetic task."""
    return ["train", str(TINY), f"trainer.run_dir={tmp / 'run'}", "data.synthetic.enabled=false",
            f"data.train_files=[{data_file}]", *extra]


def _checkpoint(tmp: Path, state: str | None = '{"step": 1, "sampler": {}, "counters": {}}',
                rng: bytes | None = None) -> Path:
    ck = tmp / "run" / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    if state is not None:
        (ck / "trainer_state.json").write_text(state)
    if rng is not None:
        (ck / "rng_rank0.pt").write_bytes(rng)
    return ck


class _RunsCode:
    """Unpickling this would run a shell command: torch.load(weights_only=True) must refuse it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious_rng(tmp: Path) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"python": _RunsCode(tmp / "PWNED"), "numpy": 0, "torch": 0, "generators": {}}, buf)
    return buf.getvalue()


DEAD_HOLDER = '{"pid": 999999, "host": "gone-host", "since": "2020-01-01 00:00:00"}\n'


def _dead_holder(run: Path) -> Path:
    """The lock file a killed run leaves: its holder's details, no flock held. A refused run keeps it as it was."""
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(DEAD_HOLDER)
    return run


_TRAINED: list[Path] = []


def _trained_run(tmp: Path) -> Path:
    """A copy, at ``tmp/run``, of a tiny run trained for one step with a checkpoint (trained once per session),
    whose lock file names a dead holder."""
    import shutil
    import tempfile

    if not _TRAINED:
        from fastcov.trainer.config import load_config
        from fastcov.trainer.train import train

        where = Path(tempfile.mkdtemp(prefix="fastcov-bad-inputs-")) / "run"
        train(load_config(TINY, [f"trainer.run_dir={where}", "reward.sandbox=inline", "trainer.eval_every=0",
                                 "trainer.max_steps=1", "trainer.save_every=1"]))
        _TRAINED.append(where)
    shutil.copytree(_TRAINED[0], tmp / "run")
    return _dead_holder(tmp / "run")


def _hf_model(tmp: Path, damage: str) -> Path:
    """A tiny Hugging Face model directory, then damaged: 'truncated' weights or an 'invalid-json' config.json."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128, tie_word_embeddings=False)
    path = tmp / "model"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    if damage == "truncated":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:5])
    else:
        (path / "config.json").write_text('{"model_type": "qwen2", ')
    return path


def _model_run(tmp: Path, damage: str) -> list[str]:
    return ["train", str(TINY), "model.arch=null", f"model.path={_hf_model(tmp, damage)}",
            f"trainer.run_dir={tmp / 'run'}"]


def _metrics_run(tmp: Path, lines: str) -> Path:
    run = tmp / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(lines)
    return run


# ------------------------------------------------------------------------------------------ the table

@dataclass
class Case:
    id: str
    build: Callable[[Path], list[str] | Callable[[], object]]  # CLI argv, or an API call
    match: str  # regex the message must match
    exc: type = Exception  # API cases: the exception type expected
    missing: tuple[str, ...] = ()  # CLI cases: packages hidden from import (as on a machine without them)


CLI = [
    # --- config files and keys
    Case("config-missing", lambda t: ["train", str(t / "nope.yaml")], r"config file .*nope\.yaml.* does not exist"),
    Case("config-is-dir", lambda t: ["train", str(t)], r"is a directory"),
    Case("config-yaml-syntax", lambda t: (t / "bad.yaml").write_text("model:\n  arch: [1,\n  x: 2\n")
         and ["train", str(t / "bad.yaml")], r"bad\.yaml.*line \d+, column \d+: YAML syntax error"),
    Case("config-not-mapping", lambda t: (t / "list.yaml").write_text("- 1\n- 2\n")
         and ["train", str(t / "list.yaml")], r"list\.yaml.*expected a mapping"),
    Case("config-not-utf8", lambda t: (t / "bin.yaml").write_bytes(b"\xff\xfe\x00model")
         and ["train", str(t / "bin.yaml")], r"bin\.yaml.*not a UTF-8"),
    Case("unknown-key-suggests", lambda t: ["train", str(TINY), "algo.mdoe=kl_cov"],
         r"unknown config key 'algo\.mdoe'; did you mean 'algo\.mode'\?"),
    Case("unknown-section", lambda t: ["train", str(TINY), "trainr.max_steps=1"],
         r"unknown config key 'trainr'; did you mean 'trainer'\?"),
    Case("unknown-key-yaml", lambda t: (t / "c.yaml").write_text(
        "model: {arch: {model_type: qwen2}, tokenizer: 'builtin:arith', colour: red}\n"
        "data: {synthetic: {enabled: true}}\n") and ["train", str(t / "c.yaml")], r"model\.colour"),
    Case("wrong-type-int", lambda t: ["train", str(TINY), "trainer.max_steps=ten"], r"trainer\.max_steps: expected an integer"),
    Case("wrong-type-bool", lambda t: ["train", str(TINY), "trainer.progress=maybe"], r"trainer\.progress: expected true/false"),
    Case("wrong-type-list", lambda t: ["train", str(TINY), "data.train_files=a.parquet"], r"data\.train_files: expected a list"),
    Case("malformed-override", lambda t: ["train", str(TINY), "algo.mode"], r"expected key=value"),
    Case("config-section-is-a-value", lambda t: (t / "s.yaml").write_text(TINY.read_text().replace(
        "\ntrainer:\n", "\ntrainer: 5\nold_trainer:\n")) and ["train", str(t / "s.yaml"), f"trainer.run_dir={t / 'r'}"],
         r"config file .*s\.yaml'?: trainer: expected a section \(key: value lines\), got 5"),
    Case("lr-inf", lambda t: ["train", str(TINY), "optim.lr=.inf"], r"optim\.lr: must be a finite number, got inf"),
    Case("lr-nan", lambda t: ["train", str(TINY), "optim.lr=nan"], r"optim\.lr: must be a finite number, got nan"),
    Case("lr-negative", lambda t: ["train", str(TINY), "optim.lr=-1e-5"], r"optim\.lr: must be > 0"),
    Case("clip-low-range", lambda t: ["train", str(TINY), "algo.loss.clip_low=1.5"], r"algo\.loss\.clip_low: must be in \[0, 1\]"),
    Case("clip-high-nan", lambda t: ["train", str(TINY), "algo.loss.clip_high=.nan"], r"algo\.loss\.clip_high: must be a finite"),
    Case("clip-cov-ratio", lambda t: ["train", str(TINY), "algo.loss.clip_cov_ratio=2"], r"algo\.loss\.clip_cov_ratio: must be in \(0, 1\]"),
    Case("kl-beta-negative", lambda t: ["train", str(TINY), "algo.loss.kl_cov_coef=-1"], r"algo\.loss\.kl_cov_coef: must be (>=|≥) 0"),
    Case("kl-beta-inf", lambda t: ["train", str(TINY), "algo.loss.kl_cov_coef=.inf"], r"algo\.loss\.kl_cov_coef: must be a finite"),
    Case("temperature-zero", lambda t: ["train", str(TINY), "rollout.temperature=0"], r"rollout\.temperature: must be > 0"),
    Case("temperature-inf", lambda t: ["train", str(TINY), "rollout.temperature=.inf"], r"rollout\.temperature: must be a finite"),
    Case("top-p-range", lambda t: ["train", str(TINY), "rollout.top_p=1.5"], r"rollout\.top_p: must be in \(0, 1\]"),
    Case("top-p-nan", lambda t: ["train", str(TINY), "rollout.top_p=.nan"], r"rollout\.top_p: must be a finite"),
    Case("batch-not-divisible", lambda t: ["train", str(TINY), "algo.mini_batches=3"],
         r"algo\.mini_batches: 3 does not divide trainer\.prompts_per_step=4"),
    # --- the run directory and --resume
    Case("run-dir-not-empty", lambda t: _metrics_run(t, '{"step": 0}\n') and
         ["train", str(TINY), f"trainer.run_dir={t / 'r'}"], r"already holds a run .*--resume.*--overwrite"),
    Case("run-dir-is-file", lambda t: (t / "f").write_text("x") and ["train", str(TINY), f"trainer.run_dir={t / 'f'}"],
         r"trainer\.run_dir: .* is a file"),
    Case("resume-and-overwrite", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}", "--resume", "--overwrite"],
         r"--resume and --overwrite exclude each other"),
    Case("resume-missing-path", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}", f"--resume={t / 'ck'}"],
         r"--resume: .*ck' does not exist"),
    Case("resume-incomplete", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}",
                                         f"--resume={_checkpoint(t, state=None)}"], r"not a complete checkpoint"),
    Case("resume-corrupt-state", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}",
                                            f"--resume={_checkpoint(t, state=TORN_STATE)}"],
         r"trainer_state\.json' is damaged"),
    Case("resume-corrupt-rng", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}",
                                          f"--resume={_checkpoint(t, rng=b'PK garbage')}"],
         r"rng_rank0\.pt' is damaged or not a fastcov RNG file"),
    Case("resume-code-in-pickle", lambda t: ["train", str(TINY), f"trainer.run_dir={t / 'run'}",
                                             f"--resume={_checkpoint(t, rng=_malicious_rng(t))}"],
         r"rng_rank0\.pt' is damaged or not a fastcov RNG file"),
    Case("resume-torn-state-keeps-the-lock", lambda t: _dead_holder(t / "run") and _checkpoint(t, state=TORN_STATE)
         and ["train", str(TINY), f"trainer.run_dir={t / 'run'}", "--resume"], r"trainer_state\.json' is damaged"),
    Case("resume-a-file-keeps-the-lock", lambda t: _dead_holder(t / "run") and (t / "run" / "metrics.jsonl").write_text(
        '{"step": 1}\n') and ["train", str(TINY), f"trainer.run_dir={t / 'run'}", f"--resume={t / 'run' / 'metrics.jsonl'}"],
         r"--resume: .*metrics\.jsonl"),
    Case("resume-model-shape-keeps-the-lock", lambda t: _trained_run(t) and [
        "train", str(TINY), f"trainer.run_dir={t / 'run'}", "reward.sandbox=inline", "trainer.max_steps=2",
        "model.arch.hidden_size=64", "model.arch.intermediate_size=128", "--resume"], r"--resume: .*size mismatch"),
    # --- the model
    Case("model-weights-truncated", lambda t: _model_run(t, "truncated"),
         r"model\.path: cannot load .*model': damaged or truncated weights \(SafetensorError: .*header"),
    Case("model-config-json-invalid", lambda t: _model_run(t, "invalid-json"),
         r"model\.path: cannot load .*model': .*config\.json' is not a valid JSON file"),
    # --- optional packages the config asks for, not installed
    Case("engine-vllm-missing", lambda t: ["train", str(TINY), "rollout.engine=vllm", f"trainer.run_dir={t / 'run'}"],
         r"rollout\.engine=vllm needs the package 'vllm', which is not installed: pip install 'fastcov\[vllm\]'",
         missing=("vllm",)),
    Case("lora-peft-missing", lambda t: ["train", str(TINY), "model.lora_rank=4", f"trainer.run_dir={t / 'run'}"],
         r"model\.lora_rank=4 needs the package 'peft', which is not installed: pip install 'fastcov\[lora\]'",
         missing=("peft",)),
    Case("qlora-bitsandbytes-missing", lambda t: ["train", str(TINY), "model.lora_rank=4", "model.quantization=4bit",
                                                  f"trainer.run_dir={t / 'run'}"],
         r"model\.quantization=4bit needs the package 'bitsandbytes'.*fastcov\[lora\]", missing=("bitsandbytes",)),
    Case("model-path-missing", lambda t: ["train", str(TINY), "model.arch=null", f"model.path={t / 'm'}",
                                          f"trainer.run_dir={t / 'run'}"], r"model\.path: .*m' does not exist"),
    Case("model-path-not-model", lambda t: (t / "m").mkdir() or ["train", str(TINY), "model.arch=null",
                                            f"model.path={t / 'm'}", f"trainer.run_dir={t / 'run'}"],
         r"model\.path: .* is not a Hugging Face model directory \(no config\.json\)"),
    Case("model-path-file", lambda t: (t / "m.bin").write_text("x") and ["train", str(TINY), "model.arch=null",
                                      f"model.path={t / 'm.bin'}", f"trainer.run_dir={t / 'run'}"], r"is a file"),
    # --- data files
    Case("data-missing", lambda t: _data_run(t, t / "missing.parquet"),
         r"data\.train_files: data file .*missing\.parquet.* does not exist; fix the path in data\.train_files"),
    Case("val-data-missing", lambda t: _data_run(t, _parquet(t / "ok.parquet", [{"prompt": "hi", "reward_model": {"ground_truth": "1"}}]),
                                                 f"data.val_files=[{t / 'nope.parquet'}]"),
         r"data\.val_files: data file .*nope\.parquet.* does not exist"),
    Case("data-not-parquet", lambda t: (t / "x.parquet").write_text("hello") and _data_run(t, t / "x.parquet"),
         r"x\.parquet: not a readable parquet file"),
    Case("data-missing-column", lambda t: _data_run(t, _parquet(t / "c.parquet", [{"prompt": "hi", "answer": "1"}])),
         r"c\.parquet: missing column 'reward_model'"),
    Case("data-null-in-row", lambda t: _data_run(t, _parquet(t / "n.parquet", [_row(), _row("b", "4"),
                                                                                {**_row("c"), "reward_model": None}])),
         r"n\.parquet row 2: column 'reward_model' must be a struct with a non-null 'ground_truth'"),
    Case("data-bad-prompt-row", lambda t: _data_run(t, _parquet(t / "p.parquet", [_row(), {**_row(), "prompt": [{"role": "user"}]}])),
         r"p\.parquet row 1: column 'prompt' must be a list of \{role, content\} messages"),
    Case("data-jsonl-missing-column", lambda t: (t / "d.jsonl").write_text(
        json.dumps(_row()) + "\n" + json.dumps(_row("b")) + "\n" + json.dumps({"prompt": "x"}) + "\n")
         and _data_run(t, t / "d.jsonl"), r"d\.jsonl line 3: missing column 'reward_model'"),
    Case("data-jsonl-bad-json", lambda t: (t / "e.jsonl").write_text(json.dumps(_row()) + "\n{oops\n")
         and _data_run(t, t / "e.jsonl"), r"e\.jsonl line 2: not valid JSON"),
    Case("data-empty", lambda t: _data_run(t, _parquet(t / "empty.parquet", [])), r"empty\.parquet: (no rows|missing column)"),
    Case("data-all-too-long", lambda t: _data_run(t, _parquet(t / "long.parquet", [_row("mia has 3 pens . " * 60)])),
         r"data\.train_files: no usable training prompts"),
    # --- usage errors of each command
    Case("no-config-arg", lambda t: ["train"], r"the following arguments are required: config"),
    Case("unknown-command", lambda t: ["trian"], r"unknown command 'trian'"),
    Case("unknown-flag", lambda t: ["train", str(TINY), "--bogus"], r"unrecognized arguments: --bogus"),
    Case("eval-model-missing", lambda t: ["eval", "--model", str(t / "m"), "--data", str(t / "v.parquet")],
         r"--model: .*m' does not exist"),
    Case("eval-model-not-model", lambda t: (t / "m").mkdir() or ["eval", "--model", str(t / "m"), "--data", "v.parquet"],
         r"--model: .* is not a Hugging Face model directory"),
    Case("eval-temperature-nan", lambda t: ["eval", "--model", str(t), "--data", "v", "--temperature", "nan"],
         r"--temperature: must be a finite number > 0"),
    Case("eval-k-zero", lambda t: ["eval", "--model", str(t), "--data", "v", "--k", "0"], r"--k must be >= 1"),
    Case("plan-gpus-zero", lambda t: ["plan", "--model", "qwen2.5-7b", "--gpus", "0", "--tokens-per-gpu", "8"],
         r"--gpus: must be >= 1"),
    Case("plan-memory-nan", lambda t: ["plan", "--model", "qwen2.5-7b", "--gpus", "1", "--tokens-per-gpu", "8",
                                       "--gpu-memory", "nan"], r"--gpu-memory: must be a finite number"),
    Case("plan-unknown-model", lambda t: ["plan", "--model", "gpt-9", "--gpus", "1", "--tokens-per-gpu", "8"],
         r"--model: unknown preset 'gpt-9'"),
    Case("plan-bad-json", lambda t: (t / "config.json").write_text("{nope") and
         ["plan", "--model", str(t / "config.json"), "--gpus", "1", "--tokens-per-gpu", "8"], r"is not valid JSON"),
    Case("fit-law-missing", lambda t: ["fit-law", str(t / "m.jsonl")], r"no such file: .*m\.jsonl"),
    Case("fit-law-bad-line", lambda t: (t / "m.jsonl").write_text('{"entropy": 1, "val_acc": 0}\n{oops}\n{}\n')
         and ["fit-law", str(t / "m.jsonl")], r"m\.jsonl:2: not valid JSON"),
    Case("fit-law-fraction", lambda t: ["fit-law", str(t / "m.jsonl"), "--fit-fraction", "2"],
         r"--fit-fraction: must be in \(0, 1\]"),
    Case("report-no-metrics", lambda t: (t / "r").mkdir() or ["report", str(t / "r")], r"'.*r' has no metrics\.jsonl"),
    Case("report-bad-value", lambda t: ["report", str(_metrics_run(t, '{"step": 0}\n{"step": 1, "entropy": "x"}\n'))],
         r"metrics\.jsonl:2: 'entropy' must be a number or null"),
]


def _api_lin(**kw):
    from fastcov import linear_logprob_entropy

    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(16, 8), labels=torch.zeros(4, dtype=torch.long))
    args.update(kw)
    return lambda: linear_logprob_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def _api(fn, *a, **kw):
    return lambda: fn()(*a, **kw)


def _load_config():
    from fastcov.trainer.config import load_config

    return load_config


def _read_parquet():
    from fastcov.trainer.data.loading import read_parquet

    return read_parquet


def _reward_fn():
    from fastcov.trainer.rewards import RewardFn

    return RewardFn


def _loss_config():
    from fastcov import LossConfig

    return LossConfig


API = [
    Case("kernel-shape", lambda t: _api_lin(weight=torch.randn(16, 7)), r"hidden's last dim 8 must equal weight's D=7",
         ValueError),
    Case("kernel-labels-shape", lambda t: _api_lin(labels=torch.zeros(5, dtype=torch.long)), r"labels shape", ValueError),
    Case("kernel-dtype", lambda t: _api_lin(weight=torch.randn(16, 8, dtype=torch.float64)), r"hidden dtype", TypeError),
    Case("kernel-labels-dtype", lambda t: _api_lin(labels=torch.zeros(4)), r"labels must be int64", TypeError),
    Case("kernel-device", lambda t: _api_lin(labels=torch.zeros(4, dtype=torch.long, device="meta")),
         r"labels is on meta", ValueError),
    Case("kernel-temperature", lambda t: _api_lin(temperature=float("nan")), r"temperature must be finite", ValueError),
    Case("loss-ratio-nan", lambda t: _api(_loss_config, clip_cov_ratio=float("nan")), r"clip_cov_ratio", ValueError),
    Case("loss-beta-inf", lambda t: _api(_loss_config, kl_cov_coef=float("inf")), r"kl_cov_coef must be finite",
         ValueError),
    Case("api-config-unknown", lambda t: _api(_load_config, str(TINY), ["optim.learning_rate=1"]),
         r"unknown config key 'optim\.learning_rate'", ValueError),
    Case("api-read-parquet-missing", lambda t: _api(_read_parquet, t / "none.parquet"), r"none\.parquet",
         FileNotFoundError),
    Case("api-reward-timeout", lambda t: _api(_reward_fn, timeout_s=float("inf")), r"timeout_s", ValueError),
]


# ------------------------------------------------------------------------------------------ checks

def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, size and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = ("dir",)
        for f in filenames:
            p = os.path.join(dirpath, f)
            data = Path(p).read_bytes()
            out[os.path.relpath(p, root)] = ("file", len(data), hashlib.sha256(data).hexdigest())
    return out


def test_the_table_is_large_enough():
    assert len(CLI) + len(API) >= 30
    assert len({c.id for c in CLI + API}) == len(CLI + API)


@pytest.mark.parametrize("case", CLI, ids=[c.id for c in CLI])
def test_cli_bad_input(case, tmp_path, capsys, monkeypatch):
    from fastcov.cli import main

    monkeypatch.delenv("FASTCOV_DEBUG", raising=False)
    argv = case.build(tmp_path)
    for name in case.missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError, find_spec finds nothing
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert re.match(r"^fastcov( [a-z-]+)?: ", lines[0]), lines[0]
    assert re.search(case.match, lines[0]), lines[0]
    assert snapshot(tmp_path) == before, "the failed command changed files"
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("case", API, ids=[c.id for c in API])
def test_api_bad_input(case, tmp_path):
    call = case.build(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(case.exc, match=case.match):
        call()
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    from fastcov.cli import UserError, main

    with pytest.raises(UserError, match="does not exist"):
        main(["train", str(tmp_path / "nope.yaml"), "--debug"])
    monkeypatch.setenv("FASTCOV_DEBUG", "1")
    with pytest.raises(UserError, match="does not exist"):
        main(["train", str(tmp_path / "nope.yaml")])


def test_internal_bugs_keep_their_traceback(monkeypatch):
    from fastcov import plan_cli
    from fastcov.cli import main

    def broken(args, **kwargs):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(plan_cli, "run", broken)
    with pytest.raises(KeyError):
        main(["plan", "--model", "qwen2.5-7b", "--gpus", "1", "--tokens-per-gpu", "8"])


def test_an_unsupported_vllm_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """An installed vLLM outside the supported range stops the run at its checks (pip's metadata, no import)."""
    import importlib.metadata

    from fastcov.cli import main
    from fastcov.trainer.runtime import dependencies

    monkeypatch.setattr(dependencies, "_installed", lambda module: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.40.0" if name == "vllm" else "1")
    before = snapshot(tmp_path)
    assert main(["train", str(TINY), "rollout.engine=vllm", f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "vLLM 0.40.0 is installed, fastcov supports vllm>=0.26,<0.34" in lines[0], lines
    assert snapshot(tmp_path) == before
