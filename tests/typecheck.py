"""mypy over fastcov/, kernels/ and trainer/ as the one package they install as (`make lint` runs it).

pyproject.toml maps ``fastcov.kernels`` to kernels/ and ``fastcov.trainer`` to trainer/, which mypy cannot
follow through an editable install, so this lays the installed tree out with symbolic links under
.cache/typecheck/ and checks ``-p fastcov`` there; paths in the report are the checkout's. The level is
pyproject.toml's ``[tool.mypy]`` (docs/design.md §8).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"kernels": ROOT / "kernels", "trainer": ROOT / "trainer", "configs": ROOT / "configs"}


def lay_out(tree: Path) -> Path:
    """``tree``/fastcov holding links to fastcov/'s entries and to the mapped folders."""
    if tree.exists():
        shutil.rmtree(tree)
    pkg = tree / "fastcov"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "fastcov").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, target in MAPPED.items():
        (pkg / name).symlink_to(target)
    return tree


def to_checkout_paths(line: str) -> str:
    for name in MAPPED:
        line = line.replace(f"fastcov/{name}/", f"{name}/")
    return line


def main() -> int:
    tree = lay_out(ROOT / ".cache" / "typecheck")
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(ROOT / ".cache" / "mypy"), "-p", "fastcov"]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "MYPYPATH": ""})
    out = "".join(to_checkout_paths(line) for line in (proc.stdout + proc.stderr).splitlines(keepends=True))
    print(out, end="")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
