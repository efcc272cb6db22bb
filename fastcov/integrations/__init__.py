"""Integrations with other frameworks. Each submodule imports its framework and fails clearly without it:

- ``fastcov.integrations.transformers``: ``apply_fastcov(model)`` for Hugging Face causal LMs.
- ``fastcov.integrations.verl``: fastcov's losses in verl's registry, verl's fused-kernel signature.
- ``fastcov.integrations.trl``: ``FastcovGRPOTrainer`` / ``FastcovGRPOConfig`` for TRL's GRPO.
"""
