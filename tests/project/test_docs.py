"""Every `docs/<name>.md §n` reference in code, configs and docs points at a heading `## n.` of that
document, and nothing refers to a design document outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for pattern in ("*.md", "fastcov/**/*.py", "kernels/*.py", "trainer/*.py", "bench/**/*.py", "tests/**/*.py",
                             "configs/**/*.yaml", "docs/*.md", "Makefile")
           for p in ROOT.glob(pattern)]
REF = re.compile(r"docs/([\w.-]+\.md) §(\d+)")


def _headings(doc: Path) -> set[str]:
    return set(re.findall(r"^## (\d+)\.", doc.read_text(), flags=re.M))


def test_section_references_resolve():
    refs = 0
    for src in SOURCES:
        for name, number in REF.findall(src.read_text(errors="replace")):
            doc = ROOT / "docs" / name
            assert doc.is_file(), f"{src.relative_to(ROOT)} cites docs/{name}, which does not exist"
            assert number in _headings(doc), f"{src.relative_to(ROOT)} cites docs/{name} §{number}: no such heading"
            refs += 1
    assert refs >= 15  # the code does cite the design


def test_no_reference_to_a_design_document_outside_the_repository():
    for src in SOURCES:
        if src.name == "test_docs.py":
            continue
        text = src.read_text(errors="replace")
        assert "DESIGN §" not in text and "shared/DESIGN" not in text, src.relative_to(ROOT)
