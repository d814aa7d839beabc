"""Triton kernels, one file per op (installed as `dflash_fast.kernels`).

Each file holds the Triton kernels, plain host functions `<op>_forward` /
`<op>_backward`, and one `torch.autograd.Function` that only calls them.
Importing this package does not import Triton; `dflash_fast.drafter.ops` imports an op
file only when the Triton backend is selected.

Imported as a top-level `kernels` (the repository root on `sys.path`: `python -m pytest`,
`python train.py` there), this directory would shadow Hugging Face's `kernels`, which
transformers >= 5.25 installs and imports (`from kernels import CUDAProperties`): then it
loads that package in its own place, and stays this empty one where there is none.
"""
import os
import sys

if __name__ == "kernels":  # never as dflash_fast.kernels
    import importlib.machinery
    import importlib.util

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import system returns what sys.modules holds after this file runs
        _spec.loader.exec_module(_module)
