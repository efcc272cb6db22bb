"""The synthetic verifiable task and its offline tokenizer.

Arithmetic word problems over small integers, answered in ``\\boxed{}``::

    user:      mia has 3 pens . mia gets 4 more . mia gives 2 away . how many pens does mia have ?
    assistant: 3 + 4 = 7 . 7 - 2 = 5 . \\boxed{5}

``write_parquet`` stores them in verl's format (``prompt`` chat messages, ``reward_model.ground_truth``,
``data_source`` = "synthetic_arith"). ``solutions`` gives several correct answer styles for one problem
(worked steps, one expression, narrated, bare box); the demo's supervised warm-start mixes them so the
starting policy has real entropy over how to answer, which RL can then collapse or keep.

``build_tokenizer`` builds a word-level tokenizer (words and single digits, each with an optional
leading space, so decoding reproduces the text exactly) with a ChatML chat template, offline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DATA_SOURCE = "synthetic_arith"
# Held-out problems with one operation more than any training problem: where a policy that has collapsed onto
# the training problems' answers shows what it lost (the demo's and the study's second evaluation).
HARDER_DATA_SOURCE = "synthetic_arith_harder"
NAMES = ["mia", "sam", "leo", "ana", "tom", "eva", "max", "zoe"]
ITEMS = ["apples", "pens", "coins", "books", "cards", "shells", "stamps", "eggs"]
INSTRUCTION = "put the answer in \\boxed{} ."
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
_PRETOKENIZE = r"\\boxed\{| ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]|\n| +"


@dataclass
class Problem:
    name: str
    item: str
    start: int
    ops: list[tuple[str, int]]  # ("+", 4) / ("-", 2)

    @property
    def values(self) -> list[int]:
        out = [self.start]
        for op, x in self.ops:
            out.append(out[-1] + x if op == "+" else out[-1] - x)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    def question(self) -> str:
        parts = [f"{self.name} has {self.start} {self.item} ."]
        for op, x in self.ops:
            parts.append(f"{self.name} gets {x} more ." if op == "+" else f"{self.name} gives {x} away .")
        parts.append(f"how many {self.item} does {self.name} have ? {INSTRUCTION}")
        return " ".join(parts)


def sample_problem(rng: random.Random, min_ops: int = 1, max_ops: int = 2, max_value: int = 9) -> Problem:
    """A problem whose numbers and intermediate totals stay in [0, max_value]."""
    n_ops = rng.randint(min_ops, max_ops)
    start = rng.randint(1, max_value)
    ops, cur = [], start
    for _ in range(n_ops):
        can_add = cur < max_value
        can_sub = cur > 1
        op = rng.choice([o for o, ok in (("+", can_add), ("-", can_sub)) if ok] or ["+"])
        if op == "+":
            x = rng.randint(1, max(1, max_value - cur))
            cur += x
        else:
            x = rng.randint(1, cur - 1)
            cur -= x
        ops.append((op, x))
    return Problem(rng.choice(NAMES), rng.choice(ITEMS), start, ops)


SOLUTION_STYLES = ("steps", "expression", "narrated", "bare")


def solution(p: Problem, style: str) -> str:
    """A correct response in one of SOLUTION_STYLES."""
    v = p.values
    box = f"\\boxed{{{p.answer}}}"
    if style == "steps":
        steps = [f"{v[i]} {op} {x} = {v[i + 1]} ." for i, (op, x) in enumerate(p.ops)]
        return " ".join(steps + [box])
    if style == "expression":
        expr = " ".join([str(p.start)] + [f"{op} {x}" for op, x in p.ops])
        return f"{expr} = {p.answer} . {box}"
    if style == "narrated":
        chain = " , then ".join(str(x) for x in v)
        return f"{p.name} has {chain} . the answer is {box}"
    if style == "bare":
        return box
    raise ValueError(f"style: expected one of {SOLUTION_STYLES}, got {style!r}")


def generate(n: int, seed: int, min_ops: int = 1, max_ops: int = 2, max_value: int = 9,
             exclude: set[str] | None = None) -> list[Problem]:
    """``n`` distinct problems (by question text), none of whose questions is in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"n: only {len(out)} distinct problems exist for these settings, asked {n}")
        p = sample_problem(rng, min_ops, max_ops, max_value)
        q = p.question()
        if q in seen:
            continue
        seen.add(q)
        out.append(p)
    return out


def to_rows(problems: list[Problem], split: str, data_source: str = DATA_SOURCE) -> list[dict]:
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": p.question()}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(path: str, problems: list[Problem], split: str, data_source: str = DATA_SOURCE) -> None:
    import pandas as pd

    pd.DataFrame(to_rows(problems, split, data_source)).to_parquet(path, index=False)


def write_task(train_path: str, val_path: str, n_train: int, n_val: int, seed: int = 0,
               min_ops: int = 1, max_ops: int = 2, max_value: int = 9, harder_path: str | None = None) -> None:
    """Write disjoint train/validation parquet files of the synthetic task; with ``harder_path``, also ``n_val``
    held-out problems with exactly ``max_ops + 1`` operations (data source HARDER_DATA_SOURCE), a length no
    training or validation problem has."""
    val = generate(n_val, seed + 1, min_ops, max_ops, max_value) if n_val else []
    train = generate(n_train, seed, min_ops, max_ops, max_value, exclude={p.question() for p in val})
    write_parquet(train_path, train, "train")
    if n_val:
        write_parquet(val_path, val, "test")
    if harder_path and n_val:
        write_parquet(harder_path, generate(n_val, seed + 2, max_ops + 1, max_ops + 1, max_value), "test",
                      HARDER_DATA_SOURCE)


def _corpus() -> list[str]:
    words = set(NAMES + ITEMS)
    for p in generate(400, 12345, 1, 4, 30):
        words.update(p.question().split())
        for s in SOLUTION_STYLES:
            words.update(solution(p, s).split())
    words.update(["user", "assistant", "system", "the", "answer", "is"])
    return sorted(words)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast for the synthetic task (~150 tokens), built offline; eos = <|im_end|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated")
    pieces: set[str] = set()
    for word in _corpus():
        for text in (word, " " + word):
            pieces.update(piece for piece, _ in pre.pre_tokenize_str(text))
    for d in "0123456789":
        pieces.update([d, " " + d])
    for c in ".,?+-=(){}/*:!":
        pieces.update([c, " " + c])
    pieces.update(["\n", " ", "  "])
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for piece in sorted(pieces):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
