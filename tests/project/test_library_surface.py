"""The library on one level (docs/api.md): the repository's own code and docs use each name from its home, never a
path that left ``fastcov``'s top level or ``fastcov.dynamics`` (those still work, with a FutureWarning: kept for
users, tests/library/test_public_api.py); and the library never reaches up into the trainer."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import fastcov
import fastcov.dynamics

ROOT = Path(__file__).resolve().parents[2]
OLD = {"fastcov": set(fastcov._MOVED), "fastcov.dynamics": set(fastcov.dynamics._MOVED)}
# the tests of the deprecation path itself, and the changelog that records it, name the old paths on purpose
EXEMPT = {ROOT / "tests" / "library" / "test_public_api.py", ROOT / "CHANGELOG.md"}


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *ROOT.glob("*.md")]
    for folder in ("fastcov", "kernels", "trainer", "bench", "tests", "docs", "configs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml")]
    return sorted(set(files) - EXEMPT)


def old_uses_in_python(source: str) -> list[str]:
    """``from fastcov import OLD``, ``from fastcov.dynamics import OLD`` and ``fastcov.OLD`` / ``fastcov.dynamics.OLD``
    attribute reads, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module in OLD:
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name in OLD[node.module]]
        elif isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if base in OLD and node.attr in OLD[base]:
                found.append(f"{node.lineno}: {base}.{node.attr}")
    return found


def old_uses_in_text(text: str) -> list[str]:
    """The same paths quoted in Markdown or YAML (prose, code blocks, ``python -m fastcov.dynamics``)."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        for module, names in OLD.items():
            words = "|".join(sorted(names))
            dotted = rf"(?<![\w./]){re.escape(module)}\.({words})\b"
            imported = rf"from {re.escape(module)} import [^\n]*\b({words})\b"
            found += [f"{n}: {module}.{m}" for m in re.findall(dotted, line) + re.findall(imported, line)]
        if re.search(r"python3? -m fastcov\.dynamics\b", line):
            found.append(f"{n}: python -m fastcov.dynamics")
    return found


def test_the_checks_find_an_old_path():
    assert old_uses_in_python("import fastcov\nfastcov.grpo(r, 4)\nfastcov.advantages.grpo(r, 4)") == [
        "2: fastcov.grpo"]
    assert old_uses_in_python("from fastcov import LossConfig, fit_entropy_law") == [
        "1: from fastcov import fit_entropy_law"]
    assert old_uses_in_python("from fastcov.dynamics import simulate, policy_entropy") == [
        "1: from fastcov.dynamics import simulate"]
    assert old_uses_in_text("`fastcov.grpo(r)` and `fastcov.advantages.grpo(r)`") == ["1: fastcov.grpo"]
    assert old_uses_in_text("    python -m fastcov.dynamics --plot x.png") == ["1: python -m fastcov.dynamics"]
    assert old_uses_in_text("from fastcov import policy_loss, PositiveWeightSchedule") == [
        "1: fastcov.PositiveWeightSchedule"]


def test_nothing_in_the_repository_uses_a_path_that_left_the_top_level():
    bad = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        uses = old_uses_in_python(text) if path.suffix == ".py" else old_uses_in_text(text)
        bad += [f"{path.relative_to(ROOT)}:{use}" for use in uses]
    assert not bad, "use the name's home (docs/api.md):\n" + "\n".join(bad)


def test_the_library_imports_with_the_trainer_unavailable():
    """`import fastcov` and the planner (fastcov/plan.py) work where fastcov.trainer cannot be imported: the trainer's
    commands call the planner, the library never calls up (docs/design.md §8; test_architecture.py checks the source)."""
    code = ("import sys; sys.modules['fastcov.trainer'] = None\n"
            "import fastcov, fastcov.plan, fastcov.plan_cli, fastcov.cli, fastcov.law_cli\n"
            "from fastcov.plan import load_model_shape, plan_memory\n"
            "plan = plan_memory(load_model_shape('qwen2.5-0.5b'), gpus=1, tokens_per_gpu=4096, zero_stage=0)\n"
            "assert plan.training_total > 0\n"
            "assert not [m for m in sys.modules if m.startswith('fastcov.trainer.')]\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_docs_api_lists_every_name_that_left_with_its_home():
    section = (ROOT / "docs" / "api.md").read_text(encoding="utf-8").split("### Names that left the top level")[1]
    rows = [line for line in section.split("\n## ")[0].splitlines() if line.startswith("| `") or line.startswith("| from")]
    for moved in (fastcov._MOVED, fastcov.dynamics._MOVED):
        for name, home in moved.items():
            row = [r for r in rows if f"`{name}`" in r.split("|")[1]]
            shown = f"{home.replace('.', '/')}.py" if home.startswith("bench.") else f"`{home}`"
            assert len(row) == 1 and shown in row[0].split("|")[2], f"docs/api.md: `{name}` -> {shown}"
