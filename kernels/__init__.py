"""Triton kernels and their plain-PyTorch twins, imported as ``fastcov.kernels``."""
