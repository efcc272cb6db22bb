"""Triton kernels and their plain-PyTorch twins, imported as ``fastcov.kernels``.

This folder is the package ``fastcov.kernels`` (pyproject.toml's package-dir; an editable install and a wheel
both map it there). From the checkout's root it is also on ``sys.path`` as a top-level ``kernels``, the name of
Hugging Face's kernel hub package that transformers and bitsandbytes import. Imported under that name, it hands
over to that package when it is installed and is not found otherwise: the folder is never ``kernels``.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    del sys.modules["kernels"]
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (the checkout's kernels/ folder is fastcov.kernels, not a top-level package)",
            name="kernels")
    _theirs = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _theirs
    try:
        _spec.loader.exec_module(_theirs)
    except BaseException:
        del sys.modules["kernels"]
        raise
