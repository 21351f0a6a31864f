"""Test setup shared by every suite.

Without a GPU the kernels run through Triton's interpreter, which must be
switched on before fa_amd (and so any @triton.jit) is imported.
"""
import os

import pytest

try:
    import torch

    _HAS_GPU = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch missing is reported by the imports
    _HAS_GPU = False

if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return "cuda" if _HAS_GPU else "cpu"
