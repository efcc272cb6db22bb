"""No package of ours imports another package's private names (``from fastcov.trainer.x import _helper`` in
kernels/, say): what one package needs from another is public there. Within a package it is fine."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# directory -> the import name it is installed as (pyproject's package-dir)
PACKAGES = {"fastcov": "fastcov", "fastcov/integrations": "fastcov.integrations", "kernels": "fastcov.kernels",
            "trainer": "fastcov.trainer", "bench": "bench"}


def _package_of(module: str) -> str | None:
    """The longest of our package names ``module`` lies in (fastcov.trainer.x -> fastcov.trainer)."""
    best = None
    for name in PACKAGES.values():
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def private_cross_imports(source: str, own_package: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
            continue
        other = _package_of(node.module)
        if other is None or other == own_package:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                out.append(f"{node.module}.{alias.name} (line {node.lineno})")
    return out


def test_no_private_names_imported_across_packages():
    bad = []
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            if package == "fastcov" and "integrations" in path.parts:
                continue  # its own package, walked under fastcov/integrations
            for hit in private_cross_imports(path.read_text(), package):
                bad.append(f"{path.relative_to(ROOT)}: {hit}")
    assert not bad, "private names imported from another package:\n" + "\n".join(bad)


def test_the_check_sees_a_private_cross_import():
    src = "from fastcov.trainer.rollout import _helper, public\nfrom fastcov.kernels import _own\n"
    assert private_cross_imports(src, "fastcov.kernels") == ["fastcov.trainer.rollout._helper (line 1)"]
    assert private_cross_imports(src, "fastcov.trainer") == ["fastcov.kernels._own (line 2)"]
