"""The checkout's kernels/ folder is ``fastcov.kernels`` and never the top-level ``kernels``: that name is Hugging
Face's kernel hub package, which transformers and bitsandbytes import (issue 43, item 7). From the checkout's root
(``python -c``, ``python -m``, a notebook) the folder is on ``sys.path``; imported as ``kernels`` it hands over to
the installed package, or is an empty namespace package. The wheel's half is in test_wheel_configs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)


def test_the_root_has_no_top_level_kernels():
    """Without Hugging Face's package, ``kernels`` is an empty namespace package: none of the folder's modules, and
    transformers' own check (which imports it) says it is not installed."""
    probe = ("import kernels\n"
             "print(kernels.__file__, list(kernels.__path__), [n for n in vars(kernels) if not n.startswith('__')])\n"
             "for code in ('import kernels.covariance_torch', 'from kernels import get_kernel'):\n"
             "    try:\n        exec(code)\n    except ImportError:\n        print('ImportError')\n"
             "from transformers.utils.import_utils import is_kernels_available\n"
             "print(is_kernels_available())")
    proc = _python(probe, ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["None [] []", "ImportError", "ImportError", "False"]


def test_the_root_hands_kernels_to_the_installed_package(tmp_path):
    theirs = tmp_path / "site" / "kernels"  # stands in for `pip install kernels`
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("def get_kernel(name):\n    return 'hub:' + name\n")
    proc = _python("from kernels import get_kernel; import kernels, sys; print(kernels.__file__); "
                   "print(get_kernel('gemm')); print(sys.modules['kernels'] is kernels)", ROOT, str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(theirs / "__init__.py"), "hub:gemm", "True"]


def test_fastcov_kernels_imports_from_the_root_and_from_elsewhere(tmp_path):
    """In the checkout and through its editable install (any other folder)."""
    probe = ("import fastcov.kernels, fastcov.kernels.covariance_torch as c; "
             "print(fastcov.kernels.__file__); print(c.__file__)")
    for cwd in (ROOT, tmp_path):
        proc = _python(probe, cwd)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), str(ROOT / "kernels" / "covariance_torch.py")]
