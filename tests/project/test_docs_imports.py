"""Every Python path the README and docs/ quote still works: a dotted ``fastcov.…`` name imports (a module,
or an attribute of one) and a ``python -m …`` module runs as a module. Paths moved inside the package
keep their public names (docs/design.md §8, entry points)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench").glob("README.md")])
DOTTED = re.compile(r"(?<![\w./-])(fastcov(?:\.[A-Za-z_]\w*)+)")
RUN_MODULE = re.compile(r"python3? -m ((?:fastcov|bench)(?:\.\w+)+)")


def quoted(pattern: re.Pattern) -> dict[str, str]:
    """name -> the first file:line that quotes it."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            for name in pattern.findall(line):
                found.setdefault(name.rstrip("."), f"{doc.relative_to(ROOT)}:{n}")
    return found


def _defined_at_top(origin: str) -> set[str]:
    """Names a module's source defines or imports at its top level (read, not run)."""
    names = set()
    for node in ast.parse(Path(origin).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(name: str) -> bool:
    """``name`` is a module, or an attribute path under the longest module prefix. A module that needs an
    optional dependency this environment lacks (verl, vLLM) is read instead of imported."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:i]))
        except ImportError:
            spec = None
        if spec is None:
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return len(parts) == i or (spec.origin is not None and parts[i] in _defined_at_top(spec.origin))
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_the_docs_quote_the_public_paths_this_checks():
    names = quoted(DOTTED)
    assert "fastcov.trainer.code_tasks.write_code_task" in names or "fastcov.trainer.code_tasks" in names
    assert "fastcov.trainer.demo" in quoted(RUN_MODULE)


@pytest.mark.parametrize("name", sorted(quoted(DOTTED)))
def test_a_quoted_dotted_name_imports(name):
    assert resolves(name), f"{quoted(DOTTED)[name]}: `{name}` does not import"


@pytest.mark.parametrize("module", sorted(quoted(RUN_MODULE)))
def test_a_quoted_python_m_module_exists(module):
    assert importlib.util.find_spec(module) is not None, f"{quoted(RUN_MODULE)[module]}: `python -m {module}`"


def test_the_check_can_fail():
    assert not resolves("fastcov.trainer.no_such_module")
    assert not resolves("fastcov.trainer.config.NoSuchName")
    assert resolves("fastcov.trainer.rewards.REWARD_TASKS")
