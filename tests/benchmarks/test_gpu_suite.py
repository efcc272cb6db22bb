"""bench/gpu_suite/ on CPU: the parts that need CUDA or vLLM record `unavailable` rows, the kernels smoke preset
really runs, every row reaches the JSONL and the markdown, a part that raises becomes an error row and `--part all`
goes on; plus the pieces a GPU run depends on, driven with CPU stand-ins. (The tiny training run:
tests/benchmarks/e2e/test_gpu_suite_e2e.py; bench/gpu_run.sh, the one device call around it, is rehearsed in
tests/benchmarks/test_gpu_run.py.)"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from _fixtures import suite_markdown, suite_rows

from bench import correctness_gpu as C
from bench import gpu_suite as S

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def suite(tmp_path, **kw) -> S.Suite:
    args = dict(out=tmp_path, size="smoke", steps=2, timeout=120.0, deadline=None, gpu=None, slug="cpu",
                date="2000-01-01", run_id="test")
    return S.Suite(**{**args, **kw})


# ---------------------------------------------------------------- parts without their hardware


@needs_cpu_only
def test_correctness_and_vllm_record_unavailable_rows_on_cpu(tmp_path, capsys):
    assert S.main(["--part", "correctness", "--out", str(tmp_path)]) == 0
    assert S.main(["--part", "vllm", "--out", str(tmp_path)]) == 0
    rows = suite_rows(tmp_path)
    envs = [r for r in rows if r["part"] == "env"]
    assert len(envs) == 2  # one environment record per invocation
    env = envs[0]
    assert env["gpu_name"] is None and env["driver"] is None and env["status"] == "ok"
    for name in ("torch", "triton", "transformers", "deepspeed", "liger-kernel", "cut-cross-entropy", "verl",
                 "vllm"):
        assert name in env["versions"], name
    assert env["versions"]["torch"] == torch.__version__
    corr = [r for r in rows if r["part"] == "correctness"]
    assert [(r["name"], r["status"], r["reason"]) for r in corr] == [("correctness_gpu", "unavailable", "needs CUDA")]
    (vllm,) = [r for r in rows if r["part"] == "vllm"]
    assert vllm["status"] == "unavailable"
    want = "vllm not installed" if importlib.util.find_spec("vllm") is None else "needs CUDA"
    assert vllm["reason"] == want
    assert all(r["run"] != envs[0]["run"] for r in rows if r["part"] == "vllm")
    md = suite_markdown(tmp_path)
    assert "## correctness" in md and "## vllm" in md and "| correctness_gpu | unavailable | needs CUDA |" in md
    assert "torch " + torch.__version__ in md
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-2].split()[:3] == ["vllm", "vllm_smoke", "unavailable"]  # the table is last
    assert out.rstrip().splitlines()[-1].split()[:3] == ["vllm", "part", "time"]


@needs_cpu_only
def test_full_size_kernels_and_train_are_unavailable_without_cuda(tmp_path):
    assert S.main(["--part", "kernels", "--out", str(tmp_path)]) == 0
    assert S.main(["--part", "train", "--size", "1.5b", "--out", str(tmp_path)]) == 0
    got = {(r["part"], r["name"]): r for r in suite_rows(tmp_path) if r["part"] != "env"}
    assert set(got) == {("kernels", "fastcov: preset gpu-run"), ("kernels", "switches: preset gpu-run-switches"),
                        ("kernels", "peers: preset gpu-run"), ("kernels", "autotune picks"),
                        ("train", "fastcov trainer"), ("train", "trl GRPOTrainer")}
    assert all(r["status"] == "unavailable" and ("needs CUDA" in r["reason"] or "off CUDA" in r["reason"])
               for r in got.values())


# ---------------------------------------------------------------- parts that really run on CPU


def test_kernels_smoke_runs_the_benchmark(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest's; interpreted Triton would take half a minute
    assert S.main(["--part", "kernels", "--size", "smoke", "--out", str(tmp_path)]) == 1  # a fastcov row not ok
    (row, autotune) = [r for r in suite_rows(tmp_path) if r["part"] == "kernels"]
    assert autotune["name"] == "autotune picks" and autotune["status"] == "unavailable"
    assert row["name"] == "smoke: preset smoke" and row["preset"] == "smoke" and row["size"] == "smoke"
    # without the interpreter the Triton path is unavailable on CPU: no pass, and the reason says which row
    assert row["status"] == "fail" and row["reason"].startswith("fastcov-triton smoke N=128: unavailable: "), row
    lines = Path(row["results_jsonl"])
    assert lines.is_file() and lines.parent.parent == tmp_path and lines.with_suffix(".md").is_file()
    cases = [json.loads(x) for x in lines.read_text().splitlines()]
    assert row["cases"] == len(cases) > 0 and sum(row["statuses"].values()) == len(cases)
    fused = {f["impl"] for f in row["fastcov"]}
    assert "fastcov-torch" in fused
    assert all(f["fb_ms"] > 0 for f in row["fastcov"])
    assert "fastcov-torch smoke N=128: fwd+bwd" in row["summary"]
    assert "| smoke: preset smoke | fail |" in suite_markdown(tmp_path)


# ---------------------------------------------------------------- errors, budget, output


def test_a_part_that_raises_is_an_error_row_and_all_goes_on(tmp_path, monkeypatch, capsys):
    ran = []

    def boom(s):
        ran.append("correctness")
        raise RuntimeError("injected failure")

    def fake(part):
        def run(s):
            ran.append(part)
            s.record(part, "fake", "ok", summary=f"{part} done")
        return run

    monkeypatch.setitem(S.PARTS, "correctness", boom)
    for part in ("kernels", "train", "pytest", "extra"):
        monkeypatch.setitem(S.PARTS, part, fake(part))
    assert S.main(["--part", "all", "--out", str(tmp_path)]) == 1  # an error row: non-zero exit
    assert ran == ["correctness", "kernels", "train", "pytest", "extra"]
    rows = suite_rows(tmp_path)
    assert [(r["part"], r["status"]) for r in rows] == [
        ("env", "ok"), ("correctness", "error"), ("kernels", "ok"), ("train", "ok"), ("pytest", "ok"), ("extra", "ok")]
    err = rows[1]
    assert err["name"] == "part" and err["reason"] == "RuntimeError: injected failure"
    assert "injected failure" in err["traceback"]
    assert len({r["run"] for r in rows}) == 1
    md = suite_markdown(tmp_path)
    assert "| part | error | RuntimeError: injected failure |" in md and "| fake | ok | extra done |" in md
    table = [line for line in capsys.readouterr().out.splitlines() if "part time" not in line]
    assert table[-5].split()[:3] == ["correctness", "part", "error"]


def test_a_spent_budget_skips_parts_and_subprocesses(tmp_path):
    s = suite(tmp_path, deadline=time.monotonic() + 20)  # less than a part needs
    S.run_part(s, "kernels")
    assert [(r["part"], r["name"], r["status"]) for r in s.rows] == [("kernels", "part", "not reached")]
    proc = s.run(["true"])  # 20 s left, 15 kept for the summary: 5 s at most
    assert proc.rc == 0 and not proc.timed_out
    late = suite(tmp_path, deadline=time.monotonic() + 5).run(["true"])
    assert late.timed_out and late.rc is None and "budget" in late.err


def test_a_timed_out_subprocess_and_its_children_are_stopped(tmp_path):
    t0 = time.perf_counter()
    proc = S.run_cmd(["bash", "-c", "echo started; sleep 60 & sleep 60"], timeout=1.0)
    assert time.perf_counter() - t0 < 20
    assert proc.timed_out and "started" in proc.out and "stopped after 1 s" in proc.tail()


def test_render_skips_a_torn_line_and_keeps_the_last_run_per_part(tmp_path):
    s1, s2 = suite(tmp_path, run_id="one"), suite(tmp_path, run_id="two")
    s1.record("env", "environment", "ok", summary="CPU (no CUDA); torch x", gpu_name=None, command="c1")
    s1.record("kernels", "preset smoke", "ok", summary="first run")
    s1.record("vllm", "vllm_smoke", "unavailable", "vllm not installed")
    s2.record("kernels", "preset smoke", "error", "bench.kernels exited 1: boom | bang")
    with open(s1.path, "a") as f:
        f.write('{"run": "two", "part": "kernels", "na')  # killed mid-write
    assert S.main(["--render", str(s1.path)]) == 0
    md = s1.path.with_suffix(".md").read_text()
    assert "first run" not in md  # the newer run of the part replaces it
    assert "| preset smoke | error | bench.kernels exited 1: boom \\| bang |" in md
    assert "| vllm_smoke | unavailable | vllm not installed |" in md
    assert "Environment: CPU (no CUDA); torch x." in md


# ---------------------------------------------------------------- GPU-side pieces with CPU stand-ins


def test_correctness_cases_record_correctness_gpu_entries(tmp_path, monkeypatch):
    """correctness_gpu's own case loop on CPU (its CUDA synchronisations stubbed): a row per case, the report."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(C, "check_environment", lambda impls: None)  # it asks for CUDA
    s = suite(tmp_path, gpu="Fake GPU 80GB")
    S.correctness_cases(s, device=torch.device("cpu"), extra=(
        "--n", "64", "--d", "32", "--v", "300", "--impls", "torch", "naive", "--temperatures", "1.0", "--rows", "8",
        "--vocab-rows", "16", "--peaked-rows", "4", "--chunk", "32", "--dtype", "bfloat16"))
    names = [(r["name"], r["status"]) for r in s.rows]
    assert names == [("torch T=1.0", "ok"), ("naive T=1.0", "ok"), ("torch T=1.0 bias", "ok"),
                     ("naive T=1.0 bias", "ok"), ("correctness_gpu", "ok")], s.rows
    case = s.rows[0]
    assert set(case["max_errors"]) == {"logprob", "entropy", "dhidden", "dweight"}
    assert "dbias" in s.rows[2]["max_errors"]
    assert case["max_errors"]["logprob"] <= C.TOLERANCES["logprob_max_abs"]
    assert "baseline" in s.rows[1]["summary"] and "baseline" not in case["summary"]
    report = json.loads(Path(s.rows[-1]["report"]).read_text())
    assert report["passed"] is True and len(report["cases"]) == 4
    assert s.rows[-1]["summary"].startswith("2/2 fastcov cases within tolerance (N 64, D 32, V 300")


def test_correctness_case_that_misses_a_tolerance_is_a_fail_row(tmp_path):
    s = suite(tmp_path)
    errs = {q: {"max_abs": 0.5, "max_rel": 0.5} for q in ("logprob", "entropy", "dhidden", "dweight")}
    entry = {"impl": "triton", "temperature": 0.6, "bias": None, "baseline_only": False, "status": "ok",
             "seconds_fwd_bwd": 0.1, "errors": errs, "invariants": {}, "passed": False,
             "failures": ["logprob_max_abs 5.00e-01 > 1e-02"]}
    S.record_correctness_case(s, entry, C.parse_args([]))
    (row,) = s.rows
    assert row["status"] == "fail" and row["reason"] == "logprob_max_abs 5.00e-01 > 1e-02"


def test_gpu_pytest_counts_passes_and_failures(tmp_path):
    tests = tmp_path / "test_fake_gpu.py"
    tests.write_text("import os\nimport pytest\n\n"
                     "@pytest.mark.gpu\ndef test_poison_is_set():\n    assert os.environ['FASTCOV_POISON'] == '1'\n\n"
                     "@pytest.mark.gpu\ndef test_broken():\n    assert False\n\n"
                     "def test_not_gpu():\n    pass\n")
    s = suite(tmp_path)
    S.gpu_pytest(s, targets=(str(tests),))
    (row,) = s.rows
    assert row["part"] == "pytest" and row["targets"] == [str(tests)]
    assert row["status"] == "fail" and row["counts"]["passed"] == 1 and row["counts"]["failed"] == 1
    assert row["counts"]["deselected"] == 1
    assert row["failed"] == [f for f in row["failed"] if "test_broken" in f] and row["failed"]


@pytest.mark.parametrize("line,want", [
    ("3 passed, 512 deselected in 41.20s", {"passed": 3, "deselected": 512}),
    ("===== 1 failed, 2 passed, 1 error, 4 warnings in 3.01s =====",
     {"failed": 1, "passed": 2, "errors": 1, "warnings": 4}),
    ("no tests ran in 0.50s", {}),
])
def test_pytest_counts(line, want):
    assert S.pytest_counts("collected\nsome 12 passed output\n" + line + "\n") == want


def test_vllm_row_from_a_smoke_result(tmp_path):
    result = {"size": "tiny", "params": 2_000_000, "vllm": "0.26.0", "sync_s": [0.5], "sync_gib": 0.25,
              "sync_gib_per_s": 0.5, "sync2_s": 0.4, "engine_stats": {"generate_s": 0.2},
              "parity_before": {"vs_bf16_policy": {"max": 0.05, "mean": 0.01, "n": 100}},
              "checks": {"parity_before": True, "lengths": True}, "ok": True}
    s = suite(tmp_path)
    S.record_vllm(s, "tiny", S.Proc(0, "vllm log line\n" + json.dumps(result) + "\n", "", 30.0))
    (row,) = s.rows
    assert row["status"] == "ok" and row["generate_tokens_per_s"] == pytest.approx(500.0)
    assert row["sync_gb_per_s"] == pytest.approx(0.5 * 2**30 / 1e9)
    assert "generate 500 tok/s" in row["summary"] and "parity max 0.050 nats" in row["summary"]
    S.record_vllm(s, "7b", S.Proc(1, json.dumps({**result, "ok": False, "checks": {"sync_7b_le_2s": False}}), "", 1))
    assert s.rows[-1]["status"] == "fail" and s.rows[-1]["reason"] == "failed: sync_7b_le_2s"
    S.record_vllm(s, "7b", S.Proc(1, "", "Traceback\nImportError: no vllm._C", 1.0))
    assert s.rows[-1]["status"] == "error" and "ImportError" in s.rows[-1]["reason"]


def test_a_fatal_exit_is_recorded_with_its_message(tmp_path):
    """correctness_gpu's die() (a missing CUDA device, fastcov not importable) used to reach the row as "exited 2"."""
    s = suite(tmp_path)
    S.guarded(s, "correctness", "correctness_gpu", lambda s: C.die("cannot import fastcov.linear_logprob_entropy: x"))
    (row,) = s.rows
    assert row["status"] == "error"
    assert row["reason"] == "exited 2: cannot import fastcov.linear_logprob_entropy: x"


def test_gpu_pytest_with_no_test_passed_is_no_pass(tmp_path, monkeypatch):
    tests = tmp_path / "test_no_gpu.py"
    tests.write_text("def test_not_gpu():\n    pass\n")
    s = suite(tmp_path)
    S.gpu_pytest(s, targets=(str(tests),))  # on CPU: the GPU tests would skip
    assert (s.rows[-1]["status"], s.rows[-1]["reason"]) == ("unavailable", "needs CUDA (the GPU tests skip)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on the GPU: none ran, so none passed
    S.gpu_pytest(s, targets=(str(tests),))
    assert (s.rows[-1]["status"], s.rows[-1]["reason"]) == ("fail", "no GPU test ran")
    S.gpu_pytest(s, targets=("tests/no_such_file.py",))
    assert (s.rows[-1]["status"], s.rows[-1]["reason"]) == ("error", "no such test file: tests/no_such_file.py")


def test_a_train_step_row_is_written_by_the_worker_as_it_is_logged(tmp_path):
    s = suite(tmp_path, flat=True)
    from bench.gpu_worker import TrainSpec, step_row

    spec = S.train_spec(s).with_(ppo_epochs=1)
    assert TrainSpec.from_json(spec.to_json()) == spec  # what the worker process gets
    rec = {"step": 1, "time/step": 2.0, "time/rollout": 1.0, "time/update": 0.5, "tokens_per_s": 100.0,
           "tokens_per_s/rollout": 300.0}
    row = step_row(spec, rec)
    assert row["name"] == "fastcov step 1" and row["run"] == "test" and row["part"] == "train" and row["warmup"]
    assert row["update_tokens_per_s"] == pytest.approx(200.0 / 0.5) and spec.rows.path == str(s.path)
    assert s.path == tmp_path / "run.jsonl"
