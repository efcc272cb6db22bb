"""The Python examples of the README and of docs/ run as written (the README's quick starts, the library
page's full examples, the TRL and verl ones): every ```python block, each in a fresh namespace and an empty working
directory. A block that imports verl runs where verl is importable (.venv-verl: tests/integrations_verl/
test_verl_docs.py runs them there) and is skipped here."""

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
_VERL = re.compile(r"^\s*(import|from) verl\b", re.M)


def uses_verl(block: str) -> bool:
    return bool(_VERL.search(block))


def run_block(name: str, block: str) -> None:
    exec(compile(block, name, "exec"), {})


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs(name, block, tmp_path, monkeypatch):
    if uses_verl(block):
        pytest.importorskip("verl", reason="verl lives in .venv-verl (make test-verl runs this block)")
    monkeypatch.chdir(tmp_path)  # what a block writes (a TRL output_dir) stays out of the checkout
    run_block(name, block)


def test_readme_and_docs_have_examples():
    readme = [name for name, _ in BLOCKS if name.startswith("README.md")]
    assert len(readme) >= 4  # the fused kernel, the losses in your own loop, TRL, transformers
    assert sum(uses_verl(block) for _, block in BLOCKS) >= 1  # verl's, run by make test-verl
    assert sum(name.startswith("docs/library.md") for name, _ in _ALL) >= 2  # the full kernel and loss examples
