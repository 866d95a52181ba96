import os
import sys

import pytest
import torch

# On a machine without a GPU the Triton kernels run in Triton's interpreter, which must be
# chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The shared references (tests/reference.py) import as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
# The benchmarks' helpers (forgetting the planners' memos) import as ``helpers.*``, as the
# scripts import them.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

from replica_waits import record_waits  # noqa: E402

import encoding_syncbn  # noqa: E402
from encoding_syncbn import compat  # noqa: E402
from encoding_syncbn.kernels import torch_ops, triton_available  # noqa: E402

if triton_available() and compat.triton_interpreting():
    import triton_interpreter

    triton_interpreter.install()

# Elements per slab for "torch-slabs": small enough that the test shapes are cut in several
# slabs, not a divisor of their sizes, so that the ATen path's slab walk runs (it is otherwise
# reached only by inputs of over 131072 elements).
TINY_SLAB = 20


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a GPU is."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["torch", "torch-slabs", "triton"])
def each_backend(request, monkeypatch):
    """Run a test once per backend (tests opt in with the marks of ``tests/backends.py``)."""
    if request.param == "triton" and not triton_available():
        pytest.skip("triton is not installed (it is an optional, Linux-only dependency)")
    if request.param == "torch-slabs":
        monkeypatch.setattr(torch_ops, "_SLAB_ELEMENTS", TINY_SLAB)
    encoding_syncbn.set_backend(request.param.split("-")[0])
    yield request.param
    encoding_syncbn.set_backend("auto")


@pytest.fixture
def replica_waits(monkeypatch):
    """Every wait of a replica on its peers during the test (``replica_waits.record_waits``)."""
    return record_waits(monkeypatch)
