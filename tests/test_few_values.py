"""In place with few values a channel, in float32 and float64: a training call whose statistics
cover fewer than ``MIN_REBUILT_COUNT`` values a channel (float64: ``MIN_FLOAT64_REBUILT_COUNT``;
the whole synchronised batch) runs out of place (``inplace_policy.rebuilds_from_count``), where
the rebuilt input's rounding, multiplied by up to 1 + |beta| / |gamma|, is not averaged out,
and a call over fewer than ``MIN_OWN_PRECISION_COUNT`` computes in float64
(``functional.computes_in``); float64's input gradient below ``MIN_FLOAT64_REBUILT_COUNT`` in
double-double (``kernels/double_double.py``). The README's bound on the input gradient (3x
nn.BatchNorm2d's error) is asserted here in float32 and float64
(benchmarks/few_values_precision.py measures it), and in float64 over thousands of values a
channel too, where the bound rests on float64's statistics rounding about once. Half
precision: tests/test_half_precision.py.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest
import torch
from backends import each_backend, one_backend
from helpers.rebuild_error import allowed_errors, exact_input_gradient, off_kink, ratios_to_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SLOPES, SMOOTH_ACTIVATIONS, activate, assert_close
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.kernels.torch_ops import _rebuilt_scale
from encoding_syncbn.layer.inplace_policy import (
    MARGIN,
    MIN_FLOAT64_REBUILT_COUNT,
    MIN_OWN_PRECISION_COUNT,
    MIN_REBUILT_COUNT,
    rebuilds_from_count,
)
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend

CHANNELS = 8
WIDE = [torch.float32, torch.float64]


def _twins(activation: str, gamma: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype
           ) -> tuple[SyncBatchNorm, SyncBatchNorm]:
    """An in-place layer and its inplace=False twin, with these parameters."""
    slope = SLOPES.get(activation, 0.01)
    layers = tuple(SyncBatchNorm(len(gamma), activation=activation, slope=slope,
                                 inplace=inplace, dtype=dtype) for inplace in (True, False))
    for layer in layers:
        with torch.no_grad():
            layer.weight.copy_(gamma)
            layer.bias.copy_(beta)
    return layers


def _step(model: nn.Module, layer: SyncBatchNorm, x: torch.Tensor, dy: torch.Tensor
          ) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and parameter gradients of one training step, and the running
    statistics it left; whether the output was written over the input (single replica)."""
    leaf = x.clone().requires_grad_()
    h = leaf * 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-place fallback's warning, where it runs
        out = model(h)
    written_over = out.data_ptr() == h.data_ptr()
    out.backward(dy)
    return (out.detach(), leaf.grad, layer.weight.grad, layer.bias.grad, layer.running_mean,
            layer.running_var), written_over


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(WIDE),
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)
def test_few_values_a_channel_train_out_of_place(dtype, activation, replicas, spatial, data):
    """With 3 to 64 values a channel over the whole (simulated DataParallel) batch, an in-place
    layer in float32 or float64 computes below ``MIN_REBUILT_COUNT`` values (float64:
    ``MIN_FLOAT64_REBUILT_COUNT``) exactly as its inplace=False twin (outputs, gradients,
    running statistics), leaving its input as it was, and in place from there on. Gammas and
    betas on both sides of the limit a channel is rebuilt at (|beta| up to 50 |gamma|)."""
    per_sample = spatial[0] * spatial[1]
    fewest = max(replicas, -(-3 // per_sample))
    # Counts on both sides of the threshold, the few values as often as the rest.
    batch = data.draw(st.one_of(st.integers(fewest, max(fewest, 22 // per_sample)),
                                st.integers(fewest, 64 // per_sample)), label="batch")
    magnitudes = data.draw(st.lists(st.floats(0.1, 10.0), min_size=CHANNELS,
                                    max_size=CHANNELS))
    ratios = data.draw(st.lists(st.floats(-50.0, 50.0), min_size=CHANNELS, max_size=CHANNELS))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    gamma = torch.tensor(magnitudes) * torch.randn(CHANNELS, generator=gen).sign()
    beta = gamma.abs() * torch.tensor(ratios)
    shape = (batch, CHANNELS, *spatial)
    count = batch * per_sample
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    layer, twin = _twins(activation, gamma, beta, dtype)
    results = []
    for norm in (layer, twin):
        model = SimulatedDataParallel(norm, replicas) if replicas > 1 else norm
        results.append(_step(model, norm, x, dy))
    (ours, written_over), (theirs, _) = results
    rebuilt = rebuilds_from_count(count, dtype)
    what = f"{dtype} {activation} x{replicas} {shape}"
    if not rebuilt:
        for got, want in zip(ours, theirs):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    if replicas == 1:
        assert written_over == rebuilt, what
    else:  # judged on the layer: a replica's input is written over only in place
        h = x.clone() * 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert (layer(h).data_ptr() == h.data_ptr()) == rebuilt, what


@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("count", [8, MIN_OWN_PRECISION_COUNT + 1])
def test_checkpoint_recomputes_a_few_values_call_out_of_place(dtype, count):
    """Under checkpoint, a synchronised float32 / float64 call over too few values a channel
    (here over 2 replicas) runs, and is recomputed, out of place: its gradients are those of
    the inplace=False model exactly; over enough values it runs in place, where checkpoint
    changes nothing."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, inplace):
            super().__init__()
            torch.manual_seed(4)
            self.fc = nn.Linear(6, CHANNELS, dtype=dtype)
            self.bn = SyncBatchNorm(CHANNELS, activation="leaky_relu", inplace=inplace,
                                    dtype=dtype)
            with torch.no_grad():
                self.bn.bias.uniform_(-5.0, 5.0)

        def forward(self, x):
            return checkpoint(lambda h: self.bn(self.fc(h)), x, use_reentrant=False)

    x = torch.randn(count, 6, generator=torch.Generator().manual_seed(5), dtype=dtype)
    grads = []
    for inplace in (True, False):
        model = Block(inplace)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = SimulatedDataParallel(model, 2)(x)
        out.square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads):
        if not rebuilds_from_count(count, dtype):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:  # in place: the rebuilt input's rounding
            assert_close(got, want, dtype)


def _bound_ratios(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor,
                  xhat_term: np.ndarray) -> torch.Tensor:
    """Per channel, ``ours``' largest error against ``exact`` over the README's bound
    (``allowed_errors``: 3x the largest of ``theirs``' error, nn.BatchNorm2d's in the same
    dtype, half an ulp of the channel's largest |dx| and nn.BatchNorm2d's typical relative
    error times ``xhat_term``, the size of dx's xhat term)."""
    dims = [0, *range(2, exact.dim())]
    their_error = (theirs.double() - exact).abs().amax(dims)
    allowed = allowed_errors(their_error.numpy(), exact.abs().amax(dims).numpy(), ours.dtype,
                             xhat_term)
    return (ours.double() - exact).abs().amax(dims) / torch.from_numpy(allowed)


# Channels a generated layer has: the bound's failures are a chance per channel.
BOUND_CHANNELS = 16
SMOOTH_CHANNELS = 48
# The whole synchronised batch's values a channel in the float64 cases: under
# MIN_FLOAT64_REBUILT_COUNT, where a float64 call's input gradient comes in double-double.
FEW = MIN_FLOAT64_REBUILT_COUNT - 1
# Bits the float64 reference computes with (mpmath): float64's input gradient over so few values
# is a difference of terms larger than itself, measured to far below its last bit.
REFERENCE_BITS = 160


def bound_case(activation: str, replicas: int, spatial: tuple[int, int], data,
               most: int = 64, channels: int = BOUND_CHANNELS, ratio: float = 1e3,
               least: int = 3):
    """A generated layer for the bound: ``(shape, gamma, beta, x, dy)`` (x and dy in float64),
    ``least`` to ``most`` values a channel over the whole batch (by default on both sides of
    ``MIN_REBUILT_COUNT`` and ``MIN_OWN_PRECISION_COUNT``), gammas and betas rebuilt and kept
    aside (|beta| up to ``ratio`` |gamma|). ELU: |gamma| <= 1 and beta >= 0, keeping z above about
    -4 (its deep saturation is a limit of its own, README)."""
    per_sample = spatial[0] * spatial[1]
    fewest = max(replicas, -(-least // per_sample))
    batch = data.draw(st.one_of(st.integers(fewest, max(fewest, min(40, most) // per_sample)),
                                st.integers(fewest, max(fewest, most // per_sample))),
                      label="batch")
    largest = 1.0 if activation == "elu" else 10.0
    magnitudes = data.draw(st.lists(st.floats(0.1, largest), min_size=channels,
                                    max_size=channels))
    ratios = data.draw(st.lists(st.one_of(st.floats(-1.5, 1.5), st.floats(1.5, ratio),
                                          st.floats(-ratio, -1.5)),
                                min_size=channels, max_size=channels))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    gamma = torch.tensor(magnitudes) * torch.randn(channels, generator=gen).sign()
    beta = gamma.abs() * torch.tensor(ratios)
    if activation == "elu":
        beta = beta.abs()
    shape = (batch, channels, *spatial)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    return shape, gamma, beta, x, dy


def _wrapped(layer: nn.Module, replicas: int | Sequence[int]) -> nn.Module:
    """``layer`` in simulated DataParallel wrappers: of ``replicas`` replicas, or nested, of
    ``replicas[0]`` outermost, ``replicas[1]`` inside each of its replicas, ..."""
    for count in reversed([replicas] if isinstance(replicas, int) else replicas):
        layer = SimulatedDataParallel(layer, count) if count > 1 else layer
    return layer


def _input_grads(x: torch.Tensor, dy: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                 activation: str, replicas: int | Sequence[int], dtypes: Sequence[torch.dtype],
                 create_graph: bool = False) -> list[torch.Tensor]:
    """The input gradients of the layer, in place where its activation may be (in simulated
    DataParallel wrappers, ``_wrapped``) in ``dtypes[0]``, then of nn.BatchNorm2d + the
    activation in each of ``dtypes``; ``create_graph``: each the result of a create_graph
    backward (a gradient penalty's first)."""
    channels, slope = x.shape[1], SLOPES.get(activation, 0.01)
    layer = SyncBatchNorm(channels, activation=activation, slope=slope, dtype=dtypes[0])
    grads = []
    for norm, dtype in ((layer, dtypes[0]),
                        *((nn.BatchNorm2d(channels, dtype=d), d) for d in dtypes)):
        with torch.no_grad():
            norm.weight.copy_(gamma)
            norm.bias.copy_(beta)
        model = _wrapped(norm, replicas) if norm is layer else norm
        leaf = x.to(dtype, copy=True).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the out-of-place fallback's warning
            out = model(leaf * 1)
        if norm is not layer:
            out = activate(out, activation, slope)
        (grad,) = torch.autograd.grad(out, leaf, dy.to(dtype), create_graph=create_graph)
        assert grad.requires_grad == create_graph
        grads.append(grad.detach())
    return grads


# The bound's tail (README, Limits): in a few channels in 10^4 the whole channel's dx is scaled
# off by the roundings of its scale (invstd's and, in place, the rebuilt weight's) where
# nn.BatchNorm2d's own error there is under half an ulp of its largest |dx|, up to some 1.4x
# the bound. A layer of a few dozen channels has such a channel in up to one draw of a hundred.
TAIL_LIMIT = 1.5


def _assert_within_bound(ratio: torch.Tensor, gamma, beta, what: str,
                         unit: str = "x the bound", tail: bool = True) -> None:
    """Every channel's ``ratio`` (its error in ``unit``) at most 1; with ``tail``, one channel
    of the layer may be in the bound's tail, up to ``TAIL_LIMIT`` (two, a chance of at most
    some 10^-4 a layer, are no tail but an error of the layer's)."""
    worst = int(ratio.argmax())
    over = int((ratio > 1.0).sum())
    limit = TAIL_LIMIT if tail and over == 1 else 1.0
    assert ratio[worst] <= limit, (
        f"{what}: channel {worst} (gamma {float(gamma[worst]):.4g}, "
        f"beta {float(beta[worst]):.4g}) at {float(ratio[worst]):.3g}{unit}, "
        f"{over} channel(s) over 1")


@one_backend  # the torch backend's helper, called directly
@settings(max_examples=200, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([torch.float32, torch.float64]),
       weight=st.floats(1e-3, 1e3), negative=st.booleans(), invstd=st.floats(1e-3, 1e3))
def test_rebuilt_scale_is_weight_times_invstd_to_one_rounding(dtype, weight, negative, invstd):
    """In place, ATen's fused backward (``torch_ops.batch_backward``) scales dx by ``unit *
    bn_weight`` (``torch_ops._rebuilt_scale``), exactly as the two are given: that product
    is ``weight * invstd`` to one rounding of the dtype (half an ulp, relative: 2^-24 in
    float32, 2^-53 in float64, and the float64 arithmetic's few roundings below the
    float32 one), not to two (unit's own rounding, which reaches every element of dx
    alike)."""
    w = torch.tensor([-weight if negative else weight], dtype=dtype)
    s = torch.tensor([invstd], dtype=dtype)
    unit, bn_weight = _rebuilt_scale(w, s)
    assert unit.dtype == bn_weight.dtype == dtype
    exact = Fraction(float(w)) * Fraction(float(s))
    got = Fraction(float(unit)) * Fraction(float(bn_weight))
    rounding = 2.0**-24 + 2.0**-50 if dtype == torch.float32 else 2.0**-53 * (1 + 2.0**-40)
    assert abs(got - exact) <= Fraction(rounding) * abs(exact)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1), (4, 4)]),
    data=st.data(),
)
def test_float32_input_gradient_within_three_times_batchnorms_error(activation, replicas,
                                                                   spatial, data):
    """In float32, in place, over generated layers (``bound_case``) on the whole simulated
    DataParallel batch, each channel's input gradient is within 3x nn.BatchNorm2d + the
    activation's error in float32 (or of half an ulp of its largest |dx|), both against
    float64."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data)
    x, dy = x.float(), dy.float()
    grads = _input_grads(x, dy, gamma, beta, activation, replicas,
                         (torch.float32, torch.float64))
    _, xhat_term = exact_input_gradient(x, dy, gamma, beta, activation,
                                        SLOPES.get(activation, 0.01))
    _assert_within_bound(_bound_ratios(*grads, xhat_term), gamma, beta,
                         f"{activation} x{replicas} {shape}")


def _smooth_derivative(activation: str, z):
    """act'(z) of a smooth activation, in mpmath at its working precision."""
    import mpmath

    if activation == "silu":
        sigmoid = 1 / (1 + mpmath.exp(-z))
        return sigmoid * (1 + z * (1 - sigmoid))
    if activation == "gelu":
        return mpmath.erfc(-z / mpmath.sqrt(2)) / 2 + z * mpmath.npdf(z)
    # gelu_tanh: z / 2 (1 + tanh(u)), u = sqrt(2 / pi) (z + 0.044715 z^3); 1 + tanh(u) =
    # 2 s(2u) and 1 - tanh(u)^2 = 4 s(2u) s(-2u), s the sigmoid, keep the tails' digits.
    k, c = mpmath.sqrt(2 / mpmath.pi), mpmath.mpf(0.044715)
    u = k * (z + c * z**3)
    up, down = 1 / (1 + mpmath.exp(-2 * u)), 1 / (1 + mpmath.exp(2 * u))
    return up + 2 * z * up * down * k * (1 + 3 * c * z * z)


def _exact_errors(grads: Sequence[torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
                  gamma: torch.Tensor, beta: torch.Tensor, activation: str
                  ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per channel, each of ``grads``' largest error against the exact input gradient of
    training-mode BatchNorm (eps 1e-5) + the activation, the exact gradient's largest |dx|
    and the size of its xhat term (``allowed_errors``), computed with ``REFERENCE_BITS``
    bits (mpmath)."""
    import mpmath

    slope = mpmath.mpf(SLOPES.get(activation, 0.01))
    errors = [torch.zeros(x.shape[1], dtype=torch.float64) for _ in grads]
    size = torch.zeros(x.shape[1], dtype=torch.float64)
    xhat_term = torch.zeros(x.shape[1], dtype=torch.float64)
    with mpmath.workprec(REFERENCE_BITS):
        for c in range(x.shape[1]):
            values = [mpmath.mpf(v) for v in x[:, c].flatten().tolist()]
            n = len(values)
            mean = mpmath.fsum(values) / n
            centred = [v - mean for v in values]
            invstd = 1 / mpmath.sqrt(mpmath.fsum(d * d for d in centred) / n + mpmath.mpf(1e-5))
            xhat = [d * invstd for d in centred]
            w, b = mpmath.mpf(float(gamma[c])), mpmath.mpf(float(beta[c]))
            dz = []
            for g, h in zip(dy[:, c].flatten().tolist(), xhat):
                z = w * h + b
                if activation in SMOOTH_ACTIVATIONS:
                    dz.append(g * _smooth_derivative(activation, z))
                elif z > 0 or activation == "identity":
                    dz.append(mpmath.mpf(g))
                elif activation == "relu":
                    dz.append(mpmath.mpf(0))
                elif activation == "leaky_relu":
                    dz.append(g * slope)
                else:  # elu
                    dz.append(g * slope * mpmath.exp(z))
            mean_dz = mpmath.fsum(dz) / n
            mean_dz_xhat = mpmath.fsum(d * h for d, h in zip(dz, xhat)) / n
            exact = [w * invstd * (d - mean_dz - h * mean_dz_xhat) for d, h in zip(dz, xhat)]
            size[c] = float(max(abs(e) for e in exact))
            xhat_term[c] = float(abs(w * invstd * mean_dz_xhat) * max(abs(h) for h in xhat))
            for grad, error in zip(grads, errors):
                got = grad[:, c].flatten().tolist()
                error[c] = float(max(abs(mpmath.mpf(g) - e) for g, e in zip(got, exact)))
    return errors, size, xhat_term


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu", "relu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1), (4, 4)]),
    data=st.data(),
)
def test_float64_input_gradient_within_three_times_batchnorms_error(activation, replicas,
                                                                   spatial, data):
    """In float64, over generated layers (``bound_case``, 3 to ``FEW`` values a channel) on
    the whole simulated DataParallel batch, each channel's input gradient is within 3x
    nn.BatchNorm2d + the activation's error in float64 (or of half an ulp of its largest
    |dx|), both against an exact reference: below ``MIN_FLOAT64_REBUILT_COUNT`` values the
    layer trains out of place and its input gradient computes in double-double
    (``kernels/double_double.py``)."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data, most=FEW)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,))
    assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation,
                         f"{activation} x{replicas} {shape}")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)
def test_float64_bound_out_of_place_below_the_rebuild(activation, replicas, spatial, data):
    """The float64 bound from ``MIN_OWN_PRECISION_COUNT`` to ``MIN_FLOAT64_REBUILT_COUNT`` - 1
    values a channel, where an in-place layer trains out of place in float64's own arithmetic:
    the statistics, invstd and the input gradient's coefficients each rounded once (the torch
    backend's ATen calls; Triton's float64 kernels in double-double), 48 channels a layer."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data,
                                           least=MIN_OWN_PRECISION_COUNT,
                                           most=MIN_FLOAT64_REBUILT_COUNT - 1,
                                           channels=SMOOTH_CHANNELS)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,))
    assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation,
                         f"{activation} x{replicas} {shape}")


def assert_float64_bound(ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor,
                         dy: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                         activation: str, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel of the float64 input gradient ``ours`` within the README's bound
    (``allowed_errors``) of ``theirs`` (nn.BatchNorm2d + the activation's), both against the
    exact one (``_exact_errors``). Returns, per channel, ours' largest error and the exact
    gradient's largest |dx|."""
    (our_error, their_error), size, xhat_term = _exact_errors((ours, theirs), x, dy, gamma,
                                                              beta, activation)
    allowed = allowed_errors(their_error.numpy(), size.numpy(), torch.float64,
                             xhat_term.numpy())
    _assert_within_bound(our_error / torch.from_numpy(allowed), gamma, beta, what)
    return our_error, size


# The layers of the create_graph tests: 2-4 simulated DataParallel replicas.
SYNCHRONISED_FEW_VALUE_CASES = dict(
    activation=st.sampled_from(["identity", "leaky_relu", "elu", "relu"]),
    replicas=st.integers(2, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu", "relu"]),
    replicas=st.lists(st.integers(2, 3), min_size=2, max_size=3),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)
def test_float64_bound_in_nested_dataparallel_calls(activation, replicas, spatial, data):
    """The float64 bound over 3 to ``FEW`` values a channel with the layer in nested simulated
    DataParallel calls (two or three deep, 2-3 replicas each; a chunk too small to split
    runs unsplit beside the nested calls): every replica's input gradient comes from the
    whole outer batch in double-double (``layer/whole_batch.py``), not from the nested
    merges' float64 gradients."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas[0], spatial, data, most=FEW)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,))
    assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation,
                         f"{activation} nested {replicas} {shape}")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(**SYNCHRONISED_FEW_VALUE_CASES)
def test_float64_bound_in_a_create_graph_backward(activation, replicas, spatial, data):
    """The float64 bound over 3 to ``FEW`` values a channel for the gradient a create_graph
    backward returns (a gradient penalty's first) over 2-4 simulated DataParallel replicas:
    its value in double-double, its graph autograd's (tests/test_edge_cases.py checks the
    second derivative against nn.BatchNorm2d's). (One replica's is nn.BatchNorm2d's own
    arithmetic there: ``BatchNormAct.backward``.)"""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data, most=FEW)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,),
                                create_graph=True)
    assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation,
                         f"{activation} x{replicas} create_graph {shape}")


def _grads_after_a_create_graph_backward(layer: SyncBatchNorm, wrapped: int | Sequence[int],
                                         x: torch.Tensor, dy: torch.Tensor,
                                         create_graph: bool = False
                                         ) -> tuple[torch.Tensor, ...]:
    """A gradient penalty's pattern, with ``layer`` in simulated DataParallel wrappers
    (``_wrapped``): after a create_graph backward of ``dy``, the input gradients of the loss
    ``(out * dy).sum()`` alone, of a penalty on the first gradient alone, and of the two
    together; ``create_graph``: of the loss's and the sum's backward passes."""
    leaf = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-place fallback's warning
        out = _wrapped(layer, wrapped)(leaf * 1)
    (first,) = torch.autograd.grad(out, leaf, dy, create_graph=True)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(x.shape[0]),
                          dtype=torch.float64)
    penalty = (first * weights).sum().square()
    (ours,) = torch.autograd.grad(out, leaf, dy, retain_graph=True, create_graph=create_graph)
    (penalty_grad,) = torch.autograd.grad(penalty, leaf, retain_graph=True)
    (both,) = torch.autograd.grad((out * dy).sum() + penalty, leaf, create_graph=create_graph)
    assert ours.requires_grad == both.requires_grad == create_graph
    return ours.detach(), penalty_grad, both.detach()


@pytest.mark.parametrize("create_graph", [False, True])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(**SYNCHRONISED_FEW_VALUE_CASES, nested=st.sampled_from([(), (), (2,), (3,), (2, 2)]))
def test_float64_bound_after_a_create_graph_backward(create_graph, activation, replicas,
                                                     spatial, data, nested):
    """A gradient penalty's pattern over 2-4 simulated DataParallel replicas and 3 to ``FEW``
    values a channel, in nested calls of ``nested`` replicas inside each of them: after a
    create_graph backward, a backward of the loss alone gives an input gradient within the
    float64 bound, and one of the loss plus a penalty on the first gradient gives the sum of
    the two apart (rounded once more): the penalty's part reaches the merges through the
    first backward's graph, and comes apart from the loss's, which is taken in double-double
    (``functional._ReadInGraph``, ``functional.MergeParts``, ``layer/whole_batch.py``).
    ``create_graph``: those backward passes are create_graph ones too (their values so; their
    graphs autograd's)."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data, most=FEW)
    layer = SyncBatchNorm(shape[1], activation=activation, slope=SLOPES.get(activation, 0.01),
                          dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(gamma)
        layer.bias.copy_(beta)
    wrapped = [replicas, *nested]
    ours, penalty_grad, both = _grads_after_a_create_graph_backward(layer, wrapped, x, dy,
                                                                    create_graph)
    theirs = _input_grads(x, dy, gamma, beta, activation, 1, (torch.float64,))[1]
    what = f"{activation} {wrapped} {shape}"
    assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation, what)
    # The penalty's part, computed in float64 apart and with the loss's, in another order:
    # their roundings differ by a few ulps of the channel's largest gradients.
    apart = ours + penalty_grad
    dims = [0, *range(2, x.dim())]
    scale = (ours.abs() + penalty_grad.abs()).amax(dims, keepdim=True)
    rounding = 64 * torch.finfo(torch.float64).eps * scale
    assert ((both - apart).abs() <= rounding).all(), (
        f"{what}: the loss and penalty's input gradient off the two apart by "
        f"{float((both - apart).abs().max()):.3g}")


# The values (channels times values a channel) of a generated layer over
# MIN_OWN_PRECISION_COUNT to FEW values a channel: over 2,000 channels at 38-44 values, where
# float64's own arithmetic exceeds the bound in about one channel of 1,500 at 38-40 values and
# one of 4,000 at 44-56, fewer at more values (the double-double gradient costs by the value).
MANY_VALUES = 96 * 1024
# The share of the bound above which a channel measured against the long double reference is
# measured again against mpmath's (``_long_double_ratios``).
SCREEN = 0.5


def many_channels_case(activation: str, replicas: int, spatial: tuple[int, int], data,
                       most: int = FEW):
    """``bound_case`` over ``MIN_OWN_PRECISION_COUNT`` to ``most`` values a channel (half the
    time up to 44, where float64's own arithmetic fails most often) with ``MANY_VALUES``
    values in all, gammas (|gamma| log-uniform in [0.1, 10], ELU [0.1, 1]) and betas (|beta| up to
    2 |gamma|; ELU's >= 0) drawn from a seed: too many for hypothesis to draw one by one."""
    per_sample = spatial[0] * spatial[1]
    fewest = max(replicas, -(-MIN_OWN_PRECISION_COUNT // per_sample))
    batch = data.draw(st.one_of(st.integers(fewest, max(fewest, 44 // per_sample)),
                                st.integers(fewest, most // per_sample)), label="batch")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    channels = MANY_VALUES // (batch * per_sample)
    largest = 1.0 if activation == "elu" else 10.0
    size = torch.empty(channels, dtype=torch.float64).uniform_(
        float(np.log(0.1)), float(np.log(largest)), generator=gen).exp()
    gamma = size * torch.randn(channels, generator=gen, dtype=torch.float64).sign()
    beta = size * torch.empty(channels, dtype=torch.float64).uniform_(-2.0, 2.0, generator=gen)
    if activation == "elu":
        beta = beta.abs()
    shape = (batch, channels, *spatial)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    return shape, gamma, beta, x, dy


def _long_double_ratios(ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor,
                        dy: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                        activation: str) -> torch.Tensor:
    """Per channel, ``ours``' error over the bound of ``assert_float64_bound``, against the
    exact gradient in numpy's long double (a 64-bit significand on x86: 11 bits beyond
    float64, of which a channel's cancellation, |dz| over |dx|, takes a few): the channels
    near the bound are measured again against mpmath's, thousands of channels too many."""
    wide = np.longdouble
    dims = (0, *range(2, x.dim()))
    view = (1, -1, *([1] * (x.dim() - 2)))
    values, grads = (t.numpy().astype(wide) for t in (x, dy))
    w, b = (t.double().numpy().astype(wide).reshape(view) for t in (gamma, beta))
    centred = values - values.mean(axis=dims, keepdims=True)
    invstd = 1 / np.sqrt((centred * centred).mean(axis=dims, keepdims=True) + wide(1e-5))
    xhat = centred * invstd
    z = w * xhat + b
    slope = wide(SLOPES.get(activation, 0.01))
    below = {"identity": np.ones_like(z), "relu": np.zeros_like(z),
             "leaky_relu": np.full_like(z, slope),
             "elu": slope * np.exp(np.minimum(z, 0))}[activation]
    dz = grads * np.where(z > 0, wide(1), below)
    m = (dz * xhat).mean(axis=dims, keepdims=True)
    exact = w * invstd * (dz - dz.mean(axis=dims, keepdims=True) - xhat * m)
    size = np.abs(exact).max(axis=dims)
    xhat_term = (np.abs(w * invstd * m) * np.abs(xhat).max(axis=dims, keepdims=True)).reshape(-1)

    def error(grad: torch.Tensor) -> np.ndarray:
        return np.abs(grad.numpy().astype(wide) - exact).max(axis=dims)

    allowed = allowed_errors(error(theirs), size, torch.float64, xhat_term)
    return torch.from_numpy((error(ours) / allowed).astype(np.float64))


@one_backend  # the gradient is ATen's double-double on every backend
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    path=st.sampled_from(["replicas", "nested", "create_graph"]),
    activation=st.sampled_from(["identity", "leaky_relu", "relu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1), (4, 4)]),
    data=st.data(),
)
def test_float64_bound_over_many_channels_below_the_rebuilt_count(path, activation, replicas,
                                                                  spatial, data):
    """The float64 bound over ``MIN_OWN_PRECISION_COUNT`` to ``FEW`` values a channel, where
    float64 trains out of place, in layers of thousands of channels (``MANY_VALUES``): float64's own
    arithmetic (its M2, invstd and coefficients rounding once each) exceeds it in single
    channels there, double-double's does not. Over 1-4 simulated DataParallel replicas
    (``replicas``), nested calls of 2 replicas in each of them (``nested``), or the value of
    a create_graph backward over 2-4 replicas (``create_graph``). Each channel is measured
    against a long double reference, and those near the bound (``SCREEN``) against mpmath's
    (``assert_float64_bound``). (ELU's double-double exp costs several times the rest of the
    gradient: its bound over these counts is the few-channel tests'.)"""
    if path != "replicas":
        replicas = max(replicas, 2)
    shape, gamma, beta, x, dy = many_channels_case(activation, replicas, spatial, data)
    wrapped = [replicas, 2] if path == "nested" else replicas
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, wrapped, (torch.float64,),
                                create_graph=path == "create_graph")
    near = (_long_double_ratios(ours, theirs, x, dy, gamma, beta, activation) > SCREEN)
    near = near.nonzero().flatten()
    if near.numel():
        assert_float64_bound(ours[:, near], theirs[:, near], x[:, near], dy[:, near],
                             gamma[near], beta[near], activation,
                             f"{activation} {path} {wrapped} {shape}")


@one_backend  # the gradient is ATen's double-double on every backend
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["leaky_relu", "relu"]),
    nesting=st.sampled_from([(2, 2), (3, 2), (2, 3)]),
    spatial=st.sampled_from([(1, 1), (1, 2), (2, 2)]),
    data=st.data(),
)
def test_float64_bound_over_many_channels_after_a_create_graph_backward_nested(
        activation, nesting, spatial, data):
    """``test_float64_bound_over_many_channels_below_the_rebuilt_count`` for a backward after
    a create_graph one (a gradient penalty's pattern, ``_grads_after_a_create_graph_backward``)
    with the layer in nested simulated DataParallel calls: the loss's input gradient is
    double-double's there too, the first backward's graph reading the nested merges'
    statistics apart (``functional.MergeParts``). Over ``MIN_OWN_PRECISION_COUNT`` to 44
    values a channel, where float64's own arithmetic exceeds the bound in about one channel
    of 1,500 (identity's more rarely)."""
    shape, gamma, beta, x, dy = many_channels_case(activation, nesting[0], spatial, data,
                                                   most=44)
    layer = SyncBatchNorm(shape[1], activation=activation, slope=SLOPES.get(activation, 0.01),
                          dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(gamma)
        layer.bias.copy_(beta)
    ours = _grads_after_a_create_graph_backward(layer, nesting, x, dy)[0]
    theirs = _input_grads(x, dy, gamma, beta, activation, 1, (torch.float64,))[1]
    near = (_long_double_ratios(ours, theirs, x, dy, gamma, beta, activation) > SCREEN)
    near = near.nonzero().flatten()
    if near.numel():
        assert_float64_bound(ours[:, near], theirs[:, near], x[:, near], dy[:, near],
                             gamma[near], beta[near], activation,
                             f"{activation} after create_graph {nesting} {shape}")


# The smooth activations whose float64 derivative is double-double through (silu's from exp,
# gelu_tanh's from sigmoids); gelu's normal CDF is float64's erfc, rounded once.
DOUBLE_DOUBLE_SLOPES = ("silu", "gelu_tanh")


@settings(max_examples=36, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(SMOOTH_ACTIVATIONS),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)
def test_float64_smooth_activations_within_three_times_batchnorms_error(activation, replicas,
                                                                       spatial, data):
    """silu, gelu and gelu_tanh (out of place) in float64 below ``MIN_FLOAT64_REBUILT_COUNT``
    values, their derivatives in double-double too: each channel within the bound of
    ``test_float64_input_gradient_within_three_times_batchnorms_error``. Many channels,
    |beta| up to 3 |gamma| (|z| up to about 56): ATen's float64 gelu' and gelu_tanh' lose
    their lower tails (1 + erf(z / sqrt 2) below z of about -3, 1 + tanh(u) below about -5),
    and a derivative at z's float64 rounding errs by act''(z) times its low part, beyond the
    bound where nn.BatchNorm2d's own roundings happen to cancel. Where act' is double-double
    through (``DOUBLE_DOUBLE_SLOPES``) the gradient errs by its final rounding alone: within
    an ulp of the channel's largest |dx|, tails included."""
    shape, gamma, beta, x, dy = bound_case(activation, replicas, spatial, data, most=8,
                                           channels=SMOOTH_CHANNELS, ratio=3.0)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,))
    what = f"{activation} x{replicas} {shape}"
    our_error, size = assert_float64_bound(ours, theirs, x, dy, gamma, beta, activation, what)
    if activation in DOUBLE_DOUBLE_SLOPES:
        float64 = torch.finfo(torch.float64)
        ulps = our_error / (float64.eps * size + float64.tiny)
        _assert_within_bound(ulps, gamma, beta, what, " ulps of its largest |dx|", tail=False)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["elu", *SMOOTH_ACTIVATIONS]),
    replicas=st.integers(1, 3),
    exponents=st.lists(st.integers(3, 300), min_size=BOUND_CHANNELS, max_size=BOUND_CHANNELS),
    signs=st.lists(st.sampled_from([-1.0, 1.0]), min_size=BOUND_CHANNELS,
                   max_size=BOUND_CHANNELS),
    data=st.data(),
)
def test_float64_far_saturated_activations_follow_batchnorm(activation, replicas, exponents,
                                                            signs, data):
    """A float64 layer below ``MIN_OWN_PRECISION_COUNT`` values whose biases put z far past
    its activation's bend (|beta| 1e3 to 1e300: exp's argument below float64's range, z^2
    and z^3 past it) gives nn.BatchNorm2d + the activation's input gradient, NaN exactly where
    that is (gelu_tanh's u'(z) overflows where z^2 does, times a slope of 0): the
    double-double exp and products of an overflow are float64's, not NaN."""
    shape, gamma, _, x, dy = bound_case(activation, replicas, (1, 1), data, most=FEW)
    beta = torch.tensor([sign * 10.0**exponent for sign, exponent in zip(signs, exponents)],
                        dtype=torch.float64)
    ours, theirs = _input_grads(x, dy, gamma, beta, activation, replicas, (torch.float64,))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, equal_nan=True,
                               msg=lambda m: f"{activation} x{replicas} {shape}: {m}")


def _off_centre_case(gen: torch.Generator, shape: tuple[int, ...], offset: torch.Tensor,
                     activation: str) -> tuple:
    """``(shape, x, dy, gamma, beta)``, float64, drawn from ``gen``: each channel's x about
    ``offset`` (given in standard deviations, its sign drawn here) standard deviations from 0
    at a scale of 0.1-10, |gamma| log-uniform in [0.1, 10] and |beta| up to |gamma| (ELU:
    |gamma| <= 1 and beta >= 0, as ``bound_case`` keeps it)."""
    channels = shape[1]
    scale = torch.empty(channels, dtype=torch.float64).uniform_(-2.3, 2.3, generator=gen).exp()
    offset = offset * torch.randn(channels, generator=gen, dtype=torch.float64).sign()
    x = ((torch.randn(shape, generator=gen, dtype=torch.float64) + offset.view(-1, 1, 1))
         * scale.view(-1, 1, 1))
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    largest = 1.0 if activation == "elu" else 10.0
    size = torch.empty(channels, dtype=torch.float64).uniform_(
        math.log(0.1), math.log(largest), generator=gen).exp()
    gamma = size * torch.randn(channels, generator=gen, dtype=torch.float64).sign()
    ratio = torch.empty(channels, dtype=torch.float64).uniform_(-1.0, 1.0, generator=gen)
    beta = size * (ratio.abs() if activation == "elu" else ratio)
    return shape, x, dy, gamma, beta


# Elements of the float64 inputs over thousands of values a channel: above one slab of the torch
# backend's walk (``torch_ops``), where a one-pass sum would take the statistics.
MANY_VALUE_ELEMENTS = 1 << 18


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    side=st.sampled_from([4, 8]),
    far=st.booleans(),
    data=st.data(),
)
def test_float64_bound_over_thousands_of_values_off_centre(activation, side, far, data):
    """The float64 bound (``_bound_ratios``' rule, against the long-double reference of
    benchmarks/few_values_precision.py) over 1024 to 8192 values a channel, in place, on
    inputs whose mean lies 1.2 to 1.9 standard deviations from 0, as a feature's often does
    (``far``: 10^2.5 to 10^4, where each slab's rounded mean costs M2 ulps unless its error
    joins the slabs' merge, ``torch_ops._float64_slab_stats``).

    Why these inputs. Over n values the input gradient's error is mostly invstd's relative
    error times dx, and a channel fails where ours exceeds 3x nn.BatchNorm2d's. Statistics
    taken in one pass as sums of ``x (x - K)`` around a shift K near the mean (one read of x)
    accumulate their terms' roundings, and the terms' ``K (x - K)`` parts, which cancel in
    the sum, grow those roundings with |K| / std: M2 then errs by many roundings where the
    centred passes' errs by a few, and with the mean over a standard deviation from 0 the
    bound fails in a few channels a hundred; on inputs centred near 0, in one channel in
    hundreds or thousands, where nn.BatchNorm2d's roundings happen to cancel. The torch
    backend's float64 M2 sums exact deviations' exact squares and its invstd rounds once
    (``torch_ops._float64_m2``, ``float64_invstd``)."""
    samples = data.draw(st.integers(1024 // side**2, min(256, 8192 // side**2)),
                        label="samples")
    count = samples * side * side
    channels = MANY_VALUE_ELEMENTS // count
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    offset = (10.0 ** torch.empty(channels, dtype=torch.float64).uniform_(2.5, 4.0, generator=gen)
              if far else
              torch.empty(channels, dtype=torch.float64).uniform_(1.2, 1.9, generator=gen))
    shape, x, dy, gamma, beta = _off_centre_case(gen, (samples, channels, side, side), offset,
                                                 activation)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation, SLOPES.get(activation, 0.01),
                                replicas=1)
    _assert_within_bound(ratios, gamma, beta, f"{activation} far={far} {shape}")


def _far_from_zero_case(data, decades: float, activation: str,
                        values: tuple[int, int] = (1024, 2048)):
    """A (samples, 2 BOUND_CHANNELS, 4, 4) float64 case of ``values`` (fewest, most) values a
    channel whose channels' means lie 10^(decades - 1/2) to 10^decades standard deviations
    from 0."""
    side = 4
    samples = data.draw(st.integers(-(-values[0] // side**2), values[1] // side**2),
                        label="samples")
    channels = BOUND_CHANNELS * 2
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    offset = 10.0 ** torch.empty(channels, dtype=torch.float64).uniform_(
        decades - 0.5, decades, generator=gen)
    return _off_centre_case(gen, (samples, channels, side, side), offset, activation)



def _assert_bound_far_from_zero(data, decades: float, activation: str, inplace: bool,
                                replicas: int | tuple[int, ...], dtype: torch.dtype) -> None:
    """The README bound on a ``_far_from_zero_case`` in ``dtype`` over ``replicas``
    simulated DataParallel replicas (a tuple: nested calls). Narrower than float64, elements
    whose z lies within its rounding of the kink are first moved off it (``off_kink``:
    there the slope is a draw of the roundings, nn.BatchNorm2d's too)."""
    shape, x, dy, gamma, beta = _far_from_zero_case(data, decades, activation)
    if dtype != torch.float64:
        x, dy, gamma, beta = (t.to(dtype) for t in (x, dy, gamma, beta))
        x = off_kink(x, gamma, beta, activation)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation, SLOPES.get(activation, 0.01),
                                replicas=replicas, inplace=inplace)
    _assert_within_bound(ratios, gamma, beta, f"{activation} inplace={inplace} {dtype} "
                         f"replicas {replicas} mean/std 1e{decades:.2g} {shape}")

@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    replicas=st.integers(1, 2),
    decades=st.floats(1.0, 4.0),
    data=st.data(),
)
def test_float64_bound_on_inputs_far_from_zero(activation, inplace, replicas, decades, data):
    """The float64 bound (``_bound_ratios``' rule, long-double reference) over 1024 to 2048
    values a channel, in place and out of place, on one or two simulated DataParallel
    replicas, on inputs whose mean lies 10 to 10^4 standard deviations from 0: a rounded
    float64 mean shifts every xhat of its channel by its error over the standard deviation
    (hundreds of ulps at 10^3), which the backward's sums carry unaveraged, as
    nn.BatchNorm2d's own mean does by other luck; and the merge's deviations of the replicas'
    rounded means cost M2 about as much. The layer normalises with the mean's error taken
    out (``functional._mean_offset``; merged, ``stats.chan_merge``)."""
    _assert_bound_far_from_zero(data, decades, activation, inplace, replicas, torch.float64)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    nesting=st.sampled_from([(2, 2), (2, 3), (3, 2)]),
    decades=st.floats(2.5, 4.0),
    data=st.data(),
)
def test_float64_bound_on_inputs_far_from_zero_through_nested_calls(activation, inplace,
                                                                    nesting, decades, data):
    """``test_float64_bound_on_inputs_far_from_zero`` with the layer in nested simulated
    DataParallel calls: each nested call's merged mean goes on to the outer merge with its
    error (``exchange.SubBatch``), and the replicas' backward takes the gap between their
    nested call's mean and the outer one exact (``functional._mean_gap``); either rounded
    shifts every element's gradient alike."""
    _assert_bound_far_from_zero(data, decades, activation, inplace, nesting, torch.float64)


def along_xhat(x: torch.Tensor, gen: torch.Generator, noise: float = 1.0) -> torch.Tensor:
    """An output gradient along x's normalised values, ``xhat + noise * N(0, 1)`` (as a
    squared loss on a layer's output gives in part; half along xhat at noise 1), drawn from
    ``gen``."""
    dims = [0, *range(2, x.dim())]
    centred = x - x.mean(dims, keepdim=True)
    xhat = centred / centred.square().mean(dims, keepdim=True).sqrt()
    return xhat + noise * torch.randn(x.shape, generator=gen, dtype=x.dtype)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    nesting=st.sampled_from([(2, 2), (2, 3), (3, 2)]),
    samples=st.integers(MIN_FLOAT64_REBUILT_COUNT // 16 + 1, 16),
    decades=st.floats(2.5, 4.0),
    data=st.data(),
)
def test_float64_bound_far_from_zero_with_gradients_along_xhat_through_nested_calls(
        activation, inplace, nesting, samples, decades, data):
    """``test_float64_bound_on_inputs_far_from_zero_through_nested_calls`` with an output
    gradient half along the normalised input (``along_xhat``) over 112 to 256 values a
    channel: ``sum(dz * xhat) / n``, and with it g_M2, is of the order of dz there (random
    dy: 1 / sqrt(n) of it), so an error in the gap between a nested call's mean and the
    outer one (each rounded by up to half an ulp of |mean|, hundreds to thousands of
    standard deviations) reaches every element of the channel at hundreds of ulps of the
    gradient. The replicas' backward takes the gap between the exact means
    (``functional._mean_gap``)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    offset = 10.0 ** torch.empty(BOUND_CHANNELS * 2, dtype=torch.float64).uniform_(
        decades - 0.5, decades, generator=gen)
    shape, x, _, gamma, beta = _off_centre_case(gen, (samples, BOUND_CHANNELS * 2, 4, 4),
                                                offset, activation)
    dy = along_xhat(x, gen)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation, SLOPES.get(activation, 0.01),
                                replicas=nesting, inplace=inplace)
    _assert_within_bound(ratios, gamma, beta, f"{activation} inplace={inplace} nested "
                         f"{nesting} mean/std 1e{decades:.2g} dy along xhat {shape}")


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    replicas=st.integers(1, 2),
    decades=st.floats(1.0, 4.0),
    data=st.data(),
)
def test_float32_bound_on_inputs_far_from_zero(activation, inplace, replicas, decades, data):
    """``test_float64_bound_on_inputs_far_from_zero`` in float32: the bound over 1024 to 2048
    values a channel, in place and out of place, on one or two simulated DataParallel
    replicas, on inputs whose mean lies 10 to 10^4 standard deviations from 0. A float32
    mean rounded once (as nn.BatchNorm2d's) still shifts every xhat of its channel by up to
    half its ulp over the standard deviation, hundreds of ulps of xhat at 10^3, and ELU's
    slope by as much: nn.BatchNorm2d's own rounding cancels it in some channels, and 3x
    its error then fails in one ELU channel in ten. Far from 0 the layer normalises with
    the mean's error taken out (``functional._mean_offset``, ``FAR_MEAN``; merged, from the
    float64 merged mean). Elements whose z lies within its rounding of the kink are moved
    off it (``off_kink``: there the slope is a draw of the roundings, nn.BatchNorm2d's
    too)."""
    _assert_bound_far_from_zero(data, decades, activation, inplace, replicas, torch.float32)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    nesting=st.sampled_from([(2, 2), (2, 3), (3, 2)]),
    decades=st.floats(1.0, 4.0),
    data=st.data(),
)
def test_float32_bound_on_inputs_far_from_zero_through_nested_calls(activation, inplace,
                                                                    nesting, decades, data):
    """``test_float32_bound_on_inputs_far_from_zero`` with the layer in nested simulated
    DataParallel calls: a nested call's merged float32 mean goes on to the outer merge with
    its rounding (``functional.MergeReplicas``), and the outer merge's float32 mean takes its
    own rounding out (``exchange._merged``)."""
    _assert_bound_far_from_zero(data, decades, activation, inplace, nesting, torch.float32)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    inplace=st.booleans(),
    replicas=st.integers(1, 2),
    side=st.sampled_from([1, 4, 8]),
    data=st.data(),
)
def test_float32_bound_over_hundreds_of_values(activation, inplace, replicas, side, data):
    """The bound in float32 over 64 to 1024 values a channel (above the counts kept out of
    place or widened), in place and out of place, on inputs within a standard deviation of
    0, one or two simulated DataParallel replicas. Every element of dx takes the per-channel
    coefficients ``w * invstd``, ``-w * invstd * mean(dz * xhat)`` and ``-w * invstd *
    mean(dz)``: each rounded once (float64's exact ``w * invstd``, then rounded to float32,
    ``backend.dx_coefs`` and the Triton kernel alike), not through float32 products."""
    samples = data.draw(st.integers(-(-64 // side**2), 1024 // side**2), label="samples")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    offset = torch.empty(BOUND_CHANNELS * 2, dtype=torch.float64).uniform_(0.0, 1.0,
                                                                           generator=gen)
    shape, x, dy, gamma, beta = _off_centre_case(gen, (samples, len(offset), side, side),
                                                 offset, activation)
    x, dy, gamma, beta = (t.float() for t in (x, dy, gamma, beta))
    x = off_kink(x, gamma, beta, activation)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation, SLOPES.get(activation, 0.01),
                                replicas=replicas, inplace=inplace)
    _assert_within_bound(ratios, gamma, beta, f"{activation} inplace={inplace} x{replicas} "
                         f"{shape}")


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(WIDE),
    noise=st.sampled_from([0.1, 1.0, None]),
    side=st.sampled_from([1, 4]),
    data=st.data(),
)
def test_bound_with_output_gradients_along_xhat(dtype, noise, side, data):
    """The bound with output gradients along the normalised input (``along_xhat``, noise 0.1 and
    1; None: independent of it) over 23 to 1024 values a channel, in place and out, 1-4
    replicas, on inputs within a standard deviation of 0, gammas and betas in the in-place
    range (|beta| < |gamma| / ``inplace_policy.MARGIN``). dx is then a difference of terms up
    to ten times its size, and the bound allows nn.BatchNorm2d's largest error in the layer
    relative to the terms' size (``allowed_errors``)."""
    activation = data.draw(st.sampled_from(["identity", "leaky_relu", "elu"]),
                           label="activation")
    replicas = data.draw(st.integers(1, 4), label="replicas")
    inplace = data.draw(st.booleans(), label="inplace")
    fewest = max(replicas, -(-MIN_REBUILT_COUNT // side**2))
    samples = data.draw(st.integers(fewest, 64), label="samples")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    _check_bound_along_xhat(dtype, noise, side, activation, replicas, inplace, samples, seed)


def test_bound_along_xhat_in_its_tail():
    """A layer of ``test_bound_with_output_gradients_along_xhat`` that has a channel in the
    bound's tail on the torch backend (in place, over 3 and 4 replicas; that test's draws
    with four times its examples found it): at most one channel over the bound, within
    ``TAIL_LIMIT``, on every backend."""
    for replicas in (3, 4):
        _check_bound_along_xhat(torch.float32, 1.0, 4, "leaky_relu", replicas, True, 44, 491)


def _check_bound_along_xhat(dtype: torch.dtype, noise: float | None, side: int,
                            activation: str, replicas: int, inplace: bool, samples: int,
                            seed: int) -> None:
    """One layer of ``test_bound_with_output_gradients_along_xhat``, its data from ``seed``."""
    wide = dtype == torch.float64
    gen = torch.Generator().manual_seed(seed)
    channels = BOUND_CHANNELS * 4
    largest = 1.0 if activation == "elu" else 10.0
    size = torch.empty(channels, dtype=torch.float64).uniform_(
        math.log(0.1), math.log(largest), generator=gen).exp()
    gamma = size * torch.randn(channels, generator=gen, dtype=torch.float64).sign()
    ratio = torch.empty(channels, dtype=torch.float64).uniform_(
        -1.0 / MARGIN, 1.0 / MARGIN, generator=gen) * 0.99
    beta = size * (ratio.abs() if activation == "elu" else ratio)
    shape = (samples, channels, side, side)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + 0.25) * 2
    dy = (torch.randn(shape, generator=gen, dtype=torch.float64) if noise is None
          else along_xhat(x, gen, noise))
    x, dy, gamma, beta = (t.to(dtype) for t in (x, dy, gamma, beta))
    if not wide:
        x = off_kink(x, gamma, beta, activation)
    ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation, SLOPES.get(activation, 0.01),
                                replicas=replicas, inplace=inplace)
    _assert_within_bound(ratios, gamma, beta, f"{dtype} {activation} inplace={inplace} "
                         f"x{replicas} dy noise {noise} {shape}")
