"""Code tasks: the dataset format, a reward that runs the answer against tests in the sandbox, and a
synthetic offline task.

Format (verl-style parquet or .jsonl, read by trainer/data/loading.py like the math data)::

    prompt:        [{"role": "user", "content": "Write a Python program that ..."}]
    reward_model:  {"ground_truth": "{\\"inputs\\": [\\"1 2\\\\n\\", ...], \\"outputs\\": [\\"3\\\\n\\", ...]}"}
    data_source:   "code_synthetic"

``ground_truth`` is a JSON string holding the tests as stdin/stdout pairs (the convention of PRIME's and
verl's code data): ``{"inputs": [...], "outputs": [...]}``; ``code_row(prompt, tests)`` builds a row.

Reward (``CodeRewardFn``, ``reward.task: code``): the last fenced code block of the response (```python
... ``` or a bare ``` ... ```) runs once per test in the sandbox (trainer/rewards/sandbox.py, or a SandboxFusion
server when ``reward.code.sandbox_fusion_url`` is set) with the test's input on stdin; the answer is
correct when every test's stdout matches (trailing whitespace of each line and trailing blank lines
ignored). No code block: wrong, nothing runs. Score 1/0 (``binary``) or ±1 (``pm1``), all tests or
nothing, as PRIME's code reward.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

DATA_SOURCE = "code_synthetic"
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def code_row(prompt: str, tests: list[tuple[str, str]], data_source: str = DATA_SOURCE) -> dict:
    """One dataset row: chat prompt and tests [(stdin, expected stdout), ...] as the JSON ground truth."""
    if not tests:
        raise ValueError("a code task needs at least one test")
    truth = json.dumps({"inputs": [t[0] for t in tests], "outputs": [t[1] for t in tests]})
    return {"prompt": [{"role": "user", "content": prompt}], "reward_model": {"ground_truth": truth},
            "data_source": data_source}


def parse_tests(ground_truth: str) -> list[tuple[str, str]]:
    """The (stdin, stdout) pairs of a ground truth; ValueError naming what is wrong."""
    try:
        obj = json.loads(ground_truth)
    except ValueError:
        raise ValueError(f"code ground truth is not JSON: {ground_truth[:80]!r}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("inputs"), list) or not isinstance(obj.get("outputs"), list):
        raise ValueError("code ground truth must be a JSON object with 'inputs' and 'outputs' lists")
    if len(obj["inputs"]) != len(obj["outputs"]) or not obj["inputs"]:
        raise ValueError(f"code ground truth: {len(obj['inputs'])} inputs but {len(obj['outputs'])} outputs")
    return [(str(i), str(o)) for i, o in zip(obj["inputs"], obj["outputs"], strict=True)]


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (python/py/unlabelled preferred), or None."""
    blocks = _FENCE_RE.findall(response or "")
    if not blocks:
        return None
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3", "")]
    return (python or [blocks[-1][1]])[-1]


def same_output(got: str, want: str) -> bool:
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(want)


class CodeRewardFn:
    """Runs code answers against their tests: a ``RewardTask`` (trainer/rewards/__init__.py); ``timeouts``
    counts runs that hit the wall clock or CPU limit."""

    def __init__(self, kind: str = "binary", limits=None, workers: int = 0, sandbox_fusion_url: str | None = None):
        from fastcov.trainer.rewards.sandbox import Sandbox, SandboxFusionClient, SandboxLimits

        if kind not in ("binary", "pm1"):
            raise ValueError(f"reward.kind: expected 'binary' or 'pm1', got {kind!r}")
        self.kind = kind
        limits = limits or SandboxLimits()
        self.backend = SandboxFusionClient(sandbox_fusion_url, limits) if sandbox_fusion_url else Sandbox(limits)
        self.workers = workers or 2
        self.timeouts = 0
        self.statuses: dict[str, int] = {}

    @classmethod
    def from_config(cls, rcfg) -> CodeRewardFn:
        from fastcov.trainer.rewards.sandbox import SandboxLimits

        c = rcfg.code
        limits = SandboxLimits(cpu_s=c.cpu_s, wall_s=c.wall_s, memory_mb=c.memory_mb, nproc=c.nproc,
                               max_output_bytes=int(c.max_output_kb * 1024), disk_mb=c.disk_mb)
        return cls(rcfg.kind, limits, rcfg.workers, c.sandbox_fusion_url)

    def is_correct(self, response: str, truth: str) -> bool:
        code = extract_code(response)
        if code is None:
            return False
        for stdin, want in parse_tests(truth):
            res = self.backend.run_python(code, stdin)
            self.statuses[res.status] = self.statuses.get(res.status, 0) + 1
            if res.status in ("timeout", "cpu_limit"):
                self.timeouts += 1
            if res.status != "ok" or not same_output(res.stdout, want):
                return False
        return True

    def final_answer(self, response: str) -> str | None:
        """The answer a response gives (its last code block), for the diversity metrics."""
        return extract_code(response)

    def check_batch(self, responses: list[str], truths: list[str]) -> list[bool]:
        if len(responses) != len(truths):
            raise ValueError(f"{len(responses)} responses but {len(truths)} ground truths")
        todo = [i for i, r in enumerate(responses) if extract_code(r) is not None]
        out = [False] * len(responses)
        if todo:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(todo))) as pool:
                for i, ok in zip(todo, pool.map(lambda j: self.is_correct(responses[j], truths[j]), todo), strict=True):
                    out[i] = ok
        return out

    def _score(self, ok: bool) -> float:
        return (1.0 if ok else 0.0) if self.kind == "binary" else (1.0 if ok else -1.0)

    def __call__(self, response: str, truth: str) -> float:
        return self._score(self.is_correct(response, truth))

    def batch(self, responses: list[str], truths: list[str]) -> list[float]:
        return [self._score(ok) for ok in self.check_batch(responses, truths)]

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ synthetic task

def _task(rng: random.Random) -> tuple[str, str, list[tuple[str, str]]]:
    """(prompt, reference solution, tests) of one small stdin/stdout problem."""
    kind = rng.choice(["sum", "max", "reverse", "count", "scale"])
    tests: list[tuple[str, str]] = []
    if kind == "sum":
        prompt = "reads integers separated by spaces from one line and prints their sum ."
        ref = "print(sum(map(int, input().split())))"
        for _ in range(3):
            xs = [rng.randint(-50, 50) for _ in range(rng.randint(1, 6))]
            tests.append((" ".join(map(str, xs)) + "\n", f"{sum(xs)}\n"))
    elif kind == "max":
        prompt = "reads integers separated by spaces from one line and prints the largest ."
        ref = "print(max(map(int, input().split())))"
        for _ in range(3):
            xs = [rng.randint(-50, 50) for _ in range(rng.randint(1, 6))]
            tests.append((" ".join(map(str, xs)) + "\n", f"{max(xs)}\n"))
    elif kind == "reverse":
        prompt = "reads one word and prints it reversed ."
        ref = "print(input().strip()[::-1])"
        for _ in range(3):
            w = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 8)))
            tests.append((w + "\n", w[::-1] + "\n"))
    elif kind == "count":
        c = rng.choice("abc")
        prompt = f"reads one word and prints how many times the letter {c} occurs in it ."
        ref = f"print(input().count({c!r}))"
        for _ in range(3):
            w = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 10)))
            tests.append((w + "\n", f"{w.count(c)}\n"))
    else:
        m = rng.randint(2, 9)
        prompt = f"reads one integer n and prints n times {m} ."
        ref = f"print(int(input()) * {m})"
        for _ in range(3):
            n = rng.randint(-100, 100)
            tests.append((f"{n}\n", f"{n * m}\n"))
    prompt = ("write a python program that " + prompt
              + " answer with the program in a ```python code block .")
    return prompt, ref, tests


def synthetic_code_tasks(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of the synthetic code task, each with ``reference`` (a correct program) added."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, ref, tests = _task(rng)
        row = code_row(prompt, tests)
        row["reference"] = ref
        rows.append(row)
    return rows


def write_code_task(train_path: str, val_path: str | None = None, n_train: int = 64, n_val: int = 8,
                    seed: int = 0) -> None:
    """The synthetic code task as verl-style parquet (``.jsonl`` when the path ends so)."""
    from pathlib import Path

    for path, n, s in ((train_path, n_train, seed), (val_path, n_val, seed + 1)):
        if path is None or n == 0:
            continue
        rows = [{k: v for k, v in r.items() if k != "reference"} for r in synthetic_code_tasks(n, s)]
        if str(path).endswith(".jsonl"):
            Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
