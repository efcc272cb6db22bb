"""A wheel built from this checkout and installed elsewhere finds its configs: it carries configs/ as
``fastcov/configs``, every source file of fastcov/, kernels/ and trainer/, kernels/ as ``fastcov.kernels`` and no
top-level ``kernels`` (the checkout's half: tests/project/test_wheel_configs.py and
tests/kernels/test_kernels_name.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _fixtures import ROOT


@pytest.mark.slow
def test_an_installed_wheel_finds_its_configs(tmp_path):
    src = tmp_path / "src"  # a copy, so the build's build/ folder never lands in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("fastcov", "kernels", "trainer", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("fastcov-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
    assert {f"fastcov/configs/{p}" for p in shipped} <= set(names)
    sources = {f"fastcov/{p.relative_to(ROOT / 'fastcov').as_posix()}" for p in (ROOT / "fastcov").rglob("*.py")}
    for folder in ("kernels", "trainer"):
        sources |= {f"fastcov/{folder}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    missing = sorted(sources - set(names))
    assert not missing, f"not in the wheel (add their packages to pyproject.toml): {missing[:5]}"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import fastcov; from fastcov.trainer.experiments.configs import resolve_config, shipped_config; "
             "print(fastcov.__file__); print(shipped_config('demo.yaml')); "
             "print(resolve_config('configs/studies/entropy-control.yaml')); "
             "from fastcov.configs import resolve_config as by_name; print(by_name('tiny'))")  # `fastcov train tiny`
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in out), out  # the wheel's copy, not the checkout
    assert Path(out[1]).is_file() and Path(out[2]).is_file() and Path(out[3]).name == "tiny.yaml"
    assert not any(n.startswith("kernels/") for n in names)
    probe = ("import fastcov.kernels, fastcov.kernels.covariance_torch as c; print(c.__file__)\n"
             "try:\n    import kernels\nexcept ImportError:\n    print('no-kernels')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(site / "fastcov" / "kernels" / "covariance_torch.py"), "no-kernels"], out
