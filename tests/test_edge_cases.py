"""Edge cases (issue 15): bad arguments, a stale group after a failed step, 0-D inputs under
SimulatedDataParallel, the out-of-place warning per layer. Float64 references: nn.BatchNorm."""

from __future__ import annotations

import itertools
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import each_backend, one_backend
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference import (
    ACTIVATIONS,
    NONFINITE,
    SMOOTH_ACTIVATIONS,
    activate,
    check_nonfinite_gradients,
)
from replica_waits import assert_waited_only_on_this_step
from torch import nn

from encoding_syncbn import SyncBatchNorm, SyncError, activations
from encoding_syncbn.sync import group as sbn_sync
from encoding_syncbn.testing import SimulatedDataParallel

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}

pytestmark = each_backend


# ---- 3. arguments refused at construction, with a message that says what to do --------------


@pytest.mark.parametrize("args,kwargs,error,words", [
    ((4,), {"eps": 0.0}, ValueError, ["eps must be a positive number", "0.0"]),
    ((4,), {"eps": -1e-5}, ValueError, ["eps must be a positive number"]),
    ((4,), {"eps": float("nan")}, ValueError, ["eps must be a positive number"]),
    # nn.BatchNorm2d's 6th positional argument is device; here it is process_group.
    ((4, 1e-5, 0.1, True, True, "cpu"), {}, TypeError, ["process_group", "device="]),
    ((4, 1e-5, 0.1, True, True, "cuda:1"), {}, TypeError, ["process_group"]),
    ((4, 1e-5, 0.1, True, True, torch.device("cpu")), {}, TypeError, ["process_group"]),
    ((4, 1e-5, 0.1, True, True, 0), {}, TypeError, ["process_group"]),
    ((4,), {"activation": "none", "inplace": True}, ValueError, ["'none'", "identity"]),
    ((4,), {"activation": "leaky_relu", "slope": 1e-39}, ValueError, ["1/slope", "float32"]),
    ((4,), {"activation": "elu", "slope": 1e-39}, ValueError, ["1/slope", "inplace=False"]),
    ((4,), {"activation": "leaky_relu", "slope": 1e-309, "dtype": torch.float64}, ValueError,
     ["float64"]),
    ((4,), {"activation": "leaky_relu", "slope": float("inf")}, ValueError, ["slope=inf"]),
])
def test_bad_arguments_are_refused_at_construction(args, kwargs, error, words):
    with pytest.raises(error) as caught:
        SyncBatchNorm(*args, **kwargs)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_arguments_at_the_edge_are_accepted():
    assert SyncBatchNorm(4, activation="none", inplace=False).inplace is False
    # Out of place nothing is inverted: any slope (as nn.LeakyReLU).
    assert SyncBatchNorm(4, activation="leaky_relu", slope=1e-39, inplace=False).slope == 1e-39
    # A float64 layer inverts in float64.
    layer = SyncBatchNorm(4, activation="leaky_relu", slope=1e-39, dtype=DT)
    x = torch.randn(6, 4, dtype=DT) * 1
    x.requires_grad_()
    layer(x * 1).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert SyncBatchNorm(4, 1e-5, 0.1, True, True, None).process_group is None


# ---- 6. a failed step whose replicas are kept alive does not stall the next one ---------------


class _StemThenSync(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, dtype=DT)
        self.bn = SyncBatchNorm(4, activation="leaky_relu", dtype=DT)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_failed_step_with_replicas_kept_alive_does_not_stall_the_next(monkeypatch,
                                                                      replica_waits):
    """Every replica fails in the stem (a shape error), before the only sync layer; the
    exception is kept (as a notebook keeps ``sys.last_value``), and with it the replicas and
    their group. The next step must form a group of its own, not wait for the dead ranks."""
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "2")
    model = _StemThenSync()
    parallel = SimulatedDataParallel(model, 2)
    parallel(torch.randn(6, 3, dtype=DT))
    with pytest.raises(RuntimeError) as failed:
        parallel(torch.randn(6, 5, dtype=DT))  # wrong width for fc
    monkeypatch.setattr(sys, "last_value", failed.value, raising=False)
    failed_group = model.bn._open_group()  # held by the failed step's replicas
    assert failed_group is not None
    ref = nn.BatchNorm1d(4, dtype=DT)
    ref.load_state_dict(model.bn.state_dict())
    x = torch.randn(6, 3, dtype=DT)
    replica_waits.clear()
    out = parallel(x)
    assert_waited_only_on_this_step(replica_waits, [failed_group], 2)
    with torch.no_grad():
        expected = F.leaky_relu(ref(model.fc(x)), 0.01)
    torch.testing.assert_close(out, expected, **TOL)
    # Twice in a row, with the exception still alive.
    with pytest.raises(RuntimeError):
        parallel(torch.randn(6, 5, dtype=DT))
    out = parallel(x)
    assert not isinstance(out, SyncError)


# ---- 7. smaller ones ------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 3])
def test_zero_dim_input_under_simulated_data_parallel_is_the_layers_error(replicas):
    layer = SyncBatchNorm(4, dtype=DT)
    with pytest.raises(ValueError, match=r"expected input of shape \(N, C, \*\).*0-D"):
        SimulatedDataParallel(layer, replicas)(torch.tensor(1.0, dtype=DT))


def test_out_of_place_fallback_warns_once_per_layer():
    first, second = (SyncBatchNorm(4, activation="leaky_relu", dtype=DT) for _ in range(2))
    messages = []
    for layer in (first, second, first, second):
        x = torch.randn(6, 4, dtype=DT, requires_grad=True)  # a leaf: cannot be overwritten
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x)
        messages.append([w for w in caught if "out of place" in str(w.message)])
    assert [len(m) for m in messages] == [1, 1, 0, 0]


@pytest.mark.parametrize("source,words", [
    ("hook", "full backward hook"),
    ("chunk", "torch.chunk"),
])
def test_out_of_place_fallback_says_why(source, words):
    """An input the layer may not overwrite: computed out of place, exactly, with a warning
    that names where the input came from."""
    layer = SyncBatchNorm(4, activation="leaky_relu", slope=0.1, dtype=DT)
    twin = nn.BatchNorm2d(4, dtype=DT)
    x = torch.randn(6, 4, 3, 3, dtype=DT, requires_grad=True)
    if source == "hook":
        layer.register_full_backward_hook(lambda module, grad_in, grad_out: None)
        given = x * 1
    else:
        given = torch.cat([x, x]).chunk(2)[0]
    with pytest.warns(UserWarning, match=words):
        out = layer(given)
    out.backward(torch.ones_like(out))
    expected_x = x.detach().clone().requires_grad_()
    activate(twin(expected_x), "leaky_relu", 0.1).backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, expected_x.grad, **TOL)


# ---- 1. double backward: a gradient penalty through conv + SyncBatchNorm --------------------


def _penalty_grads(conv, norm, x, activation, slope, replicas=None, plain=False,
                   squared=False):
    """WGAN-GP / R1 style: the gradient of ``sum(f(act(bn(conv(x)))) * w)`` w.r.t. x, with
    create_graph, then backward of its squared norm; returns the penalty's value and the
    gradients of the conv's weight and the layer's parameters. ``f`` is the identity, or the
    square (then the second backward also runs through the layer's own node)."""
    body = nn.Sequential(conv, norm)
    runner = SimulatedDataParallel(body, replicas) if replicas else body
    x = x.clone().requires_grad_()
    out = runner(x)
    if plain:
        out = activate(out, activation, slope)
    weights = torch.linspace(-1, 1, out[0].numel(), dtype=out.dtype).view(out[0].shape)
    (gx,) = torch.autograd.grad(((out.square() if squared else out) * weights).sum(), x,
                                create_graph=True)
    penalty = (gx.square().sum() - 1).square()
    params = [conv.weight, *(p for p in (norm.weight, norm.bias) if p is not None)]
    grads = torch.autograd.grad(penalty, params, allow_unused=True, materialize_grads=True)
    return penalty.detach(), grads


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["none", "identity", "leaky_relu", "elu", "relu"]),
    replicas=st.sampled_from([None, 2, 3]),
    batch=st.integers(3, 5),
    training=st.booleans(),
    squared=st.booleans(),
)
# The second backward through the layer's own nodes too, and the merge's fast path with it.
@example(activation="elu", replicas=3, batch=5, training=True, squared=True)
def test_gradient_penalty_matches_batchnorm(activation, replicas, batch, training, squared):
    slope = {"leaky_relu": 0.1, "elu": 0.7}.get(activation, 0.01)
    gen = torch.Generator().manual_seed(batch)
    conv = nn.Conv2d(2, 3, 2, dtype=DT)
    layer = SyncBatchNorm(3, activation=activation, slope=slope, inplace=False, dtype=DT)
    with torch.no_grad():
        for p in (conv.weight, conv.bias, layer.weight, layer.bias):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
        layer.running_mean.copy_(torch.randn(3, generator=gen, dtype=DT))
        layer.running_var.copy_(torch.rand(3, generator=gen, dtype=DT) + 0.5)
    ref_conv = nn.Conv2d(2, 3, 2, dtype=DT)
    ref_conv.load_state_dict(conv.state_dict())
    ref = nn.BatchNorm2d(3, dtype=DT)
    ref.load_state_dict(layer.state_dict())
    layer.train(training)
    ref.train(training)
    x = torch.randn(batch, 2, 3, 3, generator=gen, dtype=DT)
    value, grads = _penalty_grads(conv, layer, x, activation, slope, replicas, squared=squared)
    ref_value, ref_grads = _penalty_grads(ref_conv, ref, x, activation, slope, plain=True,
                                          squared=squared)
    torch.testing.assert_close(value, ref_value, rtol=1e-9, atol=1e-9)
    for name, got, want in zip(("conv", "gamma", "beta"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("replicas", [None, 2])
@pytest.mark.parametrize("training", [True, False])
def test_double_backward_in_place_is_a_clear_error(replicas, training):
    conv = nn.Conv2d(2, 3, 2, dtype=DT)
    layer = SyncBatchNorm(3, activation="leaky_relu", dtype=DT).train(training)
    with pytest.raises(RuntimeError, match="double backward.*inplace=False"):
        _penalty_grads(conv, layer, torch.randn(13, 2, 4, 4, dtype=DT), "leaky_relu", 0.01,
                       replicas)


# ---- 4. NaN and inf propagate as through nn.BatchNorm2d + the activation --------------------


def assert_follows_batchnorm(x: torch.Tensor, dy: torch.Tensor, activation: str,
                             inplace: bool, replicas: int | None,
                             trainings: tuple[bool, ...] = (True,),
                             compiled: bool = False) -> None:
    """A 3-channel float64 layer on ``x`` (under ``replicas`` simulated replicas, or called
    directly) and nn.BatchNorm2d + the activation, with the same weights and biases, in each
    of ``trainings`` in turn: output, input, weight and bias gradients and running statistics
    the same, NaN and inf where its are. ``compiled``: the layer under ``torch.compile``
    (aot_eager), both taking two steps, compared at the second (in place, the first counts
    the channels it keeps aside)."""
    slope = {"leaky_relu": 0.1, "elu": 0.7}.get(activation, 0.01)
    layer = SyncBatchNorm(3, activation=activation, slope=slope, inplace=inplace, dtype=DT)
    ref = nn.BatchNorm2d(3, dtype=DT)
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(torch.tensor([1.5, -0.7, 0.5]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    runner = SimulatedDataParallel(layer, replicas) if replicas else layer
    if compiled:
        torch._dynamo.reset()
        runner = torch.compile(runner, backend="aot_eager")
    for training, _ in itertools.product(trainings, range(2 if compiled else 1)):
        for m in (layer, ref):
            m.train(training).zero_grad(set_to_none=True)
        leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = runner(leaf * 1)
        out.backward(dy)
        expected = activate(ref(ref_leaf), activation, slope)
        expected.backward(dy)
        for name, got, want in [
            ("output", out, expected), ("input grad", leaf.grad, ref_leaf.grad),
            ("weight grad", layer.weight.grad, ref.weight.grad),
            ("bias grad", layer.bias.grad, ref.bias.grad),
            ("running_mean", layer.running_mean, ref.running_mean),
            ("running_var", layer.running_var, ref.running_var),
        ]:
            torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, name=name, training=training:
                                       f"{training=} {name}: {m}")


@pytest.mark.parametrize("activation,inplace", [
    ("none", False), ("identity", True), ("leaky_relu", False), ("leaky_relu", True),
    ("elu", False), ("elu", True), ("relu", False),
])
@pytest.mark.parametrize("replicas", [None, 2])
def test_nan_and_inf_propagate_as_batchnorm(activation, inplace, replicas):
    """Channel 0 holds a NaN, channel 1 a +inf, channel 2 is finite."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 2, 2, generator=gen, dtype=DT)
    x[1, 0, 0, 1] = float("nan")
    x[4, 1, 1, 0] = float("inf")
    dy = torch.randn(x.shape, generator=gen, dtype=DT)
    assert_follows_batchnorm(x, dy, activation, inplace, replicas)


@pytest.mark.parametrize("activation,inplace", [
    ("none", False), ("identity", True), ("leaky_relu", True), ("elu", False), ("elu", True),
    ("silu", False),
])
@pytest.mark.parametrize("batch", [2, 19])  # 12 values a channel (few) and 114
@pytest.mark.parametrize("replicas", [None, 2])
def test_float64_variance_that_overflows_follows_batchnorm(activation, inplace, batch,
                                                           replicas):
    """Channel 0's finite values reach 1e160, whose squares overflow float64: nn.BatchNorm2d's
    variance is inf and its invstd 0, so the channel's output is its bias, its input gradient
    0 and its running variance inf. Ours the same, over few values a channel (the
    double-double gradient) and many, on one replica and synchronised over two (whose
    gradient through the statistics divides by invstd), in training and evaluation."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 3, 2, 3, generator=gen, dtype=DT)
    x[:, 0] *= 1e160
    dy = torch.randn(x.shape, generator=gen, dtype=DT)
    assert_follows_batchnorm(x, dy, activation, inplace, replicas, trainings=(True, False))


@one_backend  # compiled, the layer is its formula in ATen ops
@pytest.mark.parametrize("activation,inplace", [("none", False), ("leaky_relu", True)])
@pytest.mark.parametrize("batch", [2, 19])
def test_compiled_float64_variance_that_overflows_follows_batchnorm(activation, inplace,
                                                                    batch):
    """As above under ``torch.compile``: the formula's statistics and backward."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 3, 2, 3, generator=gen, dtype=DT)
    x[:, 0] *= 1e160
    dy = torch.randn(x.shape, generator=gen, dtype=DT)
    assert_follows_batchnorm(x, dy, activation, inplace, None, trainings=(True, False),
                             compiled=True)


# (target, value, channel, element) as check_nonfinite_gradients takes them.
_INJECTIONS = st.tuples(
    st.sampled_from(("x", "running_mean", "running_var", "weight", "bias")),
    st.sampled_from(NONFINITE), st.integers(0, 2), st.integers(0, 23),
).filter(lambda injection: injection[0] != "weight" or math.isnan(injection[1]))
_NONFINITE_MODES = [(a, False) for a in (*ACTIVATIONS, *SMOOTH_ACTIVATIONS)] + [
    (a, True) for a in ACTIVATIONS if a != "none" and activations.runs_in_place(a, 0.1)
]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(_NONFINITE_MODES),
    training=st.booleans(),
    channels_last=st.booleans(),
    injections=st.lists(_INJECTIONS, min_size=1, max_size=3),
    replicas=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
# The cases issue 35 names: in evaluation, a NaN input element and a NaN running_mean; in
# place, a NaN bias (training, synchronised) and a NaN weight.
@example(mode=("leaky_relu", False), training=False, channels_last=False,
         injections=[("x", float("nan"), 0, 5)], replicas=None, seed=0)
@example(mode=("identity", True), training=False, channels_last=False,
         injections=[("running_mean", float("nan"), 1, 0)], replicas=None, seed=0)
@example(mode=("leaky_relu", True), training=True, channels_last=False,
         injections=[("bias", float("nan"), 2, 0)], replicas=None, seed=0)
@example(mode=("leaky_relu", True), training=True, channels_last=False,
         injections=[("bias", float("nan"), 2, 0)], replicas=2, seed=0)
@example(mode=("elu", True), training=False, channels_last=True,
         injections=[("weight", float("nan"), 0, 0)], replicas=None, seed=0)
# In place, ELU saturated at a z of -inf (see reference.batchnorm_grads).
@example(mode=("elu", True), training=False, channels_last=False,
         injections=[("x", -float("inf"), 0, 3), ("running_mean", float("inf"), 1, 0)],
         replicas=None, seed=0)
def test_nonfinite_gradients_follow_batchnorm(mode, training, channels_last, injections, replicas,
                                              seed):
    """NaN and inf put into input elements, running statistics, weight and bias: the input,
    weight and bias gradients have NaN and inf exactly where nn.BatchNorm2d + the activation
    has them (float64), and the same finite values elsewhere; on one replica, and on two
    (simulated DataParallel: synchronised statistics in training)."""
    check_nonfinite_gradients(*mode, training, channels_last, injections, replicas, seed)


@one_backend  # compiled, the layer is its formula in ATen ops
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from([a for a in ACTIVATIONS if a != "none"
                                and activations.runs_in_place(a, 0.1)]),
    training=st.booleans(),
    channels_last=st.booleans(),
    injections=st.lists(_INJECTIONS, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
@example(activation="leaky_relu", training=True, channels_last=False,
         injections=[("weight", float("nan"), 0, 0)], seed=0)
@example(activation="elu", training=False, channels_last=False,
         injections=[("x", -float("inf"), 0, 3), ("running_mean", float("inf"), 1, 0)], seed=0)
def test_compiled_in_place_nonfinite_gradients_follow_batchnorm(activation, training,
                                                                channels_last, injections, seed):
    """As above for an in-place layer under ``torch.compile``, once it keeps only its output
    (and the input of the channels it counted: a NaN weight's among them)."""
    torch._dynamo.reset()
    check_nonfinite_gradients(activation, True, training, channels_last, injections, None, seed,
                              compiled=True)

@one_backend  # calls the Triton kernels directly
@pytest.mark.parametrize("where", [(0, 0), (200, 0), (0, 1), (600, 1)])
def test_triton_stats_of_an_infinite_element_across_split_programs(where):
    """A channels_last input of 2 tiles, so that the partial (mean, M2, n) of two programs
    are merged: an inf gives the mean inf (as x.mean), in either program."""
    ops = pytest.importorskip("encoding_syncbn.kernels.triton.ops")
    from encoding_syncbn.kernels.triton import channel_stats, plan
    x = torch.randn(160, 2, 2, 2, dtype=DT).contiguous(memory_format=torch.channels_last)
    row, channel = where
    x.movedim(1, -1).reshape(-1, 2)[row, channel] = float("inf")
    launches, _ = channel_stats.plan_channel_stats(x, plan.launch_target(x.device))
    assert launches[0].grid[1] > 1  # split programs, merged by the second kernel
    mean, m2 = ops.EAGER.channel_stats(x)[:2]
    expected = x.mean(dim=(0, 2, 3))
    torch.testing.assert_close(mean, expected, equal_nan=True)
    assert torch.isnan(m2[channel]) and torch.isfinite(m2[1 - channel])


# ---- 5. the running variance at a large offset under DataParallel --------------------------


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_running_variance_at_large_offset_is_as_precise_as_batchnorm(offset):
    """float32 input, std 1 around ``offset``: whatever the replica count, the running
    variance is within 3x of nn.BatchNorm2d's error on the same input (the replicas' means
    are merged in float64, not rounded to float32 first)."""
    gen = torch.Generator().manual_seed(int(offset))
    x = (torch.randn(12, 4, 4, 4, generator=gen, dtype=DT) + offset).float()
    truth = 0.9 + 0.1 * x.double().var(dim=(0, 2, 3))
    plain = nn.BatchNorm2d(4)
    plain(x)
    plain_error = (plain.running_var.double() - truth).abs().max().item()
    for replicas in (1, 2, 3, 4):
        layer = SyncBatchNorm(4)
        SimulatedDataParallel(layer, replicas)(x.clone())
        error = (layer.running_var.double() - truth).abs().max().item()
        # (An absolute floor of a few float32 ulps of the variance: BN may round luckily.)
        assert error <= 3 * plain_error + 3e-7, (replicas, error, plain_error)


# ---- passes without values: the meta device, fake tensors (shape and FLOP tools) -----------


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("inplace", [True, False])
def test_meta_device_forward_and_backward(training, inplace, replicas):
    """A layer on the meta device (shape inference, lazy model building) runs as
    nn.BatchNorm2d does there: shapes only, alone or replicated. In place, its flags of small
    gammas have no values to read: nothing is kept aside."""
    layer = SyncBatchNorm(4, activation="leaky_relu", inplace=inplace).to("meta").train(training)
    model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
    x = torch.empty(3, 4, 3, 3, device="meta", requires_grad=True)  # values to train in place
    out = model(x * 1)
    out.sum().backward()
    assert out.is_meta and out.shape == x.shape
    assert x.grad.is_meta and x.grad.shape == x.shape and layer.weight.grad.is_meta


def test_fake_tensor_pass_in_place_leaves_no_answer_behind():
    """Under FakeTensorMode (a tool propagating shapes) an in-place layer runs forward and
    backward; that pass computed no flags, so it leaves the layer no answer about which
    channels to keep aside (the next real call finds them itself: here a zero gamma, whose
    gradients must come out exact)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = SyncBatchNorm(4, activation="leaky_relu", slope=0.1).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.0, 2.0]))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.randn(13, 4, 3, 3, dtype=DT, requires_grad=True)  # values to train in place
        out = layer(fake * 1)
        out.sum().backward()
    assert out.shape == fake.shape and layer._channels_aside.known is None
    twin = nn.BatchNorm2d(4).double()
    twin.load_state_dict(layer.state_dict())
    layer.weight.grad = None
    x = torch.randn(13, 4, 3, 3, dtype=DT)
    grad = torch.randn_like(x)
    leaf, expected_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(leaf * 1).backward(grad)
    activate(twin(expected_leaf), "leaky_relu", 0.1).backward(grad)
    torch.testing.assert_close(leaf.grad, expected_leaf.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, twin.weight.grad, **TOL)
    assert layer._channels_aside.known == (2,)


# ---- inputs that do not match the layer: another device, another dtype ---------------------


def _state(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in layer.state_dict().items()}


def _assert_unchanged(layer: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in layer.state_dict().items():
        if not value.is_meta:  # (a meta layer's state has no values to compare)
            assert torch.equal(value, before[key]), key


_LAYER_OPTIONS = st.fixed_dictionaries({
    "mode": st.sampled_from([("leaky_relu", True), ("identity", True), ("none", False),
                             ("elu", False)]),
    "affine": st.booleans(),
    "track_running_stats": st.booleans(),
    "training": st.booleans(),
})


def _layer_from(options: dict, device: str) -> SyncBatchNorm:
    activation, inplace = options["mode"]
    layer = SyncBatchNorm(4, activation=activation, slope=0.1, inplace=inplace,
                          affine=options["affine"],
                          track_running_stats=options["track_running_stats"], dtype=DT)
    with torch.no_grad():
        for value in layer.state_dict().values():
            if value.is_floating_point():
                value.uniform_(0.5, 1.5)  # not the defaults: an update shows
    return layer.to(device).train(options["training"])


@settings(max_examples=16, deadline=None, derandomize=True)
@given(options=_LAYER_OPTIONS, layer_on=st.sampled_from(["cpu", "meta"]))
def test_input_on_another_device_is_refused_before_anything_changes(options, layer_on):
    """A meta input into a CPU layer, or a CPU input into a meta layer, training or not, with
    or without parameters and running statistics, in place or not: refused
    before anything is read or written, naming both devices and the layer; every buffer and
    the input as they were (before, a training call decayed the running statistics first;
    without parameters it returned a meta tensor, as the Triton backend did always). A layer
    with neither parameters nor running statistics has no device: it takes any input, as
    nn.BatchNorm2d does."""
    layer = _layer_from(options, layer_on)
    before = _state(layer)
    input_on = "meta" if layer_on == "cpu" else "cpu"
    x = torch.randn(6, 4, 3, 2, dtype=DT).to(input_on)
    given = x.clone()
    if not options["affine"] and not options["track_running_stats"]:
        out = layer(given)
        assert out.device == x.device and out.shape == x.shape
        return
    with pytest.raises(RuntimeError) as info:
        layer(given)
    for words in (f"expected input on device {layer_on}", f"got input on device {input_on}",
                  "SyncBatchNorm(4)"):
        assert words in str(info.value), str(info.value)
    _assert_unchanged(layer, before)
    if not given.is_meta:
        assert torch.equal(given, x)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(options=_LAYER_OPTIONS, data=st.data())
def test_a_tensor_of_the_layer_on_another_device_is_refused_at_a_repeat_call(options, data):
    """One of the layer's tensors swapped behind its back for one on another device (here the
    meta device; on a GPU, a CPU tensor where the Triton kernels take each address as it is),
    between two calls of one key: the repeat call is refused before anything is read or
    written, naming the layer, the tensor and both devices; every other tensor and the input
    as they were."""
    if not options["affine"] and not options["track_running_stats"]:
        return  # no tensor to move
    layer = _layer_from(options, "cpu")
    x = torch.randn(6, 4, 3, 2, dtype=DT)
    layer(x.clone())  # the key's first call: its decisions kept for the repeat calls
    names = [name for name, _ in [*layer.named_parameters(), *layer.named_buffers()]]
    moved = data.draw(st.sampled_from(names))
    owner = layer._parameters if moved in layer._parameters else layer._buffers
    tensor = owner[moved]
    on_meta = tensor.detach().to("meta")
    owner[moved] = nn.Parameter(on_meta) if isinstance(tensor, nn.Parameter) else on_meta
    before = _state(layer)
    given = x.clone()
    with pytest.raises(RuntimeError) as info:
        layer(given)
    for words in (f"{moved} on meta", "the input's device cpu", "SyncBatchNorm(4"):
        assert words in str(info.value), str(info.value)
    _assert_unchanged(layer, before)
    assert torch.equal(given, x)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(options=_LAYER_OPTIONS, data=st.data(), repeat=st.booleans(),
       shape=st.sampled_from([(3,), (5,), (4, 1), (1, 4), (2, 2), ()]))
def test_a_per_channel_tensor_of_another_shape_is_refused(options, data, repeat, shape):
    """A weight, bias or running statistic that does not hold one value per channel (a model's
    code assigning it, or a pruning tool setting ``.data`` between two calls of one key,
    behind the layer's back): refused before anything is read or written, naming the layer,
    the tensor, the shape expected and the one given; every other tensor and the input as
    they were (before, the running statistics were updated, the input overwritten, and a
    Triton kernel would read or write past the tensor's end)."""
    if not options["affine"] and not options["track_running_stats"]:
        return  # no per-channel tensor
    layer = _layer_from(options, "cpu")
    x = torch.randn(6, 4, 3, 2, dtype=DT)
    if repeat:
        layer(x.clone())  # the key's first call: its decisions kept for the repeat calls
    names = [name for name, _ in [*layer.named_parameters(), *layer.named_buffers()]
             if name != "num_batches_tracked"]
    changed = data.draw(st.sampled_from(names))
    tensor = getattr(layer, changed)
    with torch.no_grad():
        if repeat:
            tensor.data = torch.ones(shape, dtype=DT)
        else:
            setattr(layer, changed, type(tensor)(torch.ones(shape, dtype=DT)))
    before = _state(layer)
    given = x.clone()
    with pytest.raises(ValueError) as info:
        layer(given)
    for words in (f"expected {changed} of shape (4,)", f"got shape {shape}", "SyncBatchNorm(4)"):
        assert words in str(info.value), str(info.value)
    _assert_unchanged(layer, before)
    assert torch.equal(given, x)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("activation,inplace", [("none", False), ("leaky_relu", True)])
def test_vmap_over_a_tracking_training_layer_leaves_the_buffers(momentum, activation, inplace):
    """``torch.func.vmap`` over a training layer that tracks running statistics: the batch's
    statistics are per mapped sample and cannot be folded into the buffers. Refused, naming
    the layer and what to do, with every buffer as it was (before, running_mean and the
    counter were updated first, then a broadcast error); nn.BatchNorm2d refuses too.
    Without running statistics it maps as nn.BatchNorm2d does."""
    layer = _layer_from({"mode": (activation, inplace), "affine": True,
                         "track_running_stats": True, "training": True}, "cpu")
    layer.momentum = momentum
    before = _state(layer)
    x = torch.randn(3, 5, 4, 2, 2, dtype=DT)
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\).*vmap.*track_running_stats"):
        torch.func.vmap(layer)(x)
    _assert_unchanged(layer, before)
    layer.track_running_stats = False
    layer.running_mean = layer.running_var = None
    plain = nn.BatchNorm2d(4, track_running_stats=False, dtype=DT)
    plain.load_state_dict({k: layer.state_dict()[k] for k in ("weight", "bias")})
    expected = activate(torch.func.vmap(plain)(x), activation, 0.1)
    torch.testing.assert_close(torch.func.vmap(layer)(x.clone()), expected, **TOL)


@pytest.mark.parametrize("batch", [5, 7])
def test_unsynchronised_replicas_all_check_before_replica_0_updates(batch):
    """``sync=False`` under DataParallel, an (N, C) input whose last chunk holds one value per
    channel (5 or 7 rows over 4 replicas): that replica raises, and replica 0, whose chunk is
    valid, updates nothing either (it waits for the others' checks before its update).
    Then a valid step keeps replica 0's update, as nn.BatchNorm1d on its chunk."""
    layer = _layer_from({"mode": ("leaky_relu", True), "affine": True,
                         "track_running_stats": True, "training": True}, "cpu")
    layer.sync = False
    before = _state(layer)
    runner = SimulatedDataParallel(layer, 4)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\(1, 4\)"):
        runner(torch.randn(batch, 4, dtype=DT))
    _assert_unchanged(layer, before)
    twin = nn.BatchNorm1d(4, dtype=DT)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(8, 4, dtype=DT)
    out = runner(x.clone())
    expected = torch.cat([activate(twin(chunk), "leaky_relu", 0.1) for chunk in x.chunk(4)])
    torch.testing.assert_close(out, expected, **TOL)
    fresh = nn.BatchNorm1d(4, dtype=DT)
    fresh.load_state_dict(before)
    fresh(x[:2])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layer, name), getattr(fresh, name), **TOL)


class _FirstChunkOnly(nn.Module):
    """Calls its layer on chunks of 3 rows only: with 8 rows over 3 replicas (3, 3, 2), the
    last replica never does."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x) if x.shape[0] == 3 else x


def test_unsynchronised_replica_0_waits_for_a_replica_that_never_comes(monkeypatch):
    """Replica 0 of a ``sync=False`` layer whose input has one value per sample and channel
    waits for every other replica's checks: one that never calls the layer fails the step
    after the timeout with ``SyncError`` naming it, the buffers unchanged. (A timeout that
    leaves the replica that does call the layer time to report, on a loaded machine too.)"""
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "2")
    layer = _layer_from({"mode": ("none", False), "affine": True,
                         "track_running_stats": True, "training": True}, "cpu")
    layer.sync = False
    before = _state(layer)
    with pytest.raises(SyncError, match=r"SyncBatchNorm\(4\).*rank 0.*ranks \[2\] did not"):
        SimulatedDataParallel(_FirstChunkOnly(layer), 3)(torch.randn(8, 4, dtype=DT))
    _assert_unchanged(layer, before)


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Tolerances of a value computed in float32 or better and rounded to the coarser dtype.
_MIXED_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 4e-3,
              torch.bfloat16: 2e-2}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    layer_dtype=st.sampled_from(_DTYPES),
    input_dtype=st.sampled_from(_DTYPES),
    mode=st.sampled_from([("leaky_relu", True), ("leaky_relu", False), ("elu", True)]),
    training=st.booleans(),
    replicas=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_input_of_another_dtype_than_the_layer(layer_dtype, input_dtype, mode, training,
                                               replicas, seed):
    """An input of any floating dtype into a layer of any (outside autocast: a float64 input
    into a float32 layer, a float32 one into a half-precision model): the layer computes in
    the input's statistics dtype, returns the input's dtype, keeps its parameters' and
    buffers' dtypes and rounds each update into them once. Outputs, gradients and running
    statistics match nn.BatchNorm2d + the activation in float64 on the layer's own values,
    within the coarser dtype's rounding (nn.BatchNorm2d refuses such mixes on the CPU)."""
    activation, inplace = mode
    slope = 0.1 if activation == "leaky_relu" else 0.7
    gen = torch.Generator().manual_seed(seed)
    layer = SyncBatchNorm(4, activation=activation, slope=slope, inplace=inplace,
                          dtype=layer_dtype).train(training)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.0, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
        layer.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0, 0.0]))
        layer.running_var.copy_(torch.tensor([1.5, 0.7, 2.0, 1.0]))
    twin = nn.BatchNorm2d(4, dtype=DT).train(training)
    twin.load_state_dict({k: v.double() if v.is_floating_point() else v
                          for k, v in layer.state_dict().items()})
    x = (torch.randn(6, 4, 3, 2, generator=gen, dtype=DT) * 2 + 1).to(input_dtype)
    dy = torch.randn(x.shape, generator=gen, dtype=DT).to(input_dtype)
    leaf, ref_leaf = x.clone().requires_grad_(), x.double().requires_grad_()
    out = SimulatedDataParallel(layer, replicas)(leaf * 1)
    expected = activate(twin(ref_leaf), activation, slope)
    out.backward(dy)
    expected.backward(dy.double())
    assert out.dtype == input_dtype and leaf.grad.dtype == input_dtype
    assert all(v.dtype == layer_dtype for k, v in layer.state_dict().items()
               if k != "num_batches_tracked")
    assert layer.weight.grad.dtype == layer_dtype
    coarser = max(_MIXED_TOL[layer_dtype], _MIXED_TOL[input_dtype])
    for name, got, want in [("output", out, expected), ("input grad", leaf.grad, ref_leaf.grad),
                            ("weight grad", layer.weight.grad, twin.weight.grad),
                            ("bias grad", layer.bias.grad, twin.bias.grad),
                            ("running_mean", layer.running_mean, twin.running_mean),
                            ("running_var", layer.running_var, twin.running_var)]:
        torch.testing.assert_close(got.double(), want, rtol=coarser, atol=coarser,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert layer.num_batches_tracked.item() == twin.num_batches_tracked.item()
