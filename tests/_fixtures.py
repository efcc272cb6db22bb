"""What many tests share: the checkout's root, the tiny training config, and the metrics that vary run to run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tiny Qwen2 and task every CPU training test runs (configs/tiny.yaml)
TINY = ROOT / "configs" / "tiny.yaml"
# metrics.jsonl keys that measure the machine, not the run: left out when two runs are compared
VOLATILE = ("time/", "tokens_per_s")


def odd_length_reward(self, text: str, truth: str) -> float:
    """RewardFn.__call__ for runs of an untrained model, which never answers right: 1 for an odd-length response,
    else 0, so a group's rewards differ and its advantages are non-zero (tests/trainer/conftest.py patches it in)."""
    return float(len(text) % 2)


def tiny(tmp_path: Path, name: str, *overrides: str):
    """configs/tiny.yaml training into ``tmp_path / name``, rewards scored in-process, then ``overrides`` (dotlist)."""
    from fastcov.trainer.config import load_config

    return load_config(TINY, [f"trainer.run_dir={Path(tmp_path) / name}", "reward.sandbox=inline", *overrides])


def stable(rows: list[dict], drop: tuple[str, ...] = VOLATILE) -> list[dict]:
    """metrics.jsonl rows without the keys that start with ``drop`` (by default those that measure the machine)."""
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]
