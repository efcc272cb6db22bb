"""What many tests share: the checkout's root, the tiny training config, and the metrics that vary run to run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tiny Qwen2 and task every CPU training test runs (configs/tiny.yaml)
TINY = ROOT / "configs" / "tiny.yaml"
# metrics.jsonl keys that measure the machine, not the run: left out when two runs are compared
VOLATILE = ("time/", "tokens_per_s")
