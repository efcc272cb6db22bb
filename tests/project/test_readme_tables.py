"""Every number in the README's tables appears in a file the table cites.

A table's sources are the repository files linked from its own cells and from the text between it and what comes
before it (the heading, or the previous table): the caption that says where its numbers come from. A number is a
token like 512, 2.12, 69%, 1.38×, 3.7e-6 or 150,716; it counts as found where a source holds a number of the same
value (so 3.7e-6 is found as 3.7e-06, 0.46 not as 0.463). The demo's printouts are indented blocks, not tables: what
make demo printed on one CPU is not a file's.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d.])|(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.]*\d)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def numbers(text: str) -> set[float]:
    return {float(token.replace(",", "")) for token in NUMBER.findall(text)}


def tables(text: str) -> list[tuple[list[str], str]]:
    """(body rows, caption) of each table: rows start with '|' at the margin; the header and its rule are left out."""
    found, caption, rows = [], [], []
    for line in text.splitlines():
        if line.startswith("|"):
            rows.append(line)
            continue
        if rows:
            found.append((rows[2:], "\n".join(caption)))
            rows, caption = [], []
        caption = [] if line.startswith("#") else [*caption, line]
    if rows:
        found.append((rows[2:], "\n".join(caption)))
    return found


def sources(rows: list[str], caption: str) -> list[pathlib.Path]:
    paths = []
    for target in LINK.findall(caption + "\n" + "\n".join(rows)):
        path = (README.parent / target).resolve()
        if path.is_file() and ROOT in path.parents:
            paths.append(path)
    return paths


def unfound(text: str) -> list[str]:
    """'<row>: <number> not in <sources>' for every number of every table not in that table's sources."""
    missing = []
    for rows, caption in tables(text):
        cited = sources(rows, caption)
        held = set().union(*(numbers(path.read_text()) for path in cited))
        for row in rows:
            for token in NUMBER.findall(row):
                if float(token.replace(",", "")) not in held:
                    names = [str(path.relative_to(ROOT)) for path in cited] or "no file"
                    missing.append(f"{row[:60]}...: {token} not in {names}")
    return missing


def test_every_number_in_the_readmes_tables_is_in_a_file_it_cites():
    text = README.read_text()
    assert sum(1 for rows, _ in tables(text) if any(NUMBER.search(row) for row in rows)) >= 2  # kernels, trainer
    assert not unfound(text), "\n".join(unfound(text))


def test_a_changed_number_is_caught():
    text = README.read_text()
    kernel_row = next(row for rows, _ in tables(text) for row in rows if "torch twin" in row)
    changed = text.replace(kernel_row, kernel_row.replace("1.36×", "1.37×"), 1)
    assert changed != text
    assert any("1.37" in line for line in unfound(changed))
    assert NUMBER.findall("0.463 / 2.0e-6 / 69% / 1.38× / 150,716 / v0.4.0") == ["0.463", "2.0e-6", "69", "1.38",
                                                                                     "150,716"]
