"""torch.compile of the single-replica layer against eager, and of converted models.

Forward and backward, training and evaluation, in place (leaky_relu) and not ("none"), on both
backends, each way a compiled call is traced (``modules.COMPILE_AS_FORMULA``): as the layer's
formula in ATen ops (the default, with no ``encoding_syncbn::`` op in the graphs), or as the
backend's custom ops (Triton kernels; on the "torch" backend the ATen path wrapped as
``aten_*`` ops). A compiled call runs out of place, so that no channel is kept aside (a
data-dependent size) and a converted model compiles to one graph, with no break, under plain
``torch.compile`` (counted by ``torch._dynamo.explain``).
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
from encoding_syncbn import SyncBatchNorm, convert_inplace_abn, convert_sync_batchnorm  # noqa: E402
from encoding_syncbn.kernels import torch_ops  # noqa: E402
from encoding_syncbn.layer import modules  # noqa: E402

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


@pytest.fixture(params=["formula", "custom_ops"])
def traced_as(request, monkeypatch):
    """How a compiled unsynchronised call is traced (``modules.COMPILE_AS_FORMULA``)."""
    monkeypatch.setattr(modules, "COMPILE_AS_FORMULA", request.param == "formula")
    return request.param


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
def test_compiled_layer_matches_eager(each_backend, traced_as, activation, training):
    layer = make_layer(activation, training)
    twin = copy.deepcopy(layer)
    recorder = GraphRecorder()
    compiled = torch.compile(twin, fullgraph=True, backend=recorder.backend)
    torch.manual_seed(0)
    for _ in range(2):  # running statistics accumulate over steps
        x, dy = torch.randn(3, C, 5, 6, dtype=torch.float64), torch.randn(3, C, 5, 6).double()
        (y, _, *rest), (y_c, given, *rest_c) = step(layer, x, dy), step(compiled, x, dy)
        assert_same([y, *rest], [y_c, *rest_c])
        # Compiled, the layer runs out of place: its input is left as it was.
        assert torch.equal(given, x)

    forward, backward = recorder.custom_ops()  # one graph each: no break, no recompile
    if traced_as == "formula":
        assert forward == backward == []
        return
    stats, normalize, normalize_running, reduce, input_grad = KERNELS[each_backend]
    assert (normalize if training else normalize_running) in forward
    assert (stats in forward) == training
    # Triton computes and finishes the statistics (invstd, running statistics) in one opaque
    # op; the torch backend's statistics are an opaque op, the rest ATen calls traced as they
    # are.
    assert reduce in backward and input_grad in backward
    # No channel is kept aside (no pass recomputing them from their input): the Function
    # keeps its whole input.
    assert backward.count("aten_backward_dx") == each_backend.startswith("torch")


def _block_net(blocks: int = 2) -> nn.Sequential:
    layers, channels = [], 3
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, C, 3, padding=1, bias=False), nn.BatchNorm2d(C),
                   nn.LeakyReLU(0.1)]
        channels = C
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("converter", [convert_inplace_abn, convert_sync_batchnorm],
                         ids=["inplace_abn", "sync_batchnorm"])
def test_converted_model_compiles_to_one_graph(traced_as, converter, training):
    """Plain ``torch.compile(model)`` (no ``fullgraph``): one graph, no break, in training
    and evaluation, whatever the gammas (a zero and a tiny one, which an eager in-place layer
    keeps aside); the compiled model computes what the eager one does."""
    torch.manual_seed(5)
    base = _block_net()
    with torch.no_grad():
        base[1].weight.copy_(torch.tensor([1.5, 0.0, -0.7, 1e-5]))
    model = converter(copy.deepcopy(base)).train(training)
    if converter is convert_inplace_abn:
        assert all(m.inplace for m in model.modules() if isinstance(m, SyncBatchNorm))
    x, dy = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(2, C, 6, 6).double()
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons
    eager = converter(copy.deepcopy(base)).train(training)
    compiled = torch.compile(model, backend="aot_eager")
    assert_same(step(eager, x, dy), step(compiled, x, dy))


def test_compiled_layer_on_a_leaf_input_is_one_graph():
    """An in-place layer fed a leaf that requires grad (eagerly: out of place, with a warning)
    compiles to one graph: no check and no warning inside the traced code."""
    layer = make_layer("leaky_relu", True)
    x = torch.randn(2, C, 5, dtype=torch.float64, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


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
def test_inductor(traced_as):
    """Inductor on the CPU (fusing the formula, or running the custom ops as extern calls)
    matches eager (one case each: inductor compiles slowly; aot_eager covers both backends
    above)."""
    layer = make_layer("leaky_relu", True)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="inductor")
    torch.manual_seed(2)
    x, dy = torch.randn(3, C, 5, 6, dtype=torch.float64), torch.randn(3, C, 5, 6).double()
    (y, _, *rest), (y_c, given, *rest_c) = step(layer, x, dy), step(compiled, x, dy)
    assert torch.equal(given, x)
    for a, b in zip([y, rest[0], *rest[1], *rest[2]], [y_c, rest_c[0], *rest_c[1], *rest_c[2]]):
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
