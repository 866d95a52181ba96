"""SyncBatchNorm against nn.BatchNorm*d + activation on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backends import each_backend, one_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    ACTIVATIONS,
    SLOPES,
    activate,
    assert_close,
    assign_or_refused,
    plain_twin,
    reference_step,
)
from torch import nn

from encoding_syncbn import SyncBatchNorm, compat, convert_sync_batchnorm, kernels
from encoding_syncbn.layer import modules
from encoding_syncbn.testing import SimulatedDataParallel

C = 4
pytestmark = each_backend


def make_layer(activation="leaky_relu", inplace=None, dtype=torch.float64, **kwargs):
    layer = SyncBatchNorm(C, activation=activation, slope=SLOPES.get(activation, 0.01),
                          inplace=inplace, **kwargs).to(dtype)
    with torch.no_grad():
        if layer.weight is not None:
            # Negative and zero gammas: exact nn.BatchNorm semantics for every sign.
            layer.weight.copy_(torch.tensor([1.5, -0.7, 0.0, 2.0]))
        if layer.bias is not None:
            layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    return layer


def activation_modes():
    for activation in ACTIVATIONS:
        yield activation, False
        if activation not in ("none", "relu"):
            yield activation, True


def run_steps(layer, twin, make_input, replicas, activation, steps=3, dtype=torch.float64):
    """Compare outputs, gradients and buffers over several training steps."""
    model = SimulatedDataParallel(layer, replicas)
    slope = SLOPES.get(activation, 0.01)
    for step in range(steps):
        x = make_input(step)
        grad = torch.randn_like(x, dtype=torch.float64).to(x.dtype)
        expected, expected_dx = reference_step(twin, x.double(), grad.double(), activation, slope)
        leaf = x.detach().clone().requires_grad_()
        out = model(leaf * 1)  # a non-leaf, so that in-place layers really run in place
        out.backward(grad)
        what = f"step {step}"
        assert out.dtype == x.dtype
        assert_close(out, expected, dtype, what + " output")
        assert_close(leaf.grad, expected_dx, dtype, what + " input grad")
        if layer.affine:
            assert_close(layer.weight.grad, twin.weight.grad, dtype, what + " weight grad")
            if layer.bias is not None:
                assert_close(layer.bias.grad, twin.bias.grad, dtype, what + " bias grad")
        if layer.track_running_stats:
            assert_close(layer.running_mean, twin.running_mean, dtype, what + " running_mean")
            assert_close(layer.running_var, twin.running_var, dtype, what + " running_var")
            assert layer.num_batches_tracked.item() == twin.num_batches_tracked.item() == step + 1


# Spatial sizes per input rank, and the channels_last format of each rank that has one.
_SPATIAL = {2: (), 3: (3,), 4: (3, 2), 5: (2, 2, 2)}
_LAST_FORMAT = {4: torch.channels_last, 5: torch.channels_last_3d}
# Gammas of every sign, zero, and around the in-place layer's invertibility limit (1e-3 times
# max(1, |b|), the channels it keeps aside); biases small and large.
_GAMMAS = [1.5, -0.7, 0.0, 2e-3, 5e-4, -1e-3, 0.3]
_BIASES = [0.0, 0.5, -1.0, 100.0]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(list(activation_modes())),
    replicas=st.integers(1, 4),
    # Values a channel on both sides of inplace_policy.rebuilds_from_count's counts, below
    # which an in-place layer trains out of place.
    batch=st.integers(2, 30),
    rank=st.sampled_from(sorted(_SPATIAL)),
    channels_last=st.booleans(),
    channels=st.integers(1, 5),
    options=st.fixed_dictionaries({
        "affine": st.booleans(), "bias": st.booleans(),
        "momentum": st.sampled_from([0.1, None, 1.0]),
        "track_running_stats": st.booleans(),
    }),
    offset=st.sampled_from([0.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_generated_layers_match_batchnorm(mode, replicas, batch, rank, channels_last, channels,
                                          options, offset, seed):
    """Training steps, then evaluation, under (simulated) DataParallel against nn.BatchNorm*d +
    the activation on the whole batch, float64: generated over activations in and out of place,
    replica counts and uneven splits (fewer chunks than replicas too), input ranks and layouts,
    channel counts, the constructor's options, gammas and biases, and large means."""
    activation, inplace = mode
    gen = torch.Generator().manual_seed(seed)
    layer = SyncBatchNorm(channels, activation=activation, slope=SLOPES.get(activation, 0.01),
                          inplace=inplace, dtype=torch.float64, **options)
    with torch.no_grad():
        if layer.weight is not None:
            layer.weight.copy_(torch.tensor(_GAMMAS, dtype=torch.float64)[
                torch.randint(len(_GAMMAS), (channels,), generator=gen)])
        if layer.bias is not None:
            layer.bias.copy_(torch.tensor(_BIASES, dtype=torch.float64)[
                torch.randint(len(_BIASES), (channels,), generator=gen)])
    twin = plain_twin(layer, rank)
    shape = (batch, channels, *_SPATIAL[rank])
    fmt = _LAST_FORMAT.get(rank) if channels_last else None

    def make_input(step):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + step) + offset
        return x.contiguous(memory_format=fmt) if fmt else x

    run_steps(layer, twin, make_input, replicas, activation, steps=2)
    layer.eval()
    twin.eval()
    x = make_input(2)
    expected = activate(twin(x), activation, SLOPES.get(activation, 0.01))
    assert_close(SimulatedDataParallel(layer, replicas)(x.clone()), expected, what="eval")


_STATE = ("weight", "bias", "running_mean", "running_var")


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(list(activation_modes())),
    replicas=st.integers(1, 3),
    steps=st.fixed_dictionaries({name: st.sampled_from([1, 2, 3]) for name in _STATE}),
    momentum=st.sampled_from([0.1, None]),
    seed=st.integers(0, 2**16),
)
def test_strided_parameters_and_buffers(mode, replicas, steps, momentum, seed):
    """Parameters and running statistics that are strided views (every ``step``-th element of
    a larger tensor) compute as contiguous ones do, and the elements between them stay
    untouched (the Triton path's statistics kernel wrote contiguous vectors over them)."""
    activation, inplace = mode
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(activation, inplace, momentum=momentum)
    twin = plain_twin(layer, 4)
    bases = {}
    for name, step in steps.items():
        base = torch.randn(C * step, generator=gen, dtype=torch.float64)
        base[::step] = getattr(layer, name).detach()
        bases[name] = base, base.clone()
        view = base[::step]
        setattr(layer, name, nn.Parameter(view) if name in ("weight", "bias") else view)
        assert getattr(layer, name).is_contiguous() == (step == 1)
    shape = (6, C, 3, 2)
    run_steps(layer, twin, lambda s: torch.randn(shape, generator=gen, dtype=torch.float64),
              replicas, activation, steps=2)
    for name, (base, before) in bases.items():
        between = torch.ones(base.numel(), dtype=torch.bool)
        between[::steps[name]] = False
        assert torch.equal(base[between], before[between]), name


class _ConvNormConv(nn.Module):
    """conv -> norm (-> activation) -> conv: under autocast the norm sees half inputs."""

    def __init__(self, norm: nn.Module, activation: str | None = None) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(3, C, 3, padding=1), norm, nn.Conv2d(C, 2, 1)
        self.activation = activation

    def forward(self, x):
        z = self.norm(self.conv1(x))
        if self.activation is not None:
            z = activate(z, self.activation, SLOPES.get(self.activation, 0.01))
        return self.conv2(z)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(list(activation_modes())),
    replicas=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_autocast_matches_batchnorm(mode, replicas, dtype, seed):
    """Mixed precision (``torch.autocast``, float32 parameters, half activations between the
    convolutions) under (simulated) DataParallel: outputs in the half dtype, the gradients of
    both convolutions and the layer, and the running statistics, as nn.BatchNorm2d + the
    activation's on the whole batch under autocast. (Replica threads take the caller's
    autocast, as ``parallel_apply``'s do.)"""
    activation, inplace = mode
    torch.manual_seed(seed)
    layer = SyncBatchNorm(C, activation=activation, slope=SLOPES.get(activation, 0.01),
                          inplace=inplace)
    twin = _ConvNormConv(nn.BatchNorm2d(C), activation)
    ours = _ConvNormConv(layer)
    ours.load_state_dict(twin.state_dict())
    x = torch.randn(6, 3, 5, 5)
    results = []
    for model in (twin, SimulatedDataParallel(ours, replicas)):
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        out.float().square().sum().backward()
        results.append(out)
    got, want = results
    assert got.dtype == want.dtype == dtype
    assert_close(got, want, dtype, "output")
    # One scale for all: conv1's bias gradient is 0 in exact arithmetic (the norm subtracts
    # the mean), rounding noise here, which a scale of its own would make a full-size value.
    scale = max(param.grad.abs().max() for param in twin.parameters())
    for name, param in twin.named_parameters():
        assert_close(ours.get_parameter(name).grad / scale, param.grad / scale, dtype, name)
    for name in ("running_mean", "running_var"):
        assert_close(getattr(layer, name), getattr(twin.norm, name), torch.float32, name)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(list(activation_modes())),
    replicas=st.integers(1, 3),
    frozen=st.sets(st.sampled_from(["weight", "bias", "input"])),
    seed=st.integers(0, 2**16),
)
def test_frozen_parameters_and_inputs(mode, replicas, frozen, seed):
    """Fine-tuning: gamma, beta or both frozen (``requires_grad_(False)``) while the layer
    trains, or an input that needs no gradient (a frozen stem's output): the gradients that
    are asked for, the running statistics and the output are nn.BatchNorm's on the whole
    batch; none is made for what is frozen."""
    activation, inplace = mode
    layer = make_layer(activation, inplace)
    twin = plain_twin(layer, 4)
    for name in ("weight", "bias"):
        if name in frozen:
            getattr(layer, name).requires_grad_(False)
            getattr(twin, name).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    model = SimulatedDataParallel(layer, replicas)
    slope = SLOPES.get(activation, 0.01)
    for step in range(2):
        x = torch.randn(6, C, 3, 2, generator=gen, dtype=torch.float64)
        grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        wants_x = "input" not in frozen
        ref_x = x.clone().requires_grad_(wants_x)
        expected = activate(twin(ref_x), activation, slope)
        leaf = x.clone().requires_grad_(wants_x)
        out = model(leaf * 1 if wants_x else leaf)
        assert_close(out, expected, what=f"step {step} output")
        assert out.requires_grad == expected.requires_grad
        if expected.requires_grad:
            expected.backward(grad)
            out.backward(grad)
        if wants_x:
            assert_close(leaf.grad, ref_x.grad, what=f"step {step} input grad")
        for name in ("weight", "bias"):
            ours, theirs = getattr(layer, name).grad, getattr(twin, name).grad
            assert (ours is None) == (theirs is None) == (name in frozen)
            if theirs is not None:
                assert_close(ours, theirs, what=f"step {step} {name} grad")
        assert_close(layer.running_mean, twin.running_mean, what="running_mean")
        assert_close(layer.running_var, twin.running_var, what="running_var")


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("replicas", [1, 2])
def test_half_model_running_stats_are_batchnorms(momentum, replicas):
    """A model made float16 (``.half()``): its running statistics are nn.BatchNorm2d's, bitwise,
    step after step: the update computed in float32 and rounded to the buffers once (updated in
    place, they were rounded at each step of it: 1-2 ulp off a call, drifting)."""
    layer = SyncBatchNorm(C, momentum=momentum).half()
    twin = nn.BatchNorm2d(C, momentum=momentum).half()
    model = SimulatedDataParallel(layer, replicas)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x = (torch.randn(6, C, 3, 2, generator=gen) * 3 + 5).half()
        model(x.clone())
        twin(x)
        for name in ("running_mean", "running_var"):
            assert torch.equal(getattr(layer, name), getattr(twin, name)), (step, name)


@pytest.mark.parametrize("activation,inplace", list(activation_modes()))
@pytest.mark.parametrize("replicas,batch", [(1, 5), (2, 6), (3, 7), (4, 8), (4, 6), (4, 3)])
def test_training_matches_full_batch(activation, inplace, replicas, batch):
    """Even and uneven splits, and fewer chunks than replicas (6 over 4 gives 3); values a
    channel enough to train in place (inplace_policy.rebuilds_from_count)."""
    layer = make_layer(activation, inplace)
    twin = plain_twin(layer, 4)
    gen = torch.Generator().manual_seed(batch * 10 + replicas)
    shape = (batch, C, 4, 4)
    run_steps(layer, twin, lambda s: torch.randn(shape, generator=gen, dtype=torch.float64),
              replicas, activation)


@pytest.mark.parametrize("shape", [(24, C), (9, C, 5), (5, C, 3, 2), (5, C, 2, 3, 2)])
@pytest.mark.parametrize("activation,inplace", [("leaky_relu", True), ("none", False)])
@pytest.mark.parametrize("replicas", [1, 3])
def test_any_number_of_trailing_dims(shape, activation, inplace, replicas):
    layer = make_layer(activation, inplace)
    twin = plain_twin(layer, len(shape))
    run_steps(layer, twin, lambda s: torch.randn(shape, dtype=torch.float64) * 3 + 1, replicas,
              activation)


def test_evaluation_without_grad_checks_no_parameters(monkeypatch):
    """In place, channels are kept aside for a backward only: an evaluation call under
    no_grad checks no parameters (host work at every call) and computes what a call with
    grad does, which keeps its zero-gamma channel aside."""
    from encoding_syncbn.layer import inplace_policy

    checks = []
    small_gamma_mask = inplace_policy.small_gamma_mask
    monkeypatch.setattr(inplace_policy, "small_gamma_mask",
                        lambda *args: checks.append(1) or small_gamma_mask(*args))
    layer = SyncBatchNorm(4, activation="leaky_relu").eval()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.0, 0.0, -2.0, 0.5]))
    x = torch.randn(2, 4, 3, 3)
    with torch.no_grad():
        quiet = layer(x.clone())
    assert checks == []
    traced = layer(x.clone().requires_grad_() * 1)
    assert checks and layer._channels_aside.known == (1,)
    torch.testing.assert_close(quiet, traced.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["leaky_relu", "elu", "identity"])
def test_gamma_changed_between_steps_under_replicas(activation, monkeypatch):
    """In place, the channels kept aside are read from the parameters once per replicate()
    (not by every replica at every call) and so follow the parameters from step to step:
    a gamma set to zero, and one set back, between steps still get exact gradients."""
    from encoding_syncbn.layer import inplace_policy

    lookups = []
    small_gamma_index = inplace_policy.small_gamma_index
    monkeypatch.setattr(inplace_policy, "small_gamma_index",
                        lambda *args: lookups.append(1) or small_gamma_index(*args))
    layer = make_layer(activation, True)
    twin = plain_twin(layer, 4)
    gammas = [[1.5, -0.7, 0.0, 2.0], [0.0, -0.7, 1.0, 0.0], [1.5, 1e-9, 0.5, 2.0]]
    gen = torch.Generator().manual_seed(5)
    for step, gamma in enumerate(gammas):
        with torch.no_grad():
            for module in (layer, twin):
                module.weight.copy_(torch.tensor(gamma))
                module.weight.grad = module.bias.grad = None
        lookups.clear()
        run_steps(layer, twin, lambda s: torch.randn(8, C, 3, 2, generator=gen,
                                                     dtype=torch.float64),
                  4, activation, steps=1)
        assert len(lookups) == 1, f"step {step}: {len(lookups)} lookups for 4 replicas"
        layer.num_batches_tracked.zero_()
        twin.num_batches_tracked.zero_()


def test_output_overwrites_input_and_only_output_is_kept():
    """In place: the result lives in the input's storage; backward keeps one activation."""
    x = torch.randn(6, C, 5, 5, dtype=torch.float64, requires_grad=True)
    h = x * 2
    full_size_saved = []

    def pack(t):
        if t.numel() == h.numel():
            full_size_saved.append(t.data_ptr())
        return t

    layer = make_layer("leaky_relu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(h)
    assert out.data_ptr() == h.data_ptr()
    assert full_size_saved == [out.data_ptr()]

    full_size_saved.clear()
    plain = nn.BatchNorm2d(C).double()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.leaky_relu(plain(x * 2), inplace=True)
    assert len(full_size_saved) == 2


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("replicas", [1, 3])
def test_input_without_grad_still_trains_the_parameters(inplace, replicas):
    """A frozen part of the network before the layer: no input gradient is asked for, and the
    parameters' gradients are still those of the whole batch."""
    layer = make_layer("leaky_relu", inplace)
    twin = plain_twin(layer, 3)
    x = torch.randn(7, C, 5, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected, _ = reference_step(twin, x, grad, "leaky_relu", SLOPES["leaky_relu"])
    out = SimulatedDataParallel(layer, replicas)(x.clone())
    out.backward(grad)
    assert_close(out, expected, what="output")
    assert_close(layer.weight.grad, twin.weight.grad, what="weight grad")
    assert_close(layer.bias.grad, twin.bias.grad, what="bias grad")


def test_layer_called_twice_in_one_forward():
    layer = make_layer("elu", True)
    twin = plain_twin(layer, 2)

    class Twice(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(self.norm(x) * 2 + 1)

    x = torch.randn(25, C, dtype=torch.float64)  # enough values to train in place
    grad = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(Twice(layer), 4)(leaf * 1)
    out.backward(grad)
    ref_leaf = x.clone().requires_grad_()
    slope = SLOPES["elu"]
    expected = activate(twin(activate(twin(ref_leaf), "elu", slope) * 2 + 1), "elu", slope)
    expected.backward(grad)
    assert_close(out, expected)
    assert_close(leaf.grad, ref_leaf.grad)
    assert_close(layer.weight.grad, twin.weight.grad)
    assert_close(layer.running_var, twin.running_var)
    assert layer.num_batches_tracked.item() == 2


@pytest.mark.parametrize("replicas", [1, 3])
def test_inplace_elu_deep_in_saturation_float64(replicas):
    """Pre-activations down to about -19: y + alpha ~ 1e-8 alpha, which float64 still holds to
    ~1e-8 relative, so the rebuilt input and the gradients stay exact to ~1e-8 (an inverse
    clamped at fp32's floor, z >= -16.1, was off by a third of a standard deviation there)."""
    layer = make_layer("elu", True)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([11.0, -11.0, 1.0, 2.0]))
        layer.bias.zero_()
    twin = plain_twin(layer, 3)
    x = torch.linspace(-1, 1, 6 * 5, dtype=torch.float64).view(5, 6).t().reshape(6, 1, 5)
    x = x.expand(6, C, 5).contiguous()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected, expected_dx = reference_step(twin, x, grad, "elu", SLOPES["elu"])
    assert expected.min() + SLOPES["elu"] < 1e-7  # saturated far below fp32's floor
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(layer, replicas)(leaf * 1)
    out.backward(grad)
    assert_close(out, expected)
    torch.testing.assert_close(leaf.grad, expected_dx, rtol=0, atol=1e-7)
    torch.testing.assert_close(layer.weight.grad, twin.weight.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("replicas", [1, 3])
def test_large_offset_float32(replicas):
    """mean 1e4, std 0.5 in float32: E[x^2] - E[x]^2 would lose the variance entirely."""
    layer = make_layer("leaky_relu", dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.5, 2.0]))
    twin = plain_twin(layer, 4).double()
    gen = torch.Generator().manual_seed(replicas)
    x = (torch.randn(6, C, 4, 4, generator=gen) * 0.5 + 1e4).float()
    grad = torch.randn(x.shape, generator=gen)
    expected, expected_dx = reference_step(twin, x.double(), grad.double(), "leaky_relu", 0.1)
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(layer, replicas)(leaf * 1)
    out.backward(grad)
    # float32 holds 1e4 to ~1e-3, i.e. ~2e-3 of a standard deviation of 0.5.
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2)
    # That rounding may put an element within ~1e-2 of the kink on the other side of it,
    # where leaky_relu's derivative jumps: compare the gradient away from the kink.
    pre_activation = torch.nn.functional.batch_norm(
        x.double(), None, None, twin.weight, twin.bias, training=True
    )
    away = pre_activation.abs() > 2e-2
    torch.testing.assert_close(leaf.grad.double()[away], expected_dx[away], rtol=0, atol=1e-2)
    torch.testing.assert_close(layer.running_var.double(), twin.running_var, rtol=1e-3, atol=0)
    torch.testing.assert_close(layer.running_mean.double(), twin.running_mean, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation,inplace",
                         [("leaky_relu", True), ("elu", True), ("relu", False)])
def test_half_precision_input_with_float32_parameters(dtype, activation, inplace):
    layer = make_layer(activation, inplace, dtype=torch.float32)
    twin = plain_twin(layer, 4).double()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, C, 4, 4, generator=gen).to(dtype)
    grad = torch.randn(x.shape, generator=gen).to(dtype)
    expected, expected_dx = reference_step(twin, x.double(), grad.double(), activation,
                                           SLOPES.get(activation, 0.01))
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(layer, 2)(leaf * 1)
    out.backward(grad)
    assert out.dtype == dtype and leaf.grad.dtype == dtype
    assert layer.running_mean.dtype == torch.float32
    assert_close(out, expected, dtype, "output")
    compared = torch.ones_like(expected, dtype=torch.bool)
    weight_tolerance = 1e-2
    if activation == "elu":
        # In place, z = log1p(y / alpha) is rebuilt from a half-precision y; where ELU
        # saturates (y -> -alpha) that inverse amplifies y's rounding by 1 / (1 + y / alpha).
        compared = expected > -0.75 * SLOPES["elu"]
        weight_tolerance = 5e-2
    assert_close(leaf.grad[compared], expected_dx[compared], dtype, "input grad")
    # Statistics and parameter gradients are accumulated in float32.
    torch.testing.assert_close(layer.running_var.double(), twin.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad.double(), twin.weight.grad,
                               rtol=weight_tolerance, atol=weight_tolerance)


@pytest.mark.parametrize("activation,inplace", [("leaky_relu", True), ("elu", False)])
@pytest.mark.parametrize("grad_layout", [torch.channels_last, torch.contiguous_format])
def test_channels_last(activation, inplace, grad_layout):
    """channels_last inputs, with gradients coming back in either layout."""
    layer = make_layer(activation, inplace)
    twin = plain_twin(layer, 4)
    model = SimulatedDataParallel(layer, 3)
    for _ in range(2):
        x = torch.randn(6, C, 3, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
        grad = torch.randn(x.shape, dtype=torch.float64).contiguous(memory_format=grad_layout)
        expected, expected_dx = reference_step(twin, x, grad, activation, SLOPES[activation])
        leaf = x.clone().requires_grad_()
        out = model(leaf * 1)
        assert out.is_contiguous(memory_format=torch.channels_last)
        out.backward(grad)
        assert_close(out, expected)
        assert_close(leaf.grad, expected_dx)
        assert_close(layer.weight.grad, twin.weight.grad)
        assert_close(layer.running_var, twin.running_var)


@pytest.mark.parametrize("activation,inplace", list(activation_modes()))
def test_eval_uses_running_stats_and_applies_activation(activation, inplace):
    layer = make_layer(activation, inplace)
    with torch.no_grad():
        layer.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        layer.running_var.copy_(torch.tensor([2.0, 0.5, 1.0, 3.0]))
    layer.eval()
    twin = plain_twin(layer, 4)
    x = torch.randn(5, C, 3, 3, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected, expected_dx = reference_step(twin, x, grad, activation, SLOPES.get(activation, 0.01))
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(layer, 3)(leaf * 1)
    out.backward(grad)
    assert_close(out, expected)
    assert_close(leaf.grad, expected_dx)
    assert_close(layer.weight.grad, twin.weight.grad)
    assert layer.num_batches_tracked.item() == 0


def test_sync_false_is_per_replica_batchnorm():
    layer = make_layer("leaky_relu", sync=False)
    twin = plain_twin(layer, 4)
    x = torch.randn(8, C, 2, 2, dtype=torch.float64)
    out = SimulatedDataParallel(layer, 4)(x.clone())
    chunks = [activate(twin(c), "leaky_relu", 0.1) for c in x.chunk(4)]
    assert_close(out, torch.cat(chunks).detach())
    # As under nn.DataParallel, the running stats keep replica 0's update; twin saw 4 updates.
    fresh = plain_twin(make_layer("leaky_relu"), 4)
    fresh(x[:2])
    assert_close(layer.running_mean, fresh.running_mean)
    assert layer.num_batches_tracked.item() == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=None),
        dict(track_running_stats=False),
        dict(affine=False),
        dict(bias=False),
        dict(eps=1e-1, momentum=0.5),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("replicas", [1, 2])
def test_constructor_options_of_batchnorm(options, replicas):
    layer = make_layer("identity", **options)
    twin = plain_twin(layer, 3)
    # Enough values a channel to train in place (inplace_policy.rebuilds_from_count).
    run_steps(layer, twin, lambda s: torch.randn(13, C, 3, dtype=torch.float64) + s, replicas,
              "identity", steps=4)
    if not layer.track_running_stats:  # in eval too, the whole batch's statistics are used
        layer.eval()
        twin.eval()
        x = torch.randn(4, C, 3, dtype=torch.float64)
        assert_close(SimulatedDataParallel(layer, replicas)(x.clone()), twin(x))
    if options.get("bias") is False:
        assert "bias" not in layer.state_dict()



@pytest.mark.parametrize("momentum", [None, 0.3])
@pytest.mark.parametrize("replicas", [1, 2])
def test_running_statistics_without_a_batch_count(momentum, replicas):
    """``num_batches_tracked`` set to None: the running statistics as nn.BatchNorm2d's, with
    ``momentum``, and with None (a cumulative average with no count) kept as they are, its
    factor 0 (before, an AttributeError naming no layer)."""
    layer = make_layer("identity", momentum=momentum)
    twin = nn.BatchNorm2d(C, momentum=momentum).double()
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(layer, name).uniform_(0.5, 1.5)
            getattr(twin, name).copy_(getattr(layer, name))
    layer.num_batches_tracked = twin.num_batches_tracked = None
    model = SimulatedDataParallel(layer, replicas)
    for step in range(3):
        x = torch.randn(6, C, 3, 3, dtype=torch.float64) + step
        assert_close(model(x.clone()), twin(x), what=f"step {step} output")
        assert_close(layer.running_mean, twin.running_mean, what=f"step {step} running_mean")
        assert_close(layer.running_var, twin.running_var, what=f"step {step} running_var")
    assert layer.num_batches_tracked is None


@pytest.mark.parametrize("inplace", [False, True])
def test_parameters_and_buffers_from_functional_call(inplace):
    """``torch.func.functional_call`` swaps the module's parameters and buffers for the ones
    it is given: the layer computes with those, and updates those running statistics."""
    layer = make_layer("leaky_relu", inplace=inplace)
    twin = plain_twin(layer, 4)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(C, generator=gen, dtype=torch.float64).requires_grad_()
    bias = torch.randn(C, generator=gen, dtype=torch.float64).requires_grad_()
    buffers = {name: t.clone() for name, t in layer.named_buffers()}
    with torch.no_grad():
        twin.weight.copy_(weight)
        twin.bias.copy_(bias)
    x = torch.randn(6, C, 3, 2, generator=gen, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected, expected_dx = reference_step(twin, x, grad, "leaky_relu", 0.1)
    leaf = x.clone().requires_grad_()
    out = torch.func.functional_call(layer, ({"weight": weight, "bias": bias}, buffers),
                                     (leaf * 1,))
    out.backward(grad)
    assert_close(out, expected, what="output")
    assert_close(leaf.grad, expected_dx, what="input grad")
    assert_close(weight.grad, twin.weight.grad, what="weight grad")
    assert_close(bias.grad, twin.bias.grad, what="bias grad")
    assert_close(buffers["running_mean"], twin.running_mean, what="running_mean")
    assert_close(buffers["running_var"], twin.running_var, what="running_var")
    assert layer.weight.grad is None and layer.num_batches_tracked.item() == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_parametrized_weight(replicas):
    """A parametrization (``torch.nn.utils.parametrize``) replaces ``weight`` by a property
    computed from its own parameter: the layer normalises with the computed weight."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        calls = 0

        def forward(self, w):
            Doubled.calls += 1
            return 2 * w

    layer = make_layer("leaky_relu")
    twin = plain_twin(layer, 4)
    parametrize.register_parametrization(layer, "weight", Doubled())
    with torch.no_grad():
        twin.weight.mul_(2)
    x = torch.randn(6, C, 3, 2, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected, expected_dx = reference_step(twin, x, grad, "leaky_relu", 0.1)
    leaf = x.clone().requires_grad_()
    Doubled.calls = 0
    out = SimulatedDataParallel(layer, replicas)(leaf * 1)
    # Computed once a call (and once at replicate(), for the channels kept aside).
    assert Doubled.calls == (replicas if replicas == 1 else 1 + replicas)
    out.backward(grad)
    assert_close(out, expected, what="output")
    assert_close(leaf.grad, expected_dx, what="input grad")
    assert_close(layer.parametrizations.weight.original.grad, 2 * twin.weight.grad,
                 what="the parametrization's parameter's grad")


@pytest.mark.parametrize("replicas", [1, 2])
def test_pruned_weight(replicas):
    """``torch.nn.utils.prune`` makes ``weight`` a plain attribute, ``weight_orig * weight_mask``,
    recomputed by a forward pre-hook (on each replica under DataParallel): the layer normalises
    with it. A gamma that became zero after the last forward (here: set in ``weight_orig``) must
    still be kept aside in place: the weight attribute still shows the old value until the next
    forward's hook, so it is not the one to choose those channels by."""
    from torch.nn.utils import prune

    layer = make_layer("leaky_relu", inplace=True)
    twin = plain_twin(layer, 4)
    prune.l1_unstructured(layer, "weight", amount=1)  # channel 2: its gamma is the smallest
    with torch.no_grad():
        for weight in (layer.weight_orig, twin.weight):
            weight[1] = 0.0  # was -0.7, as the weight attribute still says
    x = torch.randn(6, C, 3, 2, dtype=torch.float64)
    grad = torch.randn_like(x)
    expected, expected_dx = reference_step(twin, x, grad, "leaky_relu", 0.1)
    leaf = x.clone().requires_grad_()
    out = SimulatedDataParallel(layer, replicas)(leaf * 1)
    out.backward(grad)
    assert_close(out, expected, what="output")
    assert_close(leaf.grad, expected_dx, what="input grad")
    mask = layer.weight_mask
    assert mask.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert_close(layer.weight_orig.grad, mask * twin.weight.grad, what="weight_orig grad")
    assert_close(layer.bias.grad, twin.bias.grad, what="bias grad")

@pytest.mark.parametrize("shape,replicas", [((0, C, 3, 3), 1), ((4, C, 0, 3), 1),
                                            ((4, C, 0, 3), 2)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_empty_batch_like_batchnorm(momentum, shape, replicas):
    """An empty output still attached to the parameters (zero gradients), and the running
    statistics as nn.BatchNorm leaves them."""
    layer = make_layer("leaky_relu", momentum=momentum)
    twin = plain_twin(layer, 4)
    with torch.no_grad():
        for module in (layer, twin):
            module.running_mean.fill_(2.0)
            module.running_var.fill_(3.0)
    x = torch.randn(shape, dtype=torch.float64)
    out = SimulatedDataParallel(layer, replicas)(x.clone().requires_grad_() * 1)
    assert out.shape == x.shape
    expected = twin(x.clone().requires_grad_())
    out.sum().backward()
    expected.sum().backward()
    assert_close(layer.weight.grad, twin.weight.grad, what="weight grad")
    assert_close(layer.bias.grad, twin.bias.grad, what="bias grad")
    assert_close(layer.running_mean, twin.running_mean)
    assert_close(layer.running_var, twin.running_var)
    assert layer.num_batches_tracked.item() == twin.num_batches_tracked.item() == 1


def test_state_dict_is_that_of_batchnorm():
    layer = make_layer("leaky_relu")
    plain = nn.BatchNorm2d(C).double()
    assert list(layer.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    layer.load_state_dict(nn.BatchNorm2d(C).double().state_dict())
    assert "activation='leaky_relu'" in repr(layer) and "slope=0.1" in repr(layer)


def test_default_inplace_follows_invertibility():
    assert SyncBatchNorm(3).inplace is False
    assert SyncBatchNorm(3, activation="relu").inplace is False
    for activation in ("identity", "leaky_relu", "elu"):
        layer = SyncBatchNorm(3, activation=activation)
        assert layer.inplace is True and layer.activation == activation and layer.sync
    assert SyncBatchNorm(3, activation="leaky_relu", slope=0.0, inplace=False).slope == 0.0


def test_num_features_of_any_integer_type():
    """A numpy integer, as nn.BatchNorm2d takes it (a model's code may compute it so): a
    layer of that many channels, and a model holding such a BatchNorm converts."""
    layer = SyncBatchNorm(np.int64(C))
    assert type(layer.num_features) is int and layer.num_features == C
    model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(np.int32(C))))
    assert type(model[0].num_features) is int and model[0](torch.randn(2, C, 2, 2)).shape[1] == C


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_features=0),
        dict(num_features=True),
        dict(num_features=3.0),
        dict(num_features=3, activation="hardswish"),
        dict(num_features=3, activation="relu", inplace=True),
        dict(num_features=3, activation="leaky_relu", slope=0.0),
        dict(num_features=3, activation="elu", slope=-1.0),
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        SyncBatchNorm(**kwargs)


@pytest.mark.parametrize(
    "x,error,words",
    [
        (torch.randn(4, 3, 5), ValueError, ["expected 4 channels", "3 channels"]),
        (torch.randn(4), ValueError, ["(N, C, *)", "1-D"]),
        (torch.ones(4, C, dtype=torch.long), TypeError, ["floating-point", "torch.int64"]),
        (torch.ones(4, C).to(torch.float8_e4m3fn), TypeError, ["bfloat16", "float8_e4m3fn"]),
        (torch.ones(4, C, dtype=torch.complex64), TypeError, ["float64", "complex64"]),
        (torch.randn(1, C), ValueError, ["more than 1 value per channel"]),
    ],
)
@pytest.mark.parametrize("replicas", [1, 2])
def test_bad_input_leaves_state_untouched(x, error, words, replicas):
    layer = make_layer("leaky_relu", dtype=torch.float32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(error) as info:
        SimulatedDataParallel(layer, replicas)(x)
    for word in [*words, layer._label()]:
        assert word in str(info.value)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("activation,name,value,words", [
    ("leaky_relu", "slope", 0.0, ["slope > 0"]),
    ("leaky_relu", "slope", 1e-309, ["1/slope", "float64"]),
    ("elu", "slope", -1.0, ["slope > 0"]),
    ("leaky_relu", "activation", "relu", ["not invertible"]),
    ("identity", "activation", "none", ["'none' does not run in place"]),
    ("leaky_relu", "activation", "swish", ["must be one of"]),
    ("relu", "inplace", True, ["not invertible"]),
    ("leaky_relu", "inplace", 1, ["must be a bool"]),
])
def test_options_assigned_later_are_checked_by_name(activation, name, value, words):
    """``activation``, ``slope`` and ``inplace`` assigned after construction are checked as the
    constructor checks them (an in-place slope of 0 divided by zero in backward; an in-place
    relu failed there), naming the layer; the layer is left as it was."""
    layer = make_layer(activation, inplace=None)
    before = (layer.activation, layer.slope, layer.inplace)
    with pytest.raises(ValueError) as info:
        setattr(layer, name, value)
    for word in [*words, layer._label()]:
        assert word in str(info.value)
    assert (layer.activation, layer.slope, layer.inplace) == before


@one_backend  # checked at assignment, before any op
@pytest.mark.parametrize("name,value,words", [
    ("eps", 0, ["eps must be a positive number", "got 0"]),
    ("eps", -1e-5, ["eps must be a positive number"]),
    ("eps", float("nan"), ["eps must be a positive number", "nan"]),
    ("eps", "1e-5", ["eps must be a positive number", "'1e-5'"]),
    ("eps", None, ["eps must be a positive number"]),
    ("eps", True, ["eps must be a positive number"]),
    ("momentum", -0.1, ["momentum must be None", "[0, 1]"]),
    ("momentum", 1.5, ["momentum must be None"]),
    ("momentum", float("nan"), ["momentum must be None"]),
    ("momentum", "0.1", ["momentum must be None", "'0.1'"]),
])
def test_statistics_options_assigned_later_are_checked_by_name(name, value, words):
    """``eps`` and ``momentum`` assigned after construction are checked as the constructor
    checks them (eps = 0 gave NaN on a constant channel; a momentum that is not a number
    failed only in the update, after the batch was counted), naming the layer; the layer is
    left as it was and computes as before."""
    layer = make_layer("leaky_relu")
    with pytest.raises(ValueError) as info:
        setattr(layer, name, value)
    for word in [*words, layer._label()]:
        assert word in str(info.value)
    assert (layer.eps, layer.momentum) == (1e-5, 0.1)
    with pytest.raises(ValueError, match=words[0].replace("[", r"\[")):
        SyncBatchNorm(C, **{name: value})


@pytest.mark.parametrize("name,value", [("eps", 1e-3), ("eps", 2), ("momentum", 0.5),
                                        ("momentum", None), ("momentum", 0), ("momentum", 1)])
def test_statistics_options_assigned_later_are_used(name, value):
    """A valid ``eps`` or ``momentum`` assigned later takes effect, as in nn.BatchNorm2d."""
    layer = make_layer("leaky_relu")
    setattr(layer, name, value)
    twin = plain_twin(layer, 4)
    x = torch.randn(6, C, 3, 2, dtype=torch.float64)
    x[:, 0] = 0.5  # a constant channel: eps alone keeps it finite
    grad = torch.randn_like(x)
    expected, expected_dx = reference_step(twin, x, grad, "leaky_relu", layer.slope)
    leaf = x.clone().requires_grad_()
    out = layer(leaf * 1)
    out.backward(grad)
    assert_close(out, expected, what=f"output at {name}={value}")
    assert_close(leaf.grad, expected_dx, what=f"input grad at {name}={value}")
    assert_close(layer.running_var, twin.running_var, what=f"running_var at {name}={value}")


# Values of every kind, valid or not for some option.
_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 2), st.floats(allow_nan=True),
    st.text(max_size=3), st.sampled_from(["0.3", "leaky_relu", "elu", "relu", "identity",
                                          "none", "silu"]),
    st.sampled_from([np.float32(0.2), np.float64(-1.0), np.int64(1), np.bool_(True),
                     np.float32("nan"), (0.1,), [1], {"a": 1}, object(), torch.tensor(0.1)]),
)


@one_backend  # checked at assignment, before any op
@settings(max_examples=60, deadline=None, derandomize=True)
@given(activation=st.sampled_from(["leaky_relu", "elu", "identity", "relu"]),
       named=st.booleans(), assignments=st.lists(
           st.tuples(st.sampled_from(sorted(modules._ACTIVATION_OPTIONS
                                            + modules._STATISTICS_OPTIONS)), _ANY_VALUE),
           min_size=1, max_size=4))
def test_every_checked_option_refused_by_name_or_taken(activation, named, assignments):
    """Every option the layer checks at assignment (``modules._ACTIVATION_OPTIONS``,
    ``_STATISTICS_OPTIONS``), assigned any value: either refused with a ValueError naming the
    layer (its model path once converted), the layer left as it was, or taken, the layer then
    configured as one constructed with those options."""
    from encoding_syncbn import convert_sync_batchnorm

    layer = SyncBatchNorm(C, activation=activation, slope=SLOPES.get(activation, 0.01))
    if named:
        layer = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(C, C, 1), layer))[1]
    names = modules._ACTIVATION_OPTIONS + modules._STATISTICS_OPTIONS
    for name, value in assignments:
        if not assign_or_refused(layer, names, name, value, named):
            continue
        options = {key: getattr(layer, key) for key in names}
        built = SyncBatchNorm(C, **options)
        assert built._config[:3] == layer._config[:3]
        assert (built.eps, built.momentum) == (layer.eps, layer.momentum)


# Real numbers of every type nn.BatchNorm2d computes with: Python's and numpy's scalars.
_NUMBER_TYPES = [float, int, np.float16, np.float32, np.float64, np.int32, np.int64]


@one_backend  # checked at construction and assignment, before any op
@settings(max_examples=20, deadline=None, derandomize=True)
@given(eps_type=st.sampled_from(_NUMBER_TYPES[:1] + _NUMBER_TYPES[2:5]),
       eps=st.sampled_from([1e-5, 1e-3, 0.5]),
       momentum_type=st.sampled_from(_NUMBER_TYPES),
       momentum=st.sampled_from([0, 1, 0.1, 0.5, None]),
       assigned=st.booleans())
def test_statistics_options_of_any_real_number_type(eps_type, eps, momentum_type, momentum,
                                                    assigned):
    """``eps`` and ``momentum`` of any real number type (numpy's scalars, as configs loaded
    with numpy hold) are taken, at construction or by assignment, as nn.BatchNorm2d takes
    them, and computed with as the Python floats; ``convert_sync_batchnorm`` converts an
    nn.BatchNorm2d that holds them."""
    import copy

    from encoding_syncbn import convert_sync_batchnorm

    if momentum is not None and not isinstance(momentum, int):
        momentum_type = float if momentum_type in (int, np.int32, np.int64) else momentum_type
    eps_value = eps_type(eps)
    momentum_value = None if momentum is None else momentum_type(momentum)
    plain = nn.BatchNorm2d(C, eps=eps_value, momentum=momentum_value).double()
    if assigned:
        layer = SyncBatchNorm(C).double()
        layer.eps, layer.momentum = eps_value, momentum_value
    else:
        layer = SyncBatchNorm(C, eps=eps_value, momentum=momentum_value).double()
    # torch runs the BatchNorm holding numpy scalars: the references are copies of it.
    references = [copy.deepcopy(plain), copy.deepcopy(plain)]
    converted = convert_sync_batchnorm(nn.Sequential(plain))[0]
    x = torch.randn(6, C, 3, 2, dtype=torch.float64)
    x[:, 0] = 0.5  # a constant channel: eps alone keeps it finite
    for synced, reference in zip((layer, converted), references):
        assert type(synced.eps) is float and synced.eps == float(eps_value)
        assert synced.momentum == (None if momentum is None else float(momentum_value))
        for _ in range(2):
            assert_close(synced(x.clone()), reference(x.clone()), what="output")
        assert_close(synced.running_var, reference.running_var, what="running_var")


@one_backend
@pytest.mark.parametrize("name,value", [
    ("eps", np.float32(0)), ("eps", np.float64(-1e-5)), ("eps", np.float32("nan")),
    ("eps", np.bool_(True)), ("momentum", np.int64(2)), ("momentum", np.float32(-0.1)),
    ("momentum", np.float64("nan")), ("momentum", np.bool_(False)),
])
def test_invalid_numpy_statistics_options_are_refused(name, value):
    """numpy scalars that are no valid ``eps`` or ``momentum`` are refused as the Python
    numbers are, at construction and by assignment, naming the layer."""
    with pytest.raises(ValueError, match=f"{name} must be"):
        SyncBatchNorm(C, **{name: value})
    layer = make_layer("leaky_relu")
    with pytest.raises(ValueError, match=layer._label().replace("(", r"\(").replace(")", r"\)")):
        setattr(layer, name, value)
    assert (layer.eps, layer.momentum) == (1e-5, 0.1)


def test_options_assigned_later_are_used():
    """A valid assignment takes effect: a new slope, then out of place with slope 0."""
    layer = make_layer("leaky_relu")
    for slope, inplace in [(0.3, True), (0.0, False)]:
        if not inplace:
            layer.inplace = False
        layer.slope = slope
        twin = plain_twin(layer, 4)
        x = torch.randn(6, C, 3, 2, dtype=torch.float64)
        grad = torch.randn_like(x)
        expected, expected_dx = reference_step(twin, x, grad, "leaky_relu", slope)
        leaf = x.clone().requires_grad_()
        out = layer(leaf * 1)
        out.backward(grad)
        assert_close(out, expected, what=f"output at slope {slope}")
        assert_close(leaf.grad, expected_dx, what=f"input grad at slope {slope}")


_ASSIGNMENTS = [("slope", 0.3), ("slope", 0.05), ("slope", 0.0), ("activation", "elu"),
                ("activation", "leaky_relu"), ("activation", "identity"), ("activation", "silu"),
                ("inplace", False), ("inplace", True)]


@settings(max_examples=30, deadline=None)
@given(assignments=st.lists(st.sampled_from(_ASSIGNMENTS), min_size=1, max_size=6),
       pickled=st.booleans())
def test_any_assignments_compute_as_a_layer_built_with_them(assignments, pickled):
    """The configuration a layer computes with is made when its options are assigned: after
    any sequence of assignments (the refused ones leave it as it was), and a pickle round
    trip, the layer computes what a layer constructed with its options computes."""
    import pickle

    layer = make_layer("leaky_relu")
    for name, value in assignments:
        try:
            setattr(layer, name, value)
        except (ValueError, TypeError):
            pass
    if pickled:
        layer = pickle.loads(pickle.dumps(layer))
    built = SyncBatchNorm(C, activation=layer.activation, slope=layer.slope,
                          inplace=layer.inplace).double()
    built.load_state_dict(layer.state_dict())
    x = torch.randn(8, C, 3, dtype=torch.float64)  # enough values to train in place
    grad = torch.randn_like(x)
    outputs = []
    for module in (layer, built):
        leaf = x.clone().requires_grad_()
        out = module(leaf * 1)
        out.backward(grad)
        outputs.append((out.detach(), leaf.grad, module.weight.grad))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_non_tensor_input_is_refused_by_name():
    layer = make_layer("leaky_relu")
    with pytest.raises(TypeError, match=r"SyncBatchNorm\(4\) at 0x.*expected a torch.Tensor, got "
                                        "list"):
        layer([1.0, 2.0])


@pytest.mark.parametrize("make_view", ["chunk", "no_grad_slice"])
def test_views_autograd_will_not_let_us_overwrite(make_view):
    """A chunk piece, or a view made under no_grad: computed out of place, exact gradients."""
    layer = make_layer("leaky_relu")
    twin = plain_twin(layer, 3)
    leaf = torch.randn(6, C, 5, dtype=torch.float64, requires_grad=True)
    base = leaf * 1
    if make_view == "chunk":
        x = base.chunk(2)[0]
    else:
        with torch.no_grad():
            x = base[:3]
    before = x.detach().clone()
    grad = torch.randn_like(before)
    with pytest.warns(UserWarning, match="cannot be overwritten; computing out of place"):
        out = layer(x)
    assert out.data_ptr() != x.data_ptr() and torch.equal(x.detach(), before)
    expected, expected_dx = reference_step(twin, before, grad, "leaky_relu", SLOPES["leaky_relu"])
    assert_close(out, expected)
    if make_view == "chunk":
        out.backward(grad)
        assert_close(leaf.grad[:3], expected_dx)


def _step_dropping_the_output(layer, x: torch.Tensor, grad: torch.Tensor, hold: str | None,
                              retain: bool = False):
    """A training step whose in-place output is held by ``hold`` (None: by nothing once the
    next op has read it; "output", "view", "detached": the caller keeps that), then backward
    (twice with ``retain``). Returns the gradients and, where held, what is held and its
    values after forward."""
    leaf = x.detach().clone().requires_grad_()
    out = layer(leaf * 1)
    held = {"output": out, "view": out[1:], "detached": out.detach(), None: None}[hold]
    before = None if held is None else held.detach().clone()
    loss = out.clone()  # CloneBackward hands the gradient on as it is
    del out
    loss.backward(grad, retain_graph=retain)
    grads = [leaf.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
    if retain:
        for t in (leaf, layer.weight, layer.bias):
            t.grad = None
        loss.backward(grad)
        for first, again in zip(grads, (leaf.grad, layer.weight.grad, layer.bias.grad)):
            torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)
    return grads, held, before


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["leaky_relu", "elu", "identity"]),
    hold=st.sampled_from([None, "output", "view", "detached"]),
    retain=st.booleans(),
    batch=st.integers(6, 12),
    channels_last=st.booleans(),
    offset=st.sampled_from([0.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_an_output_nothing_holds_is_the_backwards_scratch(activation, hold, retain, batch,
                                                          channels_last, offset, seed):
    """Backward may rebuild the input over an in-place output that nothing reads afterwards:
    gradients exact against nn.BatchNorm2d + the activation (float64), and equal to those of a
    step whose output is held; an output, a view or a detached alias the caller holds, or a
    graph kept for a second backward, is never written (its values after backward are those
    of forward). Gammas include zero and small ones (channels kept aside)."""
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(activation, inplace=True)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, 5e-4, 0.0, -0.7]))
    twin = plain_twin(layer, 4)
    x = torch.randn(batch, C, 5, 4, generator=gen, dtype=torch.float64) + offset
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    _, expected_dx = reference_step(twin, x, grad, activation, SLOPES.get(activation, 0.01))

    got, held, before = _step_dropping_the_output(layer, x, grad, hold, retain)
    assert_close(got[0], expected_dx, what="input grad")
    assert_close(got[1], twin.weight.grad, what="weight grad")
    assert_close(got[2], twin.bias.grad, what="bias grad")
    if held is not None:
        assert torch.equal(held, before), f"the {hold} the caller holds was written"
    layer.zero_grad()
    also, _, _ = _step_dropping_the_output(layer, x, grad, "output")
    for name, a, b in zip(("dx", "dw", "db"), got, also):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


@one_backend  # the layer's decision, handed to whichever backend
@pytest.mark.parametrize("hold, retain, hooked, untold, overwritten", [
    (None, False, False, False, True),
    ("output", False, False, False, False),
    ("view", False, False, False, False),
    ("detached", False, False, False, False),
    (None, True, False, False, False),
    ("output", False, True, False, False),  # a hook may hand backward the caller's own tensor
    (None, False, False, True, False),  # a torch without the private APIs that tell
])
def test_backward_overwrites_only_an_output_nothing_holds(monkeypatch, hold, retain, hooked,
                                                          untold, overwritten):
    """What the backend is told: the output is its scratch only where nothing reads it after
    backward (the case the tests above see exact)."""
    if untold:
        monkeypatch.setattr(compat, "_storage_use_count", lambda: None)
    told = []
    real = kernels.TORCH.batch_backward

    def spy(*args, overwrite_saved=False, **kwargs):
        told.append(overwrite_saved)
        return real(*args, overwrite_saved=overwrite_saved, **kwargs)

    monkeypatch.setattr(kernels.TORCH, "batch_backward", spy)
    x = torch.randn(6, C, 5, 4, dtype=torch.float64)
    layer = make_layer("leaky_relu", inplace=True)
    if hooked:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            _step_dropping_the_output(layer, x, torch.randn_like(x), hold, retain)
    else:
        _step_dropping_the_output(layer, x, torch.randn_like(x), hold, retain)
    assert told[0] is overwritten
