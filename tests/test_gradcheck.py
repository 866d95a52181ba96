"""gradcheck (float64) of the autograd Functions, alone and composed as the layer uses them."""

from __future__ import annotations

import pytest
import torch

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.functional import (
    ActConfig,
    batch_norm_act,
    normalize_with,
    synced_batch_norm_act,
)
from encoding_syncbn.stats import merge_stats
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = pytest.mark.usefixtures("each_backend")


@pytest.fixture(autouse=True)
def gradcheck(each_backend, monkeypatch):
    """Full gradcheck on ATen; Triton's interpreter is too slow for a full Jacobian, so there
    gradcheck's fast mode checks random projections of it instead."""
    full = torch.autograd.gradcheck
    monkeypatch.setattr(torch.autograd, "gradcheck",
                        lambda *a, **k: full(*a, fast_mode=each_backend == "triton", **k))


MODES = [("none", False), ("relu", False), ("leaky_relu", True), ("leaky_relu", False),
         ("elu", True), ("elu", False), ("identity", True)]


def inputs(shape=(4, 3, 5)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
    # Negative and small-but-invertible gammas, and one that must be kept aside (zero).
    w = torch.tensor([1.3, -0.6, 0.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.2, -0.1, 0.4], dtype=torch.float64, requires_grad=True)
    return x, w, b


@pytest.mark.parametrize("activation,inplace", MODES)
def test_batch_norm_act(activation, inplace):
    config = ActConfig(activation, 0.3, inplace)
    x, w, b = inputs()
    # clone: gradcheck's inputs are leaves, which an in-place Function may not overwrite.
    assert torch.autograd.gradcheck(
        lambda x, w, b: batch_norm_act(x.clone(), w, b, 1e-3, config)[0], (x, w, b)
    )


@pytest.mark.parametrize("activation,inplace", MODES)
def test_norm_act_with_given_statistics(activation, inplace):
    config = ActConfig(activation, 0.3, inplace)
    x, w, b = inputs()
    mean = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
    invstd = torch.tensor([1.1, 0.7, 2.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, m, s, w, b: normalize_with(x.clone(), m, s, w, b, config),
        (x, mean, invstd, w, b),
    )


def test_merge_stats():
    gen = torch.Generator().manual_seed(1)
    means = torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    m2s = (torch.rand(3, 4, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    counts = torch.tensor([2.0, 7.0, 0.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda m, q: merge_stats(m, q, counts, 1e-3), (means, m2s))


@pytest.mark.parametrize("activation,inplace", MODES)
def test_local_stats_merge_and_norm_act_composed(activation, inplace):
    """The synchronised path with one participant: LocalStats -> MergeStats -> NormAct."""
    config = ActConfig(activation, 0.3, inplace)

    def exchange(mean, m2, count):
        counts = torch.tensor([count], dtype=torch.float64)
        merged_mean, _, invstd = merge_stats(mean[None], m2[None], counts, 1e-3)
        return merged_mean, invstd

    x, w, b = inputs()
    assert torch.autograd.gradcheck(
        lambda x, w, b: synced_batch_norm_act(x.clone(), w, b, config, exchange), (x, w, b)
    )


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
def test_layer_across_simulated_replicas(activation):
    """Gradients that cross replicas through the master's merge (3 uneven chunks)."""
    layer = SyncBatchNorm(3, activation=activation, slope=0.3, eps=1e-3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.3, -0.6, 0.0]))
    model = SimulatedDataParallel(layer, 3)
    x = torch.randn(7, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: model(x * 1), (x,))
