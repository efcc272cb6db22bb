"""Integrations with other frameworks. Each submodule imports its framework and fails clearly without it:

- ``fastcov.integrations.transformers``: ``apply_fastcov(model)`` for Hugging Face causal LMs.
"""
