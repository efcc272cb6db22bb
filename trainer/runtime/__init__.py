"""The runtime room: what every other part of the trainer stands on.

Distributed helpers (``distributed``), precision rules (``precision``), the policy model and its
DeepSpeed wrapper, micro-batches, checkpoints, the run directory, its log (``run_log``) and how a run stops
(``errors``). From the rest of ``fastcov.trainer`` it imports only the data room (docs/design.md §8).
"""
