"""The README stays a short front page, every docs/ page can be reached from it and from the site's nav
(mkdocs.yml), the README's links resolve, and the version is written in one place with a changelog entry.

`make docs` (in CI) builds the site in strict mode; these checks need no MkDocs and run in `make test`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import fastcov

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# docs pages that show a repository file (docs/_hooks.py includes it): reached when that file is
SHOWS = {DOCS / "index.md": ROOT / "README.md", DOCS / "changelog.md": ROOT / "CHANGELOG.md"}


def _links(page: Path) -> list[tuple[str, Path]]:
    """(link, resolved path) of the relative links of a Markdown file, fenced code left out."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    out = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if path and not re.match(r"^[a-z][a-z0-9+.-]*:|^/", target, re.I):
            out.append((target, (page.parent / path).resolve()))
    return out


def _reachable_from_readme() -> set[Path]:
    seen, queue = {ROOT / "README.md"}, [ROOT / "README.md"]
    while queue:
        page = queue.pop()
        for _, target in _links(page):
            if target.suffix == ".md" and target.is_file() and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values()))
    return set()


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {README_LINES})"


def test_the_readmes_links_resolve():
    broken = [t for t, path in _links(ROOT / "README.md") if not path.exists()]
    assert not broken, broken


def test_every_docs_page_is_reachable_from_the_readme():
    reached = _reachable_from_readme()
    pages = sorted(DOCS.rglob("*.md"))
    missing = [p.relative_to(ROOT).as_posix() for p in pages if p not in reached and SHOWS.get(p) not in reached]
    assert not missing, f"not linked from the README, directly or through the pages it links: {missing}"
    assert len(pages) >= 20


def test_every_docs_page_is_in_the_site_nav():
    nav = _nav_pages(_mkdocs()["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def test_the_site_builds_strictly_from_docs():
    cfg = _mkdocs()
    assert cfg["docs_dir"] == "docs" and cfg["strict"] is True
    assert all(cfg["validation"][k] == "warn" for k in ("omitted_files", "unrecognized_links", "anchors"))
    assert "make docs" in (ROOT / ".ci" / "run").read_text()
    for page, shown in SHOWS.items():
        assert f"<!-- include {shown.relative_to(ROOT).as_posix()} -->" in page.read_text(encoding="utf-8")


def test_the_version_is_written_once_and_has_a_changelog_entry():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fastcov.__version__)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fastcov.__version__"}
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## {re.escape(fastcov.__version__)} ", changelog, re.M), "no changelog section for it"
    assert f"Version {fastcov.__version__} " in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_api_reference_documents_every_exported_name():
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [name for name in fastcov.__all__ if not re.search(rf"\b{name}\b", api)]
    assert not missing, f"docs/api.md does not name these exports of fastcov: {missing}"


def test_the_site_hook_points_links_at_what_the_site_has():
    pytest.importorskip("mkdocs")  # requirements/docs.txt (make docs), not the dev environment
    spec = importlib.util.spec_from_file_location("_docs_hooks", DOCS / "_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    text = "[r](docs/results.md#across-seeds) [c](configs/demo.yaml) [l](CHANGELOG.md) [x](https://x.org)\n"
    text += "```python\n[not](a/link.md)\n```\n"
    out = hooks.relink(text, ROOT / "README.md", "index.md")
    assert out.splitlines()[0] == ("[r](results.md#across-seeds) [c](_repo/configs/demo.yaml) [l](changelog.md) "
                                   "[x](https://x.org)")
    assert "[not](a/link.md)" in out
    assert hooks.relink("[c](../../configs/demo.yaml)", DOCS / "demo" / "x.md", "demo/x.md") == "[c](../_repo/configs/demo.yaml)"
    assert hooks.relink("[m](missing.md)", DOCS / "x.md", "x.md") == "[m](missing.md)"  # left for the build to flag
