"""No function or method in trainer/ or bench/ is longer than 80 lines: a longer one is split into named
steps. Length = end_lineno - lineno + 1 of the ``def`` (decorators not counted, its docstring counted)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("trainer", "bench")
MAX_LINES = 80


def long_functions(source: str, filename: str, limit: int = MAX_LINES) -> list[str]:
    """'file:line name (n lines)' for every function or method (nested ones included) over ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                found.append(f"{filename}:{node.lineno} {node.name} ({n} lines)")
    return found


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_function_over_80_lines_in_trainer_and_bench():
    files = _sources()
    assert len(files) >= 20 and any(p.parent.name == "bench" for p in files)  # the walk does see the code
    found = [f for p in files for f in long_functions(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(found)


def test_the_check_names_a_long_function_and_method():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))  # with its def line: 81 lines
    source = ("def short():\n    pass\n\n\ndef long():\n" + body + "\n\nclass C:\n"
              + textwrap.indent("async def m(self):\n" + body, "    "))
    assert long_functions(source, "fake.py") == ["fake.py:5 long (81 lines)", "fake.py:89 m (81 lines)"]
    assert long_functions("def f():\n" + "    x = 1\n" * 79, "ok.py") == []  # exactly 80 lines is allowed
