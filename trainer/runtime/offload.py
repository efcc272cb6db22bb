"""Activation offload (``trainer.offload_activations``): the tensors the training forward saves for its
backward (with gradient checkpointing: each layer's input, plus the fused head's O(T) statistics) go to
pinned host memory as they are saved and come back when the backward needs them (torch's
``save_on_cpu``). The copies are synchronous; overlapping them with compute is not done yet.

On CPU the activations already live in host memory: the switch is a no-op, said once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

_said_once = False


def activation_offload(enabled: bool, device: torch.device,
                       force: bool = False) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the training forward runs in: ``save_on_cpu`` when ``enabled`` on a GPU
    (or ``force``, for tests on CPU), else a null context."""
    global _said_once
    if not enabled:
        return contextlib.nullcontext
    if device.type != "cuda" and not force:
        if not _said_once:
            _said_once = True
            warnings.warn("trainer.offload_activations: this run is on the CPU, where activations already live "
                          "in host memory; nothing is offloaded (said once)", stacklevel=2)
        return contextlib.nullcontext
    pin = device.type == "cuda"
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)
