"""The ``data`` section: the prompt files, or the demo's synthetic task."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastcov.trainer.config.base import check as _check


@dataclass
class SyntheticConfig:
    """Arithmetic word problems answered in \\boxed{}; written as verl-style parquet into the run dir."""

    enabled: bool = False
    n_train: int = 2000
    n_val: int = 200
    min_ops: int = 1
    max_ops: int = 2
    max_value: int = 9
    seed: int = 0


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # When no val_files are given, this fraction of the training prompts is held out.
    val_fraction: float = 0.05
    max_prompt_len: int = 512
    # None uses the tokenizer's chat template; a string is a Jinja chat template to use instead.
    chat_template: str | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # At most this many validation prompts are evaluated (0 = all).
    max_val_prompts: int = 0

    def validate(self) -> None:
        """Range checks of this section's own fields; raises ConfigError naming the key."""
        d = self
        _check(bool(d.train_files) or d.synthetic.enabled, "data.train_files",
               "give parquet files or enable data.synthetic")
        _check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
        _check(d.max_prompt_len > 0, "data.max_prompt_len", "must be > 0")
        _check(d.max_val_prompts >= 0, "data.max_val_prompts", "must be >= 0")
        s = d.synthetic
        _check(s.n_train > 0, "data.synthetic.n_train", "must be > 0")
        _check(s.n_val >= 0, "data.synthetic.n_val", "must be >= 0")
        _check(1 <= s.min_ops <= s.max_ops, "data.synthetic.min_ops", "need 1 <= min_ops <= max_ops")
        _check(s.max_value >= 2, "data.synthetic.max_value", "must be >= 2")

