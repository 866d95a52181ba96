"""The GPU suite: real Triton kernels on CUDA tensors (skipped where there is no GPU).

    TRITON_INTERPRET=0 python -m pytest -q -m cuda tests/test_cuda.py

(``tests/conftest.py`` otherwise selects Triton's interpreter for the CPU tests.) Every result
is compared with plain PyTorch: the kernels with ``torch_ops`` in float64 (on the GPU: the
largest shapes' float64 references would take minutes on the CPU), the layers with
``nn.BatchNorm`` + activation on the whole batch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flat_ops import REFERENCE as R
from flat_ops import triton_ops as flat_triton_ops
from fresh_python import run_fresh
from reference import NONFINITE, activate, check_nonfinite_gradients
from torch import nn
from torch.utils.checkpoint import checkpoint

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.kernels import TORCH, BatchSums, NormParams, torch_ops
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = pytest.mark.cuda

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SLOPES = {"leaky_relu": 0.1, "elu": 1.3, "relu": 0.0, "identity": 0.0}


@pytest.fixture(autouse=True)
def triton_on_gpu():
    """The real kernels: the Triton backend, not interpreted."""
    from encoding_syncbn.kernels.triton import ops, plan

    if plan.INTERPRET:
        pytest.skip("Triton's interpreter is on: run with TRITON_INTERPRET=0")
    encoding_syncbn.set_backend("triton")
    yield ops
    encoding_syncbn.set_backend("auto")


@pytest.fixture
def flat_triton(triton_on_gpu):
    """The Triton ops with flat arguments (the kernel tests' spelling)."""
    return flat_triton_ops()


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    """Convolutions in full float32: with TF32 (cuDNN's default on Ampere and later) a conv's
    rounding depends on the algorithm cuDNN picks for each batch size, and the layers' tests
    compare a model run on chunks of the batch with one run on the whole of it."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _input(shape, dtype, channels_last, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = shape[1]
    offset = torch.randn((1, c) + (1,) * (len(shape) - 2), generator=g, device="cuda") * 3
    x = (torch.randn(shape, generator=g, dtype=torch.float64, device="cuda") * 2 + offset)
    x = x.to(dtype)
    if channels_last:
        x = x.permute(0, *range(2, x.dim()), 1).contiguous()
        x = x.permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    return x


def _close(actual, expected, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    torch.testing.assert_close(actual.double(), expected.double().to(actual.device), rtol=tol,
                               atol=tol)


# Reductions split over programs (C well under the planner's 4 programs an SM) and not (NCHW
# with C = 640: one program a channel on any GPU with fewer than 320 SMs).
_SHAPES = [(3, 5, 7, 9), (2, 3, 4, 5, 6), (7, 5), (16, 64, 129, 131), (64, 256, 56, 56),
           (2, 3, 1024, 1031), (4, 640, 6, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# 2-D inputs have one layout.
@pytest.mark.parametrize("shape,channels_last", [
    pytest.param(shape, last, id=f"{shape}-{'channels_last' if last else 'nchw'}")
    for shape in _SHAPES for last in (False, True) if len(shape) > 2 or not last])
@pytest.mark.parametrize("activation,saved_is_output", [
    ("leaky_relu", True), ("elu", True), ("identity", True), ("relu", False),
    ("leaky_relu", False)])
def test_kernels_match_reference(triton_on_gpu, flat_triton, dtype, channels_last, shape,
                                 activation, saved_is_output):
    T = flat_triton
    x = _input(shape, dtype, channels_last)
    ref_x = x.double()
    c, acc = shape[1], torch_ops.stats_dtype(dtype)
    count = x.numel() // c
    mean, m2, _ = T.channel_stats(x)
    ref_mean, ref_m2, _ = torch_ops.channel_stats(ref_x)
    _close(mean, ref_mean, torch.float32)
    _close(m2 / count, ref_m2 / count, torch.float32, 10)
    g = torch.Generator().manual_seed(1)
    weight = ((torch.rand(c, generator=g, dtype=torch.float64) + 0.5) * torch.where(
        torch.rand(c, generator=g) > 0.3, 1.0, -1.0).double()).cuda()
    bias = torch.randn(c, generator=g, dtype=torch.float64).cuda() * 0.5
    invstd = (ref_m2 / count + 1e-5).rsqrt()
    vecs = [v.to(acc) for v in (ref_mean, invstd, weight, bias)]
    slope = SLOPES[activation]
    out = torch.empty_like(x)
    T.normalize_act(x, *vecs, activation, slope, out)
    ref_out = torch.empty_like(ref_x)
    R.normalize_act(ref_x, ref_mean, invstd, weight, bias, activation, slope, ref_out)
    _close(out, ref_out, dtype)
    saved = out if saved_is_output else x
    # From the input, an element whose z is within float32 rounding of 0 may fall on the other
    # side of relu's or leaky_relu's kink than in float64 (derivative 1 against the slope): such
    # elements (some 10**-5 of them) are left out of the dx comparisons.
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    ref_z = ((ref_x - ref_mean.view(per_channel)) * (invstd * weight).view(per_channel)
             + bias.view(per_channel))
    near_kink = (ref_z.abs() < 1e-5) & (not saved_is_output)
    assert near_kink.double().mean() < 1e-4
    ref_saved = out.double() if saved_is_output else ref_x
    dy = _input(shape, dtype, channels_last, seed=2)
    ref_dy = dy.double()
    sums = T.backward_reduce(saved, dy, *vecs, activation, slope, saved_is_output)
    ref_sums = R.backward_reduce(ref_saved, ref_dy, ref_mean, invstd, weight, bias,
                                         activation, slope, saved_is_output)
    for got, want in zip(sums, ref_sums):
        _close(got / count, want / count, torch.float32, 10)
    coefs = [torch.randn(c, generator=g, dtype=torch.float64).cuda() for _ in range(3)]
    dx = T.backward_dx(saved, dy, *vecs, activation, slope, saved_is_output,
                       *(v.to(acc) for v in coefs))
    ref_dx = R.backward_dx(ref_saved, ref_dy, ref_mean, invstd, weight, bias, activation,
                                   slope, saved_is_output, *coefs)
    _close(dx.masked_fill(near_kink, 0), ref_dx.masked_fill(near_kink, 0), dtype, 4)
    # A layer on its own batch: the coefficients derived in the kernel from the sums.
    dx = triton_on_gpu.EAGER.backward_dx(saved, dy, NormParams(*vecs, activation, slope),
                                         saved_is_output, BatchSums(*sums, count))
    ref_dx = TORCH.backward_dx(ref_saved, ref_dy,
                               NormParams(ref_mean, invstd, weight, bias, activation, slope),
                               saved_is_output, BatchSums(*(v.double() for v in sums), count))
    _close(dx.masked_fill(near_kink, 0), ref_dx.masked_fill(near_kink, 0), dtype, 4)


@pytest.mark.parametrize("running_dtype", [None, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(64, 3, 40, 40), (4, 300, 9, 7)])
def test_batch_stats_matches_reference(flat_triton, running_dtype, momentum, shape):
    """The statistics, invstd, the running statistics, the counter and the small-gamma flags
    in two launches (few channels: split and merged by the finalising kernel), against the ATen
    reference in float64 (gammas away from the flags' limit, where float32 and float64
    agree)."""
    T = flat_triton
    c, limit = shape[1], 0.016
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3
    bias = torch.randn(c, generator=g, dtype=torch.float64) * 10
    factors = torch.tensor([0.0, 0.5, 2.0, 10.0], dtype=torch.float64)[torch.arange(c) % 4]
    weight = bias.abs().clamp_min(1.0) * limit * factors
    running = ref_running = None
    if running_dtype is not None:
        r_mean = torch.randn(c, generator=g, dtype=torch.float64)
        r_var = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
        batches = torch.tensor(7)
        running = (r_mean.to(running_dtype).cuda(), r_var.to(running_dtype).cuda(),
                   batches.cuda(), momentum)
        ref_running = (r_mean, r_var, batches.clone(), momentum)
    none = (None, None, None, None)
    mean, invstd, small = T.batch_stats(x.float().cuda(), 1e-5, *(running or none),
                                        weight.float().cuda(), bias.float().cuda(), limit)
    ref_mean, ref_invstd, ref_small = R.batch_stats(
        x, 1e-5, *(ref_running or none), weight, bias, limit)
    _close(mean, ref_mean, torch.float32)
    _close(invstd, ref_invstd, torch.float32)
    assert small.cpu().tolist() == ref_small.int().tolist()
    if running is not None:
        for got, want in zip(running[:2], ref_running[:2]):
            _close(got, want, running_dtype)
        assert running[2].item() == ref_running[2].item() == 8


def _network(inplace=True):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        SyncBatchNorm(16, activation="leaky_relu", slope=0.1, inplace=inplace),
        nn.Conv2d(16, 8, 3, padding=1),
        SyncBatchNorm(8, activation="elu", slope=1.0, inplace=inplace),
    ).cuda()


def _reference_of(net):
    ref = nn.Sequential(
        net[0], nn.BatchNorm2d(16), nn.LeakyReLU(0.1), net[2], nn.BatchNorm2d(8), nn.ELU(1.0)
    ).cuda()
    ref[1].load_state_dict(net[1].state_dict())
    ref[4].load_state_dict(net[3].state_dict())
    return ref


def _train_and_compare(runner, net, batch=12):
    import copy

    ref = _reference_of(copy.deepcopy(net))
    x = torch.randn(batch, 3, 17, 19, device="cuda")
    out = runner(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    out.square().sum().backward()
    expected.square().sum().backward()
    for got, want in ((net[1], ref[1]), (net[3], ref[4]), (net[0], ref[0])):
        torch.testing.assert_close(got.weight.grad, want.weight.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var, rtol=1e-4, atol=1e-5)


def test_data_parallel_on_every_gpu_matches_the_whole_batch():
    net = _network()
    devices = list(range(torch.cuda.device_count()))
    _train_and_compare(nn.DataParallel(net, device_ids=devices), net, batch=4 * len(devices) + 1)


def test_simulated_data_parallel_on_one_gpu_matches_the_whole_batch():
    net = _network()
    _train_and_compare(SimulatedDataParallel(net, 3), net)


def test_checkpoint_under_sync_on_gpu():
    net = _network()
    plain = _network()

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    x = torch.randn(8, 3, 9, 9, device="cuda")
    SimulatedDataParallel(Checkpointed(net), 2)(x).square().sum().backward()
    SimulatedDataParallel(plain, 2)(x).square().sum().backward()
    for a, b in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("zero_gamma", [False, True])
def test_in_place_layer_under_cuda_graph_capture(zero_gamma):
    layer = SyncBatchNorm(16, activation="leaky_relu", slope=0.1).cuda()
    if zero_gamma:
        with torch.no_grad():
            layer.weight[::3] = 0.0
    static_x = torch.randn(8, 16, 12, 12, device="cuda")
    static_dy = torch.randn_like(static_x)
    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    def step():
        x = static_x + leaf  # a non-leaf: overwritten in place
        out = layer(x)
        out.backward(static_dy)
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_out = step()
    layer.weight.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    expected = F.leaky_relu(F.batch_norm(static_x, None, None, w, b, True), 0.1)
    expected.backward(static_dy)
    torch.testing.assert_close(static_out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-3, atol=1e-3)


def _graphed_step(capture, net):
    """``net``'s training forward as a CUDA graph: ``torch.cuda.make_graphed_callables``
    (forward and backward each one graph) or ``torch.compile(mode="reduce-overhead")``
    (inductor's CUDA graph trees)."""
    if capture == "make_graphed_callables":
        return torch.cuda.make_graphed_callables(net, (torch.randn(4, 3, 12, 12, device="cuda"),))

    compiled = torch.compile(net, mode="reduce-overhead")

    def step(x):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    for _ in range(3):  # compiled, then recorded: replayed from the next call on
        # Gradients dropped, as an optimiser's zero_grad does: accumulating into the last
        # step's, which the replay that follows overwrites, is refused (plain BatchNorm too).
        net.zero_grad(set_to_none=True)
        step(torch.randn(4, 3, 12, 12, device="cuda")).square().mean().backward()
    net.zero_grad(set_to_none=True)
    return step


@pytest.mark.parametrize("capture", ["make_graphed_callables", "reduce-overhead"])
def test_training_steps_in_a_cuda_graph(capture, monkeypatch):
    """A one-replica training step captured in a CUDA graph replays the in-place layers with
    no host work (their Python never runs once captured) and trains as the plain model does:
    outputs, the optimiser's parameters and the running statistics after several steps."""
    import copy

    from torch._dynamo.utils import counters

    net = _network()
    ref = _reference_of(copy.deepcopy(net))
    with torch.no_grad():
        net[1].weight[::5] = 0.0  # channels kept aside, as a zero-initialised gamma's
        ref[1].weight.copy_(net[1].weight)
    counters.clear()
    graphed = _graphed_step(capture, net)
    with torch.no_grad():  # capture's warm-up steps updated the running statistics
        for mine, theirs in ((net[1], ref[1]), (net[3], ref[4])):
            for name, buffer in mine.named_buffers():
                buffer.copy_(theirs.get_buffer(name))
    calls = []
    original = SyncBatchNorm._forward
    monkeypatch.setattr(SyncBatchNorm, "_forward",
                        lambda self, *args: calls.append(self) or original(self, *args))
    optimisers = [torch.optim.SGD(model.parameters(), lr=0.05) for model in (net, ref)]
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        x = torch.randn(4, 3, 12, 12, device="cuda", generator=g)
        outs = []
        for run, optimiser in zip((graphed, ref), optimisers):
            optimiser.zero_grad()
            out = run(x)
            outs.append(out.detach().clone())  # before a CUDA graph tree's next replay
            out.square().mean().backward()
            optimiser.step()
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    assert calls == []
    assert counters["inductor"]["cudagraph_skips"] == 0
    for mine, theirs in ((net[1], ref[1]), (net[3], ref[4]), (net[0], ref[0])):
        torch.testing.assert_close(mine.weight, theirs.weight, rtol=1e-4, atol=1e-5)
    for mine, theirs in ((net[1], ref[1]), (net[3], ref[4])):
        torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-4, atol=1e-5)


def test_compiled_in_place_layer_counts_nothing_on_gpu():
    """Compiled on a GPU an in-place layer runs out of place: moved there it carries no hook
    counting the channels it keeps aside (the count is taken on CPU parameters only, so
    nothing of it can land in a CUDA graph's capture or memory pool), and its compiled steps
    ask for none."""
    layer = SyncBatchNorm(8, activation="leaky_relu", slope=0.1, inplace=True)
    assert layer._compiled_keep_aside_hook is not None
    layer = layer.cuda()
    assert layer._compiled_keep_aside_hook is None
    assert not layer.weight._post_accumulate_grad_hooks
    compiled = torch.compile(layer)
    for _ in range(2):
        x = torch.randn(4, 8, 10, 10, device="cuda", requires_grad=True)
        compiled(x * 1).square().mean().backward()
    assert layer._compiled_keep_aside is None
    assert layer._compiled_keep_aside_last_call == [None]


@pytest.mark.parametrize("activation", ["leaky_relu", "elu", "identity", "relu"])
def test_compiled_single_replica_layer(activation):
    layer = SyncBatchNorm(8, activation=activation, slope=0.2).cuda()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(4, 8, 10, 10, device="cuda")
    ref_x = x.clone().requires_grad_()
    x = x.clone().requires_grad_()
    out = compiled(x * 1)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    expected = activate(F.batch_norm(ref_x, None, None, w, b, True), activation, 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    dy = torch.randn_like(out)
    out.backward(dy)
    expected.backward(dy)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-3, atol=1e-3)


# A fresh process with the default backend: its first layer call, compiled on the custom ops'
# path (a DataParallel replica's), needs the kernels' module.
_FIRST_CALL = """
import json, torch
import encoding_syncbn
from encoding_syncbn.layer import modules
modules.COMPILE_AS_FORMULA = False
model = encoding_syncbn.convert_inplace_abn(torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.LeakyReLU(0.01)))
explained = torch._dynamo.explain(model.cuda())(torch.randn(2, 3, 8, 8, device="cuda"))
print(json.dumps([explained.graph_count, explained.graph_break_count]))
"""


def test_first_compiled_call_of_a_process_on_gpu_is_one_graph():
    """The kernels imported with the package ("auto", a torch built for GPUs), not inside the
    first compiled call's trace, which they would break."""
    found = run_fresh(_FIRST_CALL, env={"ENCODING_SYNCBN_BACKEND": None,
                                        "TRITON_INTERPRET": "0"})
    assert found == [1, 0]


class _OnOwnStream(nn.Module):
    """Runs ``inner`` on a fresh side stream that first sleeps: what one replica writes is
    late on its stream, so a peer that reads it without waiting for that stream reads
    garbage."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)
            out = self.inner(x)
        torch.cuda.current_stream().wait_stream(stream)
        return out


@pytest.mark.parametrize("data_parallel", ["simulated", "torch"])
def test_replicas_on_their_own_streams_match_the_whole_batch(data_parallel):
    net = _network()
    wrapped = _OnOwnStream(net)
    if data_parallel == "simulated":
        runner = SimulatedDataParallel(wrapped, 3)
    else:
        runner = nn.DataParallel(wrapped, device_ids=list(range(torch.cuda.device_count())))
    _train_and_compare(runner, net, batch=13)


def test_capture_for_deployment_on_gpu():
    """An evaluating network on the GPU exports (torch.export) and traces (torch.jit.trace)
    to ATen ops only, computing what the Triton kernels do; torch.fx records each layer as one
    call that runs them."""
    net = _network().eval()
    x = torch.randn(4, 3, 17, 19, device="cuda")
    expected = net(x.clone())
    exported = torch.export.export(net, (x.clone(),))
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not [op for op in ops if "encoding_syncbn" in op], ops
    torch.testing.assert_close(exported.module()(x.clone()), expected, rtol=1e-4, atol=1e-4)
    traced = torch.jit.trace(net, x.clone())
    torch.testing.assert_close(traced(x.clone()), expected, rtol=1e-4, atol=1e-4)
    graph_module = torch.fx.symbolic_trace(net)
    torch.testing.assert_close(graph_module(x.clone()), expected, rtol=1e-4, atol=1e-4)


def test_in_place_layer_without_values_on_gpu():
    """Fake CUDA tensors (FakeTensorMode) and the meta device: an in-place training step runs
    (shapes only) and leaves the layer no answer about the channels kept aside; the next real
    step keeps a zero gamma's channel aside and is exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = SyncBatchNorm(8, activation="leaky_relu", slope=0.1).cuda()
    with torch.no_grad():
        layer.weight[3] = 0.0
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.randn(4, 8, 5, 5, device="cuda", requires_grad=True)
        layer(fake * 1).sum().backward()
    meta = SyncBatchNorm(8, activation="leaky_relu").to("meta")
    meta(torch.empty(4, 8, 5, 5, device="meta", requires_grad=True) * 1).sum().backward()
    assert layer._channels_aside.known is None
    layer.weight.grad = None
    x = torch.randn(4, 8, 5, 5, device="cuda")
    leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn_like(x)
    layer(leaf * 1).backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    F.leaky_relu(F.batch_norm(ref_leaf, None, None, w, b, True), 0.1).backward(dy)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-4, atol=1e-4)
    assert layer._channels_aside.known == (3,)


def test_autocast_under_data_parallel_matches_the_whole_batch(device="cuda"):
    """Mixed precision: float16 activations between the convolutions, under nn.DataParallel
    on every GPU (whose replica threads enter autocast again) and SimulatedDataParallel,
    against nn.BatchNorm2d + activations on the whole batch under autocast."""
    import copy

    net = _network().to(device)
    ref = _reference_of(copy.deepcopy(net)).to(device)
    runners = [SimulatedDataParallel(net, 3)]
    if device == "cuda":
        runners.append(nn.DataParallel(net, device_ids=list(range(torch.cuda.device_count()))))
    x = torch.randn(13, 3, 17, 19, device=device)
    with torch.autocast(device, dtype=torch.float16):
        expected = ref(x)
    expected.float().square().sum().backward()
    for runner in runners:
        net.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            out = runner(x)
        assert out.dtype == expected.dtype == torch.float16
        torch.testing.assert_close(out, expected, rtol=4e-3, atol=4e-3)
        out.float().square().sum().backward()
        for got, want in ((net[1], ref[1]), (net[3], ref[4]), (net[0], ref[0])):
            scale = want.weight.grad.abs().max()
            torch.testing.assert_close(got.weight.grad / scale, want.weight.grad / scale,
                                       rtol=1e-2, atol=1e-2)


def test_strided_running_statistics_on_gpu(device="cuda"):
    """Running statistics that are every other element of a larger tensor: updated as
    nn.BatchNorm2d's, the elements between them untouched (the statistics kernel writes
    contiguous vectors: strided buffers go through a copy)."""
    layer = SyncBatchNorm(6, activation="leaky_relu", slope=0.1).to(device)
    twin = nn.BatchNorm2d(6).to(device)
    base = torch.randn(2, 12, device=device)
    before = base.clone()
    layer.running_mean, layer.running_var = base[0, ::2], base[1, ::2].abs()
    twin.running_mean, twin.running_var = base[0, ::2].clone(), base[1, ::2].abs().clone()
    x = torch.randn(8, 6, 5, 5, device=device)
    layer(x.clone())
    twin(x)
    torch.testing.assert_close(layer.running_mean, twin.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.running_var, twin.running_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(base[0, 1::2], before[0, 1::2])


def test_func_grad_on_gpu(device="cuda"):
    """torch.func.grad of a converted network's parameters (the layer in ATen ops there)
    equals that of the reverted network."""
    import copy

    net = _network().to(device)
    torch.func.replace_all_batch_norm_modules_(net)
    plain = encoding_syncbn.revert_sync_batchnorm(copy.deepcopy(net))
    x = torch.randn(6, 3, 9, 9, device=device)

    def grads(model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        return torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).square()
                               .sum())(params)

    got, want = grads(net), grads(plain)
    # One scale: the convolutions' biases before a norm have gradient 0 in exact arithmetic.
    scale = max(g.abs().max() for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name] / scale, want[name] / scale, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation,inplace", [
    (a, False) for a in ("none", "identity", "leaky_relu", "elu", "relu", "silu", "gelu",
                         "gelu_tanh")] + [(a, True) for a in ("identity", "leaky_relu", "elu")])
@pytest.mark.parametrize("training,replicas", [(False, None), (True, None), (True, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_nonfinite_gradients_follow_batchnorm_on_gpu(activation, inplace, training, replicas,
                                                     channels_last):
    """Each kind of NaN and inf (reference.NONFINITE) in turn, in an input element and in each
    parameter and buffer, in the real kernels: gradients with NaN and inf where nn.BatchNorm2d
    + the activation has them (float64, on the CPU); the CPU suite generates mixes of them."""
    for target in ("x", "running_mean", "running_var", "weight", "bias"):
        for value in NONFINITE:
            if target == "weight" and not math.isnan(value):
                continue  # see reference.NONFINITE
            check_nonfinite_gradients(activation, inplace, training, channels_last,
                                      [(target, value, 1, 4)], replicas, seed=1, device="cuda")


@pytest.mark.parametrize("training", [True, False])
def test_training_after_an_inference_mode_call_on_gpu(training, device="cuda"):
    """An in-place layer with a zero gamma called first under inference_mode, then trained
    with autograd: every call as nn.BatchNorm2d + leaky_relu. The pinned host buffer its
    flags of small gammas are copied into, made in that first call, is written by the later
    ones outside inference mode."""
    layer = SyncBatchNorm(4, activation="leaky_relu", slope=0.1).to(device)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, 0.0, -0.7, 2.0]))
    twin = nn.BatchNorm2d(4).to(device)
    twin.load_state_dict(layer.state_dict())
    layer.train(training)
    twin.train(training)
    x = torch.randn(8, 4, 6, 6, device=device)
    with torch.inference_mode():
        out = layer(x.clone())
        expected = F.leaky_relu(twin(x), 0.1)
    torch.testing.assert_close(out, expected, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    layer.train()
    twin.train()
    for step in range(3):
        x = torch.randn(8, 4, 6, 6, device=device)
        dy = torch.randn_like(x)
        leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = layer(leaf * 1)
        expected = F.leaky_relu(twin(ref_leaf), 0.1)
        out.backward(dy)
        expected.backward(dy)
        for got, want in ((out, expected), (leaf.grad, ref_leaf.grad),
                          (layer.running_var, twin.running_var)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("layer_on,input_on", [("cpu", "cuda"), ("cuda", "cpu")])
def test_input_on_another_device_is_refused_on_gpu(backend, training, layer_on, input_on):
    """A CUDA input into a CPU layer and the reverse, in place: refused before anything is
    read or written (the Triton kernels would otherwise be handed a CPU buffer), naming both
    devices; the buffers and the input as they were."""
    encoding_syncbn.set_backend(backend)
    layer = SyncBatchNorm(4, activation="leaky_relu").to(layer_on).train(training)
    with torch.no_grad():
        layer.running_var.uniform_(0.5, 1.5)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(6, 4, 3, 3, device=input_on)
    given = x.clone()
    with pytest.raises(RuntimeError, match=f"expected input on device {layer_on}.*"
                                           f"got input on device {input_on}"):
        layer(given)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(given, x)


def test_a_small_gamma_comes_and_goes_over_repeat_calls_on_gpu(device="cuda"):
    """An in-place layer's repeat training calls (its training step's, whose small-gamma flags
    lie in one buffer that each launch writes whole) keep a channel aside once its gamma falls
    below the limit and stop once it rises again: each answer a later call's flags, none
    left from an earlier one. (On a GPU an answer lands at the call after the one that wrote
    it: three calls a phase, the device synchronised after each.)"""
    layer = SyncBatchNorm(6, activation="leaky_relu").to(device)
    x = torch.randn(4, 6, 5, 5, device=device)

    def kept_after_three_calls():
        for _ in range(3):
            layer(x.clone().requires_grad_() * 1).sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
        return layer._channels_aside.known

    assert kept_after_three_calls() == ()
    with torch.no_grad():
        layer.weight[2] = 1e-6
    assert kept_after_three_calls() == (2,)
    with torch.no_grad():
        layer.weight[2] = 1.0
    assert kept_after_three_calls() == ()
    assert layer._call_memo is not None  # the phases' calls were repeat calls
