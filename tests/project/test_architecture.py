"""The house rules of docs/design.md §8, checked on the source: no import cycle between modules (imports
inside functions included), and each room imports only the rooms its row of the map allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# where each top-level package lives in the checkout (pyproject.toml's package-dir)
PACKAGE_DIRS = {"fastcov": ROOT / "fastcov", "fastcov.kernels": ROOT / "kernels",
                "fastcov.trainer": ROOT / "trainer", "fastcov.configs": ROOT / "configs"}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the packages above (a package is its __init__)."""
    mods = {}
    for pkg, base in PACKAGE_DIRS.items():
        for f in base.rglob("*.py"):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to: itself, or its longest prefix that is a module."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules ``module`` imports anywhere in its file (``from pkg import mod`` counts as mod)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out |= {m for n in names if (m := _resolve(n, mods)) and m != module}
    return out


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room_map() -> tuple[dict[str, str], dict[str, set[str]]]:
    """From docs/design.md §8: module prefix -> room, and room -> the rooms it may import."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## 8. The trainer's rooms", 1)[1]
    prefixes, allowed = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("room", "---") or not cells[1].startswith("`"):
            continue
        room = cells[0]
        for prefix in re.findall(r"`([\w.]+)`", cells[1]):
            prefixes[prefix] = room
        allowed[room] = set() if cells[3] == "—" else {r.strip() for r in cells[3].split(",")}
    return prefixes, allowed


def room_of(module: str, prefixes: dict[str, str]) -> str | None:
    best = max((p for p in prefixes if module == p or module.startswith(p + ".")), key=len, default=None)
    return prefixes.get(best) if best else None


def test_there_is_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving the shared part down a room):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_map_names_every_room_it_allows_and_covers_every_module():
    prefixes, allowed = room_map()
    assert {"runtime", "rollout", "rewards", "data", "experiments", "loop"} <= set(allowed)
    for room, targets in allowed.items():
        assert targets <= set(allowed), f"docs/design.md §8: {room} may import unknown rooms {targets - set(allowed)}"
    unmapped = [m for m in project_modules() if room_of(m, prefixes) is None]
    assert not unmapped, f"modules in no room of docs/design.md §8: {unmapped}"


def test_each_room_imports_only_what_the_map_allows():
    prefixes, allowed = room_map()
    bad = []
    for module, targets in sorted(import_graph().items()):
        src = room_of(module, prefixes)
        for t in sorted(targets):
            dst = room_of(t, prefixes)
            if dst != src and dst not in allowed[src]:
                bad.append(f"{module} ({src}) imports {t} ({dst})")
    assert not bad, "imports the map in docs/design.md §8 does not allow:\n" + "\n".join(bad)


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from fastcov.trainer import train\n    from . import config\n")
    mods = {"fastcov.trainer.runtime.m": f, "fastcov.trainer.train": f, "fastcov.trainer.runtime.config": f}
    assert imports_of("fastcov.trainer.runtime.m", f, mods) == {"fastcov.trainer.train",
                                                                  "fastcov.trainer.runtime.config"}
    prefixes, allowed = room_map()
    assert room_of("fastcov.trainer.train", prefixes) not in allowed[room_of("fastcov.trainer.runtime.m", prefixes)]


@pytest.mark.parametrize("module", ["fastcov.trainer.experiments.demo", "fastcov.trainer.experiments.study"])
def test_only_commands_and_entry_points_import_experiments(module):
    prefixes, _ = room_map()
    importers = {room_of(m, prefixes) for m, t in import_graph().items() if module in t}
    assert importers <= {"experiments", "commands", "entry points"}, importers
