"""``encoding_syncbn.inplace_abn``: mapillary's inplace_abn API on ``SyncBatchNorm``.

mapillary's package does not install here (its metadata step fails before its CUDA build), so
the reference is its formula in plain PyTorch on the whole batch, float64::

    ABN:                      y = act(xhat * w + b)
    InPlaceABN(Sync), funcs:  y = act(xhat * (|w| + eps) + b),  d|w|/dw = -1 if w < 0 else +1

(checked against a source build of the real package when the issue was filed). ``install()``
runs in fresh interpreters, before and after timm / segmentation_models_pytorch are imported.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import pickle
import re
import subprocess
import sys
import textwrap
import types

import mapillary
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from backends import each_backend, one_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import activate, assert_close, assign_or_refused
from torch import nn

from encoding_syncbn import (
    SyncBatchNorm,
    convert_inplace_abn,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from encoding_syncbn.inplace_abn import (
    ABN,
    InPlaceABN,
    InPlaceABNSync,
    inplace_abn,
    inplace_abn_sync,
    set_active_group,
)
from encoding_syncbn.sync import distributed
from encoding_syncbn.testing import SimulatedDataParallel

TESTS = os.path.dirname(os.path.abspath(__file__))
C = 4
CLASSES = (ABN, InPlaceABN, InPlaceABNSync)
PARAMS = {"leaky_relu": 0.1, "elu": 0.7, "identity": 0.01, "relu": 0.01}
WEIGHT = (1.5, -0.7, 0.0, 2.0)  # every sign, and 0 (where |w| + eps matters most)
BIAS = (0.1, 0.2, -0.3, 0.0)

pytestmark = each_backend


def cases():
    for cls in CLASSES:
        for activation in cls._activations:
            yield cls, activation


def make(cls, activation="leaky_relu", param=None, **kwargs):
    layer = cls(C, activation=activation, activation_param=PARAMS[activation] if param is None
                else param, **kwargs).double()
    if layer.weight is not None:
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(WEIGHT))
            layer.bias.copy_(torch.tensor(BIAS))
    return layer


class Formula:
    """The formula in plain torch, with a copy of a layer's (or a function's) state."""

    def __init__(self, weight, bias, running_mean, running_var, eps, magnitude):
        self.weight = None if weight is None else weight.detach().clone()
        self.bias = None if bias is None else bias.detach().clone().requires_grad_()
        self.running_mean = None if running_mean is None else running_mean.detach().clone()
        self.running_var = None if running_var is None else running_var.detach().clone()
        self.eps, self.magnitude = eps, magnitude
        self.weight_grad = None

    @classmethod
    def of(cls, layer):
        return cls(layer.weight, layer.bias, layer.running_mean, layer.running_var, layer.eps,
                   isinstance(layer, InPlaceABN))

    def step(self, x, grad, training, momentum, activation, param):
        """Output and input gradient; weight_grad / bias.grad accumulate."""
        x = x.detach().clone().requires_grad_()
        gamma = None
        if self.weight is not None:
            raw = self.weight
            gamma = (raw.abs() + self.eps if self.magnitude else raw.clone()).requires_grad_()
        out = activate(
            F.batch_norm(x, self.running_mean, self.running_var, gamma, self.bias, training,
                         momentum, self.eps),
            activation, param,
        )
        out.backward(grad)
        if gamma is not None:
            dweight = gamma.grad * (torch.where(raw < 0, -1.0, 1.0) if self.magnitude else 1.0)
            self.weight_grad = dweight if self.weight_grad is None else self.weight_grad + dweight
        return out.detach(), x.grad


def check_step(layer, ref, model, x, step, momentum):
    grad = torch.randn_like(x)
    param = layer.slope  # activation_param on ours, and on SyncBatchNorm
    expected, expected_dx = ref.step(x, grad, layer.training, momentum, layer.activation, param)
    leaf = x.clone().requires_grad_()
    out = model(leaf * 1)  # a non-leaf: the in-place layers really run in place
    out.backward(grad)
    what = f"{type(layer).__name__}({layer.activation}) step {step}"
    assert_close(out, expected, what=what + " output")
    assert_close(leaf.grad, expected_dx, what=what + " input grad")
    if layer.weight is not None:
        assert_close(layer.weight.grad, ref.weight_grad, what=what + " weight grad")
        assert_close(layer.bias.grad, ref.bias.grad, what=what + " bias grad")
    if layer.running_mean is not None:
        assert_close(layer.running_mean, ref.running_mean, what=what + " running_mean")
        assert_close(layer.running_var, ref.running_var, what=what + " running_var")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls, activation", list(cases()),
                         ids=[f"{c.__name__}-{a}" for c, a in cases()])
def test_the_formula_alone(cls, activation, training):
    torch.manual_seed(0)
    layer = make(cls, activation)
    if not training:
        with torch.no_grad():
            layer.running_mean.copy_(torch.tensor([0.3, -1.0, 0.0, 2.0]))
            layer.running_var.copy_(torch.tensor([0.5, 2.0, 1.0, 3.0]))
    layer.train(training)
    assert layer.inplace == (cls is not ABN)
    ref = Formula.of(layer)
    for step in range(2):
        x = torch.randn(4, C, 2, 3, dtype=torch.float64) * 2 + 1  # values to train in place
        check_step(layer, ref, layer, x, step, 0.1)
    assert layer.num_batches_tracked.item() == (2 if training else 0)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_data_parallel_normalises_the_whole_batch(cls, replicas):
    """Under (simulated) DataParallel every class equals the formula on the whole batch,
    cumulative running averages (momentum=None) included."""
    torch.manual_seed(1)
    layer = make(cls, "elu", momentum=None)
    ref = Formula.of(layer)
    model = SimulatedDataParallel(layer, replicas)
    for step in range(2):
        x = torch.randn(9, C, 3, dtype=torch.float64) * 3 - 1  # values to train in place
        check_step(layer, ref, model, x, step, 1.0 / (step + 1))
    assert layer.num_batches_tracked.item() == 2


def test_across_processes_only_the_sync_class_merges(monkeypatch):
    """ABN and InPlaceABN normalise per process under torch.distributed, InPlaceABNSync over
    its group: seen through the layer's one door to the cross-process merge."""
    gathered = []

    def merge_across_processes(mean, m2, count, eps, group, batch=None, error=None):
        gathered.append(group)
        return mean, m2, (m2 / count + eps).rsqrt(), count, error

    monkeypatch.setattr(distributed, "is_active", lambda group=None: True)
    monkeypatch.setattr(distributed, "merge_across_processes", merge_across_processes)
    x = torch.randn(4, C, 3, dtype=torch.float64)
    for cls in (ABN, InPlaceABN):
        make(cls)(x.clone())
    assert gathered == []
    layer = make(InPlaceABNSync, group="the group")
    layer(x.clone())
    assert gathered == ["the group"]
    set_active_group(torch.nn.Sequential(layer, make(ABN)), "another")
    assert layer.group == layer.process_group == "another"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_state_dict_saved_by_mapillary_loads_strict_and_computes_the_same(cls):
    """Their keys (built by hand), version 2 with num_batches_tracked and version 1 without."""
    torch.manual_seed(2)
    state = {
        "weight": torch.tensor([0.5, -2.0, 0.0, 1.0]),
        "bias": torch.tensor([0.1, -0.2, 0.3, 0.0]),
        "running_mean": torch.tensor([1.0, -1.0, 0.5, 0.0]),
        "running_var": torch.tensor([2.0, 0.5, 1.0, 4.0]),
        "num_batches_tracked": torch.tensor(7),
    }
    x = torch.randn(2, C, 3, 3, dtype=torch.float64)
    for version in (2, 1):
        saved = dict(state)
        if version == 1:
            del saved["num_batches_tracked"]
        saved = type("StateDict", (dict,), {})(saved)
        saved._metadata = {"": {"version": version}}
        layer = cls(C, activation="leaky_relu", activation_param=0.2)
        layer.load_state_dict(saved, strict=True)
        assert layer.num_batches_tracked.item() == (7 if version == 2 else 0)
        layer = layer.double().eval()
        ref = Formula.of(layer)
        expected, _ = ref.step(x, torch.ones_like(x), False, 0.1, "leaky_relu", 0.2)
        assert_close(layer(x.clone()), expected, what=f"version {version}")
    assert list(layer.state_dict()) == list(state)


def test_the_public_api_matches_mapillarys():
    """Their positional parameters, in their order, with their defaults; their attributes."""
    common = [("num_features", inspect.Parameter.empty), ("eps", 1e-5), ("momentum", 0.1),
              ("affine", True), ("track_running_stats", True), ("activation", "leaky_relu"),
              ("activation_param", 0.01)]
    for cls, extra in ((ABN, []), (InPlaceABN, []), (InPlaceABNSync, [("group", None)])):
        parameters = [p for p in inspect.signature(cls).parameters.values()
                      if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert [(p.name, p.default) for p in parameters] == common + extra, cls
    functions = [("x", inspect.Parameter.empty), ("weight", inspect.Parameter.empty),
                 ("bias", inspect.Parameter.empty), ("running_mean", inspect.Parameter.empty),
                 ("running_var", inspect.Parameter.empty), ("training", True),
                 ("momentum", 0.1), ("eps", 1e-5), ("activation", "leaky_relu"),
                 ("activation_param", 0.01)]
    for function, extra in ((inplace_abn, []), (inplace_abn_sync, [("group", None)])):
        parameters = inspect.signature(function).parameters.values()
        assert [(p.name, p.default) for p in parameters] == functions + extra, function
    layer = InPlaceABNSync(3, 1e-3, None, True, False, "elu", 0.5, "g")
    assert (layer.num_features, layer.eps, layer.momentum, layer.affine,
            layer.track_running_stats, layer.activation, layer.activation_param,
            layer.group) == (3, 1e-3, None, True, False, "elu", 0.5, "g")
    assert list(layer.state_dict()) == ["weight", "bias"]
    layer.set_group("h")
    assert layer.group == "h"
    with pytest.raises(ValueError, match=r"InPlaceABN: activation must be one of .*'relu'"):
        InPlaceABN(3, activation="relu")


def test_where_in_place_is_impossible_the_gradient_is_still_exact():
    """smp's decoder_use_norm="inplace" is leaky_relu with slope 0 (a relu): out of place, x
    untouched, the relu's gradient (mapillary's in-place backward let the zeros' through)."""
    torch.manual_seed(3)
    layer = make(InPlaceABN, "leaky_relu", param=0.0)
    assert not layer.inplace
    ref = Formula.of(layer)
    x = torch.randn(4, C, 3, dtype=torch.float64)
    check_step(layer, ref, layer, x, 0, 0.1)
    kept = x.clone()
    layer(x)
    assert torch.equal(x, kept)


@pytest.mark.parametrize("param", [0.0, 0.2])
def test_activation_param_assigned_after_construction(param):
    """``activation_param`` assigned later (as a model's code may do): in place exactly where
    the new value is invertible, and exact either way, back and forth."""
    torch.manual_seed(4)
    layer = make(InPlaceABN, "leaky_relu")
    ref = Formula.of(layer)
    x = torch.randn(8, C, 3, dtype=torch.float64)  # enough values to train in place
    for step, value in enumerate([param, 0.1, param]):
        layer.activation_param = value
        assert (layer.slope, layer.inplace) == (value, value > 0)
        check_step(layer, ref, layer, x, step, 0.1)


@one_backend  # checked at assignment, before any op
@settings(max_examples=40, deadline=None, derandomize=True)
@given(cls=st.sampled_from(CLASSES), named=st.booleans(), assignments=st.lists(st.tuples(
    st.sampled_from(["activation_param", "slope", "activation", "inplace", "eps", "momentum"]),
    st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.integers(-1, 2),
              st.sampled_from(["abc", "0.3", "elu", "relu", np.float32(0.2), np.int64(0),
                               object(), [0.1]]))), min_size=1, max_size=4))
def test_every_refused_assignment_names_the_layer(cls, named, assignments):
    """Any value assigned to mapillary's ``activation_param`` or an option the layer checks:
    taken, or refused with a ValueError naming the layer (its model path once converted),
    the layer left as it was."""
    layer = make(cls, "leaky_relu")
    if named:
        layer = convert_sync_batchnorm(nn.Sequential(nn.Identity(), layer))[1]
    names = ("activation", "slope", "inplace", "eps", "momentum")
    for name, value in assignments:
        assign_or_refused(layer, names, name, value, named)


@pytest.mark.parametrize("function", [inplace_abn, inplace_abn_sync])
def test_the_functions(function):
    """In place over x, the running statistics updated in place with ``momentum``."""
    torch.manual_seed(4)
    weight = torch.tensor(WEIGHT, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    running_mean = torch.zeros(C, dtype=torch.float64)
    running_var = torch.ones(C, dtype=torch.float64)
    ref = Formula(weight, bias, running_mean, running_var, 1e-3, magnitude=True)
    for training in (True, False):
        # Enough values a channel to train in place (inplace_policy.rebuilds_from_count).
        x = torch.randn(14, C, 8, dtype=torch.float64)
        grad = torch.randn_like(x)
        expected, expected_dx = ref.step(x, grad, training, 0.3, "elu", 0.7)
        leaf = x.clone().requires_grad_()
        h = leaf * 1
        out = function(h, weight, bias, running_mean, running_var, training, 0.3, 1e-3,
                       "elu", 0.7)
        assert out is h
        out.backward(grad)
        assert_close(out, expected, what="output")
        assert_close(leaf.grad, expected_dx, what="input grad")
        assert_close(weight.grad, ref.weight_grad, what="weight grad")
        assert_close(bias.grad, ref.bias.grad, what="bias grad")
        assert_close(running_mean, ref.running_mean, what="running_mean")
        assert_close(running_var, ref.running_var, what="running_var")
    # No running statistics: the batch's, in training and not.
    x = torch.randn(3, C, 5, dtype=torch.float64)
    out = function(x.clone(), None, None, None, None, False)
    assert_close(out, F.leaky_relu(F.batch_norm(x, None, None, training=True), 0.01))
    # A weight of another shape than (C,): refused naming the function, nothing written.
    name = "InPlaceABNSync" if function is inplace_abn_sync else "InPlaceABN"
    given, before = x.clone(), running_mean.clone()
    with pytest.raises(ValueError, match=re.escape(f"{name} function: expected weight of "
                                                   f"shape ({C},)") + ".*got shape \\(4, 1\\)"):
        function(given, weight.detach()[:, None], bias, running_mean, running_var, True)
    assert torch.equal(given, x) and torch.equal(running_mean, before)


# ---- conversions ---------------------------------------------------------------------------


def mapillary_named(name, group=None):
    """mapillary's layer ``name`` (tests/mapillary.py: their class path, attributes,
    Parameters and buffers) with this module's weights, statistics and batch count."""
    group = {"group": group} if name == "InPlaceABNSync" else {}
    module = getattr(mapillary, name)(C, 1e-4, 0.2, activation="elu", activation_param=0.7,
                                      **group).double()
    with torch.no_grad():
        module.weight.copy_(torch.tensor(WEIGHT))
        module.bias.copy_(torch.tensor(BIAS))
        module.running_mean.copy_(torch.linspace(-1, 1, C))
        module.running_var.copy_(torch.linspace(0.5, 2, C))
        module.num_batches_tracked.fill_(3)
    return module


@pytest.mark.parametrize("name", ["ABN", "InPlaceABN", "InPlaceABNSync"])
def test_mapillarys_layers_convert_and_revert_exactly(name):
    """A model mixing torch's and mapillary's layers converts whole (nothing left per
    replica), loads its own state_dict strict, computes the formula on the whole batch under
    DataParallel, and reverts to the same state_dict: mapillary's class if it imports, else
    ours with sync=False."""
    torch.manual_seed(5)
    model = nn.Sequential(mapillary_named(name), nn.BatchNorm1d(C).double())
    state = {key: value.clone() for key, value in model.state_dict().items()}
    weight = model[0].weight
    converted = convert_sync_batchnorm(model, process_group="pg")
    layer = converted[0]
    assert all(isinstance(m, SyncBatchNorm) and m.sync for m in converted)
    assert layer.weight is weight and layer.process_group == "pg"
    assert layer.inplace == (name != "ABN") and layer.activation == "elu"
    assert isinstance(layer, InPlaceABNSync) == (name != "ABN")
    converted.load_state_dict(state, strict=True)
    ref = Formula(weight, layer.bias, layer.running_mean, layer.running_var, 1e-4,
                  magnitude=name != "ABN")
    check_step(layer, ref, SimulatedDataParallel(layer, 2),  # enough values to train in place
               torch.randn(8, C, 3, dtype=torch.float64), 0, 0.2)

    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[0]) is globals()[name] and not reverted[0].sync
    assert type(reverted[1]) is nn.BatchNorm1d
    assert list(reverted.state_dict()) == list(state)
    x = torch.randn(4, C, 2, dtype=torch.float64)
    reverted.eval()
    assert_close(reverted[0](x.clone()), ref.step(x, x, False, 0.2, "elu", 0.7)[0])


def test_ours_convert_to_process_synchronised_layers_and_revert_to_themselves(monkeypatch):
    assert convert_sync_batchnorm(mapillary_named("InPlaceABNSync", "own"), "pg").group == "own"
    # ABN and InPlaceABN are per process under torch.distributed: a conversion synchronises.
    model = convert_sync_batchnorm(nn.Sequential(*(make(cls) for cls in CLASSES)), "pg")
    assert [type(m) for m in model] == [SyncBatchNorm, InPlaceABNSync, InPlaceABNSync]
    monkeypatch.setattr(distributed, "is_active", lambda group=None: group == "pg")
    assert all(m._syncs_processes() for m in model)
    assert [type(m) for m in revert_sync_batchnorm(model)] == list(CLASSES)
    # Built directly, ours revert to their class, never to a plain BatchNorm (which would
    # drop |w| + eps).
    for cls in CLASSES:
        reverted = revert_sync_batchnorm(nn.Sequential(make(cls)))[0]
        assert type(reverted) is cls and not reverted.sync


class _ReadsItsInputAgain(nn.Module):
    """``bn(h) + h``: right only where ``bn`` runs out of place."""

    def __init__(self, bn):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(C, C, 1).double(), bn

    def forward(self, x):
        h = self.conv(x)
        return self.bn(h) + h


@pytest.mark.parametrize("cls", [InPlaceABN, InPlaceABNSync], ids=lambda c: c.__name__)
def test_ours_set_out_of_place_stay_out_of_place_through_every_conversion(cls, monkeypatch):
    """An in-place class of ours set ``inplace=False`` (its input is read again): each
    converter keeps it out of place, so the model computes what it did, also where
    mapillary's package imports (its classes always write over their input: ours stay)."""
    fake_abn = types.ModuleType("inplace_abn.abn")
    for name in ("ABN", "InPlaceABN", "InPlaceABNSync"):
        setattr(fake_abn, name, getattr(mapillary, name))
    monkeypatch.setitem(sys.modules, "inplace_abn", types.ModuleType("inplace_abn"))
    monkeypatch.setitem(sys.modules, "inplace_abn.abn", fake_abn)
    torch.manual_seed(7)
    x = torch.randn(6, C, 4, 4, dtype=torch.float64)  # enough values to train in place
    for training in (True, False):
        block = _ReadsItsInputAgain(make(cls, "elu"))
        block.bn.inplace = False
        block.train(training)
        expected = block(x)
        if training:
            block.bn.running_mean.zero_(), block.bn.running_var.fill_(1)
        for convert in (convert_sync_batchnorm, convert_inplace_abn, revert_sync_batchnorm):
            converted = convert(copy.deepcopy(block))
            assert isinstance(converted.bn, cls) and not converted.bn.inplace, convert
            assert_close(converted(x), expected, what=f"{convert.__name__}, {training=}")
    # Left in place, a layer reverts to mapillary's class, which computes the same.
    assert type(revert_sync_batchnorm(nn.Sequential(make(cls)))[0]) is getattr(mapillary,
                                                                                cls.__name__)


def test_an_out_of_place_choice_outlives_activation_param():
    """``inplace=False`` set at an invertible value stays through ``activation_param``
    assignments of invertible values; out of place because the value was not invertible
    (the class's choice), the layer goes back in place at an invertible one."""
    layer = make(InPlaceABN)
    layer.inplace = False
    for value in (0.2, 0.3, 0.0):
        layer.activation_param = value
        assert (layer.slope, layer.inplace) == (value, False)
    layer.activation_param = 0.2
    assert layer.inplace


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_messages_name_the_class_and_path(cls):
    """Warnings and errors raised in a call or its backward name the layer as its class, at
    its model path once converted."""
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}({C}): eps")):
        cls(C, eps=-1.0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(C, C, 1).double(), make(cls)))
    label = f"{type(model[1]).__name__}({C}) at model path '1'"  # (ABN: SyncBatchNorm)
    assert model[1]._label() == label
    x = torch.randn(4, C, 6, 6, dtype=torch.float64)  # enough values to train in place
    if not model[1].inplace:
        return
    with pytest.warns(UserWarning, match=re.escape(label) + r" \(inplace=True\) got a leaf"):
        model[1](x.clone().requires_grad_())
    y = model(x)
    y.mul_(2)  # its output modified in place: its backward refuses
    with pytest.raises(RuntimeError, match=re.escape(label) + r" \(inplace=True\) wrote"):
        y.sum().backward()
    out = model(x.requires_grad_())
    with pytest.raises(RuntimeError, match=re.escape(label) + " .*double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_a_model_pickled_by_mapillarys_package_loads_after_install(monkeypatch):
    """torch.save(model) with their classes: unpickled where ``inplace_abn.abn`` is ours."""
    torch.manual_seed(6)
    original = mapillary_named("InPlaceABNSync")
    fake_abn = types.ModuleType("inplace_abn.abn")
    fake_abn.InPlaceABNSync = type(original)
    monkeypatch.setitem(sys.modules, "inplace_abn", types.ModuleType("inplace_abn"))
    monkeypatch.setitem(sys.modules, "inplace_abn.abn", fake_abn)
    saved = pickle.dumps(nn.Sequential(original))
    fake_abn.InPlaceABNSync = InPlaceABNSync  # what install() makes the name resolve to
    layer = pickle.loads(saved)[0]
    assert type(layer) is InPlaceABNSync and layer.inplace and layer.sync
    assert (layer.activation, layer.activation_param, layer.group) == ("elu", 0.7, None)
    ref = Formula(original.weight, original.bias, original.running_mean, original.running_var,
                  1e-4, magnitude=True)
    check_step(layer, ref, SimulatedDataParallel(layer, 2),  # enough values to train in place
               torch.randn(8, C, 3, dtype=torch.float64), 0, 0.2)
    assert type(revert_sync_batchnorm(nn.Sequential(layer))[0]) is InPlaceABNSync


# ---- install(): fresh interpreters --------------------------------------------------------

# timm and smp import torchvision, a CUDA build here: tests/third_party.py lets its op
# registrations fail quietly (its docstring says why that is safe).
_QUIET_TORCHVISION = """
import sys
sys.path.insert(0, sys.argv[2])
from third_party import import_or_skip
import_or_skip("torchvision")
"""

_USE_THEM = """
import torch, timm, segmentation_models_pytorch as smp
import timm.layers.inplace_abn as timm_iabn
import encoding_syncbn.inplace_abn as ours
assert timm_iabn.has_iabn and timm_iabn.inplace_abn is ours.inplace_abn
import inplace_abn, inplace_abn.functions, inplace_abn.abn, inplace_abn.group
assert inplace_abn.InPlaceABN is inplace_abn.abn.InPlaceABN is ours.InPlaceABN
assert inplace_abn.functions.inplace_abn_sync is ours.inplace_abn_sync
assert inplace_abn.set_active_group is inplace_abn.group.set_active_group
torch.manual_seed(0)
norm = timm.layers.InplaceAbn(3, act_layer="leaky_relu").double()
x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
out = norm(x * 1)
ref = torch.nn.functional.leaky_relu(torch.nn.functional.batch_norm(
    x, None, None, torch.full((3,), 1 + 1e-5, dtype=torch.float64), None, True), 0.01)
torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
out.sum().backward()
model = smp.Unet(encoder_name="resnet18", encoder_weights=None, decoder_use_norm="inplace",
                 decoder_channels=(8, 8, 8, 8, 8), classes=2).double()
norms = [m for m in model.decoder.modules() if isinstance(m, ours.InPlaceABN)]
assert norms and all(m.activation_param == 0.0 for m in norms), norms
model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).square().mean().backward()
assert all(m.weight.grad is not None for m in norms)
from encoding_syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.testing import SimulatedDataParallel
model = convert_sync_batchnorm(model)  # mixed: torch's BatchNorm2d and InPlaceABN
assert all(isinstance(m, SyncBatchNorm) and m.sync for m in model.modules()
           if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
assert not any(type(m) is ours.InPlaceABN for m in model.modules())  # per process in DDP
# timm's InplaceAbn calls the function (per replica): converted, it is synchronised.
net = torch.nn.Sequential(timm.layers.InplaceAbn(3, act_layer="elu", act_param=0.5)).double()
state = {key: value.clone() for key, value in net.state_dict().items()}
x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
expected = net(x.clone())
after = {key: value.clone() for key, value in net.state_dict().items()}
net.load_state_dict(state, strict=True)
net = convert_sync_batchnorm(net)
assert isinstance(net[0], ours.InPlaceABNSync) and net[0].inplace
torch.testing.assert_close(SimulatedDataParallel(net, 3)(x.clone()), expected,
                           rtol=1e-12, atol=1e-12)
net = revert_sync_batchnorm(net)
assert type(net[0]) is timm.layers.InplaceAbn and net[0].act_name == "elu"
for key, value in net.state_dict().items():
    torch.testing.assert_close(value, after[key], rtol=1e-12, atol=1e-12)
assert list(net.state_dict()) == list(after)
print("OK")
"""

_SCRIPTS = {
    "install_first": _QUIET_TORCHVISION + """
import encoding_syncbn.inplace_abn
assert encoding_syncbn.inplace_abn.install() is True
assert encoding_syncbn.inplace_abn.install() is True  # idempotent
""" + _USE_THEM,
    "install_after_timm_and_smp": _QUIET_TORCHVISION + """
import timm, segmentation_models_pytorch as smp
import timm.layers.inplace_abn
assert not timm.layers.inplace_abn.has_iabn
import encoding_syncbn.inplace_abn
assert encoding_syncbn.inplace_abn.install() is True
""" + _USE_THEM,
    # A working mapillary package is left alone; a broken build is replaced, with a warning.
    "real_package_present": """
import sys, warnings
sys.path.insert(0, sys.argv[1] + "/working")
import encoding_syncbn.inplace_abn as ours
assert ours.install() is False
import inplace_abn
assert inplace_abn.REAL and "inplace_abn.functions" not in sys.modules
print("OK")
""",
    "real_package_broken": """
import sys, warnings
sys.path.insert(0, sys.argv[1] + "/broken")
import encoding_syncbn.inplace_abn as ours
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert ours.install() is True
assert "does not import (no _backend)" in str(caught[0].message), caught
from inplace_abn.functions import inplace_abn
assert inplace_abn is ours.inplace_abn
print("OK")
""",
}


@one_backend  # fresh interpreters: they run on their own default backend
def test_install_in_fresh_interpreters(tmp_path):
    packages = {"working": "REAL = True\n", "broken": "raise ImportError('no _backend')\n"}
    for kind, body in packages.items():
        (tmp_path / kind / "inplace_abn").mkdir(parents=True)
        (tmp_path / kind / "inplace_abn" / "__init__.py").write_text(body)
    root = os.path.dirname(TESTS)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for library in ("timm", "segmentation_models_pytorch"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed")
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), str(tmp_path), TESTS], cwd=root,
            env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, script in _SCRIPTS.items()
    }
    failures = []
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        if run.returncode != 0 or "OK" not in out:
            failures.append(f"{name}: rc={run.returncode}\n{out}\n{err[-3000:]}")
    assert not failures, "\n\n".join(failures)
