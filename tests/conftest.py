"""Test set-up: CPU runs Triton kernels through the interpreter, nothing reaches a hub.

TRITON_INTERPRET must be set before any module that defines a @triton.jit
function is imported, so it is set here, before the test modules load.
"""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (bf16 kernel numerics, benchmarks)")
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 (pytest passes hooks by name)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; the Triton interpreter computes bf16 wrongly")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
