"""In place in half precision: the gradients of an in-place layer whose output is float16 or
bfloat16 (under ``torch.autocast``, in a model made half, or on a half input with float32
parameters) stay within 3x the error nn.BatchNorm2d + the activation make in the same
precision, against float64, over the whole range of gamma and beta.

Backward rebuilds the input from the half-precision output, dividing by gamma; it amplifies the
output's rounding by ``|beta| / |gamma|``. Channels where that is too much are kept aside
(``inplace_policy.REBUILD_LIMIT``), and ELU runs out of place in half precision
(``inplace_policy.stays_in_place``).

Each gradient's error is measured per channel: the largest error of its elements (dx), or the
error of the channel's value (dw, db). The bound is 3x the larger of nn.BatchNorm2d's own error
and half an ulp of the dtype at the gradient's size there: the largest |dx| of the channel, and
for the sums ``dw = sum(dz * xhat)`` and ``db = sum(dz)`` the root of the sum of their squared
terms (how large a sum of such terms is, whatever cancels in it). That floor is what rounding to
the dtype costs: torch's gradients carry it in a half model and not under autocast (float32
parameters, float32 sums), where a value that cancels to ~0 would otherwise allow no error.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from backends import each_backend, one_backend
from helpers.rebuild_error import allowed_errors
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SLOPES, activate
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.layer import inplace_policy
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend

C = 4
SHAPE = (4, C, 3, 3)
HALF = [torch.float16, torch.bfloat16]
# How the layer meets half precision: autocast (float32 parameters, half activations), a model
# made half (``.half()``), or a half input into float32 parameters without autocast.
MODES = ["autocast", "half model", "half input"]

# A gamma: zero, or a sign and a magnitude from 1e-3 to 10; beta: a multiple of |gamma| from 0
# to 1e3 (or beta alone where gamma is zero), either sign.
magnitudes = st.one_of(st.just(0.0), st.floats(1e-3, 10.0))
ratios = st.one_of(st.just(0.0), st.just(1.0), st.floats(1e-2, 1e3))
signs = st.sampled_from([1.0, -1.0])
channel = st.tuples(magnitudes, signs, ratios, signs)
# A channel rebuilt from its half-precision output: |beta| below |gamma|.
rebuilt = st.tuples(st.floats(0.1, 10.0), signs, st.floats(0.0, 0.7), signs)


def _parameters(channels):
    gamma = torch.tensor([m * s for m, s, _, _ in channels])
    beta = torch.tensor([(m or 1.0) * r * s for m, _, r, s in channels])
    return gamma, beta


def _reference(x, dy, gamma, beta, running, activation, slope, training):
    """float64 nn.BatchNorm2d + the activation: the gradients and, per channel, the sizes the
    floor takes (see the module docstring)."""
    norm = nn.BatchNorm2d(len(gamma), dtype=torch.float64).train(training)
    _load(norm, gamma, beta, running)
    leaf = x.double().requires_grad_()
    z = norm(leaf)
    z.retain_grad()
    activate(z, activation, slope).backward(dy.double())
    stats = (None, None) if training else (norm.running_mean, norm.running_var)
    xhat = F.batch_norm(leaf.detach(), *stats, training=training, eps=norm.eps)
    dz, dims = z.grad, [0, 2, 3]
    # The size of dx's xhat term (``allowed_errors``); evaluation has none.
    xhat_term = torch.zeros(len(gamma), dtype=torch.float64)
    if training:
        invstd = leaf.detach().var(dims, unbiased=False).add(norm.eps).rsqrt()
        xhat_term = (gamma.double().abs() * invstd * (dz * xhat).mean(dims).abs()
                     * xhat.abs().amax(dims))
    sizes = (leaf.grad.abs().amax(dims), (dz * xhat).square().sum(dims).sqrt(),
             dz.square().sum(dims).sqrt(), xhat_term)
    return (leaf.grad, norm.weight.grad, norm.bias.grad), sizes


def _load(norm, gamma, beta, running):
    with torch.no_grad():
        norm.weight.copy_(gamma)
        norm.bias.copy_(beta)
        norm.running_mean.copy_(running[0])
        norm.running_var.copy_(running[1])


def _gradients(norm, x, dy, mode, replicas, activation, slope):
    """The input, weight and bias gradients of ``norm`` (+ the activation, unless it fuses
    one) on ``x``, under ``mode``."""
    model = SimulatedDataParallel(norm, replicas) if replicas > 1 else norm
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=x.dtype, enabled=mode == "autocast"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-place fallback's warning, where it runs
        out = model(leaf * 1)
        if not isinstance(norm, SyncBatchNorm):
            out = activate(out, activation, slope)
    assert out.dtype == x.dtype
    out.backward(dy)
    return leaf.grad, norm.weight.grad, norm.bias.grad


class _Case:
    """A generated case: the input and output gradient in ``dtype``, gamma and beta from
    ``channels``, running statistics near the data's (evaluation with statistics far from
    it: below), the float64 reference, and an nn.BatchNorm2d twin and an in-place layer in
    the precision ``mode`` gives the parameters."""

    def __init__(self, dtype, mode, activation, training, channels, offset, seed) -> None:
        self.slope = SLOPES.get(activation, 0.01)
        self.gamma, self.beta = _parameters(channels)
        gen = torch.Generator().manual_seed(seed)
        self.x = (torch.randn(SHAPE, generator=gen) * 2 + offset).to(dtype)
        self.dy = torch.randn(SHAPE, generator=gen).to(dtype)
        self.running = (torch.randn(C, generator=gen) * 0.5 + offset,
                        torch.rand(C, generator=gen) * 6 + 1)
        self.reference, self.sizes = _reference(self.x, self.dy, self.gamma, self.beta,
                                                self.running, activation, self.slope, training)
        params = dtype if mode == "half model" else torch.float32
        self.twin = nn.BatchNorm2d(C).to(params).train(training)
        self.layer = SyncBatchNorm(C, activation=activation, slope=self.slope,
                                   inplace=True).to(params).train(training)
        self.what = (f"{dtype} {mode} {activation} {'training' if training else 'eval'}, "
                     f"gamma {self.gamma.tolist()}, beta {self.beta.tolist()}")


def _assert_within_bound(ours, torch_same, reference, sizes, dtype, what, summed=1,
                         sum_roundings=None):
    """Per channel: our error within the README's bound (``allowed_errors``: 3x the
    largest of torch's error, half an ulp at the size and, for dx, torch's typical relative
    error times its xhat term); ``summed``: the half-precision gradients summed into each
    parameter gradient (a half model's replicas each round theirs before DataParallel adds
    them, rounding again); ``sum_roundings``: the half ulps at dw's and db's size allowed
    instead."""
    for name, got, theirs, want, size in zip(("dx", "dw", "db"), ours, torch_same, reference,
                                             sizes):
        error = (got.double() - want).abs()
        torch_error = (theirs.double() - want).abs()
        roundings, xhat_term = 1, None
        if error.dim() > 1:  # dx: the largest error of each channel's elements
            error, torch_error = error.amax([0, 2, 3]), torch_error.amax([0, 2, 3])
            xhat_term = sizes[3].numpy()
        elif sum_roundings is not None:
            roundings = sum_roundings
        elif summed > 1:
            roundings = summed + 1
        assert torch.isfinite(error).all(), f"{what}: {name} is not finite: {got}"
        allowed = torch.from_numpy(allowed_errors(torch_error.numpy(), size.numpy(), dtype,
                                                  xhat_term, roundings))
        bad = error > allowed
        assert not bad.any(), (
            f"{what}: {name} off in channels {bad.nonzero().view(-1).tolist()}: error "
            f"{error[bad].tolist()} > allowed {allowed[bad].tolist()} (torch's "
            f"{torch_error[bad].tolist()}, size {size[bad].tolist()})")


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(HALF),
    mode=st.sampled_from(MODES),
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    replicas=st.sampled_from([1, 2]),
    training=st.sampled_from([True, True, False]),
    channels=st.lists(channel, min_size=C, max_size=C),
    offset=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**16),
)
def test_gradients_within_three_times_batchnorms_error(dtype, mode, activation, replicas,
                                                       training, channels, offset, seed):
    """Identity, leaky_relu and ELU in place, trained alone or under (simulated) DataParallel,
    or evaluated with running statistics: input, weight and bias gradients within 3x
    nn.BatchNorm2d + the activation's error in the same precision (see the module docstring),
    for gammas from 0 to 10 of either sign and |beta| / |gamma| from 0 to 1e3."""
    case = _Case(dtype, mode, activation, training, channels, offset, seed)
    for norm in (case.twin, case.layer):
        _load(norm, case.gamma, case.beta, case.running)
    torch_same = _gradients(case.twin, case.x, case.dy, mode, 1, activation, case.slope)
    ours = _gradients(case.layer, case.x, case.dy, mode, replicas, activation, case.slope)
    _assert_within_bound(ours, torch_same, case.reference, case.sizes, dtype,
                         f"x{replicas} {case.what}", replicas if mode == "half model" else 1)


@one_backend  # compiled, the layer is its formula in ATen ops
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(HALF),
    mode=st.sampled_from(MODES),
    activation=st.sampled_from(["identity", "leaky_relu"]),
    training=st.sampled_from([True, True, False]),
    channels=st.tuples(channel, rebuilt, rebuilt, rebuilt),
    offset=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**16),
)
def test_compiled_gradients_within_three_times_batchnorms_error(dtype, mode, activation,
                                                                training, channels, offset,
                                                                seed):
    """As above for a layer under ``torch.compile``, at its second step, which keeps for
    backward only the output and the input of the channels counted after the first: one
    channel of any gamma and beta, three rebuilt from the output (ELU in half precision runs
    out of place, compiled or not)."""
    case = _Case(dtype, mode, activation, training, channels, offset, seed)
    layer = case.layer
    leaf = _compiled_steps(layer, case.gamma, case.beta, case.running, case.x, case.dy,
                           mode == "autocast")
    # One channel kept aside at most: the first, where it is small (the hook counts against
    # the running variance the step left).
    limit = inplace_policy.gamma_limit(with_margin=True)
    spread = inplace_policy.running_spread(layer._running_of(layer.running_var))
    kept_aside = inplace_policy.small_gamma_mask(case.gamma, case.beta, limit, spread)[0]
    assert layer._compiled_keep_aside == int(kept_aside)
    _load(case.twin, case.gamma, case.beta, case.running)
    torch_same = _gradients(case.twin, case.x, case.dy, mode, 1, activation, case.slope)
    _assert_within_bound((leaf.grad, layer.weight.grad, layer.bias.grad), torch_same,
                         case.reference, case.sizes, dtype, f"compiled {case.what}")


def _compiled_steps(layer, gamma, beta, running, x, dy, autocast):
    """Two steps of ``layer`` under ``torch.compile`` (the first counts the channels kept
    aside), each from ``gamma``, ``beta`` and ``running``: the second step's input leaf."""
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    for _ in range(2):
        _load(layer, gamma, beta, running)
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=x.dtype, enabled=autocast):
            out = compiled(leaf * 1)
        assert out.dtype == x.dtype
        out.backward(dy)
    return leaf


@pytest.mark.parametrize("dtype", HALF)
def test_elu_runs_out_of_place_in_half_precision(dtype):
    """ELU's inverse cannot rebuild a saturated half-precision output (z = log1p(y / alpha)
    amplifies y's rounding by exp(-z)): an in-place ELU layer computes out of place on half
    inputs, under autocast or not, as ``inplace=False`` does, and in place again on float32."""
    gen = torch.Generator().manual_seed(3)
    layer = SyncBatchNorm(C, activation="elu", slope=0.7, inplace=True)
    twin = SyncBatchNorm(C, activation="elu", slope=0.7, inplace=False)
    for norm in (layer, twin):
        _load(norm, torch.tensor([4.0, 1.0, -2.0, 0.5]), torch.tensor([-3.0, 0.0, 1.0, -1.0]),
              (torch.zeros(C), torch.ones(C)))
    x = (torch.randn(SHAPE, generator=gen) * 3).to(dtype)
    dy = torch.randn(SHAPE, generator=gen).to(dtype)
    for autocast in (True, False):
        results = []
        for norm in (layer, twin):
            h = x.clone().requires_grad_() * 1
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                out = norm(h)
            assert out.data_ptr() != h.data_ptr()
            out.backward(dy)
            results.append((out, norm.weight.grad.clone(), norm.bias.grad.clone()))
            norm.zero_grad()
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    h = torch.randn(SHAPE, generator=gen) * 1
    assert layer(h).data_ptr() == h.data_ptr()


@one_backend
@pytest.mark.parametrize("dtype", HALF)
def test_a_layer_switching_dtype_keeps_the_same_channels_aside(dtype):
    """A single-replica layer keeps aside the channels of |beta| > |gamma| in every dtype of
    the call (the rebuild's error is in units of the output's rounding, whatever its dtype):
    float32, then half precision (autocast between convolutions), then float32 again."""
    layer = SyncBatchNorm(C, activation="leaky_relu", inplace=True)
    _load(layer, torch.ones(C), torch.tensor([0.0, 10.0, 0.5, -10.0]),
          (torch.zeros(C), torch.ones(C)))
    channels = layer._channels_aside
    for input_dtype in (torch.float32, dtype, torch.float32):
        layer(torch.randn(SHAPE).to(input_dtype) * 1).float().sum().backward()
        assert channels.known == (1, 3)


@pytest.mark.parametrize("activation", ["identity", "leaky_relu"])
def test_evaluation_whose_float16_output_overflows(activation):
    """Evaluation with running statistics far from the data: nn.BatchNorm2d's float16 output
    overflows to inf there, and so does ours. The input gradient is w * invstd * dz, which
    needs no rebuilt input: finite as torch's, within 3x its error. The weight gradient of a
    channel rebuilt from an infinite output needs the input the output lost: it is not finite
    (never a finite wrong value); the other channels' are torch's, channel 0's too: a running
    variance under eps makes it near-constant as the layer sees it, |beta| above |gamma| s
    (s = sqrt(var / (var + eps)) = 0.3), and it keeps its input aside."""
    slope = SLOPES.get(activation, 0.01)
    gen = torch.Generator().manual_seed(11)
    gamma, beta = torch.tensor([2.0, -1.5, 1.0, 0.5]), torch.tensor([0.5, 0.0, -0.2, 0.1])
    # Channels 0 and 1: variance 1e-6 (invstd 302 with eps) against data of spread 100: |z|
    # past float16's 65504.
    running = (torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([1e-6, 1e-6, 1.0, 2.0]))
    x = (torch.randn(SHAPE, generator=gen) * 100).to(torch.float16)
    dy = torch.randn(SHAPE, generator=gen).to(torch.float16)
    twin = nn.BatchNorm2d(C).eval()
    layer = SyncBatchNorm(C, activation=activation, slope=slope, inplace=True).eval()
    for norm in (twin, layer):
        _load(norm, gamma, beta, running)
    reference, sizes = _reference(x, dy, gamma, beta, running, activation, slope, False)
    torch_same = _gradients(twin, x, dy, "autocast", 1, activation, slope)
    ours = _gradients(layer, x, dy, "autocast", 1, activation, slope)
    assert torch_same[0].isfinite().all() and torch_same[1].isfinite().all()
    with torch.autocast("cpu", dtype=torch.float16):
        out = layer(x.clone())
    assert out.isinf().flatten(2).any(2).any(0).tolist() == [True, True, False, False]
    assert layer._channels_aside.known == (0,)
    assert not ours[1][1].isfinite()
    kept = [0, 2, 3]
    _assert_within_bound((ours[0], ours[1][kept], ours[2]),
                         (torch_same[0], torch_same[1][kept], torch_same[2]),
                         (reference[0], reference[1][kept], reference[2]),
                         (sizes[0], sizes[1][kept], sizes[2], sizes[3]), torch.float16,
                         f"{activation} evaluation overflowing float16")


def _failure_chance(count: int, B: float) -> float:
    """``inplace_policy.rebuilds_from_count``'s chance that a rebuilt channel of ``count``
    values exceeds the bound, of which the rebuild has ``B`` shares: I(1 - c*; (n - 2) / 2,
    1 / 2), integrated here (Simpson's rule in the variable v = sqrt(1 - s), which removes
    the density's pole at s = 1)."""
    from encoding_syncbn.layer.inplace_policy import REBUILD_LIMIT as rho

    n, a = count, (count - 2) / 2
    c_star = (B**2 - (1 + rho) ** 2 / (3 * n)) / (B**2 + (1 + rho) ** 2)
    # With s = 1 - v^2: integral of s^(a-1) (1-s)^(-1/2) ds from 0 to 1 - c* is
    # integral of 2 (1 - v^2)^(a-1) dv from sqrt(c*) to 1.
    lo, steps = math.sqrt(c_star), 20000
    h = (1 - lo) / steps
    f = [2 * (1 - (lo + i * h) ** 2) ** (a - 1) for i in range(steps + 1)]
    integral = h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    log_beta = math.lgamma(a) + math.lgamma(0.5) - math.lgamma(a + 0.5)
    return integral / math.exp(log_beta)


@one_backend
def test_fewest_values_rebuilt_follows_from_the_error_analysis():
    """``MIN_REBUILT_COUNT`` is the smallest count whose chance of exceeding the bound (the
    analysis of ``inplace_policy.rebuilds_from_count``) is below the accepted one, and that
    chance falls with the count; ``MIN_OWN_PRECISION_COUNT`` the same for a rebuild left
    one share of the bound fewer (its arithmetic as fine as the output's), and
    ``MIN_FLOAT64_REBUILT_COUNT`` for one left two fewer (float64's coefficients round too)."""
    from encoding_syncbn.layer.inplace_policy import (
        ACCEPTED_FAILURE_CHANCE,
        GRADIENT_ERROR_BOUND,
        MIN_FLOAT64_REBUILT_COUNT,
        MIN_OWN_PRECISION_COUNT,
        MIN_REBUILT_COUNT,
    )

    for fewest, shares in ((MIN_REBUILT_COUNT, GRADIENT_ERROR_BOUND),
                           (MIN_OWN_PRECISION_COUNT, GRADIENT_ERROR_BOUND - 1),
                           (MIN_FLOAT64_REBUILT_COUNT, GRADIENT_ERROR_BOUND - 2)):
        chances = [_failure_chance(n, shares) for n in range(4, fewest + 1)]
        assert all(a > b for a, b in zip(chances, chances[1:]))
        assert chances[-2] > ACCEPTED_FAILURE_CHANCE >= chances[-1]
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"fewer than {MIN_REBUILT_COUNT} values a channel" in readme


# Channels of the few-values test: the rebuild's failures are a chance per channel.
FEW_VALUES_CHANNELS = 16


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(HALF),
    mode=st.sampled_from(MODES),
    activation=st.sampled_from(["identity", "leaky_relu"]),
    replicas=st.integers(1, 4),
    spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
    data=st.data(),
)
def test_few_values_a_channel_within_three_times_batchnorms_error(dtype, mode, activation,
                                                                  replicas, spatial, data):
    """With 3 to 64 values a channel over the whole (simulated DataParallel) batch, as an
    (N, C, 1, 1) pooling branch has, in-place gradients stay within 3x nn.BatchNorm2d's
    error: a channel whose rebuilt input loses too much to the output's rounding when few
    values average it out trains out of place (``inplace_policy.rebuilds_from_count``); from
    ``MIN_REBUILT_COUNT`` values on the layer stays in place. Gammas and betas on both sides
    of the limit a channel is rebuilt at (|beta| up to 1e3 |gamma|)."""
    from encoding_syncbn.layer.inplace_policy import MIN_REBUILT_COUNT

    per_sample = spatial[0] * spatial[1]
    fewest = max(replicas, -(-3 // per_sample))
    # Few values a channel (where the rebuild fails) as often as the rest of the range.
    batch = data.draw(st.one_of(st.integers(fewest, max(fewest, 8 // per_sample)),
                                st.integers(fewest, 64 // per_sample)), label="batch")
    channels = FEW_VALUES_CHANNELS
    magnitudes_ = data.draw(st.lists(st.floats(1e-2, 10.0), min_size=channels,
                                     max_size=channels))
    ratios_ = data.draw(st.lists(st.one_of(st.floats(-0.99, 0.99), st.floats(1.5, 1e3),
                                           st.floats(-1e3, -1.5)),
                                 min_size=channels, max_size=channels))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    shape = (batch, channels, *spatial)
    count = batch * per_sample
    slope = SLOPES.get(activation, 0.01)
    params = dtype if mode == "half model" else torch.float32
    gamma = (torch.tensor(magnitudes_) * torch.randn(channels, generator=gen).sign()).to(params)
    beta = (gamma.abs().float() * torch.tensor(ratios_)).to(params)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    no_running = (torch.zeros(channels), torch.ones(channels))
    # The reference holds the parameters as the layers do (rounded in a half model).
    reference, sizes = _reference(x, dy, gamma.float(), beta.float(), no_running, activation,
                                  slope, True)
    twin = nn.BatchNorm2d(channels).to(params)
    layer = SyncBatchNorm(channels, activation=activation, slope=slope, inplace=True).to(params)
    for norm in (twin, layer):
        _load(norm, gamma, beta, no_running)
    torch_same = _gradients(twin, x, dy, mode, 1, activation, slope)
    ours = _gradients(layer, x, dy, mode, replicas, activation, slope)
    _assert_within_bound(ours, torch_same, reference, sizes, dtype,
                         f"{dtype} {mode} {activation} x{replicas} {shape}, gamma "
                         f"{gamma.tolist()}, beta {beta.tolist()}",
                         replicas if mode == "half model" else 1)
    h = x.clone() * 1
    with torch.autocast("cpu", dtype=dtype, enabled=mode == "autocast"):
        out = layer(h)
    assert (out.data_ptr() == h.data_ptr()) == (count >= MIN_REBUILT_COUNT)


@pytest.mark.parametrize("count", [8, 32])
def test_checkpoint_recomputes_a_few_values_call_as_it_ran(count):
    """Under checkpoint, a synchronised half-precision call is recomputed in place exactly
    where it ran in place: with too few values a channel over the whole batch (here 8, over
    2 replicas of 4) it ran out of place, and so does its recomputation, which hands backward
    the input, not the output. Gradients as without checkpoint."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            torch.manual_seed(4)
            self.fc = nn.Linear(6, C)
            self.bn = SyncBatchNorm(C, activation="leaky_relu", inplace=True)
            self.checkpointed = checkpointed

        def forward(self, x):
            block = lambda h: self.bn(self.fc(h))  # noqa: E731
            return checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)

    x = torch.randn(count, 6, generator=torch.Generator().manual_seed(5))
    grads = []
    for checkpointed in (True, False):
        model = Block(checkpointed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = SimulatedDataParallel(model, 2)(x)
        out.float().square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
