"""The Python examples of the README and of docs/ run as written (the README's quick starts, the library
page's full examples): every ```python block, each in a fresh namespace."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_ALL = [(f"{page.relative_to(ROOT)} python block {i}", block)
        for page in PAGES
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]
_FIRST = {}  # block -> the first place that shows it: a copy (the README's quick starts) runs once
for _name, _block in _ALL:
    _FIRST.setdefault(_block, _name)
BLOCKS = [(name, block) for block, name in _FIRST.items()]


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs(name, block):
    exec(compile(block, name, "exec"), {})


def test_readme_and_docs_have_examples():
    readme = [name for name, _ in BLOCKS if name.startswith("README.md")]
    assert len(readme) >= 3  # the fused kernel, the losses in your own loop, transformers
    assert sum(name.startswith("docs/library.md") for name, _ in _ALL) >= 2  # the full kernel and loss examples
