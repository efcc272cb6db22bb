"""Integrations with other frameworks. Each submodule imports its framework and, without it (or with a version
it was not written for), fails with one line naming the extra to install:

- ``fastcov.integrations.transformers`` (``pip install 'fastcov[hf]'``): ``apply_fastcov(model)`` for Hugging Face
  causal LMs whose logits are a plain linear head of the last hidden state; anything else is refused when patched.
- ``fastcov.integrations.verl`` (``pip install 'fastcov[verl]'``): fastcov's losses in verl's registry, equal to
  verl's own for every ``loss_agg_mode``; verl's fused-kernel signature.
- ``fastcov.integrations.trl`` (``pip install 'fastcov[trl]'``, trl>=1.16,<2): ``FastcovGRPOTrainer`` /
  ``FastcovGRPOConfig`` for TRL's GRPO.

docs/integrations.md lists, per framework, what is exact and what is refused.
"""
