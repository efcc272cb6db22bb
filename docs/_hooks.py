"""MkDocs hooks (mkdocs.yml `hooks:`): the site is built from docs/, but the pages link to files of the
repository outside it (configs/*.yaml, bench/results/*, bench/README.md) and the home page is the README.

- ``<!-- include PATH -->`` in a page is replaced by the repository file PATH (docs/index.md includes the
  README, docs/changelog.md the CHANGELOG), so each has one source.
- A relative link to a repository file outside docs/ is rewritten to a copy of that file in the site under
  ``_repo/`` (Markdown files there are rendered as pages and their own links followed the same way); the
  README and the CHANGELOG are linked to their pages. A link to a file that does not exist is left as it is,
  so the strict build fails on it.

Links are read in Markdown outside fenced code blocks: ``[text](target)`` and ``![alt](target)``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REPO_DIR = "_repo"  # where files from outside docs/ land in the site
PAGE_FOR = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}  # repository files that are site pages
INCLUDE = re.compile(r"^<!-- include (\S+) -->$", re.M)
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")  # link text may wrap
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)", re.I)

_sources: dict[str, Path] = {}  # site URI of a generated page -> the repository file it shows


def _outside_code(text: str):
    """(is_code, chunk) pieces of ``text``: fenced code blocks are passed through untouched."""
    chunk: list[str] = []
    code = False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            if not code:
                yield False, "".join(chunk)
                chunk = [line]
            else:
                chunk.append(line)
                yield True, "".join(chunk)
                chunk = []
            code = not code
            continue
        chunk.append(line)
    yield code, "".join(chunk)


def _site_uri(target: Path) -> str | None:
    """The site URI that shows the repository file ``target``, or None where it is not a file here."""
    if not target.is_file():
        return None
    if target.is_relative_to(DOCS):
        return target.relative_to(DOCS).as_posix()
    rel = target.relative_to(ROOT).as_posix()
    return PAGE_FOR.get(rel, f"{REPO_DIR}/{rel}")


def _targets(text: str, source: Path):
    """(match, resolved path) of every relative link in ``text``, a Markdown file at ``source``."""
    for code, chunk in _outside_code(text):
        if code:
            continue
        for m in LINK.finditer(chunk):
            path = m.group(2).split("#", 1)[0]
            if path and not EXTERNAL.match(m.group(2)):
                resolved = (source.parent / path).resolve()
                if resolved.is_relative_to(ROOT):
                    yield m, resolved


def relink(text: str, source: Path, page_uri: str) -> str:
    """``text`` (the Markdown of ``source``) with its relative links pointing where the site has their targets,
    relative to the page at ``page_uri``."""
    out = []
    for code, chunk in _outside_code(text):
        if code:
            out.append(chunk)
            continue

        def fix(m: re.Match) -> str:
            target = m.group(2)
            if EXTERNAL.match(target):
                return m.group(0)
            path, _, anchor = target.partition("#")
            uri = _site_uri((source.parent / path).resolve()) if path else None
            if uri is None:
                return m.group(0)  # missing (the build reports it) or a bare anchor
            new = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
            return m.group(1) + new + ("#" + anchor if anchor else "") + m.group(3)

        out.append(LINK.sub(fix, chunk))
    return "".join(out)


def on_files(files: Files, config) -> Files:
    """Add every repository file the pages link to (transitively, through linked Markdown files)."""
    _sources.clear()
    queue = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    queue += [ROOT / name for name in PAGE_FOR]  # included whole by their pages, so read from where they live
    seen = set(queue)
    while queue:
        source = queue.pop()
        if source.suffix != ".md":
            continue
        for _, target in _targets(source.read_text(encoding="utf-8"), source):
            uri = _site_uri(target)
            if uri is None or target in seen:
                continue
            seen.add(target)
            if uri.startswith(REPO_DIR + "/"):
                files.append(File.generated(config, uri, abs_src_path=str(target), inclusion=InclusionLevel.NOT_IN_NAV))
                _sources[uri] = target
                queue.append(target)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    source = _sources.get(uri) or Path(page.file.abs_src_path)
    out = []
    pos = 0
    for m in INCLUDE.finditer(markdown):  # an included file's links are relative to where it lives
        out.append(relink(markdown[pos:m.start()], source, uri))
        included = ROOT / m.group(1)
        out.append(relink(included.read_text(encoding="utf-8"), included, uri))
        pos = m.end()
    out.append(relink(markdown[pos:], source, uri))
    return "".join(out)
