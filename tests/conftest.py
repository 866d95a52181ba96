import os
import sys

import pytest

# On a machine without a GPU the Triton kernels run in Triton's interpreter, which must be
# chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The shared references (tests/reference.py) import as a plain module.
sys.path.insert(0, os.path.dirname(__file__))

import encoding_syncbn  # noqa: E402
from encoding_syncbn.kernels import triton_available  # noqa: E402


@pytest.fixture(params=["torch", "triton"])
def each_backend(request):
    """Run a test once per backend (modules opt in with ``usefixtures("each_backend")``)."""
    if request.param == "triton" and not triton_available():
        pytest.skip("triton is not installed (it is an optional, Linux-only dependency)")
    encoding_syncbn.set_backend(request.param)
    yield request.param
    encoding_syncbn.set_backend("auto")
