"""The fused activations through their one definition (encoding_syncbn/activations.py): SiLU and
GELU (erf and tanh forms), fused out of place, against F.silu / F.gelu on the whole batch."""

from __future__ import annotations

import pytest
import torch
from backends import each_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SMOOTH_ACTIVATIONS, activate, assert_close, plain_twin, reference_step
from torch import nn

from encoding_syncbn import (
    SyncBatchNorm,
    activations,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from encoding_syncbn.layer.norm_act import BatchNormAct
from encoding_syncbn.testing import SimulatedDataParallel

DT = torch.float64


def _layer(activation: str, channels: int, gen: torch.Generator) -> SyncBatchNorm:
    layer = SyncBatchNorm(channels, activation=activation, dtype=DT)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(channels, generator=gen, dtype=DT))
        layer.bias.copy_(torch.randn(channels, generator=gen, dtype=DT))
    return layer


@each_backend
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(SMOOTH_ACTIVATIONS),
    shape=st.sampled_from([(7, 3), (4, 3, 5), (3, 5, 2, 3), (2, 3, 2, 2, 3)]),
    channels_last=st.booleans(),
    replicas=st.sampled_from([1, 2]),
)
def test_forward_and_gradients_match_torch(activation, shape, channels_last, replicas):
    """Training (synchronised over replicas) then eval, in float64: outputs, input, weight
    and bias gradients, running statistics against nn.BatchNorm + F.silu / F.gelu."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + replicas)
    layer = _layer(activation, shape[1], gen)
    assert layer.inplace is False
    twin = plain_twin(layer, len(shape))
    model = SimulatedDataParallel(layer, replicas)
    x = torch.randn(shape, generator=gen, dtype=DT) * 2 + 0.5
    if channels_last and len(shape) == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(shape, generator=gen, dtype=DT)
    expected, expected_dx = reference_step(twin, x, grad, activation, 0.0)
    leaf = x.clone().requires_grad_()
    out = model(leaf * 1)
    out.backward(grad)
    assert_close(out, expected, what="output")
    assert_close(leaf.grad, expected_dx, what="input grad")
    assert_close(layer.weight.grad, twin.weight.grad, what="weight grad")
    assert_close(layer.bias.grad, twin.bias.grad, what="bias grad")
    assert_close(layer.running_var, twin.running_var, what="running_var")
    layer.eval()
    twin.eval()
    with torch.no_grad():
        assert_close(layer(x), activate(twin(x), activation, 0.0), what="eval output")


@pytest.mark.parametrize("activation", SMOOTH_ACTIVATIONS)
def test_double_backward(activation):
    """Out of place, the layer differentiates twice (gradient penalties)."""
    gen = torch.Generator().manual_seed(0)
    layer = _layer(activation, 3, gen)
    x = torch.randn(4, 3, 2, generator=gen, dtype=DT, requires_grad=True)
    torch.autograd.gradgradcheck(lambda t: layer(t), (x,))


@pytest.mark.parametrize("activation", SMOOTH_ACTIVATIONS + ("relu",))
def test_in_place_is_a_clear_error(activation):
    with pytest.raises(ValueError, match=rf"SyncBatchNorm\(3\): activation='{activation}' "
                                         r"with inplace=True: .* not invertible"):
        SyncBatchNorm(3, activation=activation, inplace=True)


def test_unknown_activation_names_the_choices():
    with pytest.raises(ValueError, match=r"activation must be one of .*'gelu_tanh'.*'silu'"):
        SyncBatchNorm(3, activation="swish")


@pytest.mark.parametrize("act", [nn.SiLU(), nn.SiLU(inplace=True), nn.GELU(),
                                 nn.GELU(approximate="tanh")])
def test_convert_fuses_and_revert_gives_the_module_back(act):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), BatchNormAct(3, act=act)).double()
    x = torch.randn(4, 2, 3, 3, dtype=DT)
    expected = model(x)
    converted = convert_sync_batchnorm(model)
    layer = converted[1]
    assert type(layer) is SyncBatchNorm and not layer.inplace
    assert layer.activation == activations.from_module(act)[0]
    assert_close(converted(x), expected, what="converted")
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[1].act) is type(act)
    assert getattr(reverted[1].act, "approximate", None) == getattr(act, "approximate", None)
    assert_close(reverted(x), expected, what="reverted")


def test_every_definition_is_consistent():
    """Each definition's forward, in-place forward and derivative agree with autograd; its
    inverse (where it has one) gives z and dz back from the output; its module computes it."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, generator=gen, dtype=DT) * 3
    dy = torch.randn(64, generator=gen, dtype=DT)
    for name, definition in activations.ACTIVATIONS.items():
        slope = 0.3
        leaf = z.clone().requires_grad_()
        y = definition.forward(leaf, slope)
        (want_dz,) = torch.autograd.grad(y, leaf, dy)
        assert_close(definition.forward_(z.clone(), slope), y.detach(), what=name)
        if definition.derivative is not None:
            assert_close(definition.derivative(dy, z, slope, torch.empty_like(z)), want_dz,
                         what=f"{name} derivative")
        if definition.inverse is not None:
            z_out, dz_out = torch.empty_like(z), torch.empty_like(z)
            definition.inverse(y.detach(), dy, slope, z_out, dz_out, torch.empty_like(z))
            assert_close(z_out, z, what=f"{name} inverse")
            assert_close(dz_out, want_dz, what=f"{name} inverse's dz")
        module = activations.to_module(name, slope)
        if module is not None:
            assert_close(module(z.clone()), y.detach(), what=f"{name} module")
            assert activations.from_module(module) == (name, slope if definition.has_param
                                                       else 0.0)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), specials=st.lists(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0]), min_size=1,
    max_size=6))
def test_derivatives_do_not_depend_on_size_or_layout(seed, specials):
    """An element's dz from z (or z and dz from the output y) is the same in a long contiguous
    tensor, alone, and in a strided view, NaN and inf included. ATen's CPU ELU backward is
    not: NaN at a NaN z in its vectorised body, dy in its scalar loop (a short tensor, a
    strided walk)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(64, generator=gen, dtype=DT) * 3
    positions = torch.randperm(64, generator=gen)[:len(specials)]
    z[positions] = torch.tensor(specials, dtype=DT)
    dy = torch.randn(64, generator=gen, dtype=DT)
    for name, definition in activations.ACTIVATIONS.items():
        if definition.derivative is not None:
            _assert_same_in_every_form(f"{name} derivative", _derivative_of(definition), dy, z)
        if definition.inverse is not None:
            y = definition.forward(z, _SLOPE)
            _assert_same_in_every_form(f"{name} inverse", _inverse_of(definition), dy, y)


_SLOPE = 0.3


def _derivative_of(definition: activations.Activation):
    return lambda dy, z: definition.derivative(dy, z, _SLOPE, torch.empty_like(z))


def _inverse_of(definition: activations.Activation):
    def z_and_dz(dy, y):
        z_out, dz_out = torch.empty_like(y), torch.empty_like(y)
        definition.inverse(y, dy, _SLOPE, z_out, dz_out, torch.empty_like(y))
        return torch.stack([z_out, dz_out])

    return z_and_dz


def _assert_same_in_every_form(what: str, op, *inputs: torch.Tensor) -> None:
    """``op`` of 1-D ``inputs`` on each element alone and on strided views, against ``op`` on
    the whole contiguous tensors."""
    whole = op(*inputs)
    alone = torch.cat([op(*(t[i:i + 1] for t in inputs)) for i in range(len(inputs[0]))], -1)
    strided = op(*(torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0] for t in inputs))
    for form, got in (("alone", alone), ("strided", strided)):
        # Vectorised and scalar exp and tanh may differ in the last bits (absolute, where the
        # derivative crosses zero); NaN and inf may not.
        torch.testing.assert_close(got, whole, equal_nan=True, rtol=1e-13, atol=1e-13,
                                   msg=lambda m, form=form: f"{what}, {form}: {m}")
