"""fastcov: fused vocabulary kernels and entropy-controlled policy losses for RL on reasoning LLMs.

Importing this package never imports deepspeed, vllm or transformers.
"""

from fastcov.ops import LogprobEntropy, linear_logprob_entropy, logprob_entropy_from_logits

__version__ = "0.1.0"

__all__ = [
    "LogprobEntropy",
    "linear_logprob_entropy",
    "logprob_entropy_from_logits",
]
