"""A repeat call of one key takes the checks and decisions its layer kept (``call_memo``):
its results are a first call's, whatever changed between the calls, and what it runs is
counted.

Each case calls a layer once (which keeps its memo), changes something between the calls (an
attribute, the mode, the parameters' values or holders, the context of the call), and calls it
again, on an input of the key laid out or made as callers hand them (a view it may not
overwrite, a leaf, another layout): outputs, gradients, running statistics, the input's values
afterwards and the warnings must be those of a twin of the layer that went through the same,
but whose memo an assignment dropped just before the second call, so that it runs that call
from its checks. A bad input of a new key is refused as on a first call, the layer untouched.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import sys
import warnings
from unittest import mock

import pytest
import torch
from backends import each_backend, one_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import parametrize, prune

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.inplace_abn import ABN, InPlaceABN
from encoding_syncbn.layer import modules
from encoding_syncbn.sync import distributed

pytestmark = each_backend

SHAPE = (4, 3, 5, 6)


class _Double(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def _swap_buffers(layer, x):
    """The call through ``functional_call`` with running statistics of its own: those must be
    the ones updated."""
    buffers = {"running_mean": torch.full((3,), 0.5, dtype=x.dtype),
               "running_var": torch.full((3,), 2.0, dtype=x.dtype)}
    out = torch.func.functional_call(layer, buffers, (x,))
    return out, buffers


# What changes between the first and the repeat call: (name, change(layer) -> None).
CHANGES = {
    "nothing": lambda layer: None,
    "eval": lambda layer: layer.eval(),
    "activation": lambda layer: setattr(layer, "activation", "elu"),
    "out of place": lambda layer: setattr(layer, "inplace", False),
    "slope": lambda layer: setattr(layer, "slope", 0.5),
    "eps": lambda layer: setattr(layer, "eps", 0.25),
    "momentum": lambda layer: setattr(layer, "momentum", None),
    "zero gamma": lambda layer: layer.weight.data.__setitem__(1, 0.0),
    "float32 parameters": lambda layer: layer.float(),
    "parametrized weight": lambda layer: parametrize.register_parametrization(
        layer, "weight", _Double()),
    "pruned weight": lambda layer: prune.l1_unstructured(layer, "weight", amount=0.4),
    "no running statistics": lambda layer: (setattr(layer, "running_mean", None),
                                            setattr(layer, "running_var", None)),
    # Into the layer's dicts, with no assignment: the memo stays, the next call reads them.
    "weight registered anew": lambda layer: layer.register_parameter(
        "weight", torch.nn.Parameter(layer.weight.detach() * 0.5)),
    "count taken out": lambda layer: layer._buffers.pop("num_batches_tracked"),
}

# Around the repeat call: (name, context manager factory).
CONTEXTS = {
    "plain": contextlib.nullcontext,
    "no grad": torch.no_grad,
    "misuse checks": encoding_syncbn.check_inplace,
}


# The layer: (name, make(activation) -> layer). mapillary's classes override the hooks a repeat
# call runs (``_affine_params``: |w| + eps; ``_syncs_processes``: per process).
LAYERS = {
    "SyncBatchNorm": lambda activation: SyncBatchNorm(3, activation=activation, slope=0.1,
                                                      dtype=torch.float64),
    "InPlaceABN": lambda activation: InPlaceABN(3, activation=activation, activation_param=0.1,
                                                dtype=torch.float64),
    "ABN": lambda activation: ABN(3, activation=activation, activation_param=0.1,
                                  dtype=torch.float64),
}

# The second call's input, of the first's shape: (name, make(x) -> tensor the layer gets).
# Whether it may be overwritten, and how its kernels are laid out, is decided afresh at each
# call (``inplace_policy.can_overwrite``, ``TrainingStep``'s variants).
INPUTS = {
    "fresh": lambda x: x * 1,
    "channels last": lambda x: (x * 1).contiguous(memory_format=torch.channels_last),
    "transposed": lambda x: (x.transpose(2, 3) * 1).transpose(2, 3),
    "chunk of a batch": lambda x: torch.cat([x, x]).mul(1).chunk(2)[0],
    "leaf": lambda x: x,
    "no grad": lambda x: x.detach().clone(),
    "expanded": lambda x: (x[:, :, :1] * 1).expand(x.shape),
}


def _call(layer, x, dy, swap, kind="fresh"):
    """One call and its backward: output, input gradient, parameter gradients, running
    statistics afterwards, the input's values afterwards (overwritten or not) and the
    warnings the call gave."""
    x = x.clone().requires_grad_()
    source = INPUTS[kind](x)  # an in-place layer overwrites a fresh non-leaf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if swap:
            out, buffers = _swap_buffers(layer, source)
            running = [buffers["running_mean"], buffers["running_var"]]
        else:
            out = layer(source)
            running = [layer.running_mean, layer.running_var]
    result = out.detach().clone()
    if out.requires_grad:
        out.backward(dy)
    grads = [None if p.grad is None else p.grad.clone() for p in layer.parameters()]
    with torch._C.DisableTorchFunctionSubclass():  # read even where the checks mark it stale
        after = source.detach().clone()
    return (result, x.grad, grads, [None if r is None else r.clone() for r in running],
            after, [str(w.message) for w in caught])


def _made(cls, activation):
    """A layer of ``cls`` (``LAYERS``) with parameters and running statistics of every sign."""
    if cls != "SyncBatchNorm" and activation == "none":
        activation = "identity"  # mapillary's name
    layer = LAYERS[cls](activation)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.8]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        layer.running_mean.copy_(torch.tensor([0.3, -0.2, 0.1]))
        layer.running_var.copy_(torch.tensor([0.5, 2.0, 1.5]))
    return layer


def _first_then_repeat(layer, change, context, dtype, swap, kind):
    """``layer`` and a twin called once, changed, and called again on the same input (the
    twin's memo dropped before): both second calls' results, or None where the change was
    refused."""
    gen = torch.Generator().manual_seed(0)
    twin = copy.deepcopy(layer)
    x0, x1 = (torch.randn(SHAPE, dtype=dtype, generator=gen) for _ in range(2))
    dy = torch.randn(SHAPE, dtype=dtype, generator=gen)
    for one in (layer, twin):
        _call(one, x0, dy, swap=False)
        assert one._call_memo is not None
        try:
            CHANGES[change](one)
        except ValueError:
            return None  # refused by the layer (an in-place elu at a slope it cannot invert)
        for p in one.parameters():
            p.grad = None
    twin.sync = twin.sync  # an assignment: the twin runs its next call from its checks
    assert twin._call_memo is None
    with CONTEXTS[context]():
        return _call(layer, x1, dy, swap, kind), _call(twin, x1, dy, swap, kind)


def _assert_same(got, want):
    assert got[5] == want[5]  # the same warnings (an input it cannot overwrite)
    for a, b in zip((*got[:2], *got[2], *got[3], got[4]),
                    (*want[:2], *want[2], *want[3], want[4])):
        if a is None or b is None:
            assert a is b
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(change=st.sampled_from(sorted(CHANGES)), context=st.sampled_from(sorted(CONTEXTS)),
       dtype=st.sampled_from([torch.float64, torch.float32]), swap=st.booleans(),
       activation=st.sampled_from(["leaky_relu", "identity", "none"]), training=st.booleans(),
       kind=st.sampled_from(sorted(INPUTS)))
def test_a_repeat_call_matches_a_first_call(change, context, dtype, swap, activation, training,
                                            kind):
    layer = _made("SyncBatchNorm", activation)
    layer.train(training)
    calls = _first_then_repeat(layer, change, context, dtype, swap, kind)
    if calls is not None:
        _assert_same(*calls)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(cls=st.sampled_from(sorted(LAYERS)), kind=st.sampled_from(sorted(INPUTS)),
       dtype=st.sampled_from([torch.float64, torch.float32]),
       activation=st.sampled_from(["leaky_relu", "identity", "none"]), training=st.booleans())
def test_a_repeat_call_of_each_class_runs_its_hooks(cls, kind, dtype, activation, training):
    """mapillary's classes through the repeat call itself (nothing changed, nothing around
    the call): their hooks as a first call runs them, ``_affine_params`` (|w| + eps) and
    ``_syncs_processes`` (per process: with a process group up, ABN and InPlaceABN still
    take the repeat call, where ``SyncBatchNorm`` would synchronise)."""
    layer = _made(cls, activation)
    layer.train(training)
    forward = modules.SyncBatchNorm._forward
    full = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            modules.SyncBatchNorm, "_forward", autospec=True,
            side_effect=lambda *args: full.append(args[0]) or forward(*args)))
        if cls != "SyncBatchNorm":
            stack.enter_context(mock.patch.object(distributed, "is_active", return_value=True))
        got, want = _first_then_repeat(layer, "nothing", "plain", dtype, False, kind)
    assert layer not in full[1:]  # the second call went through the repeat call alone
    _assert_same(got, want)


@one_backend  # the refusals come before any backend is asked
def test_a_bad_input_of_a_new_key_is_refused_with_the_layer_untouched():
    layer = SyncBatchNorm(3, activation="leaky_relu")
    layer(torch.randn(SHAPE) * 1)
    memo = layer._call_memo
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = {
        "expected 3 channels": torch.randn(4, 2, 5, 6),
        "expected a floating-point input": torch.ones(SHAPE, dtype=torch.int64),
        "more than 1 value per channel": torch.randn(1, 3),
        "expected input of shape": torch.randn(3),
    }
    for message, x in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            layer(x)
        assert layer._call_memo is memo
        for k, v in layer.state_dict().items():
            torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    layer(torch.randn(SHAPE) * 1)  # the key kept still runs
    assert layer._call_memo is memo


# Where the layer drops its memo: (name, change(layer) -> None).
DROPS = {
    "eval": lambda layer: layer.eval(),
    "an attribute assigned": lambda layer: setattr(layer, "activation", "identity"),
    "an attribute deleted": lambda layer: delattr(layer, "_path"),
    "to()": lambda layer: layer.to(torch.float64),
    "a parametrization": lambda layer: parametrize.register_parametrization(
        layer, "weight", _Double()),
}


@one_backend  # bookkeeping of the module, no computation
@pytest.mark.parametrize("change", sorted(DROPS))
def test_the_memo_is_dropped_where_its_decisions_may_change(change):
    layer = SyncBatchNorm(3, activation="leaky_relu")
    layer(torch.randn(SHAPE) * 1)
    assert layer._call_memo is not None
    DROPS[change](layer)
    assert layer._call_memo is None


@one_backend  # bookkeeping of the module, no computation
def test_a_copy_keeps_no_memo():
    layer = SyncBatchNorm(3, activation="leaky_relu")
    layer(torch.randn(SHAPE) * 1)
    assert copy.deepcopy(layer)._call_memo is None
    assert pickle.loads(pickle.dumps(layer))._call_memo is None
    assert layer._call_memo is not None


# The layer package's Python functions a repeat training call of an in-place layer runs,
# forward and backward (the backend's ops and torch's own not counted): what the memo leaves
# to do per call (counted, as the launches are; ``benchmarks/host_overhead.py`` times it).
REPEAT_CALL_FUNCTIONS = 40


@one_backend  # the layer's own Python, the same above either backend
def test_a_repeat_call_runs_a_counted_number_of_the_layers_functions():
    layer = SyncBatchNorm(3, activation="leaky_relu")
    x = torch.randn(SHAPE)
    dy = torch.randn(SHAPE)
    for _ in range(2):
        layer(x.clone().requires_grad_() * 1).backward(dy)
    package = modules.__file__.rsplit("/", 2)[0]  # .../encoding_syncbn
    kernels = package + "/kernels/"
    counted: list[str] = []
    module_reads = []

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package) and not name.startswith(kernels):
            counted.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        if event == "call" and frame.f_code is torch.nn.Module.__getattr__.__code__:
            module_reads.append(frame.f_locals.get("name"))

    source = x.clone().requires_grad_() * 1
    sys.setprofile(profile)
    try:
        layer(source).backward(dy)
    finally:
        sys.setprofile(None)
    assert "modules.py:_forward" not in counted  # the checks were not run again
    assert len(counted) <= REPEAT_CALL_FUNCTIONS, counted
    # The parameters and running statistics read from the layer's dicts (``_state``), not
    # through nn.Module's __getattr__, which raises and catches an AttributeError each.
    assert module_reads == []


def test_a_repeat_call_asks_for_its_ops_only_when_the_choice_may_have_changed(monkeypatch):
    """A repeat call runs the ops its memo keeps while the backend chosen is the memo's and no
    dispatch mode is active; otherwise it asks ``ops_for`` as a first call does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    asked = []
    ops_for = modules.ops_for
    monkeypatch.setattr(modules, "ops_for", lambda x: asked.append(1) or ops_for(x))
    layer = SyncBatchNorm(3, activation="leaky_relu")
    x = torch.randn(SHAPE)
    chosen = encoding_syncbn.get_backend()
    layer(x * 1)
    asked.clear()
    layer(x * 1)
    assert asked == []
    with Passing():
        layer(x * 1)
    assert asked == [1]
    other = "auto" if chosen != "auto" else "torch"
    encoding_syncbn.set_backend(other)
    try:
        layer(x * 1)
    finally:
        encoding_syncbn.set_backend(chosen)
    assert asked == [1, 1]
