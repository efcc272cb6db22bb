"""Prompt data: verl-style parquet in, tokenized de-duplicated prompts out, sampled in a resumable order.

Parquet columns (verl's): ``prompt`` — a list of chat messages ``{"role", "content"}``;
``reward_model`` — a struct with ``ground_truth``; ``data_source`` — a string (used to pick the evaluation
temperature). Other columns are ignored. A ``.jsonl`` file with the same fields, one object per line, is
read too. Files are untrusted input: a missing file, a file that is not parquet/JSON lines, a missing
column or a bad value raises ``DataError`` naming the file, the column and the row (0-based, as pandas
counts; JSONL: the 1-based line).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastcov.errors import UserError


class DataError(UserError, ValueError):
    """A data file that cannot be used; the message names the file, and the column and row when it can."""


class DataFileNotFound(UserError, FileNotFoundError):
    """A data file that does not exist."""


@dataclass
class Example:
    """One prompt. ``prompt_ids``: token ids (chat template applied, generation prompt appended)."""

    prompt_ids: list[int]
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    key: str = field(repr=False, default="")


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        raise DataError(f"{where}: column 'prompt' is null; give a list of {{role, content}} messages")
    try:
        if any(m["role"] is None or m["content"] is None for m in value):
            raise KeyError("null role or content")
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    except (TypeError, KeyError, IndexError):
        raise DataError(f"{where}: column 'prompt' must be a list of {{role, content}} messages") from None
    if not msgs:
        raise DataError(f"{where}: column 'prompt' is empty")
    return msgs


def _ground_truth(value: Any, where: str) -> str:
    if isinstance(value, dict) and value.get("ground_truth") is not None:
        gt = value["ground_truth"]
    else:
        raise DataError(f"{where}: column 'reward_model' must be a struct with a non-null 'ground_truth' field")
    if hasattr(gt, "tolist"):
        gt = gt.tolist()
    if isinstance(gt, (list, tuple)):
        gt = gt[0] if len(gt) == 1 else ",".join(map(str, gt))
    return str(gt)


REQUIRED_COLUMNS = ("prompt", "reward_model")


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
                where = f"{path} line {lineno}"
                for col in REQUIRED_COLUMNS:
                    if col not in row:
                        raise DataError(f"{where}: missing column {col!r}")
                rows.append((where, row))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a UTF-8 JSON-lines file") from None
    return rows


def _read_table(path: Path) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}); give verl-style "
                        "parquet or .jsonl") from None
    cols = set(table.column_names)
    for required in REQUIRED_COLUMNS:
        if required not in cols:
            raise DataError(f"{path}: missing column {required!r} (have {', '.join(sorted(cols)) or 'none'})")
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a verl-style parquet (or ``.jsonl``) file as ``{"messages", "ground_truth", "data_source"}``.

    Raises DataFileNotFound / DataError naming the file, column and row.
    """
    path = Path(path)
    if not path.exists():
        raise DataFileNotFound(f"data file {str(path)!r} does not exist")
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} is not a file")
    if not os.access(path, os.R_OK):
        raise DataError(f"data file {str(path)!r} is not readable (permissions)")
    raw = _read_jsonl(path) if path.suffix.lower() in (".jsonl", ".json") else _read_table(path)
    if not raw:
        raise DataError(f"{path}: no rows; give a file with at least one prompt")
    out = []
    for where, row in raw:
        out.append({
            "messages": _messages(row["prompt"], where),
            "ground_truth": _ground_truth(row["reward_model"], where),
            "data_source": str(row.get("data_source") or "unknown"),
        })
    return out


def load_examples(files: list[str], tokenizer, max_prompt_len: int, chat_template: str | None = None,
                  exclude: set[str] | None = None) -> tuple[list[Example], dict[str, int]]:
    """Read, de-duplicate (by message list), tokenize with the chat template, drop over-long prompts.

    Returns the examples and counts {"rows", "duplicates", "excluded", "too_long"}.
    """
    seen: set[str] = set()
    exclude = exclude or set()
    stats = {"rows": 0, "duplicates": 0, "excluded": 0, "too_long": 0}
    out: list[Example] = []
    for f in files:
        for row in read_parquet(f):
            stats["rows"] += 1
            key = json.dumps(row["messages"], sort_keys=True)
            if key in seen:
                stats["duplicates"] += 1
                continue
            seen.add(key)
            if key in exclude:
                stats["excluded"] += 1
                continue
            ids = tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, tokenize=False, chat_template=chat_template
            )
            ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_len:
                stats["too_long"] += 1
                continue
            out.append(Example(ids, row["messages"], row["ground_truth"], row["data_source"], key))
    return out, stats


def split_train_val(examples: list[Example], val_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out ``val_fraction`` of the examples (seeded), at least one when the fraction is > 0."""
    if val_fraction <= 0 or len(examples) < 2:
        return list(examples), []
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(val_fraction * len(examples))))
    val_idx = set(idx[:n_val])
    return ([e for i, e in enumerate(examples) if i not in val_idx],
            [e for i, e in enumerate(examples) if i in val_idx])


class PromptSampler:
    """Prompts in a seeded order, reshuffled every epoch; the position is part of the checkpoint."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("PromptSampler: the training set is empty")
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.pos >= self.n:
                self.epoch += 1
                self.pos = 0
                self._order = self._perm(self.epoch)
            take = min(count - len(out), self.n - self.pos)
            out.extend(self._order[self.pos : self.pos + take])
            self.pos += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise DataError(f"resume: the training set has {self.n} prompts, the checkpoint had {state['n']}")
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.pos = state["pos"]
        self._order = self._perm(self.epoch)


def staging_dir(data_dir: Path) -> Path:
    """Where the synthetic task is written before it is renamed into ``data_dir`` (a run directory that
    holds nothing else can still be trained into: ``runtime.run_dir.REGENERABLE``)."""
    return data_dir.with_name(f".{data_dir.name}.tmp")


def _write_synthetic(data_dir: Path, s) -> None:
    """The synthetic task into ``data_dir``, whole or not at all: written beside it, fsynced, then renamed
    in, train.parquet last, so a train.parquet that exists means both files are complete."""
    import shutil

    from fastcov.trainer.data.synthetic import write_task

    tmp = staging_dir(data_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_task(str(tmp / "train.parquet"), str(tmp / "val.parquet"), s.n_train, s.n_val, s.seed, s.min_ops,
               s.max_ops, s.max_value)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("val.parquet", "train.parquet"):
        if not (tmp / name).exists():  # no validation split (n_val 0)
            continue
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp / name, data_dir / name)
    shutil.rmtree(tmp, ignore_errors=True)


def prepare_data(cfg, tokenizer, run_dir: Path, rank: int = 0):
    """Train and validation examples for a Config (writes the synthetic task into the run dir first).

    Only rank 0 writes files; callers synchronise before other ranks read them.
    """
    d = cfg.data
    train_files, val_files = list(d.train_files), list(d.val_files)
    if d.synthetic.enabled:
        s = d.synthetic
        data_dir = run_dir / "data"
        tr, va = data_dir / "train.parquet", data_dir / "val.parquet"
        if rank == 0 and not tr.exists():
            _write_synthetic(data_dir, s)
        train_files.append(str(tr))
        if s.n_val:
            val_files.append(str(va))
    return train_files, val_files


def _load_option(key: str, files: list[str], tokenizer, d, exclude: set[str] | None = None):
    """``load_examples`` of the files a config option lists; a missing file names that option."""
    try:
        return load_examples(files, tokenizer, d.max_prompt_len, d.chat_template, exclude=exclude)
    except DataFileNotFound as exc:
        raise DataFileNotFound(f"{key}: {exc}; fix the path in {key} (in the config, or {key}=... on the "
                               "command line)") from None


def load_train_val(cfg, tokenizer, train_files: list[str], val_files: list[str]):
    d = cfg.data
    if val_files:
        val, vstats = _load_option("data.val_files", val_files, tokenizer, d)
        train, tstats = _load_option("data.train_files", train_files, tokenizer, d, exclude={e.key for e in val})
    else:
        allx, tstats = _load_option("data.train_files", train_files, tokenizer, d)
        train, val = split_train_val(allx, d.val_fraction, cfg.trainer.seed)
        vstats = {}
    if d.max_val_prompts and len(val) > d.max_val_prompts:
        val = val[: d.max_val_prompts]
    if not train:
        raise DataError(f"data.train_files: no usable training prompts in {train_files} ({tstats}); "
                        "check data.max_prompt_len and that the training and validation files differ")
    return train, val, {"train": tstats, "val": vstats}
