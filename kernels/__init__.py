"""Triton kernels and their plain-PyTorch twins, imported as ``fastcov.kernels``.

This folder is the package ``fastcov.kernels`` (pyproject.toml's package-dir; an editable install and a wheel
both map it there). From the checkout's root it is also on ``sys.path`` as a top-level ``kernels``, the name of
Hugging Face's kernel hub package that transformers and bitsandbytes import. Imported under that name it is never
this folder: it hands over to that package when one is installed, and is otherwise an empty namespace package
(nothing in it, no ``__file__``: transformers reads that as "not installed").
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys
    import types

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        _theirs = types.ModuleType("kernels")
        _theirs.__spec__ = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _theirs.__spec__.submodule_search_locations = []
        _theirs.__path__ = []
        _theirs.__file__ = None
        sys.modules["kernels"] = _theirs
    else:
        _theirs = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _theirs
        try:
            _spec.loader.exec_module(_theirs)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules["kernels"]
            raise
