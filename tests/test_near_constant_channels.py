"""In place, near-constant channels: a channel whose batch standard deviation is well under
sqrt(eps) has a normalised input of spread s = sqrt(var / (var + eps)) well under 1, and the
output ``y = gamma * xhat + beta`` holds xhat in its low digits only. Rebuilt from y, xhat errs
by y's rounding times ``|beta| / |gamma|``, which against xhat's own size is ``|beta| /
(|gamma| * s)``: the layer keeps aside the channels where that passes the limit
(``torch_ops.small_gamma``), so that the gradients stay within 3x nn.BatchNorm2d + the
activation's error in the same precision (the bound of ``test_half_precision``), for |beta| /
|gamma| the limit alone would rebuild at.

Each path chooses the channels from the spread it knows: a single replica's training call from
its batch (the check riding on the statistics), replicas and evaluation from the running
variance (here converged to the batch's), a compiled call from the running variance too.
"""

from __future__ import annotations

import pytest
import torch
from backends import each_backend, one_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SLOPES
from test_half_precision import (
    _assert_within_bound,
    _compiled_steps,
    _gradients,
    _load,
    _reference,
)
from torch import nn

from encoding_syncbn import SyncBatchNorm

pytestmark = each_backend

C = 4
# 128 values a channel: in place in every dtype (float64 would take 112).
SHAPE = (8, C, 4, 4)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Rebuilt by the |beta| / |gamma| limit alone: below 1.
ratios = st.floats(0.05, 0.7)
magnitudes = st.floats(0.1, 10.0)
signs = st.sampled_from([1.0, -1.0])


class _Case:
    """Channels of batch std ``std`` times 1, 1, 3 and 10 around a mean of a few stds; gamma
    and beta from ``gammas`` and ``ratios``; running statistics those of the batch (the
    unbiased variance, as a layer trained on such batches converges to)."""

    def __init__(self, dtype, activation, std, gammas, ratios_, seed) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.slope = SLOPES.get(activation, 0.01)
        self.gamma = torch.tensor([m * s for m, s in gammas])
        self.beta = torch.tensor([abs(g) * r * s for g, (r, s) in zip(self.gamma.tolist(),
                                                                        ratios_)])
        stds = std * torch.tensor([1.0, 1.0, 3.0, 10.0], dtype=torch.float64).view(1, C, 1, 1)
        means = (torch.rand(1, C, 1, 1, generator=gen, dtype=torch.float64) * 4 - 2) * stds
        self.x = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) * stds
                  + means).to(dtype)
        self.dy = torch.randn(SHAPE, generator=gen).to(dtype)
        var, mean = torch.var_mean(self.x.double(), (0, 2, 3))
        self.running = (mean.float(), var.float())
        self.mode = "half input" if dtype == torch.float32 else "autocast"
        # float32 in place sums dz * xhat in float32, where ATen's CPU BatchNorm backward sums
        # in float64: the sum's rounding besides the output's (half precision sums in float32,
        # well under its output's rounding).
        self.sum_roundings = 2 if dtype == torch.float32 else None
        self.what = (f"{dtype} {activation} std {std:g}, gamma {self.gamma.tolist()}, "
                     f"beta {self.beta.tolist()}")

    def norms(self, activation, training):
        twin = nn.BatchNorm2d(C).train(training)
        layer = SyncBatchNorm(C, activation=activation, slope=self.slope,
                              inplace=True).train(training)
        for norm in (twin, layer):
            _load(norm, self.gamma, self.beta, self.running)
        return twin, layer


cases = dict(dtype=st.sampled_from(DTYPES), activation=st.sampled_from(["identity", "leaky_relu"]),
             std=st.sampled_from([1e-4, 3e-4, 1e-3, 1.0]),
             gammas=st.lists(st.tuples(magnitudes, signs), min_size=C, max_size=C),
             ratios_=st.lists(st.tuples(ratios, signs), min_size=C, max_size=C),
             seed=st.integers(0, 2**16))


@settings(max_examples=24, deadline=None, derandomize=True)
@given(path=st.sampled_from(["alone", "replicas", "evaluation"]), **cases)
def test_near_constant_channels_within_three_times_batchnorms_error(path, dtype, activation,
                                                                    std, gammas, ratios_, seed):
    """Trained alone (the batch's spread), under (simulated) DataParallel or evaluated (the
    running variance's): input, weight and bias gradients within the bound."""
    case = _Case(dtype, activation, std, gammas, ratios_, seed)
    training = path != "evaluation"
    twin, layer = case.norms(activation, training)
    replicas = 2 if path == "replicas" else 1
    torch_same = _gradients(twin, case.x, case.dy, case.mode, 1, activation, case.slope)
    ours = _gradients(layer, case.x, case.dy, case.mode, replicas, activation, case.slope)
    reference, sizes = _reference(case.x, case.dy, case.gamma, case.beta, case.running,
                                  activation, case.slope, training)
    _assert_within_bound(ours, torch_same, reference, sizes, dtype, f"{path} {case.what}",
                         sum_roundings=case.sum_roundings)


@one_backend  # compiled, the layer is its formula in ATen ops
@settings(max_examples=5, deadline=None, derandomize=True)
@given(**cases)
def test_compiled_near_constant_channels_within_three_times_batchnorms_error(
        dtype, activation, std, gammas, ratios_, seed):
    """Under ``torch.compile``, at the second step, which keeps aside the channels counted
    after the first from the running variance."""
    case = _Case(dtype, activation, std, gammas, ratios_, seed)
    twin, layer = case.norms(activation, True)
    leaf = _compiled_steps(layer, case.gamma, case.beta, case.running, case.x, case.dy,
                           case.mode == "autocast")
    assert layer._compiled_keep_aside is not None  # counted: the second step rebuilt
    torch_same = _gradients(twin, case.x, case.dy, case.mode, 1, activation, case.slope)
    reference, sizes = _reference(case.x, case.dy, case.gamma, case.beta, case.running,
                                  activation, case.slope, True)
    _assert_within_bound((leaf.grad, layer.weight.grad, layer.bias.grad), torch_same,
                         reference, sizes, dtype, f"compiled {case.what}",
                         sum_roundings=case.sum_roundings)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_channels_rebuilt_at_a_batch_of_ordinary_spread(dtype):
    """The spread keeps aside only what it must: at a batch std of 1 the channels of |beta| /
    |gamma| under the limit are rebuilt, as before any spread is looked at."""
    layer = SyncBatchNorm(C, activation="leaky_relu", inplace=True)
    _load(layer, torch.ones(C), torch.tensor([0.0, 0.7, -0.7, 3.0]),
          (torch.zeros(C), torch.ones(C)))
    x = torch.randn(SHAPE).to(dtype)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        layer(x * 1).float().sum().backward()
    assert layer._channels_aside.known == (3,)
