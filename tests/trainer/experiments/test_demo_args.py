"""The demo's command line refuses bad --style-weights naming the flag, before any work starts; its evaluation on
harder.parquet skips, and names, what it cannot evaluate."""

import pytest

from fastcov.trainer.experiments.demo import main


@pytest.mark.parametrize("weights", ["0.5,0.5", "1,1,1,x", "1,-1,1,1", "0,0,0,0"])
def test_bad_style_weights_are_refused_with_the_flag_named(weights, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "demo"), "--style-weights", weights])
    assert exc.value.code == 2
    assert "--style-weights" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # refused before writing the task


def test_reproducible_cpu_env_pins_avx2_paths_once_and_keeps_user_values():
    from fastcov.trainer.experiments.demo import REPRODUCIBLE_CPU_ENV, reproducible_cpu_env

    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    env = reproducible_cpu_env({"PATH": "/bin"}, "x86_64", avx2 | {"avx512f"})
    assert env == {"PATH": "/bin", **REPRODUCIBLE_CPU_ENV}
    # already re-executed (or set by the user): nothing to do, so there is no loop
    assert reproducible_cpu_env(env, "x86_64", avx2) is None
    assert REPRODUCIBLE_CPU_ENV["MKL_CBWR"] == "COMPATIBLE"  # MKL's AVX2 branch exists on Intel CPUs only
    kept = reproducible_cpu_env({"MKL_CBWR": "AVX512"}, "x86_64", avx2)
    assert kept["MKL_CBWR"] == "AVX512" and kept["ATEN_CPU_CAPABILITY"] == "avx2"
    assert reproducible_cpu_env({}, "aarch64", set()) is None
    assert reproducible_cpu_env({}, "x86_64", {"sse4_2", "avx"}) is None  # no AVX2 path to pin to
    assert reproducible_cpu_env({"FASTCOV_NATIVE_CPU": "1"}, "x86_64", avx2) is None


def test_demo_module_reexecutes_with_the_pinned_cpu_paths():
    """`python -m fastcov.trainer.demo` re-runs itself with REPRODUCIBLE_CPU_ENV before parsing anything."""
    import os
    import platform
    import subprocess
    import sys

    from fastcov.trainer.experiments.demo import REPRODUCIBLE_CPU_ENV

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() != "x86_64" or " avx2" not in flags:
        pytest.skip("needs an x86-64 CPU with AVX2")
    env = {k: v for k, v in os.environ.items() if k not in REPRODUCIBLE_CPU_ENV}
    # without the re-exec this script prints nothing; with it, the re-executed demo prints its --help
    out = subprocess.run([sys.executable, "-c",
                          "import sys; sys.argv = ['demo', '--help'];"
                          "import fastcov.trainer.experiments.demo as d; d.reexec_for_reproducible_cpu('fastcov.trainer.experiments.demo')"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--style-weights" in out.stdout


def test_harder_evaluation_skips_what_it_cannot_evaluate(tmp_path, capsys):
    from types import SimpleNamespace

    from fastcov.trainer.experiments import demo

    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0, threads=1), rollout=SimpleNamespace(max_new_tokens=8))
    runs, cfgs = {("grpo", None): tmp_path / "grpo"}, {("grpo", None): cfg}
    # no harder.parquet (a task written before it had one): nothing evaluated, nothing said
    assert demo.evaluate_harder_runs(runs, cfgs, tmp_path / "harder.parquet", tmp_path / "sft", "demo") == {}
    # a run that stopped before exporting its final model is named and skipped; the others would go on
    (tmp_path / "harder.parquet").write_bytes(b"")
    (tmp_path / "grpo").mkdir()
    assert demo.evaluate_harder_runs(runs, cfgs, tmp_path / "harder.parquet", tmp_path / "sft", "demo") == {}
    assert "no final model, not evaluated on harder.parquet" in capsys.readouterr().out
    assert not (tmp_path / "grpo" / "harder_eval.json").exists()
