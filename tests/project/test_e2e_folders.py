"""The slow tests live in e2e/ folders (issue 56): each room keeps its end-to-end runs (whole trainings, several
processes, fresh processes that measure memory) in its own e2e/ folder, so `make test-fast` leaves them out by
folder alone. A test module outside an e2e/ folder that carries the slow mark (a decorator, ``pytestmark`` or a
``pytest.param``'s marks) fails here: move that test into its room's e2e/ folder."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def is_slow_mark(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (any ``<name>.mark.slow``) or ``mark.slow``, called or not."""
    if not (isinstance(node, ast.Attribute) and node.attr == "slow"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (isinstance(owner, ast.Name)
                                                                           and owner.id == "mark")


def slow_marks(path: Path) -> list[int]:
    """The lines of ``path`` whose code uses the slow mark (comments and strings do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return sorted({node.lineno for node in ast.walk(tree) if is_slow_mark(node)})


def slow_outside_e2e(tests: Path) -> list[str]:
    """'path:line' for every use of the slow mark in a .py file under ``tests`` that is not inside an e2e/ folder."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if "e2e" in rel.parts[:-1] or "__pycache__" in rel.parts:
            continue
        out += [f"{(tests.name / rel).as_posix()}:{line}" for line in slow_marks(path)]
    return out


def test_no_slow_test_outside_an_e2e_folder():
    found = slow_outside_e2e(ROOT / "tests")
    assert not found, ("slow tests outside an e2e/ folder (move each into its room's e2e/ folder, named after the "
                       "module it tests, e.g. tests/trainer/e2e/test_lora_e2e.py):\n" + "\n".join(found))


def test_the_slow_tests_are_in_e2e_folders():
    """The check above walks real test files: the e2e/ folders hold slow tests, and make test-fast skips exactly
    those folders, without a marker expression that could leave a slow test in."""
    e2e = sorted((ROOT / "tests").rglob("e2e/*.py"))
    assert len({p.parent for p in e2e}) >= 2 and sum(len(slow_marks(p)) for p in e2e) >= 40
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "make test-fast is gone"
    markers = [arg for arg in re.findall(r"\s-m\s+(\S+)", recipe.group(1)) if arg != "pytest"]
    assert '--ignore-glob="*/e2e/*"' in recipe.group(1) and not markers, recipe.group(1)


def test_the_check_names_a_slow_mark_outside_e2e(tmp_path):
    tests = tmp_path / "tests"
    files = {
        "room/test_fast.py": "import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n",
        "room/test_param.py": "import pytest\n\n@pytest.mark.parametrize('n', [1, pytest.param(2, marks=pytest.mark.slow)])\n"
                              "def test_b(n):\n    pass\n",
        "room/test_module.py": "from pytest import mark\n\npytestmark = [mark.slow]\n",
        "room/test_words.py": "# pytest.mark.slow in a comment\n'''and pytest.mark.slow in a string'''\n",
        "room/test_other_mark.py": "import pytest\n\n@pytest.mark.gpu\ndef test_c():\n    pass\n",
        "room/e2e/test_run_e2e.py": "import pytest\n\n@pytest.mark.slow\ndef test_d():\n    pass\n",
        "room/e2e/sub/test_deeper.py": "import pytest\n\npytestmark = pytest.mark.slow\n",
    }
    for rel, text in files.items():
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text(text)
    assert slow_outside_e2e(tests) == ["tests/room/test_fast.py:3", "tests/room/test_module.py:3",
                                       "tests/room/test_param.py:3"]
