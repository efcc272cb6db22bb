"""The shipped run configs, importable as ``fastcov.configs`` so that ``importlib.resources`` finds the same
YAML files in a checkout and in an installed wheel (``fastcov.trainer.experiments.configs``)."""
