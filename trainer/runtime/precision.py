"""The one bf16/fp32 rule: bf16 on a GPU, fp32 on CPU or wherever ``model.dtype: fp32`` asks for it.

The policy's parameters, the rollout copy, the reference model and the evaluation model all follow it,
so it lives here once (DeepSpeed keeps the fp32 master weights inside the optimizer's partitions).
"""

from __future__ import annotations

import torch


def param_dtype(mcfg, device: torch.device) -> torch.dtype:
    """The dtype a model on ``device`` is built in, given the config's ``model`` section (or None)."""
    if device.type != "cuda" or (mcfg is not None and getattr(mcfg, "dtype", "bf16") == "fp32"):
        return torch.float32
    return torch.bfloat16
