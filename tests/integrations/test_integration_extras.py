"""Without an extra's packages, each integration and the CLI say in one line which extra to install.

Each case runs in a fresh interpreter with the framework's modules masked (``sys.modules[name] = None`` makes
``import name`` fail as if it were not installed), or with a fake package of another version first on the path.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, *, path: Path | None = None) -> subprocess.CompletedProcess:
    prelude = f"import sys\nsys.path.insert(0, {str(path)!r})\n" if path is not None else "import sys\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def _import_error(module: str, masked: tuple[str, ...] = (), path: Path | None = None) -> str:
    out = _run(f"""
        for name in {masked!r}:
            sys.modules[name] = None
        try:
            import {module}
        except ImportError as exc:
            print(str(exc))
        else:
            print("IMPORTED")
    """, path=path)
    assert out.returncode == 0, out.stderr[-2000:]
    message = out.stdout.strip()
    assert message != "IMPORTED" and "\n" not in message, message
    return message


def test_transformers_patch_names_the_hf_extra():
    message = _import_error("fastcov.integrations.transformers", ("transformers",))
    assert "pip install 'fastcov[hf]'" in message and "fastcov.integrations.transformers" in message


def test_trl_integration_names_the_trl_extra():
    message = _import_error("fastcov.integrations.trl", ("trl",))
    assert "pip install 'fastcov[trl]'" in message and "trl" in message


def test_verl_integration_names_the_verl_extra():
    message = _import_error("fastcov.integrations.verl", ("verl",))
    assert "pip install 'fastcov[verl]'" in message


@pytest.mark.parametrize("version", ["0.29.1", "2.0.0", "1.15.2.dev0"])
def test_trl_of_another_version_is_refused_in_one_line(tmp_path, version):
    fake = tmp_path / "trl"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    message = _import_error("fastcov.integrations.trl", path=tmp_path)
    assert message == (f"fastcov.integrations.trl needs trl>=1.16,<2, found trl {version}: "
                       f"pip install 'fastcov[trl]'")


def test_trl_of_a_supported_version_passes_the_check(tmp_path):
    fake = tmp_path / "trl"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '1.17.0'\n")
    # the version check passes; the import then fails on the fake's missing GRPOConfig, not on the version
    message = _import_error("fastcov.integrations.trl", path=tmp_path)
    assert "GRPOConfig" in message and "needs trl" not in message


def test_importing_fastcov_needs_no_extra():
    out = _run("""
        for name in ("transformers", "trl", "verl", "deepspeed", "yaml", "vllm"):
            sys.modules[name] = None
        import fastcov, fastcov.kernels, fastcov.losses
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("argv,missing", [
    (["train", "configs/tiny.yaml"], "yaml"),
    (["train", "configs/tiny.yaml"], "deepspeed"),
])
def test_cli_train_without_the_train_extra_is_one_line(argv, missing):
    out = _run(f"""
        sys.modules[{missing!r}] = None
        from fastcov.cli import main
        sys.exit(main({argv!r}))
    """)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines == [f"fastcov train: needs the 'train' extra (no module named {missing!r}): "
                     f"pip install 'fastcov[train]'"], out.stderr[-2000:]


def test_pyproject_extras_keep_the_hf_patch_free_of_deepspeed():
    tomllib = pytest.importorskip("tomllib")

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"train", "hf", "trl", "verl"} <= set(extras)
    hf = " ".join(extras["hf"])
    assert "transformers" in hf and "deepspeed" not in hf and "fastcov[train" not in hf
    assert any(req.startswith("trl>=1.16,<2") for req in extras["trl"])
    assert "fastcov[hf]" in extras["trl"] and not any("deepspeed" in req for req in extras["trl"])
    assert any(req.startswith("verl") for req in extras["verl"])
