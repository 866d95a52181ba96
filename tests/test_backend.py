"""Backend selection when Triton is broken: the torch backend keeps working, and asking for
Triton says why it cannot run."""

import importlib

import pytest
import torch

import encoding_syncbn
from encoding_syncbn import kernels


@pytest.fixture
def broken_triton(monkeypatch):
    """Triton that fails to import with a non-ImportError (an older release without
    ``triton.knobs`` raises AttributeError)."""
    real_import = importlib.import_module

    def import_module(name, *args):
        if name.endswith(".triton.ops"):
            raise AttributeError("module 'triton' has no attribute 'knobs'")
        return real_import(name, *args)

    monkeypatch.setattr(kernels, "_triton_ops", None)
    monkeypatch.setattr(kernels, "_triton_import_error", None)
    monkeypatch.setattr(kernels.importlib, "import_module", import_module)
    monkeypatch.setattr(kernels, "_backend", "auto")


@pytest.mark.usefixtures("broken_triton")
def test_set_backend_triton_says_why_and_keeps_the_backend():
    with pytest.raises(RuntimeError, match=r"AttributeError: .*knobs.*'torch' backend works"):
        encoding_syncbn.set_backend("triton")
    assert encoding_syncbn.get_backend() == "auto"
    assert not kernels.triton_available()


@pytest.mark.usefixtures("broken_triton")
def test_torch_backend_works_without_triton():
    encoding_syncbn.set_backend("auto")
    layer = encoding_syncbn.SyncBatchNorm(3, activation="leaky_relu").double()
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    expected = torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(x, None, None, training=True), 0.01
    )
    torch.testing.assert_close(layer(x.clone()), expected)
