"""torch.compile(fullgraph=True) of the single-replica layer against eager.

Forward and backward, training and evaluation, in place (leaky_relu) and not ("none"), on both
backends: the layer's ops must reach the traced graphs as the ``encoding_syncbn::`` custom ops
(Triton kernels; on the "torch" backend the ATen path wrapped as ``aten_*`` ops), the channels
kept aside (|gamma| too small to invert) through ``aside_channels``, with no graph break.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import encoding_syncbn  # noqa: E402
from encoding_syncbn import SyncBatchNorm, compat  # noqa: E402
from encoding_syncbn.kernels import torch_ops  # noqa: E402

C = 4

# Custom ops of each backend's forward and backward graphs: the Triton kernels, or the ATen
# path wrapped as custom ops (its slab loops with out= calls cannot be traced).
# (statistics, normalisation in training, in evaluation, reduction, input gradient)
KERNELS = {
    "triton": ("batch_stats", "normalize_act_", "normalize_running_", "backward_reduce",
               "backward_dx"),
    "torch": ("aten_channel_stats", "aten_normalize_act_", "aten_normalize_running_",
              "aten_backward_reduce", "aten_backward_dx"),
}
KERNELS["torch-slabs"] = KERNELS["torch"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphRecorder:
    """An aot_eager-like backend that keeps the forward and backward FX graphs."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._record, bw_compiler=self._record)

    def _record(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def custom_ops(self) -> list[list[str]]:
        """Per graph, the ``encoding_syncbn::`` ops it calls (mutating ones functionalised)."""
        found = []
        for gm in self.graphs:
            names = []
            for node in gm.graph.nodes:
                target = node.target
                if node.op != "call_function":
                    continue
                if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in (
                    "auto_functionalized", "auto_functionalized_v2"
                ):
                    target = node.args[0]
                if isinstance(target, torch._ops.OpOverload) and (
                    target.namespace == "encoding_syncbn"
                ):
                    names.append(target._opname)
            found.append(names)
        return found


def make_layer(activation: str, training: bool) -> SyncBatchNorm:
    layer = SyncBatchNorm(C, activation=activation).double()
    with torch.no_grad():
        # A zero and a tiny gamma: those channels are kept aside (their number is only known
        # at run time), the others rebuilt from the output.
        layer.weight.copy_(torch.tensor([1.5, 0.0, -0.7, 1e-5]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.4]))
        layer.running_mean.copy_(torch.tensor([0.5, -0.2, 0.1, 0.0]))
        layer.running_var.copy_(torch.tensor([0.8, 1.2, 2.0, 0.5]))
    return layer.train(training)


def step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One forward and backward; what the caller can observe afterwards."""
    leaf = x.clone().requires_grad_()
    given = leaf * 1  # not a leaf: the in-place layer may overwrite it
    y = model(given)
    y.backward(dy)
    params = [p.grad for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    return y.detach().clone(), given.detach().clone(), leaf.grad, params, buffers


def assert_same(eager, compiled):
    for a, b in zip(eager, compiled):
        if isinstance(a, list):
            assert_same(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("activation", ["leaky_relu", "none"])
def test_compiled_layer_matches_eager(each_backend, activation, training):
    layer = make_layer(activation, training)
    twin = copy.deepcopy(layer)
    recorder = GraphRecorder()
    compiled = torch.compile(twin, fullgraph=True, backend=recorder.backend)
    torch.manual_seed(0)
    for _ in range(2):  # running statistics accumulate over steps
        x, dy = torch.randn(3, C, 5, 6, dtype=torch.float64), torch.randn(3, C, 5, 6).double()
        assert_same(step(layer, x, dy), step(compiled, x, dy))

    forward, backward = recorder.custom_ops()  # one graph each: no break, no recompile
    stats, normalize, normalize_running, reduce, input_grad = KERNELS[each_backend]
    assert (normalize if training else normalize_running) in forward
    assert (stats in forward) == training
    # Triton computes and finishes the statistics (invstd, running statistics) in one opaque
    # op; the torch backend's statistics are an opaque op, the rest ATen calls traced as they
    # are.
    assert reduce in backward and input_grad in backward
    # In place, the channels kept aside are chosen by a custom op of data-dependent size and
    # recomputed from their input by the ATen ops.
    inplace = activation != "none"
    assert ("aside_channels" in forward) == inplace
    aside_passes = backward.count("aten_backward_dx") - each_backend.startswith("torch")
    assert aside_passes == inplace


def test_compiled_in_place_overwrites_its_input(each_backend):
    layer = make_layer("leaky_relu", True)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, C, 7, dtype=torch.float64)
    expected, given = layer(x.clone()), x.clone()
    out = compiled(given)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(given, expected, rtol=1e-12, atol=1e-12)


def test_compiled_out_of_place_where_torch_cannot_compile_in_place(each_backend, monkeypatch):
    """Where torch cannot compile the in-place layer (before 2.13), it is compiled out of
    place: the same outputs, gradients and running statistics, the input left as it was."""
    monkeypatch.setattr(compat, "COMPILES_IN_PLACE", False)
    layer = make_layer("leaky_relu", True)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    torch.manual_seed(4)
    x, dy = torch.randn(2, C, 7, dtype=torch.float64), torch.randn(2, C, 7).double()
    (y, overwritten, *rest), (y_c, given, *rest_c) = step(layer, x, dy), step(compiled, x, dy)
    assert torch.equal(overwritten, y) and torch.equal(given, x)
    assert_same([y, *rest], [y_c, *rest_c])


def test_compiled_model_all_gammas_zero(each_backend):
    """Inside a model (the layer's input is a graph intermediate), zero-initialised gamma."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), SyncBatchNorm(C, activation="leaky_relu"),
        nn.Conv2d(C, 2, 1),
    ).double()
    nn.init.zeros_(model[1].weight)
    twin = copy.deepcopy(model)
    recorder = GraphRecorder()
    compiled = torch.compile(twin, fullgraph=True, backend=recorder.backend)
    x, dy = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(2, 2, 6, 6).double()
    assert_same(step(model, x, dy), step(compiled, x, dy))
    assert len(recorder.graphs) == 2


@pytest.fixture
def torch_backend():
    encoding_syncbn.set_backend("torch")
    yield
    encoding_syncbn.set_backend("auto")


@pytest.mark.usefixtures("torch_backend")
def test_inductor():
    """Inductor on the CPU runs the custom ops as extern calls and matches eager (one case:
    inductor compiles slowly; aot_eager covers both backends above)."""
    layer = make_layer("leaky_relu", True)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="inductor")
    torch.manual_seed(2)
    x, dy = torch.randn(3, C, 5, 6, dtype=torch.float64), torch.randn(3, C, 5, 6).double()
    eager, result = step(layer, x, dy), step(compiled, x, dy)
    for a, b in zip(eager[:3], result[:3]):
        torch.testing.assert_close(b, a)
    for a, b in zip(eager[3] + eager[4], result[3] + result[4]):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("slab", [None, 20], ids=["whole", "slabs"])
def test_opcheck_compile_ops(slab, monkeypatch):
    """The custom ops that stand in for the ATen path while compiling, real against fake
    (shapes, dtypes and strides), on dense, channels_last and strided inputs, processed whole
    and in slabs."""
    if slab is not None:
        monkeypatch.setattr(torch_ops, "_SLAB_ELEMENTS", slab)
    ops = torch.ops.encoding_syncbn
    torch.manual_seed(3)
    dense = torch.randn(3, C, 5, 6)
    strided = torch.randn(3, C, 5, 12)[..., ::2]
    for x in (dense, dense.to(memory_format=torch.channels_last), strided):
        params = torch.randn(C), torch.rand(C) + 0.5, torch.randn(C), torch.randn(C)
        coefs = torch.randn(C), torch.randn(C), torch.randn(C)
        torch.library.opcheck(ops.aten_channel_stats.default, (x,))
        torch.library.opcheck(ops.aten_normalize_act_.default,
                              (x, *params, "elu", 1.0, torch.empty_like(x)))
        y = torch.empty_like(x)
        ops.aten_normalize_act_(x, *params, "leaky_relu", 0.1, y)
        torch.library.opcheck(ops.aten_backward_reduce.default,
                              (y, x, *params, "leaky_relu", 0.1, True))
        # Given coefficients (DxCoefs: count -1), and derived from a batch's sums.
        torch.library.opcheck(ops.aten_backward_dx.default,
                              (y, x, *params, "leaky_relu", 0.1, True, *coefs, -1))
        torch.library.opcheck(ops.aten_backward_dx.default,
                              (y, x, *params, "leaky_relu", 0.1, True, *coefs, 90))
    for weight in (torch.tensor([1.0, 0.0, 1e-5, -2.0]), torch.zeros(C), torch.ones(C)):
        torch.library.opcheck(ops.aside_channels.default, (weight, torch.full((C,), 0.5), 1e-3))
