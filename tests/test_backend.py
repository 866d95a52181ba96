"""Backend selection when Triton is broken: the torch backend keeps working, and asking for
Triton says why it cannot run."""

import collections
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


@pytest.mark.usefixtures("broken_triton")
def test_asking_for_broken_triton_says_why_at_the_call(monkeypatch):
    """``ENCODING_SYNCBN_BACKEND=triton`` (set at import, never loaded) where Triton fails to
    import: the layer's call says why, rather than falling back."""
    monkeypatch.setattr(kernels, "_backend", "triton")
    layer = encoding_syncbn.SyncBatchNorm(3, activation="leaky_relu")
    with pytest.raises(RuntimeError, match=r"triton cannot be imported: AttributeError: .*knobs"):
        layer(torch.randn(8, 3, 5) * 1)  # values enough for the kernels (float64 below 38)


def test_triton_on_cpu_without_its_interpreter_says_what_to_do(monkeypatch):
    """Triton asked for, a CPU tensor, kernels compiled for GPUs (not interpreted): an error
    naming the device and the two ways out, not a kernel launch on host memory; a meta
    tensor still reaches the ops."""
    class CompiledKernels:
        INTERPRET = False

        @staticmethod
        def backend_for(x):
            assert x.is_meta, "no kernel may run on a CPU tensor"
            return "the ops' fake implementations"

    monkeypatch.setattr(kernels, "_triton_ops", CompiledKernels)
    monkeypatch.setattr(kernels, "_backend", "triton")
    with pytest.raises(RuntimeError, match=r"runs on CUDA tensors, got a cpu tensor.*"
                                           r"TRITON_INTERPRET=1.*set_backend\('torch'\)"):
        kernels.ops_for(torch.ones(2, 3))
    # A meta tensor (shapes only) goes to the ops, whose fake implementations compute none.
    assert kernels.ops_for(torch.ones(2, 3, device="meta")) == "the ops' fake implementations"


class _Counting:
    """A test double: the torch backend, counting the calls of each op."""

    name = "counting"

    def __init__(self):
        self.calls = collections.Counter()

    def __getattr__(self, op):
        def call(*args, **kwargs):
            self.calls[op] += 1
            return getattr(kernels.TORCH, op)(*args, **kwargs)
        return call


@pytest.mark.parametrize("inplace", [False, True])
def test_a_backend_runs_the_layer(monkeypatch, inplace):
    """A backend is one object: in its place, every op of the layer (forward and backward, in
    place or not) goes through it, with the torch backend's results. (Out of place, a float64
    backward reduces, then corrects the sums for the mean's error, then takes dx:
    ``functional._mean_offset``.)"""
    torch.manual_seed(0)
    # 200 values a channel: float64 below MIN_FLOAT64_REBUILT_COUNT takes its input gradient in
    # double-double, outside the backend.
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    dy = torch.randn_like(x)

    def run():
        layer = encoding_syncbn.SyncBatchNorm(3, activation="leaky_relu", inplace=inplace).double()
        x_in = x.clone().requires_grad_()
        out = layer(x_in.clone() if inplace else x_in)
        out.backward(dy)
        evaluated = layer.eval()(x.clone())
        return (out.detach(), x_in.grad, layer.running_mean, layer.running_var,
                layer.num_batches_tracked, evaluated)

    monkeypatch.setattr(kernels, "_backend", "torch")
    expected = run()
    counting = _Counting()
    monkeypatch.setattr(kernels, "reference_ops", lambda: counting)
    torch.testing.assert_close(run(), expected, rtol=0, atol=0)
    backward = ({"batch_backward": 1} if inplace
                else {"backward_reduce": 1, "backward_dx": 1})
    assert counting.calls == {"batch_stats": 1, "normalize_act": 1, "normalize_running": 1,
                              **backward}


def test_unknown_backend_names_are_refused():
    before = encoding_syncbn.get_backend()
    with pytest.raises(ValueError, match="must be one of .*'auto'.*got 'nope'"):
        encoding_syncbn.set_backend("nope")
    assert encoding_syncbn.get_backend() == before


@pytest.mark.parametrize("name", ["torch", "triton", "triton through the dispatcher"])
def test_batch_stats_records_no_autograd_history(name):
    """The layer asks for the statistics in grad mode, of an input that requires grad: no
    backend may attach them to x's graph (the layer's backward differentiates through them
    itself), and each updates the running statistics in place all the same."""
    if name == "torch":
        backend = kernels.TORCH
    else:
        if not kernels.triton_available():
            pytest.skip("triton is not installed (it is an optional, Linux-only dependency)")
        from encoding_syncbn.kernels.triton import ops as triton_ops
        backend = triton_ops.EAGER if name == "triton" else triton_ops.TRACED
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True) * 2
    weight, bias = torch.tensor([1.0, 1e-9, -2.0], dtype=torch.float64), torch.zeros(3).double()
    running = kernels.RunningStats(torch.zeros(3).double(), torch.ones(3).double(),
                                   torch.zeros((), dtype=torch.long), 0.5)
    assert torch.is_grad_enabled()
    mean, invstd, small = backend.batch_stats(x, 1e-5, running,
                                              kernels.GammaCheck(weight, bias, 1e-3))
    assert not (mean.requires_grad or invstd.requires_grad or small.requires_grad)
    assert torch.is_grad_enabled()  # the mode the call found, restored
    var, expected_mean = torch.var_mean(x.detach(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(mean, expected_mean)
    torch.testing.assert_close(invstd, torch.rsqrt(var + 1e-5))
    assert small.tolist() == [0, 1, 0]
    torch.testing.assert_close(running.mean, expected_mean * 0.5)
    assert running.batches.item() == 1
