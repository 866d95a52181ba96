"""A single-replica training step makes no device sync: no ``nonzero``, ``item``,
``_local_scalar_dense`` or ``tolist`` in forward or backward (on a GPU each would stall the
host until the device's queue drains, and forbid CUDA graph capture).

Checked on the CPU with a dispatch mode that fails on those ops, for each backend and each
activation, in place and not, with a zero gamma among the channels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from backends import each_backend, one_backend
from hypothesis import example, given, settings
from hypothesis import strategies as st
from late_copies import late_copies
from reference import activate
from torch.utils._python_dispatch import TorchDispatchMode

from encoding_syncbn import SyncBatchNorm

pytestmark = each_backend

DT = torch.float64
aten = torch.ops.aten


class NoHostSync(TorchDispatchMode):
    """Fails on every op that reads a device value back to the host."""

    FORBIDDEN = {aten.nonzero.default, aten._local_scalar_dense.default, aten.item.default,
                 aten.is_nonzero.default, aten.equal.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"{func} syncs with the device")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_tolist(monkeypatch):
    """``Tensor.tolist`` reads values without dispatching an op: refuse it by hand."""

    def refuse(self):
        raise AssertionError("tolist syncs with the device")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)


MODES = [("identity", True), ("leaky_relu", True), ("elu", True),
         ("none", False), ("leaky_relu", False), ("elu", False), ("relu", False)]


@pytest.mark.parametrize("activation,inplace", MODES)
def test_single_replica_training_step_has_no_host_sync(request, activation, inplace):
    layer = SyncBatchNorm(4, activation=activation, slope=0.3, inplace=inplace, momentum=None,
                          dtype=DT)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, 0.0, -0.7, 0.02]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.5]))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    running_mean, running_var = torch.zeros(4, dtype=DT), torch.ones(4, dtype=DT)
    calls = []

    def step(check):
        calls.append(check)
        cumulative = 1.0 / len(calls)  # momentum=None: the cumulative average
        x = torch.randn(6, 4, 3, 5, dtype=DT, generator=gen).requires_grad_()
        ref_x = x.detach().clone().requires_grad_()
        dy = torch.randn(6, 4, 3, 5, dtype=DT, generator=gen)
        w = layer.weight.detach().clone().requires_grad_()
        b = layer.bias.detach().clone().requires_grad_()
        expected = activate(
            F.batch_norm(ref_x, running_mean, running_var, w, b, True, cumulative, 1e-5),
            activation, 0.3,
        )
        expected.backward(dy)
        opt.zero_grad()
        with check:
            out = layer(x * 1)  # a non-leaf: the in-place layer overwrites it
            out.backward(dy)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-9, atol=1e-10)
        for got, want in ((layer.weight.grad, w.grad), (layer.bias.grad, b.grad)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        opt.step()

    step(contextlib.nullcontext())  # a layer's first call may wait once (on a GPU)
    request.getfixturevalue("no_tolist")
    for _ in range(2):
        step(NoHostSync())
    torch.testing.assert_close(layer.running_var, running_var, rtol=1e-9, atol=1e-10)


def test_a_gamma_that_becomes_zero_is_kept_aside_at_the_next_call():
    """The in-place layer's choice of channels follows the parameters (on the CPU the check's
    answer is there at once): a gamma zeroed between calls gets exact gradients."""
    layer = SyncBatchNorm(3, activation="leaky_relu", slope=0.2, dtype=DT)
    x = torch.randn(6, 3, 4, dtype=DT)  # enough values a channel to train in place
    layer(x * 1).sum().backward()
    with torch.no_grad():
        layer.weight[1] = 0.0
    layer.zero_grad()
    leaf = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    layer(leaf * 1).backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    F.leaky_relu(F.batch_norm(ref_x, None, None, w, b, True), 0.2).backward(dy)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(leaf.grad, ref_x.grad, rtol=1e-9, atol=1e-10)


# Gammas around the in-place limits, in units of max(1, |b|): zero, below, on and above 1e-3
# (rebuilt from the output only above it) and ChannelsAside' 16x margin; paired with
# biases of 0, 1 and 100. Plain gammas (0.3, 2) besides: scaled by 100 they would saturate ELU,
# whose inverse then loses the input (a documented limit of ELU in place).
LIMIT_FACTORS = [0.0, 0.5e-3, 1e-3, 1.5e-3, 16e-3, 17e-3, -1e-3, -20e-3]
PLAIN_GAMMAS = [0.3, -0.3, 2.0]


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
    channels=st.integers(1, 6),
    momentum=st.sampled_from([0.1, 1.0, None]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@example(activation="leaky_relu", channels=6, momentum=None, steps=3, seed=0)
def test_single_replica_steps_match_batchnorm(activation, channels, momentum, steps, seed):
    """The single-replica step's per-channel work (invstd, the running statistics, the counter
    and the in-place layer's choice of channels to keep aside: one Triton launch, or ATen calls)
    against nn.BatchNorm2d + the activation, step after step, gammas changing around the
    limits, float64."""
    slope = {"leaky_relu": 0.2, "elu": 0.7}.get(activation, 0.01)
    gen = torch.Generator().manual_seed(seed)
    layer = SyncBatchNorm(channels, activation=activation, slope=slope, momentum=momentum,
                          dtype=DT)
    ref = torch.nn.BatchNorm2d(channels, momentum=momentum, dtype=DT)
    for step in range(steps):
        pick = torch.randint(len(LIMIT_FACTORS) + len(PLAIN_GAMMAS), (channels,), generator=gen)
        bias = torch.tensor([0.0, 1.0, 100.0], dtype=DT)[torch.randint(3, (channels,),
                                                                      generator=gen)]
        scale = torch.cat([bias.abs().clamp_min(1.0).view(-1, 1).expand(-1, len(LIMIT_FACTORS)),
                           torch.ones(channels, len(PLAIN_GAMMAS), dtype=DT)], dim=1)
        gamma = (torch.tensor(LIMIT_FACTORS + PLAIN_GAMMAS, dtype=DT) * scale)[
            torch.arange(channels), pick]
        with torch.no_grad():
            for module in (layer, ref):
                module.weight.copy_(gamma)
                module.bias.copy_(bias)
        layer.zero_grad()
        ref.zero_grad()
        x = torch.randn(4, channels, 3, 2, generator=gen, dtype=DT) * 2 + 1
        dy = torch.randn(x.shape, generator=gen, dtype=DT)
        leaf, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = layer(leaf * 1)
        expected = activate(ref(ref_x), activation, slope)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
        out.backward(dy)
        expected.backward(dy)
        for got, want in ((leaf.grad, ref_x.grad), (layer.weight.grad, ref.weight.grad),
                          (layer.bias.grad, ref.bias.grad),
                          (layer.running_mean, ref.running_mean),
                          (layer.running_var, ref.running_var)):
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)
        assert layer.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1


@settings(max_examples=25, deadline=None)
@given(
    flags=st.lists(st.integers(0, 3), min_size=1, max_size=70),
    dtype=st.sampled_from([torch.bool, torch.uint8, torch.int8, torch.int32, torch.float32]),
    step=st.integers(1, 3),
)
def test_flags_of_any_dtype_and_layout_are_read(flags, dtype, step):
    """``ChannelsAside`` reads offered flags as bytes where they lie: flags a backend
    hands it in another dtype (a wider int, float) or strided are read as what they say, not as
    their raw bytes (the channels kept aside are the nonzero flags, and only those); from one call
    to the next, another buffer, of another length too (the view it keeps is of the last
    buffer it read: a new one is viewed anew)."""
    from encoding_syncbn.layer.inplace_policy import ChannelsAside

    channels = ChannelsAside()
    for offered_flags in (flags, flags[::-1], flags[1:] or flags):
        padded = torch.zeros(len(offered_flags) * step, dtype=torch.int64)
        padded[::step] = torch.tensor(offered_flags)
        offered = padded.to(dtype)[::step]
        weight = torch.ones(len(offered_flags))
        index = channels.index(weight, torch.zeros_like(weight), flags=offered)
        assert ([] if index is None else index.tolist()) == [
            i for i, flag in enumerate(offered_flags) if flag]


@one_backend  # the layer's bookkeeping, the same on every backend
@settings(max_examples=25, deadline=None)
@given(
    calls=st.lists(st.lists(st.integers(0, 2), min_size=5, max_size=5), min_size=1,
                   max_size=6),
    dtype=st.sampled_from([torch.bool, torch.uint8, torch.float32]),
)
def test_a_reused_flags_buffer_is_read_anew_at_each_call(calls, dtype):
    """A layer's calls hand ``ChannelsAside`` one flags buffer that each rewrites (a training
    step's on the CPU, the layer's pinned copy on a GPU): each call keeps aside what the
    buffer holds then, never an earlier call's flags."""
    from encoding_syncbn.layer.inplace_policy import ChannelsAside

    channels = ChannelsAside()
    buffer = torch.zeros(5, dtype=dtype)
    weight = torch.ones(5)
    for flags in calls:
        buffer.copy_(torch.tensor(flags))
        index = channels.index(weight, torch.zeros_like(weight), flags=buffer)
        assert ([] if index is None else index.tolist()) == [
            i for i, flag in enumerate(flags) if flag]


def test_a_small_gamma_comes_and_goes_over_repeat_calls():
    """An in-place layer's repeat training calls (on the Triton backend its training step's,
    whose small-gamma flags lie in one buffer that each call writes whole) keep a channel
    aside once its gamma falls below the limit, and stop once it rises again: the GPU suite's
    test, on the CPU (where each call reads its own flags at once)."""
    from test_cuda import test_a_small_gamma_comes_and_goes_over_repeat_calls_on_gpu as phases

    phases(device="cpu")


@one_backend  # the layer's bookkeeping, the same on every backend
@settings(max_examples=40, deadline=None, derandomize=True)
@given(calls=st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), min_size=4,
                                                         max_size=4)), min_size=1, max_size=10))
def test_each_call_checks_while_an_answer_is_on_its_way(calls):
    """On a GPU a call's small-gamma flags reach the host calls later. Every training call
    runs the check all the same (a layer's statistics launch stays the same from call to
    call), flags offered while an earlier answer is on its way are dropped (its copy stays
    where it lands), and each call keeps aside the newest answer that has landed: the first
    call's at once (it waits for it), the others' as their copies land. ``calls``: per call,
    whether the answer on its way has landed when the call polls, and the flags its check
    writes."""
    from encoding_syncbn.layer.inplace_policy import ChannelsAside

    channels = ChannelsAside()
    weight, bias = torch.ones(4), torch.zeros(4)
    on_its_way = known = None
    with late_copies() as landing:
        for lands, flags in calls:
            landing["now"] = lands
            check = channels.check(weight, bias)
            assert check is not None and check.weight is weight and check.bias is bias
            kept = channels.index(weight, bias, flags=torch.tensor(flags, dtype=torch.uint8))
            if on_its_way is None:
                on_its_way = [i for i, flag in enumerate(flags) if flag]
            if known is None or lands:
                known, on_its_way = on_its_way, None
            assert ([] if kept is None else kept.tolist()) == known
