"""The runtime room: what every other part of the trainer stands on.

Distributed helpers (``distributed``), precision rules (``precision``), the policy model and its
DeepSpeed wrapper, micro-batches, checkpoints and the run directory. It imports nothing else from
``fastcov.trainer`` but ``fastcov.trainer.errors`` (docs/design.md §8).
"""
