"""gradcheck (float64) of the autograd Functions, alone and composed as the layer uses them."""

from __future__ import annotations

import pytest
import torch
from backends import each_backend
from merge import merge_stats

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.activations import ActConfig
from encoding_syncbn.layer.functional import (
    NormAct,
    batch_norm_act,
    merge_replicas,
    replica_stats,
)
from encoding_syncbn.layer.inplace_policy import ChannelsAside
from encoding_syncbn.layer.modules import record_paths
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend


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
    config = ActConfig(activation, 0.3, inplace=inplace)
    # Enough values a channel to train in place (inplace_policy.rebuilds_from_count).
    x, w, b = inputs((8, 3, 5))
    # clone: gradcheck's inputs are leaves, which an in-place Function may not overwrite.
    assert torch.autograd.gradcheck(
        lambda x, w, b: batch_norm_act(x.clone(), w, b, 1e-3, config), (x, w, b)
    )


@pytest.mark.parametrize("activation,inplace", MODES)
def test_norm_act_with_given_statistics(activation, inplace):
    config = ActConfig(activation, 0.3, inplace=inplace)
    x, w, b = inputs()
    mean = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
    invstd = torch.tensor([1.1, 0.7, 2.0], dtype=torch.float64, requires_grad=True)
    kept = ChannelsAside().index(w, b) if inplace else None
    assert torch.autograd.gradcheck(
        lambda x, m, s, w, b: NormAct.apply(x.clone(), m, s, w, b, config, None, kept),
        (x, mean, invstd, w, b),
    )


def test_merge_stats():
    gen = torch.Generator().manual_seed(1)
    means = torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    m2s = (torch.rand(3, 4, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    counts = torch.tensor([2.0, 7.0, 0.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda m, q: merge_stats(m, q, counts, 1e-3), (means, m2s))


def synced_in_one_thread(x, w, b, config, split, other_ranks=None):
    """The synchronised path as the replicas run it, the replicas one after the other: each
    piece's statistics, the master's merge, then each piece's ``NormAct``. ``other_ranks``:
    constant ``(means, m2s, counts)`` of other processes, merged after the replicas (the
    cross-process step)."""
    pieces = [piece.clone() for piece in x.split(split)]  # clones: in place is allowed
    contributions = [replica_stats(piece) for piece in pieces]
    mean, m2, invstd, _ = merge_replicas(contributions, 1e-3)
    if other_ranks is not None:
        means, m2s, counts = other_ranks
        own_count = sum(c.count for c in contributions)
        mean, _, invstd = merge_stats([mean, *means], [m2, *m2s], [own_count, *counts], 1e-3)
    kept = ChannelsAside().index(w, b) if config.inplace else None
    return [NormAct.apply(c.x, mean, invstd, w, b, config, c.link, kept)
            for c in contributions]


@pytest.mark.parametrize("activation,inplace", MODES)
@pytest.mark.parametrize("split", [(4,), (2, 1, 1)], ids=str)
def test_merge_replicas_and_norm_act_composed(activation, inplace, split):
    """Each replica's input gradient, written by the merge's backward (one coefficient pair
    for all replicas)."""
    config = ActConfig(activation, 0.3, inplace=inplace)
    x, w, b = inputs()
    assert torch.autograd.gradcheck(
        lambda x, w, b: torch.cat(synced_in_one_thread(x, w, b, config, split)), (x, w, b)
    )


@pytest.mark.parametrize("activation,inplace", [("leaky_relu", True), ("elu", False)])
def test_merge_replicas_followed_by_a_cross_process_merge(activation, inplace):
    """The replicas normalise with statistics other than their merge's own: the
    ``saved.mean - mean`` term of the coefficients."""
    config = ActConfig(activation, 0.3, inplace=inplace)
    x, w, b = inputs()
    gen = torch.Generator().manual_seed(3)
    other_ranks = (
        list(torch.randn(2, 3, dtype=torch.float64, generator=gen)),
        list(torch.rand(2, 3, dtype=torch.float64, generator=gen) + 1.0),
        [6, 3],
    )
    assert torch.autograd.gradcheck(
        lambda x, w, b: torch.cat(synced_in_one_thread(x, w, b, config, (1, 3), other_ranks)),
        (x, w, b),
    )


def test_differentiating_one_replica_output_alone_is_a_clear_error():
    x, w, b = inputs()
    config = ActConfig("leaky_relu", 0.3, inplace=True)
    first, _ = synced_in_one_thread(x, w, b, config, (2, 2))
    with pytest.raises(RuntimeError, match="through every replica's output"):
        first.sum().backward()


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
def test_layer_across_simulated_replicas(activation):
    """Gradients that cross replicas through the master's merge (3 uneven chunks)."""
    layer = SyncBatchNorm(3, activation=activation, slope=0.3, eps=1e-3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.3, -0.6, 0.0]))
    model = SimulatedDataParallel(layer, 3)
    # Enough values a channel over the whole batch to train in place (rebuilds_from_count),
    # the merge's backward writing each replica's gradient (fewer take it in double-double).
    x = torch.randn(38, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: model(x * 1), (x,))


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
def test_layer_across_simulated_replicas_differentiates_twice_over_few_values(activation):
    """Float64 over fewer than ``MIN_FLOAT64_REBUILT_COUNT`` values a channel, across replicas:
    the create_graph backward's input gradient takes its value from double-double
    (``layer/whole_batch.py``) and its graph from autograd; its derivative is that graph's."""
    layer = SyncBatchNorm(3, activation=activation, slope=0.3, eps=1e-3,
                          inplace=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.3, -0.6, 0.2]))
    model = SimulatedDataParallel(layer, 2)
    x = torch.randn(5, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: model(x * 1), (x,))


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
@pytest.mark.parametrize("nested", [False, True])
def test_layer_across_simulated_replicas_differentiates_a_later_create_graph_backward(
        activation, nested):
    """After a create_graph backward, a second one of the loss plus a penalty on the first
    gradient (float64, few values a channel, across replicas; ``nested``: in 2 nested calls
    of 2): its value from double-double with the penalty's part read apart
    (``functional._ReadInGraph``, ``functional.MergeParts``), its graph autograd's; its
    derivative is that graph's."""
    layer = SyncBatchNorm(3, activation=activation, slope=0.3, eps=1e-3,
                          inplace=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.3, -0.6, 0.2]))
    model = SimulatedDataParallel(SimulatedDataParallel(layer, 2) if nested else layer, 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    dy, weights = (torch.randn(5, 3, 2, dtype=torch.float64, generator=gen) for _ in range(2))

    def second_gradient(x):
        out = model(x * 1)
        (first,) = torch.autograd.grad(out, x, dy, create_graph=True)
        penalty = (first * weights).sum().square()
        return torch.autograd.grad((out * dy).sum() + penalty, x, create_graph=True)[0]

    assert torch.autograd.gradcheck(second_gradient, (x,))



@pytest.mark.parametrize("activation,inplace", [("none", False), ("leaky_relu", True),
                                                ("elu", False)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("replicas", [1, 2])
def test_batched_gradients_are_refused_naming_the_layer(activation, inplace, training,
                                                        replicas):
    """A backward vmapped over output gradients (``is_grads_batched``, ``jacobian(vectorize=
    True)``) meets kernels and ``out=`` calls that take one at a time: an error naming the
    layer and the ways that work, never a number."""
    model = torch.nn.Sequential(
        SyncBatchNorm(3, activation=activation, inplace=inplace).double().train(training))
    record_paths(model)
    x = torch.randn(16, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    out = SimulatedDataParallel(model, replicas)(x * 1)
    grads = torch.randn(4, *x.shape, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(3\) at model path '0': .* one "
                                           r"output gradient at a time.*vectorize=False"):
        torch.autograd.grad(out, x, grads, is_grads_batched=True)
    if replicas == 1:
        with pytest.raises(RuntimeError, match="one output gradient at a time"):
            torch.autograd.functional.jacobian(lambda t: model(t * 1), x[:4].detach(),
                                               vectorize=True)
