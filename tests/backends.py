"""Marks choosing the backends a test runs on (the ``each_backend`` fixture of conftest.py)."""

import pytest

#: On "torch", "torch-slabs" (the ATen path cut in tiny slabs) and "triton" (on the CPU, the
#: kernels in Triton's interpreter): a test, or ``pytestmark`` for a whole module.
each_backend = pytest.mark.usefixtures("each_backend")

#: In a module marked ``each_backend``, a test that does not depend on the backend (the reason
#: beside it): once, on the torch backend.
one_backend = pytest.mark.parametrize("each_backend", ["torch"], indirect=True)
