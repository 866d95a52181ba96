"""torch.compile of the single-replica layer against eager, and of converted models.

Forward and backward, training and evaluation, in place (leaky_relu) and not ("none"), on both
backends, each way a compiled call is traced (``modules.COMPILE_AS_FORMULA``): as the layer's
formula in ATen ops (the default, with no ``encoding_syncbn::`` op in the graphs), or as the
backend's custom ops (Triton kernels; on the "torch" backend the ATen path wrapped as
``aten_*`` ops). A compiled call leaves its input as it was, and a converted model compiles
to one graph, with no break, under plain ``torch.compile`` (counted by
``torch._dynamo.explain``). Compiled in place, a layer keeps for backward only its output and
the input of a static number of channels (``layer/compiled_inplace.py``), once it has counted
them: tested against nn.BatchNorm2d + the activation, and by what the graph saves.
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import test_few_values as few_values  # noqa: E402
import torch  # noqa: E402
from fresh_python import run_fresh  # noqa: E402
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition  # noqa: E402
from helpers.rebuild_error import ratios_to_bound  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference import activate, plain_twin  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import encoding_syncbn  # noqa: E402
from encoding_syncbn import SyncBatchNorm, convert_inplace_abn, convert_sync_batchnorm  # noqa: E402
from encoding_syncbn.kernels import torch_ops  # noqa: E402
from encoding_syncbn.layer import compiled_inplace, functional, inplace_policy, modules  # noqa: E402

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
        # 120 values a channel: fewer than MIN_FLOAT64_REBUILT_COUNT would take float64's input
        # gradient in double-double, outside the backend's ops.
        x, dy = torch.randn(4, C, 5, 6, dtype=torch.float64), torch.randn(4, C, 5, 6).double()
        (y, _, *rest), (y_c, given, *rest_c) = step(layer, x, dy), step(compiled, x, dy)
        assert_same([y, *rest], [y_c, *rest_c])
        # Compiled, the layer runs out of place: its input is left as it was.
        assert torch.equal(given, x)

    graphs = recorder.custom_ops()
    if traced_as == "formula":
        assert all(ops == [] for ops in graphs)
        # One forward and one backward graph: no break; an in-place layer compiles again
        # once it has counted the channels it keeps aside (after the first backward).
        assert len(graphs) == (4 if activation == "leaky_relu" else 2)
        return
    forward, backward = graphs  # one graph each: no break, no recompile
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


def test_compiled_float64_gradient_over_few_values_is_one_op(each_backend, monkeypatch):
    """Compiled through the custom ops, a float64 call over fewer values a channel than
    ``MIN_FLOAT64_REBUILT_COUNT`` takes its double-double input gradient as one opaque op,
    not its hundreds of elementwise steps (Inductor fuses those into a C++ kernel of
    thousands of lines): the backward graph calls it, and computes bitwise what eager does."""
    monkeypatch.setattr(modules, "COMPILE_AS_FORMULA", False)
    layer = make_layer("leaky_relu", True)
    x, dy = torch.randn(3, C, 5, 6, dtype=torch.float64), torch.randn(3, C, 5, 6).double()
    assert inplace_policy.takes_double_double_gradient(x.dtype, x.numel() // C, False)
    recorder = GraphRecorder()
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend=recorder.backend)
    eager, traced = step(layer, x, dy), step(compiled, x, dy)
    forward, backward = recorder.custom_ops()
    assert "float64_batch_backward" in backward and "float64_batch_backward" not in forward
    assert torch.equal(traced[2], eager[2])  # the input gradient
    assert_same(eager, traced)


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
    x, dy = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, C, 6, 6).double()
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons
    eager = converter(copy.deepcopy(base)).train(training)
    compiled = torch.compile(model, backend="aot_eager")
    assert_same(step(eager, x, dy), step(compiled, x, dy))


class _Checkpointed(nn.Module):
    """``_block_net`` run under ``torch.utils.checkpoint`` (non-reentrant), a head after it."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, nn.Conv2d(C, 2, 1).double()

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("built", ["converted", "direct"])
def test_model_compiles_inside_a_checkpoint_once(training, built):
    """A checkpointed region compiles as one traced region that refuses Python side effects
    (``fullgraph=True`` raises on one): the layer makes none while compiling (it notes the
    input's rank only eagerly), converted or built directly, and compiles once, computing
    what the eager model does."""
    torch.manual_seed(5)
    body = _block_net()
    if built == "direct":
        body = nn.Sequential(*(SyncBatchNorm(m.num_features).double()
                               if isinstance(m, nn.BatchNorm2d) else m for m in body))
    model = _Checkpointed(convert_sync_batchnorm(body)).train(training)
    x, dy = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, 2, 6, 6).double()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=recorder.backend, fullgraph=True)
    for _ in range(2):
        assert_same(step(eager, x, dy), step(compiled, x, dy))
    assert len(recorder.graphs) == 2  # one forward and one backward: compiled once


def test_compiled_layer_on_a_leaf_input_is_one_graph():
    """An in-place layer fed a leaf that requires grad (eagerly: out of place, with a warning)
    compiles to one graph: no check and no warning inside the traced code."""
    layer = make_layer("leaky_relu", True)
    x = torch.randn(2, C, 5, dtype=torch.float64, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


# A fresh process's first layer call, compiled on the custom ops' path: the call needs the
# kernels' module there, and importing it inside the trace breaks the graph.
_FIRST_CALL = """
import json, sys, torch
torch.backends.cuda.is_built = lambda: sys.argv[1] == "gpu build"
import encoding_syncbn
from encoding_syncbn import kernels
from encoding_syncbn.layer import modules
modules.COMPILE_AS_FORMULA = False
layer = encoding_syncbn.SyncBatchNorm(4, activation="leaky_relu", inplace=True)
explained = torch._dynamo.explain(layer)(torch.randn(2, 4, 5) * 1)
print(json.dumps([kernels._triton_ops is not None, explained.graph_count,
                  explained.graph_break_count]))
"""


@pytest.mark.parametrize(("backend", "build", "imported"), [
    ("triton", "cpu build", True), ("auto", "gpu build", True), ("auto", "cpu build", False),
    ("torch", "gpu build", False)])
def test_first_compiled_call_of_a_process_is_one_graph(backend, build, imported):
    """Where the backend chosen at import may take the Triton kernels (asked for, or "auto"
    in a torch built for GPUs), they import with the package, and a process's first call,
    compiled, is one graph; elsewhere the package does not import Triton."""
    pytest.importorskip("triton")
    found = run_fresh(_FIRST_CALL, build,
                      env={"ENCODING_SYNCBN_BACKEND": backend, "TRITON_INTERPRET": "1"})
    assert found == [imported, 1, 0]


def test_a_graph_break_inside_a_compiled_in_place_call():
    """A compiled in-place call that a graph break splits between its plan and its ops (a
    user's torch may fail to trace any step of it) computes what the eager call does: the
    configuration planned before the break is read after it (Dynamo of torch 2.11 rebuilds a
    NamedTuple's ``_replace`` short of its fields there)."""
    widened = functional._widened

    def broken(x, dtype):
        torch._dynamo.graph_break()
        return widened(x, dtype)

    torch.manual_seed(3)
    layer = make_layer("leaky_relu", True)
    layer.inplace = True
    x, dy = torch.randn(4, C, 5, dtype=torch.float64), torch.randn(4, C, 5).double()
    eager = step(copy.deepcopy(layer), x, dy)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modules, "COMPILE_AS_FORMULA", False)
        patch.setattr(functional, "_widened", broken)
        explained = torch._dynamo.explain(copy.deepcopy(layer))(x * 1)
        assert explained.graph_break_count == 1, explained.break_reasons
        torch._dynamo.reset()
        compiled = step(torch.compile(layer, backend="aot_eager"), x, dy)
    assert_same(eager, compiled)


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


# A quotient or a root in Inductor's C++: vectorised or scalar.
_QUOTIENT = re.compile(r" / tmp|reciprocal\(\)|sqrt\(")
_LOOP_BOUND = re.compile(r"for\(.*<static_cast<int64_t>\((\d+)L\)")


def _per_element_ops(code: str, per_channel: int) -> tuple[int, int]:
    """``(quotients and roots, all ops)`` on lines of Inductor's C++ kernels run once an
    element, not once a channel: inside loops whose bounds multiply to at least
    ``per_channel`` (the values a channel), found by the braces that enclose each line."""
    quotients = ops = depth = 0
    loops: list[tuple[int, int]] = []  # (depth of the loop's body, its bound)
    pending = None
    for line in code.splitlines():
        bound = _LOOP_BOUND.search(line)
        if bound:
            pending = int(bound.group(1))
        for char in line:
            if char == "{":
                depth += 1
                if pending is not None:
                    loops.append((depth, pending))
                    pending = None
            elif char == "}":
                if loops and loops[-1][0] == depth:
                    loops.pop()
                depth -= 1
        if loops and math.prod(b for _, b in loops) >= per_channel and " = " in line:
            ops += 1
            quotients += len(_QUOTIENT.findall(line))
    return quotients, ops


def test_compiled_in_place_element_loops_take_no_quotient():
    """Inductor computes a per-channel value inside the element loops that read it unless it
    is a graph output or a reduction's: the compiled in-place layer's formula keeps every
    quotient and root (1 / w, / n, rsqrt) out of them, as Inductor's own BatchNorm does, in
    forward and backward, once it keeps only its output and the input of the channels it
    counted (its second step)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    layer = make_layer("leaky_relu", True)
    compiled = torch.compile(layer)
    x, dy = (torch.randn(4, C, 6, 6, dtype=torch.float64) for _ in range(2))
    step(compiled, x, dy)  # the first step runs out of place and counts the small gammas
    _, codes = run_and_get_code(lambda: step(compiled, x, dy))
    assert layer._compiled_keep_aside == 2  # the zero and the tiny gamma, from their input
    quotients, ops = _per_element_ops("\n".join(codes), x.numel() // C)
    assert ops > 20, codes  # the element loops were found: forward and backward
    assert quotients == 0


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


# ---- in place, compiled: only the output kept for backward -------------------------------

class SavedRecorder(GraphRecorder):
    """``GraphRecorder`` partitioning as Inductor does (min-cut: which tensors the forward
    keeps for backward is its choice), recording what each forward graph saves."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = aot_autograd(fw_compiler=self._record, bw_compiler=self._record,
                                    partition_fn=min_cut_rematerialization_partition)

    def saved_shapes(self, outputs: int) -> list[tuple[int, ...]]:
        """The shapes of the tensors the last forward graph keeps for backward (what it
        returns after its ``outputs`` outputs: the buffers it updates, then the model's)."""
        forward = self.graphs[-2]
        returned = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        return [tuple(node.meta["val"].shape) for node in returned[outputs:]
                if isinstance(node, torch.fx.Node)
                and isinstance(node.meta.get("val"), torch.Tensor)]


def _in_place_layer(activation, slope, gammas, betas, training, dtype=torch.float64):
    layer = SyncBatchNorm(len(gammas), activation=activation, slope=slope, inplace=True,
                          dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(gammas))
        layer.bias.copy_(torch.tensor(betas))
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    return layer.train(training)


def _plain_step(layer, x, dy, activation, slope):
    """Output and (dx, dw, db) of nn.BatchNorm2d + the activation, twin of ``layer``."""
    twin = plain_twin(layer, x.dim(), layer.weight.dtype)
    leaf = x.clone().requires_grad_()
    out = activate(twin(leaf), activation, slope)
    out.backward(dy)
    return out.detach(), (leaf.grad, twin.weight.grad, twin.bias.grad)


gammas = st.sampled_from([0.0, 1e-7, -1e-5, 1e-3, 0.02, -0.3, 1.0, 2.5])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["leaky_relu", "elu", "identity"]),
    training=st.booleans(),
    # Each with enough values a channel for float64 to train in place
    # (inplace_policy.rebuilds_from_count).
    shape=st.sampled_from([(6, 3, 4, 5), (24, 4, 5), (7, 5, 2, 2, 4), (3, 6, 7, 6)]),
    channel_params=st.lists(st.tuples(gammas, st.sampled_from([0.0, 0.4, -3.0])),
                            min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_compiled_in_place_gradients_match_batchnorm(activation, training, shape,
                                                     channel_params, seed):
    """float64: a compiled in-place layer's output, input, weight and bias gradients match
    nn.BatchNorm*d + the activation for every gamma (zeros and tiny ones kept aside), in the
    first compiled step (out of place: the channels kept aside not counted yet) and in the
    steps after it, which keep for backward only the output and the input of the counted
    channels (a static number: a power of two covering the small gammas)."""
    channels = shape[1]
    slope = {"leaky_relu": 0.1, "elu": 0.7}.get(activation, 0.01)
    params = channel_params[:channels]
    layer = _in_place_layer(activation, slope, [g for g, _ in params], [b for _, b in params],
                            training)
    torch._dynamo.reset()  # each example's layer, compiled afresh
    recorder = SavedRecorder()
    compiled = torch.compile(layer, backend=recorder.backend)
    gen = torch.Generator().manual_seed(seed)
    for call in range(3):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
        dy = torch.randn(shape, generator=gen, dtype=torch.float64)
        out, want = _plain_step(layer, x, dy, activation, slope)
        for p in layer.parameters():
            p.grad = None
        got_out, _, dx, (dw, db), _ = step(compiled, x, dy)
        for name, got, expected in zip(("output", "dx", "dw", "db"), (got_out, dx, dw, db),
                                       (out, *want)):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, what=f"call {call}, {name}": f"{what}: {m}")
    limit = inplace_policy.gamma_limit(with_margin=True)
    spread = inplace_policy.running_spread(layer._running_of(layer.running_var))
    small = int(inplace_policy.small_gamma_mask(layer.weight, layer.bias, limit, spread).sum())
    kept = layer._compiled_keep_aside
    assert kept == (min(channels, 1 << (small - 1).bit_length()) if small else 0)
    # The steps after the first keep the output and the kept channels' input, no more.
    outputs = 1 + 3 * training  # running mean, variance and batch count; the output
    full = [s for s in recorder.saved_shapes(outputs)
            if len(s) == len(shape) and s[0] == shape[0] and s[2:] == shape[2:]]
    if kept < channels:
        assert sorted(full) == sorted([shape] + ([(shape[0], kept, *shape[2:])] if kept else []))
    assert len(recorder.graphs) == 4  # two compilations (before and after the count), no break


def _saved_bytes(model, x, dy) -> int:
    """Bytes of the activation-sized tensors (or parts of one: kept channels) the compiled
    model's forward keeps for backward, once the in-place layers counted their channels
    (the second step's graph)."""
    torch._dynamo.reset()
    recorder = SavedRecorder()
    compiled = torch.compile(model, backend=recorder.backend)
    for _ in range(2):
        step(compiled, x, dy)
    outputs = 3 * 3 + 1  # each layer's running mean, variance and batch count; the output
    return sum(math.prod(s) * x.element_size() for s in recorder.saved_shapes(outputs)
               if len(s) == 4 and s[0] == x.shape[0] and s[2:] == x.shape[2:]
               and s != x.shape)  # the input, kept by the first convolution


def test_compiled_in_place_keeps_one_activation_a_block():
    """Counted in the compiled graph: a converted in-place net keeps for backward one
    activation a block (its output, which the next convolution keeps anyway) and the input
    of the channels kept aside; compiled out of place, and the plain net compiled, keep
    more (the normalisation's input besides)."""
    torch.manual_seed(6)
    base = _block_net(3)
    with torch.no_grad():
        base[4].weight[2] = 0.0  # the second block keeps one channel aside
    x, dy = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, C, 6, 6).double()
    activation = x.shape[0] * C * 6 * 6 * x.element_size()
    ours = _saved_bytes(convert_inplace_abn(copy.deepcopy(base)), x, dy)
    assert ours == 3 * activation + activation // C
    plain = _saved_bytes(copy.deepcopy(base), x, dy)
    assert plain >= 2 * 3 * activation
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_inplace, "KEEP_ONLY_OUTPUT", False)
        assert _saved_bytes(convert_inplace_abn(copy.deepcopy(base)), x, dy) >= 2 * 3 * activation


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_in_place_model_after_a_step_compiles_to_one_graph(training):
    """Once its layers counted the channels they keep aside (after a compiled step's
    backward), a converted in-place model still compiles to one graph with no break."""
    torch.manual_seed(7)
    base = _block_net()
    with torch.no_grad():
        base[1].weight.copy_(torch.tensor([1.5, 0.0, -0.7, 1e-5]))
    model = convert_inplace_abn(base).train(training)
    x, dy = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, C, 6, 6).double()
    step(torch.compile(model, backend="aot_eager"), x, dy)
    assert [m._compiled_keep_aside for m in model.modules() if isinstance(m, SyncBatchNorm)] \
        == [2, 0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


def test_compiled_in_place_count_follows_gamma():
    """The count of channels kept aside: none from eager calls (they cost nothing there);
    after each compiled backward, from the parameters then, growing (and recompiling) as a
    gamma falls within ``MARGIN`` times the limit, so that the next call keeps it aside
    once it falls below (to zero here: the graph chooses which channels from the current
    gammas); forgotten where the parameters change outside training (load_state_dict) and
    by a copy. Gradients match nn.BatchNorm2d + leaky_relu throughout."""
    layer = _in_place_layer("leaky_relu", 0.1, [1.0, -2.0, 0.5, 1.5], [0.5, 0.3, -0.2, 1.0],
                            True)
    torch.manual_seed(8)
    x, dy = torch.randn(6, C, 4, 5, dtype=torch.float64), torch.randn(6, C, 4, 5).double()
    step(layer, x, dy)
    assert layer._compiled_keep_aside is None
    recorder = GraphRecorder()
    compiled = torch.compile(layer, backend=recorder.backend)
    # gamma[0] against |beta[0]| = 0.5: 1, then just above the limit (rebuilt; counted:
    # within the margin), then 0 (kept aside: a rebuild would divide by zero).
    above = 0.5 * inplace_policy.REBUILD_LIMIT * (1 + inplace_policy.MARGIN) / 2
    for gamma, counted in ((1.0, 0), (above, 1), (0.0, 1)):
        with torch.no_grad():
            layer.weight[0] = gamma
        layer.zero_grad(set_to_none=True)
        out, want = _plain_step(layer, x, dy, "leaky_relu", 0.1)
        got_out, _, dx, grads, _ = step(compiled, x, dy)
        for got, expected in zip((got_out, dx, *grads), (out, *want)):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
        assert layer._compiled_keep_aside == counted
    # Compiled before the first count, then once for each count: 0, 1.
    assert len(recorder.graphs) == 6
    assert copy.deepcopy(layer)._compiled_keep_aside is None
    layer.load_state_dict(layer.state_dict())
    assert layer._compiled_keep_aside is None


def test_compiled_in_place_counts_on_cpu_parameters_only(monkeypatch):
    """The count is taken by a hook on the layer's CPU parameters, where they lie: a layer
    moved off the CPU (here to the meta device) carries no hook, so that no backward runs
    any work of its own there (a CUDA graph's capture or memory pool would record it), and
    one moved back counts again; compiled on another device a call keeps no channel aside
    (it runs out of place), whatever its count."""
    layer = _in_place_layer("leaky_relu", 0.1, [1.0, 0.0, 0.5, 1.5], [0.0] * C, True)
    hooks = lambda: layer.weight._post_accumulate_grad_hooks  # noqa: E731
    assert len(hooks()) == 1
    layer.to("meta")
    assert not hooks() and layer._compiled_keep_aside_hook is None
    layer.to_empty(device="cpu")
    assert len(hooks()) == 1
    torch.manual_seed(9)
    x, dy = torch.randn(6, C, 4, 5, dtype=torch.float64), torch.randn(6, C, 4, 5).double()
    step(torch.compile(layer, backend="aot_eager"), x, dy)
    assert layer._compiled_keep_aside is not None
    layer.double()  # moved (to its own dtype): counted again after the next backward
    assert layer._compiled_keep_aside is None and len(hooks()) == 1
    layer.__dict__["_compiled_keep_aside"] = 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert compiled_inplace.keep_aside(layer, x, 120) == 1
    assert compiled_inplace.keep_aside(layer, x.to("meta"), 120) is None


def test_compiled_in_place_warns_where_a_gamma_outgrew_its_count():
    """A gamma set to zero outside training after the count (no margin covers it): that
    step's backward rebuilds the channel from its output, and the layer says so, naming
    itself; it counts the channel then, and the next step keeps it aside, exactly."""
    layer = _in_place_layer("leaky_relu", 0.1, [1.0, -2.0, 0.5, 1.5], [0.0, 0.3, -0.2, 1.0],
                            True)
    torch.manual_seed(10)
    x, dy = torch.randn(6, C, 4, 5, dtype=torch.float64), torch.randn(6, C, 4, 5).double()
    compiled = torch.compile(layer, backend="aot_eager")
    for _ in range(2):  # out of place, then keeping no channel aside
        step(compiled, x, dy)
    assert layer._compiled_keep_aside == 0
    with torch.no_grad():
        layer.weight[2] = 0.0
    with pytest.warns(RuntimeWarning, match=r"SyncBatchNorm\(4\) .*1 channels .* counted 0"):
        step(compiled, x, dy)
    assert layer._compiled_keep_aside == 1
    layer.zero_grad(set_to_none=True)
    out, want = _plain_step(layer, x, dy, "leaky_relu", 0.1)
    got_out, _, dx, grads, _ = step(compiled, x, dy)
    for got, expected in zip((got_out, dx, *grads), (out, *want)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    # An eager step after a gamma set to zero is exact: no warning.
    with torch.no_grad():
        layer.weight[1] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(layer, x, dy)


def test_export_after_a_compiled_step_computes_the_formula():
    """``torch.export`` of a layer that counted its channels in compiled steps records the
    kernels' formula, as any export does: no rebuilt Function, no choice of channels."""
    layer = _in_place_layer("leaky_relu", 0.1, [1.0, 0.0, 0.5, 1.5], [0.0] * C, True)
    torch.manual_seed(11)
    x, dy = torch.randn(6, C, 4, 5, dtype=torch.float64), torch.randn(6, C, 4, 5).double()
    compiled = torch.compile(layer, backend="aot_eager")
    for _ in range(2):
        step(compiled, x, dy)
    assert layer._compiled_keep_aside == 1
    layer.eval()
    exported = torch.export.export(layer, (x.clone(),))
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not [op for op in ops if "topk" in op or "index_select" in op], ops
    torch.testing.assert_close(exported.module()(x.clone()), layer(x.clone()))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    decades=st.floats(2.5, 4.0),
    data=st.data(),
)
def test_compiled_float64_bound_on_inputs_far_from_zero(activation, inplace, decades, data):
    """``test_few_values.test_float64_bound_on_inputs_far_from_zero`` compiled (the formula,
    under aot_eager: Inductor compiles each generated shape for minutes on this machine;
    ``few_values_precision.py --compile inductor`` measures it): over 1024 to 2048 values a
    channel whose mean lies 10^2.5 to 10^4 standard deviations from 0, the input gradient
    within the README's bound (3x nn.BatchNorm2d's error, long-double reference), out of
    place and in place (its second call, once the layer has counted the channels it keeps
    aside). The graph takes the mean's rounding out of xhat (``layer/compiled_mean.py``):
    else it shifts every xhat of a channel alike, hundreds of ulps at 10^3, which the
    backward's sums carry unaveraged."""
    shape, x, dy, gamma, beta = few_values._far_from_zero_case(data, decades, activation)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation,
                                few_values.SLOPES.get(activation, 0.01), replicas=1,
                                inplace=inplace, compiler="aot_eager")
    few_values._assert_within_bound(ratios, gamma, beta, f"{activation} inplace={inplace} "
                                    f"mean/std 1e{decades:.2g} {shape}")



@pytest.mark.parametrize("batch", [6, 8, 9])
def test_compiled_float32_in_place_stays_within_the_bound_over_few_values(batch):
    """float32 in place over 24-36 values a channel, fewer than
    ``MIN_OWN_PRECISION_COUNT``: eagerly such a call computes in float64; compiled, in the
    input's own precision, an input rebuilt from the output would leave the bound no share
    (a few channels of 2048 over it), so it runs out of place, within the README's bound
    (|beta| / |gamma| up to 0.8)."""
    channels = 2048
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, channels, 2, 2, generator=gen) * 2 + 0.5
    dy = torch.randn(batch, channels, 2, 2, generator=gen)
    gamma = (torch.rand(channels, generator=gen) + 0.5) * torch.randn(channels,
                                                                      generator=gen).sign()
    beta = gamma.abs() * torch.rand(channels, generator=gen) * 0.8
    torch._dynamo.reset()
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, "leaky_relu", 0.01, replicas=1,
                                compiler="aot_eager")
    few_values._assert_within_bound(ratios, gamma, beta, f"compiled float32 batch {batch}")
