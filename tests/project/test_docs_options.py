"""The config options README.md, docs/trainer.md and the guides the README's sections moved to quote exist, with the values and defaults they state.

An option is a dotted key that starts with a section of the run config (model, data, rollout, reward,
algo, optim, trainer): in backticks, alone or with a value (`algo.max_gen_batches`,
`algo.loss.cov_score=random`, `trainer.packing: true`), or a key=value override on a command line. Each must
be a field of the config dataclasses (walked from ``Config``); a quoted value must be one the field's type
accepts; a default the text states right after the quote ("`trainer.packing: true` (default)",
"`algo.scope: global`, the default", "`rollout.sync_bucket_mb`, default 64") must equal the dataclass
default. Python code blocks are not read (there model.x is Python). fastcov.ops, bench.rollout,
runs/demo/data/... and file names are not options: a key never follows a word character, ".", "/" or "-".
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from fastcov.trainer.config import Config, config_key

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/trainer.md", "docs/training.md", "docs/lora.md", "docs/scale-out.md", "docs/results.md",
        "docs/library.md", "docs/frameworks.md", "docs/getting-started.md", "docs/benchmarks.md", "docs/async.md")
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
# Dotted names in the docs that start like an option and are not one, on purpose.
NOT_OPTIONS = {
    "algo.mdoe": "the misspelt key shown being rejected",
    "model.generate": "transformers' generate method",
    "trainer.logger": "verl's name for what trainer.report_to is",
}
_KEY = rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]\w*)+)"
SPAN_OPTION = re.compile(_KEY + r"(?:=(\S+)|: (\S+))?")  # inside backticks
OVERRIDE = re.compile(_KEY + r"=(\S+)")  # anywhere else: key=value only
SPAN = re.compile(r"`([^`\n]+)`")
# what follows a quoted option when the text states its default: "(default)", ", the default",
# ", default 64", "(default 64)", ", defaults to 64"
DEFAULT_AFTER = re.compile(r"^(?:,\s*|\s*\()(?:the\s+)?default(?:s to)?\b(?:\s+(?P<value>[^\s,;)]+))?")
PLACEHOLDERS = {"...", "[...]"}


@dataclass(frozen=True)
class Mention:
    where: str  # file:line
    key: str
    value: str | None = None  # quoted with the key (key=value, key: value)
    default: str | None = None  # the default the text states for it


def _clean(value: str | None) -> str | None:
    """A quoted value without the shell quotes around it or the prose punctuation after it."""
    if value is None:
        return None
    value = value.strip("\"'")
    return value if value in PLACEHOLDERS else value.rstrip(",;:)")


def mentions(text: str, name: str) -> list[Mention]:
    """Every option quoted in ``text`` (a Markdown file called ``name``), in order."""
    found, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.lstrip()[3:].strip()
            continue
        if fence in ("python", "py"):
            continue
        where = f"{name}:{n}"
        for span in SPAN.finditer(line):
            for m in SPAN_OPTION.finditer(span.group(1)):
                value = _clean(m.group(2) or m.group(3))
                stated = DEFAULT_AFTER.match(line[span.end():])
                default = None if stated is None else (stated.group("value") or value or "")
                found.append(Mention(where, m.group(1), value, _clean(default)))
        for m in OVERRIDE.finditer(SPAN.sub(" ", line)):  # the spans are read above
            found.append(Mention(where, m.group(1), _clean(m.group(2))))
    return found


def resolve(key: str) -> tuple[dataclasses.Field, Any] | None:
    """The dataclass field ``key`` names and its type, walking from ``Config``; None when there is none."""
    cls, found = Config, None
    for part in key.split("."):
        if cls is None:
            return None
        fields = {config_key(f): f for f in dataclasses.fields(cls)}  # the YAML key (rollout.async: async_mode)
        if part not in fields:
            return None
        tp = typing.get_type_hints(cls)[fields[part].name]
        found = fields[part], tp
        cls = tp if dataclasses.is_dataclass(tp) else None
    return found


def accepts(tp: Any, value: Any) -> bool:
    """Whether a YAML value fits the annotation (the config's own checks are stricter on ranges)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(a, value) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return True


def parse(value: str) -> Any:
    """A value as the config reads it: YAML, and "1e-6" (a string to PyYAML) a float as the config takes it."""
    v = yaml.safe_load(value)
    if isinstance(v, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", v):
        return float(v)
    return v


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def problems(text: str, name: str) -> list[str]:
    """What ``text`` gets wrong about the config: unknown options, values of the wrong type, defaults
    that are not the dataclass's."""
    out = []
    for m in mentions(text, name):
        if m.key in NOT_OPTIONS:
            continue
        found = resolve(m.key)
        if found is None:
            out.append(f"{m.where}: `{m.key}` is not a config option")
            continue
        f, tp = found
        if m.value is not None and m.value not in PLACEHOLDERS and not accepts(tp, parse(m.value)):
            out.append(f"{m.where}: `{m.key}` quoted with {m.value!r}, which its type {tp} does not accept")
        if m.default is not None and (m.default == "" or parse(m.default) != _default(f)):
            out.append(f"{m.where}: `{m.key}` stated default {m.default!r}, the config's is {_default(f)!r}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_quoted_options_exist_with_their_values_and_defaults(doc):
    assert problems((ROOT / doc).read_text(), doc) == []


@pytest.mark.parametrize("doc", ["docs/trainer.md", "docs/scale-out.md"])
def test_the_extractor_sees_the_options(doc):
    found = mentions((ROOT / doc).read_text(), doc)
    assert len({m.key for m in found}) >= 10  # the extractor does see the doc's options
    assert any(m.default is not None for m in found)  # and a stated default


def test_exempt_names_are_quoted_and_are_not_options():
    quoted = {m.key for doc in DOCS for m in mentions((ROOT / doc).read_text(), doc)}
    for key in NOT_OPTIONS:
        assert key in quoted and resolve(key) is None, key


def test_the_check_reports_what_is_wrong():
    text = "\n".join([
        "Set `algo.no_such_option=3`, `trainer.packing: false` (default) and `rollout.vllm_mode: sideways`;",
        "`rollout.sync_bucket_mb`, default 32; `fastcov.ops`, `bench.rollout`, `train.py`, runs/demo/data/x.",
        "`trainer.keep_last`, defaults to 2; `algo.mode: kl_cov`; `optim.lr` (default 1e-6).",
        "    fastcov train CONFIG optim.nope=1 trainer.max_steps=ten data.synthetic.enabled=true",
        "```python",
        "model.whatever=1  # Python, not an option",
        "```",
    ])
    assert [m.key for m in mentions(text, "fake.md")] == [
        "algo.no_such_option", "trainer.packing", "rollout.vllm_mode", "rollout.sync_bucket_mb",
        "trainer.keep_last", "algo.mode", "optim.lr",
        "optim.nope", "trainer.max_steps", "data.synthetic.enabled"]
    assert problems(text, "fake.md") == [
        "fake.md:1: `algo.no_such_option` is not a config option",
        "fake.md:1: `trainer.packing` stated default 'false', the config's is True",
        "fake.md:1: `rollout.vllm_mode` quoted with 'sideways', which its type "
        "typing.Literal['colocated', 'server'] does not accept",
        "fake.md:2: `rollout.sync_bucket_mb` stated default '32', the config's is 64.0",
        "fake.md:4: `optim.nope` is not a config option",
        "fake.md:4: `trainer.max_steps` quoted with 'ten', which its type <class 'int'> does not accept",
    ]
