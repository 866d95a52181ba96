"""Calls under ``torch.inference_mode`` and ``torch.no_grad`` between training calls (a
validation pass between epochs): every call, and every later one, computes what
nn.BatchNorm2d + the activation compute in float64 (outputs, gradients, running statistics),
in place with channels kept aside (zero and small gammas) and out of place, on a layer that
lived through the earlier calls and on one made afresh (process-wide caches outlive layers).
"""

from __future__ import annotations

import pytest
import torch
from backends import each_backend, one_backend
from hypothesis import example, given, settings
from hypothesis import strategies as st
from merge import merge_stats
from reference import SLOPES, activate
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.layer import inplace_policy
from encoding_syncbn.sync import stats
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-10}
C = 4
# Zero, and below, at and above the in-place layer's keep-aside limit (1e-3 * max(1, |b|)).
_GAMMAS = [0.0, 5e-4, -1e-3, 2e-3, 1.5, -0.7]
_BIASES = [0.0, 0.5, -1.0]
_MODES = [("identity", True), ("leaky_relu", True), ("elu", True), ("leaky_relu", False),
          ("none", False), ("relu", False)]
# How a call runs: its module mode, and the grad mode around it ("grad": with a backward).
_CALLS = [(training, grad) for training in (True, False)
          for grad in ("grad", "no_grad", "inference")]


def _step(layer, twin, x, dy, training, grad, activation, slope, replicas, what):
    """One call of the layer and of its float64 twin, compared."""
    layer.train(training)
    twin.train(training)
    layer.zero_grad()
    twin.zero_grad()
    runner = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
    if grad == "grad":
        leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = runner(leaf * 1)  # a non-leaf: in place, the layer overwrites it
        expected = activate(twin(ref_leaf), activation, slope)
        out.backward(dy)
        expected.backward(dy)
        pairs = [("input grad", leaf.grad, ref_leaf.grad),
                 ("weight grad", layer.weight.grad, twin.weight.grad),
                 ("bias grad", layer.bias.grad, twin.bias.grad)]
    else:
        context = torch.no_grad() if grad == "no_grad" else torch.inference_mode()
        with context:
            out = runner(x.clone())
            expected = activate(twin(x.clone()), activation, slope)
        pairs = []
    pairs += [("output", out, expected), ("running_mean", layer.running_mean, twin.running_mean),
              ("running_var", layer.running_var, twin.running_var)]
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")
    assert layer.num_batches_tracked.item() == twin.num_batches_tracked.item(), what


def _fresh(layer: SyncBatchNorm) -> SyncBatchNorm:
    """A new layer with ``layer``'s options and state."""
    made = SyncBatchNorm(C, activation=layer.activation, slope=layer.slope,
                         inplace=layer.inplace, momentum=layer.momentum, dtype=DT)
    made.load_state_dict(layer.state_dict())
    return made


# An input made under inference_mode and given to an in-place layer outside it is computed out
# of place, with a warning (once per layer); these sequences make such inputs.
@pytest.mark.filterwarnings("ignore:.*cannot be overwritten; computing out of place:UserWarning")
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    mode=st.sampled_from(_MODES),
    momentum=st.sampled_from([0.1, None]),
    replicas=st.sampled_from([1, 1, 2]),
    calls=st.lists(st.tuples(st.sampled_from(_CALLS), st.booleans()), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
)
# The report's case: a validation pass under inference_mode, then training, in place with a
# zero gamma, on the same layer and on a new one.
@example(mode=("leaky_relu", True), momentum=0.1, replicas=1,
         calls=[((False, "inference"), False), ((True, "grad"), False),
                ((True, "inference"), False), ((True, "grad"), True)], seed=1)
def test_call_sequences_match_batchnorm(mode, momentum, replicas, calls, seed):
    """Generated sequences of training and evaluation calls, each with a backward, under
    no_grad or under inference_mode, some on a layer made afresh from the last one's state;
    gammas include zero and values around the keep-aside limit."""
    activation, inplace = mode
    slope = SLOPES.get(activation, 0.01)
    gen = torch.Generator().manual_seed(seed)
    layer = SyncBatchNorm(C, activation=activation, slope=slope, inplace=inplace,
                          momentum=momentum, dtype=DT)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(_GAMMAS, dtype=DT)[
            torch.randint(len(_GAMMAS), (C,), generator=gen)])
        layer.bias.copy_(torch.tensor(_BIASES, dtype=DT)[
            torch.randint(len(_BIASES), (C,), generator=gen)])
    twin = nn.BatchNorm2d(C, momentum=momentum, dtype=DT)
    twin.load_state_dict(layer.state_dict())
    for i, ((training, grad), fresh) in enumerate(calls):
        if fresh:
            layer = _fresh(layer)
        x = torch.randn(4, C, 3, 2, generator=gen, dtype=DT) * 2 + 1
        dy = torch.randn(x.shape, generator=gen, dtype=DT)
        _step(layer, twin, x, dy, training, grad, activation, slope, replicas,
              f"call {i} ({'train' if training else 'eval'}, {grad}, fresh={fresh})")


@pytest.mark.parametrize("training", [True, False])
def test_training_after_an_inference_mode_call_with_a_channel_kept_aside(training):
    """The report's case, alone: one call under inference_mode of an in-place layer with a
    zero gamma, then training with autograd, on that layer and on a new one (before, both
    failed with "Inference tensors cannot be saved for backward": a process-wide cache held
    the kept-aside channels' index tensor made under inference mode)."""
    inplace_policy.channel_index.cache_clear()  # so that the inference_mode call builds the entry
    layer = SyncBatchNorm(C, activation="leaky_relu", slope=0.1, dtype=DT)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, 0.0, -0.7, 2.0]))
    twin = nn.BatchNorm2d(C, dtype=DT)
    twin.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, C, 3, 2, generator=gen, dtype=DT)
    dy = torch.randn(x.shape, generator=gen, dtype=DT)
    _step(layer, twin, x, dy, training, "inference", "leaky_relu", 0.1, 1, "inference call")
    _step(layer, twin, x, dy, True, "grad", "leaky_relu", 0.1, 1, "same layer")
    _step(_fresh(layer), twin, x, dy, True, "grad", "leaky_relu", 0.1, 1, "new layer")


@one_backend  # the merge of statistics, no backend op
def test_merge_after_inference_mode_differentiates_twice():
    """The merge's cached counts and constants, first built under inference_mode, serve a
    later merge differentiated twice (create_graph saves them for backward)."""
    gen = torch.Generator().manual_seed(0)
    means = [torch.randn(3, generator=gen, dtype=DT) for _ in range(2)]
    m2s = [torch.rand(3, generator=gen, dtype=DT) + 1 for _ in range(2)]
    counts = [4, 7]
    stats._counts_from_ints.cache_clear()  # built here, under inference_mode
    stats._constant.cache_clear()
    with torch.inference_mode():
        merge_stats(means, m2s, counts, 1e-5)
    leaves = [m.clone().requires_grad_() for m in means]
    mean = merge_stats(leaves, m2s, counts, 1e-5)[0]
    (grad,) = torch.autograd.grad(mean.square().sum(), leaves[0], create_graph=True)
    grad.sum().backward()
    # mean = (4 m_0 + 7 m_1) / 11: d/dm_0 of sum(mean^2) = 2 mean * 4/11, whose sum's
    # gradient is 2 * (4/11)^2 per channel.
    torch.testing.assert_close(leaves[0].grad, torch.full((3,), 2 * (4 / 11) ** 2, dtype=DT))


@pytest.mark.filterwarnings("ignore:.*cannot be overwritten; computing out of place:UserWarning")
@pytest.mark.parametrize("mode", _MODES[:4], ids=lambda m: f"{m[0]}-inplace={m[1]}")
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_inference_tensor_in_a_recorded_call_is_refused_first(mode, training):
    """An input made under inference_mode, given to the layer outside it while a parameter
    requires grad: autograd cannot save it for backward. Refused naming the layer, with the
    running statistics and the batch count as they were (nn.BatchNorm2d counts the batch
    before its refusal), at the key's first call and at a repeat call; with the parameters
    frozen, computed as nn.BatchNorm2d + the activation. (DataParallel's scatter hands its
    replicas new tensors: there the call computes, as nn.BatchNorm2d's.)"""
    activation, inplace = mode
    slope = SLOPES.get(activation, 0.01)
    layer = SyncBatchNorm(C, activation=activation, slope=slope, inplace=inplace,
                          dtype=DT).train(training)
    twin = nn.BatchNorm2d(C, dtype=DT).train(training)
    with torch.inference_mode():
        x = torch.randn(4, C, 3, 2, dtype=DT) + 2
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    layer(x.clone() * 1)  # the key's first call, in a recorded graph: its decisions kept
    twin(x.clone())
    for call in ("repeat", "first"):
        assert layer._call_memo is not None  # the first call's, kept through a refusal
        if call == "first":
            layer.eps = layer.eps  # an assignment: the decisions are taken afresh
            assert layer._call_memo is None
        state = {key: value.clone() for key, value in layer.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\).*inference tensor"):
            layer(x)
        for key, value in layer.state_dict().items():
            assert torch.equal(value, state[key]), (call, key)
    layer.requires_grad_(False)
    twin.requires_grad_(False)
    expected = activate(twin(x), activation, slope)
    torch.testing.assert_close(layer(x), expected, **TOL)
    assert before.keys() == layer.state_dict().keys()
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(layer.state_dict()[key], twin.state_dict()[key], **TOL)
