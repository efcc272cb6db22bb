"""bench/gpu_run.sh --rehearse: the one-call GPU run on CPU at toy sizes. The same script, order, caps, budget
cut-off and partial results as on a lent GPU, and its one-line failure paths (a missing wheel, a part that
crashes, a budget that runs out mid-part); plus what would travel to the device machine (tree + wheels) stays
under the call's 64 MiB. Two runs of the script, about two minutes together on 2 shared cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_suite as S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
WHEELS = ("liger_kernel cut_cross_entropy deepspeed pydantic pydantic_core annotated_types typing_inspection hjson "
          "math_verify latex2sympy2_extended antlr4_python3_runtime verl").split()
SHARED_WHEELS = ROOT.parent / "shared" / "gpu" / "wheels"  # beside a developer's checkout; absent in CI
TRAVEL_LIMIT = 64 * 2**20
RETURNED_FILES = 8  # the device call returns at most 8 files, at most 2 folders down


def fake_wheels(folder: Path, skip: str | None = None) -> Path:
    """One valid (empty) zip per wheel gpu_run.sh expects, ``skip`` left out: the rehearsal checks, not installs."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in WHEELS:
        if name != skip:
            with zipfile.ZipFile(folder / f"{name}-0.0.0-py3-none-any.whl", "w") as z:
                z.writestr(f"{name}/__init__.py", "")
    return folder


def rehearse(out: Path, wheels: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET", "PYTHONPATH")}
    proc = subprocess.run(["bash", str(SCRIPT), "--rehearse", "--out", str(out), "--wheels", str(wheels),
                           "--python", sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    rows = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]
    return proc, rows


def by_name(rows: list[dict], part: str) -> dict[str, dict]:
    return {r["name"]: r for r in rows if r["part"] == part}


def returned_files(out: Path) -> list[Path]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= RETURNED_FILES, files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)  # $OUT/a/b/file comes back, deeper does not
    return files


def test_rehearsal_runs_every_part_in_order_with_partial_results(tmp_path):
    out = tmp_path / "out"
    proc, rows = rehearse(out, fake_wheels(tmp_path / "whl"), "--cap", "train=45")
    log = proc.stdout + proc.stderr
    assert {p.name for p in returned_files(out)} == {"run.log", "run.jsonl", "run.md", "kernels.jsonl", "kernels.md"}
    order = list(dict.fromkeys(r["part"] for r in rows))
    assert order == ["env", "setup", "correctness", "kernels", "train", "pytest", "extra"], order
    env = rows[0]
    assert env["commit"] == subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip()
    for name in ("numpy", "setuptools", "pyarrow", "triton"):
        assert name in env["versions"], name
    assert "gpu_run: GPU none (CPU); driver" in log and "setuptools" in log and "pyarrow" in log

    setup = by_name(rows, "setup")
    assert [setup[n]["status"] for n in ("wheels", "install", "import fastcov")] == ["ok"] * 3, setup
    if "travel size" in setup:  # a checkout with git: the tree and the wheels that would travel
        assert setup["travel size"]["status"] == "ok", setup["travel size"]

    corr = [r for r in rows if r["part"] == "correctness" and r["name"] == "correctness_gpu"]
    assert [r["status"] for r in corr] == ["ok", "ok"], corr  # the 7B- and 32B-like heads, Triton interpreted
    assert {r["impl"] for r in rows if r["part"] == "correctness" and "impl" in r} == {"triton", "naive"}

    kern = by_name(rows, "kernels")
    assert kern["fastcov: preset rehearse"]["status"] == "ok", kern
    assert kern["peers: preset rehearse"]["status"] == "ok", kern  # naive runs; the peers are unavailable
    assert kern["autotune picks"]["status"] == "unavailable"
    cases = [json.loads(line) for line in (out / "kernels.jsonl").read_text().splitlines()]
    triton = [c for c in cases if c["impl"] == "fastcov-triton"]
    assert {c["group"] for c in triton} == {"tiny-7b", "tiny-32b"} and all(c["status"] == "ok" for c in triton)
    assert all(c["floor_fb_ms"] for c in triton)  # beside the same-run matmul floor
    assert {c["status"] for c in cases if c["impl"] in ("liger", "cce", "verl")} == {"unavailable"}

    train = by_name(rows, "train")
    trainer = train["fastcov trainer"]
    steps = [n for n in train if n.startswith("fastcov step ")]
    if trainer["status"] == "ok":
        assert steps == ["fastcov step 1", "fastcov step 2"]
    else:  # a loaded machine: the cap stops the worker; the steps it logged before stay
        assert trainer["status"] == "timeout" and "time cap" in trainer["reason"], trainer
    assert trainer["plan_peak_gib"] > 0

    (pytest_row,) = [r for r in rows if r["part"] == "pytest" and r["name"] == "pytest -m gpu"]
    assert pytest_row["status"] == "unavailable" and pytest_row["counts"].get("skipped", 0) > 0, pytest_row
    assert pytest_row["targets"] == list(S.GPU_TEST_FILES) and not pytest_row["counts"].get("passed")

    (extra,) = [r for r in rows if r["part"] == "extra"]
    assert extra["status"] == "not reached" and "whole cap" in extra["reason"]
    md = (out / "run.md").read_text()
    assert "## setup" in md and "## extra" in md and "| part | not reached |" in md
    bad = [r for r in rows if r["status"] in S.BAD_STATUSES]
    assert proc.returncode == (1 if bad else 0), (proc.returncode, bad, log[-3000:])
    assert f"files under {out}" in log.splitlines()[-1]


def test_rehearsal_failure_paths_missing_wheel_crash_and_budget(tmp_path):
    out = tmp_path / "out"
    proc, rows = rehearse(out, fake_wheels(tmp_path / "whl", skip="liger_kernel"), "--budget", "45",
                          "--parts", "correctness,kernels,train", "--fault", "correctness=crash",
                          "--fault", "kernels=hang")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1
    returned_files(out)
    wheels = by_name(rows, "setup")["wheels"]
    assert wheels["status"] == "error" and "missing from" in wheels["reason"] and "liger_kernel" in wheels["reason"]
    assert "gpu_run: wheels: error: missing from" in log and "prepare.sh" in wheels["reason"]
    crash = by_name(rows, "correctness")["part"]
    assert crash["status"] == "error" and crash["reason"] == "InjectedCrash: injected crash of part correctness"
    kern = by_name(rows, "kernels")
    assert kern["hang (injected)"]["status"] == "partial"  # written by the part before the budget stopped it
    assert kern["fastcov: preset rehearse"]["status"] == "timeout"
    (train,) = [r for r in rows if r["part"] == "train"]
    assert train["status"] == "not reached" and "--budget" in train["reason"]
    assert [r["part"] for r in rows if r["part"] not in ("env", "setup")][-1] == "train"


def test_what_travels_fits_one_call():
    """The tree git would send (tracked + untracked-not-ignored) and the wheels of ../shared/gpu (when this
    checkout has them; a CI clone does not) stay under the device call's 64 MiB."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tree = sum((ROOT / p).stat().st_size for p in listed.stdout.decode().split("\0") if p and (ROOT / p).is_file())
    wheels = sum(p.stat().st_size for p in SHARED_WHEELS.glob("*.whl")) if SHARED_WHEELS.is_dir() else 0
    assert tree + wheels < TRAVEL_LIMIT, (tree, wheels)


def test_commit_from_the_environment_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(S.runner, "REPO", tmp_path)  # a tree that travelled without .git
    monkeypatch.setenv(S.COMMIT_ENV, "abc123")
    assert S.git_commit() == "abc123"
    monkeypatch.delenv(S.COMMIT_ENV)
    assert S.git_commit() is None


def test_parts_order_and_bad_options(tmp_path, capsys):
    assert S.parse_parts("pytest,correctness") == ["pytest", "correctness"]
    assert S.parse_parts("all") == list(S.RUN_ORDER) and "vllm" not in S.RUN_ORDER
    with pytest.raises(ValueError, match="unknown part 'kernel'"):
        S.parse_parts("correctness,kernel")
    for argv, message in ((["--parts", "kernel"], "unknown part 'kernel'"),
                          (["--parts", "train", "--fault", "train=hang"], "--fault is for the rehearsal only"),
                          (["--parts", "train", "--cap", "train=soon"], "seconds must be a number"),
                          (["--out", str(tmp_path)], "name the parts")):
        with pytest.raises(SystemExit):
            S.main(argv)
        assert message in capsys.readouterr().err


def test_autotune_picks_beside_the_compile_report():
    """The configs the autotuner picked (as bench.kernels records them per fastcov-triton case) joined with the
    compile report's registers and spills for the same kernel, dtype, config and arch."""
    preds = S.compile_predictions("sm_90a")
    assert preds, "bench/results/compile/fastcov.jsonl has sm_90a rows"
    (kernel, dtype, config), row = next((k, r) for k, r in preds.items() if k[1] == "bfloat16")
    # the key as Triton 3.x builds it: the key's arguments, then the dtype of every tensor argument in order
    # (hidden, weight, bias, labels, partials, top-k values, top-k indices)
    key = ["4096", "152064", "3584", "1", "False", "True", "0", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16",
           "torch.int64", "torch.float32", "torch.float32", "torch.int32"]
    case = {"group": "qwen2.5-7b", "n": 4096, "autotune": [
        {"kernel": kernel, "key": key, "config": config},
        {"kernel": kernel, "key": key, "config": "1x1x1/w1s1"}]}
    got = S.autotune_rows([case], "sm_90a", preds)
    assert got[0]["in_report"] and got[0]["registers"] == row["registers"] and got[0]["dtype"] == "bfloat16"
    assert got[0]["spill_stores"] == row["spill_stores"] == 0
    assert not got[1]["in_report"] and got[1]["registers"] is None


def test_naive_compile_compiles_every_shape_of_a_run():
    """torch's default recompile limit (8) is below the h100 preset's 10 graphs: past it dynamo ran the function
    uncompiled without a word. Loading naive-compile raises the limit and makes hitting it an error."""
    import torch._dynamo.config as dynamo_config

    from bench import peers

    saved = {k: getattr(dynamo_config, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit")
             if hasattr(dynamo_config, k)}
    try:
        peers.raise_recompile_limit()
        if "recompile_limit" in saved:
            assert dynamo_config.recompile_limit >= peers.RECOMPILE_LIMIT > 10
        if "fail_on_recompile_limit_hit" in saved:
            assert dynamo_config.fail_on_recompile_limit_hit is True
    finally:
        for k, v in saved.items():
            setattr(dynamo_config, k, v)


def test_autotune_picks_are_read_from_the_autotuners_cache(monkeypatch):
    """What bench.kernels records per fastcov-triton case on CUDA: the autotuners' cached picks for the shape."""
    import triton

    from bench.kernels import shape_autotune_picks
    from fastcov.kernels import linear_logprob_entropy as K

    cfg = triton.Config({"BLOCK_N": 256, "BLOCK_V": 128, "BLOCK_D": 32}, num_warps=8, num_stages=3)
    monkeypatch.setattr(K._forward_tuned, "cache", {(4096, 152064, 3584, 2, "torch.bfloat16"): cfg,
                                                    (64, 500, 32, 1, "torch.float32"): cfg})
    monkeypatch.setattr(K._dz_tuned, "cache", {})
    (pick,) = shape_autotune_picks(4096, 3584, 152064)
    assert pick["kernel"] == "linear_logprob_entropy._forward_kernel" and pick["config"] == "256x128x32/w8s3"
    assert pick["key"] == ["4096", "152064", "3584", "2", "torch.bfloat16"]
    assert S.compile_predictions("sm_90a").get((pick["kernel"], "bfloat16", pick["config"])), "a shipped config"
