"""The lean trainer, imported as ``fastcov.trainer``."""
