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
        # Triton's interpreter (needs triton >= 3.7, and CPU-only torch state) is what these tests check;
        # a GPU machine runs the same paths for real in the other tests
        skip_cpu = pytest.mark.skip(reason="checks the CPU interpreter path (run without a GPU)")
        for item in items:
            if "cpu_only" in item.keywords:
                item.add_marker(skip_cpu)
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    # (cpu_only tests, which run the interpreter itself, are skipped on a GPU machine: see below)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return "cuda" if _HAS_GPU else "cpu"
