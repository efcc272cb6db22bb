"""Chat-formatted arithmetic for a pretrained chat model, with a difficulty knob.

A question in plain English, answered in ``\\boxed{}`` and scored by the math reward (the last boxed answer
compared exactly as a rational number, trainer/rewards/math_task.py). One worked exchange of the same level comes
first (``shots``: a small chat model rarely boxes its answer unasked twice; SmolLM2-135M-Instruct wrote "The
answer is 14." to "What is 7 + 7? Put the final answer in \\boxed{}.")::

    user:      What is 12 + 30 - 7? Put the final answer in \\boxed{}.
    assistant: 12 + 30 - 7 = 35. \\boxed{35}
    user:      What is 47 + 18 - 15? Put the final answer in \\boxed{}.
    assistant: ... \\boxed{50}

A ``Level`` sets the difficulty: ``digits``, how many digits every operand has (1: 1-9, 2: 10-99, ...), and
``ops``, how many additions and subtractions follow the first operand. Subtraction is only drawn when the
running total stays non-negative, so every answer is a non-negative integer. ``write_task`` stores a level in
verl's format (``prompt`` chat messages, ``reward_model.ground_truth``, ``data_source`` = ``chat_arith_<level>``),
the format ``fastcov train`` and ``fastcov eval`` read; the model's own chat template formats it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Put the final answer in \\boxed{}."
DATA_SOURCE = "chat_arith"


@dataclass(frozen=True)
class Level:
    """``digits`` digits per operand, ``ops`` operations (+ or -) after the first operand."""

    digits: int
    ops: int

    def __post_init__(self):
        if not (isinstance(self.digits, int) and 1 <= self.digits <= 6):
            raise ValueError(f"digits: must be an integer in [1, 6], got {self.digits!r}")
        if not (isinstance(self.ops, int) and 1 <= self.ops <= 8):
            raise ValueError(f"ops: must be an integer in [1, 8], got {self.ops!r}")

    @property
    def name(self) -> str:
        return f"d{self.digits}o{self.ops}"

    @classmethod
    def parse(cls, text: str) -> Level:
        """``"d2o1"`` (or ``"2,1"``) -> Level(2, 1); ValueError naming the form otherwise."""
        t = text.strip().lower()
        try:
            if t.startswith("d") and "o" in t:
                digits, ops = t[1:].split("o", 1)
            else:
                digits, ops = t.split(",", 1)
            return cls(int(digits), int(ops))
        except ValueError as exc:
            raise ValueError(f"level: expected dDoO (e.g. d2o1: 2-digit operands, 1 operation), got {text!r} "
                             f"({exc})") from None


# Easiest first: where the scan of the start model looks for a level it can learn.
LEVELS = (Level(1, 1), Level(1, 2), Level(2, 1), Level(2, 2), Level(3, 1), Level(3, 2))


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]
    signs: tuple[str, ...]  # one "+" or "-" per operand after the first

    @property
    def expression(self) -> str:
        return str(self.operands[0]) + "".join(f" {s} {x}" for s, x in zip(self.signs, self.operands[1:],
                                                                          strict=True))

    @property
    def answer(self) -> int:
        total = self.operands[0]
        for s, x in zip(self.signs, self.operands[1:], strict=True):
            total = total + x if s == "+" else total - x
        return total

    def question(self) -> str:
        return f"What is {self.expression}? {INSTRUCTION}"

    def worked(self) -> str:
        """A correct reply in the format the reward reads."""
        return f"{self.expression} = {self.answer}. \\boxed{{{self.answer}}}"


def messages(p: Problem, example: Problem | None) -> list[dict]:
    """The chat of one problem: the worked ``example`` exchange (if any), then the question."""
    shot = [] if example is None else [{"role": "user", "content": example.question()},
                                       {"role": "assistant", "content": example.worked()}]
    return shot + [{"role": "user", "content": p.question()}]


def sample_problem(rng: random.Random, level: Level) -> Problem:
    """Operands of exactly ``level.digits`` digits (1 digit: 1-9); each operation + or - with equal chance,
    - only while the total stays >= 0."""
    lo, hi = (1 if level.digits == 1 else 10 ** (level.digits - 1)), 10 ** level.digits - 1
    operands = [rng.randint(lo, hi)]
    signs: list[str] = []
    total = operands[0]
    for _ in range(level.ops):
        x = rng.randint(lo, hi)
        sign = rng.choice("+-") if total >= x else "+"
        total = total + x if sign == "+" else total - x
        operands.append(x)
        signs.append(sign)
    return Problem(tuple(operands), tuple(signs))


def generate(n: int, seed: int, level: Level, exclude: set[str] | None = None, fewer_ok: bool = False) -> list[Problem]:
    """``n`` distinct problems of ``level`` (by expression), none in ``exclude``; if fewer exist (d1o1 has 126),
    ValueError, or with ``fewer_ok`` as many as a long search finds."""
    rng = random.Random(f"{seed}:{level.name}")
    seen = set(exclude or ())
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            if fewer_ok:
                break
            raise ValueError(f"n: only {len(out)} distinct {level.name} problems exist, asked {n}")
        p = sample_problem(rng, level)
        if p.expression in seen:
            continue
        seen.add(p.expression)
        out.append(p)
    return out


def to_rows(problems: list[Problem], level: Level, split: str, shots: int = 1, seed: int = 0) -> list[dict]:
    """verl-style rows; with ``shots`` = 1 each prompt opens with a worked example of the same level, drawn
    from problems that are none of ``problems``."""
    examples: list[Problem | None] = [None] * len(problems)
    if shots:
        # a small level may have no problem left over: then any other problem of the level than the question
        pool = (generate(64, seed + 7, level, exclude={p.expression for p in problems}, fewer_ok=True)
                or generate(64, seed + 7, level, fewer_ok=True))
        rng = random.Random(f"{seed}:shots:{level.name}")
        examples = [rng.choice([e for e in pool if e.expression != p.expression]) for p in problems]
    return [{"data_source": f"{DATA_SOURCE}_{level.name}",
             "prompt": messages(p, ex),
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "level": level.name}}
            for i, (p, ex) in enumerate(zip(problems, examples, strict=True))]


def write_parquet(path: str, problems: list[Problem], level: Level, split: str, shots: int = 1, seed: int = 0) -> None:
    import pandas as pd

    pd.DataFrame(to_rows(problems, level, split, shots, seed)).to_parquet(path, index=False)


def write_task(train_path: str | None, val_path: str, n_train: int, n_val: int, level: Level, seed: int = 0,
               shots: int = 1) -> None:
    """Disjoint train / validation parquet files of ``level`` (validation drawn first, with ``seed + 1``), each
    prompt with ``shots`` (0 or 1) worked examples; no training file when ``train_path`` is None. A level with
    fewer than ``n_train`` other problems trains on all of them."""
    if shots not in (0, 1):
        raise ValueError(f"shots: must be 0 or 1, got {shots!r}")
    val = generate(n_val, seed + 1, level)
    write_parquet(val_path, val, level, "test", shots, seed + 1)
    if train_path is not None:
        train = generate(n_train, seed, level, exclude={p.expression for p in val}, fewer_ok=True)
        write_parquet(train_path, train, level, "train", shots, seed)
