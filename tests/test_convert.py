"""convert_sync_batchnorm / revert_sync_batchnorm."""

from __future__ import annotations

import ast
import copy
import pathlib
import pickle
import warnings

import pytest
import torch
from backends import each_backend
from convert_check import check_conversion
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference import assert_close
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.layer.norm_act import BatchNormAct, SyncBatchNormAct
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend


class _Group:
    """Stands for a torch.distributed process group (never used: not initialised)."""


GROUP = _Group()


def model():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5, momentum=None, affine=False)),
        nn.Flatten(2), nn.BatchNorm1d(5, eps=1e-3, track_running_stats=False),
        nn.Unflatten(2, (4, 4)), nn.Conv2d(5, 2, 1), nn.SyncBatchNorm(2, bias=False),
    ).double()
    return net


def test_convert_reuses_parameters_buffers_and_flags():
    net = model().eval()
    originals = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    params = [(m.weight, m.bias) for m in originals]
    buffers = [(m.running_mean, m.running_var) for m in originals]
    converted = convert_sync_batchnorm(net, process_group=GROUP)
    layers = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert len(layers) == 4
    for layer, original, (w, b), (rm, rv) in zip(layers, originals, params, buffers):
        assert layer.weight is w and layer.bias is b
        assert layer.running_mean is rm and layer.running_var is rv
        assert (layer.eps, layer.momentum, layer.affine, layer.track_running_stats) == (
            original.eps, original.momentum, original.affine, original.track_running_stats)
        assert not layer.training and layer.process_group is GROUP
        assert all(t.dtype == torch.float64 and t.device.type == "cpu"
                   for t in layer.state_dict().values() if t.is_floating_point())


def test_converted_model_trains_like_the_original():
    reference, net = model(), convert_sync_batchnorm(model())
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, net)]
    for _ in range(3):
        runs = (reference, SimulatedDataParallel(net, 3))
        for opt, run in zip(optimizers, runs):
            opt.zero_grad()
            run(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(reference.state_dict().items(), net.state_dict().values()):
        assert_close(b, a, what=name)


def test_convert_inside_data_parallel_wrapper():
    wrapped = nn.DataParallel(model())
    converted = convert_sync_batchnorm(wrapped)
    assert converted is wrapped
    assert sum(isinstance(m, SyncBatchNorm) for m in wrapped.module.modules()) == 4


def test_revert_gives_plain_batchnorm_and_activation_module():
    net = nn.Sequential(
        SyncBatchNorm(3, activation="leaky_relu", slope=0.2), nn.Flatten(2),
        SyncBatchNorm(3, activation="elu", slope=0.5), nn.Unflatten(2, (2, 2)),
        SyncBatchNorm(3, activation="identity"),
    ).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    expected = net(x.clone())
    net.eval()
    expected_eval = net(x.clone())
    running_means = [m.running_mean for m in net.modules() if isinstance(m, SyncBatchNorm)]
    keys = list(net.state_dict())
    net.train()
    plain = revert_sync_batchnorm(net)
    kinds = [type(m) for m in plain.modules()]
    assert SyncBatchNorm not in kinds
    assert isinstance(plain[0], BatchNormAct) and isinstance(plain[0].act, nn.LeakyReLU)
    assert plain[0].act.negative_slope == 0.2
    assert isinstance(plain[2], BatchNormAct) and plain[2].act.alpha == 0.5
    assert type(plain[4]) is nn.BatchNorm2d
    assert list(plain.state_dict()) == keys  # the activation adds no key (issue 15 item 7)
    assert [m.running_mean for m in plain.modules() if isinstance(m, _BatchNorm)] == running_means
    assert plain.training
    plain.eval()
    assert_close(plain(x.clone()), expected_eval)
    assert expected.shape == x.shape


@pytest.mark.parametrize("cls,shape", [(nn.BatchNorm1d, (4, 3)), (nn.BatchNorm1d, (4, 3, 5)),
                                       (nn.BatchNorm2d, (4, 3, 2, 2)),
                                       (nn.BatchNorm3d, (4, 3, 2, 2, 2))])
def test_revert_before_any_forward_gives_the_class_converted_from(cls, shape):
    plain = revert_sync_batchnorm(convert_sync_batchnorm(nn.Sequential(cls(3))))
    assert type(plain[0]) is cls
    plain(torch.randn(shape))  # the reverted layer accepts the original's inputs


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
@pytest.mark.parametrize("slope", [-0.3, 0.0, 0.2])
def test_reverted_activation_trains_for_any_slope(activation, slope):
    """Out of place, the layer takes any slope; the reverted activation must differentiate
    like it (torch cannot run in-place leaky_relu / elu backward for slope <= 0)."""
    layer = SyncBatchNorm(3, activation=activation, slope=slope, inplace=False).double()
    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    (expected,) = torch.autograd.grad(out.square().sum(), x)
    plain = revert_sync_batchnorm(layer)
    layer_x = x.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(plain(layer_x * 1).square().sum(), layer_x)
    assert_close(grad, expected)


# ---- the registry ---------------------------------------------------------------------------


class Scaled(nn.Module):
    """A norm layer the registry does not know: BatchNorm2d then a fixed scale."""

    def __init__(self, channels):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.scale = 2.0

    def forward(self, x):
        return self.bn(x) * self.scale


class SyncScaled(SyncBatchNorm):
    def forward(self, x):
        return super().forward(x) * 2.0


class ScaledAgain(Scaled):
    """Keeps ``Scaled.forward``: converts like it."""


@pytest.fixture
def scaled_registered(monkeypatch):
    from encoding_syncbn.conversions import convert
    monkeypatch.setattr(convert, "_CONVERSIONS", dict(convert._CONVERSIONS))
    calls = []

    def to_sync(module, process_group):
        calls.append(process_group)
        layer = SyncScaled(module.bn.num_features, process_group=process_group,
                           dtype=module.bn.weight.dtype)
        layer.load_state_dict(module.bn.state_dict())
        return layer

    def to_original(layer):
        module = Scaled(layer.num_features).to(layer.weight.dtype)
        module.bn.load_state_dict(layer.state_dict())
        return module

    yield to_sync, to_original, calls


@pytest.mark.parametrize("by_name", [False, True])
def test_registered_class_converts_and_reverts(scaled_registered, by_name):
    to_sync, to_original, calls = scaled_registered
    encoding_syncbn.register_conversion(f"{__name__}.Scaled" if by_name else Scaled,
                                        to_sync, to_original)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), Scaled(3), nn.Sequential(ScaledAgain(3))).double()
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    expected = net(x)
    converted = convert_sync_batchnorm(copy.deepcopy(net), process_group=GROUP)
    assert [type(m) for m in converted.modules()].count(SyncScaled) == 2 and calls == [GROUP] * 2
    assert_close(converted(x), expected)
    assert converted[1]._converted_from == f"{__name__}.Scaled"
    reverted = revert_sync_batchnorm(pickle.loads(pickle.dumps(converted)))
    assert type(reverted[1]) is Scaled and type(reverted[2][0]) is Scaled  # the registered one
    assert_close(reverted(x), expected)


def test_unknown_subclass_overriding_forward_is_an_error():
    class Doubled(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    net = nn.Sequential(nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(Doubled(3))))
    with pytest.raises(TypeError, match=r"Doubled at '0\.1\.0' .*BatchNorm2d.*overrides "
                                        r"forward.*register_conversion\(Doubled"):
        convert_sync_batchnorm(net)

    class Renamed(nn.BatchNorm1d):  # keeps forward: converts like its base
        pass

    layer = convert_sync_batchnorm(nn.Sequential(Renamed(3)))[0]
    assert type(layer) is SyncBatchNorm and layer.last_input_dim == 3


def test_lazy_batchnorm_converts_once_materialised():
    net = nn.Sequential(nn.Conv2d(2, 3, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"LazyBatchNorm2d at '1' has no num_features yet; "
                                         r"run one forward"):
        convert_sync_batchnorm(net)
    net(torch.randn(2, 2, 3, 3))
    assert type(convert_sync_batchnorm(net)[1]) is SyncBatchNorm


def test_register_conversion_checks_its_arguments():
    with pytest.raises(TypeError, match="module.QualName"):
        encoding_syncbn.register_conversion("BatchNorm2d", lambda m, g: m)
    with pytest.raises(TypeError, match="to_sync must be callable"):
        encoding_syncbn.register_conversion(nn.BatchNorm2d, None)


def test_revert_of_an_unregistered_source_is_an_error():
    layer = convert_sync_batchnorm(nn.BatchNorm2d(3))
    layer._converted_from = "nowhere.Norm"
    with pytest.raises(LookupError, match="converted from nowhere.Norm, whose conversion is "
                                          "not registered"):
        revert_sync_batchnorm(layer)
    with pytest.raises(TypeError, match=r"SyncScaled at the root of the model overrides "
                                        r"forward .*plain form is unknown"):
        revert_sync_batchnorm(SyncScaled(3))  # built directly: what it computes is unknown


def test_classmethod_is_the_converter():
    net = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), GROUP)
    assert type(net[0]) is SyncBatchNorm and net[0].process_group is GROUP


def _package_imports() -> dict[str, set[str]]:
    """Each module of the package: the modules of the package it imports, lazily or not
    (``from . import x`` counted as an import of ``x``)."""
    root = pathlib.Path(encoding_syncbn.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                found.update([f"{base}.{node.module}"] if node.module
                             else [f"{base}.{alias.name}" for alias in node.names])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(alias.name for alias in node.names)
                found.add(getattr(node, "module", None) or "")
        graph[name] = found
    return {name: {m for m in found if m in graph and m != name}
            for name, found in graph.items()}


def test_imports_run_one_way():
    """No module of the package imports, even lazily, one that imports it back (directly or
    through others): the layer does not import its converters, which import the layer. The
    package's ``__init__``, which imports its modules to re-export their names, is left out."""
    graph = _package_imports()
    graph.pop("encoding_syncbn")
    for start in graph:
        reached, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name in graph and name not in reached:
                reached.add(name)
                todo.extend(graph[name])
        assert start not in reached, f"{start} imports a module that imports it back"
    assert not graph["encoding_syncbn.layer.modules"] & {"encoding_syncbn.conversions.convert",
                                                         "encoding_syncbn.layer.norm_act"}


# ---- shared modules (issue 15 item 2) ---------------------------------------------------------


class SharedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.norm = self.bn  # a second name for the same layer
        self.body = nn.Sequential(self.bn, nn.ReLU(), self.bn)

    def forward(self, x):
        return self.body(self.norm(self.conv(x)))


def test_shared_modules_convert_and_revert_as_one_module():
    torch.manual_seed(0)
    net = SharedNorm().double()
    x = torch.randn(6, 3, 3, 3, dtype=torch.float64) * torch.arange(1.0, 7).view(6, 1, 1, 1)
    with torch.no_grad():
        expected = copy.deepcopy(net)(x)
    converted = convert_sync_batchnorm(net)
    assert type(converted.bn) is SyncBatchNorm
    assert converted.norm is converted.bn and converted.body[0] is converted.body[2] is converted.bn
    with torch.no_grad():
        # Per-replica statistics in any of the three calls would be off by up to ~1.
        assert_close(SimulatedDataParallel(converted, 3)(x), expected)
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted.bn) is nn.BatchNorm2d
    assert reverted.norm is reverted.bn and reverted.body[0] is reverted.body[2] is reverted.bn


# ---- revert keeps what the layer computes and its keys (issue 15 item 7) ---------------------


def test_reverted_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 1), SyncBatchNorm(4, activation="leaky_relu", slope=0.1),
        nn.Conv2d(4, 4, 1), SyncBatchNorm(4, activation="relu"),
    ).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    net(x.clone())
    torch.save(net.state_dict(), tmp_path / "synced.pt")
    reverted = revert_sync_batchnorm(copy.deepcopy(net)).eval()
    torch.save(reverted.state_dict(), tmp_path / "plain.pt")
    fresh = revert_sync_batchnorm(copy.deepcopy(net))
    fresh.load_state_dict(torch.load(tmp_path / "synced.pt"), strict=True)
    net.load_state_dict(torch.load(tmp_path / "plain.pt"), strict=True)
    assert_close(reverted(x), net.eval()(x.clone()))
    again = convert_sync_batchnorm(copy.deepcopy(reverted))
    assert [m.activation for m in again.modules() if isinstance(m, SyncBatchNorm)] == [
        "leaky_relu", "relu"]
    assert_close(again(x.clone()), reverted(x))


def test_revert_after_a_6d_input_accepts_6d_input():
    layer = SyncBatchNorm(3).double()
    x = torch.randn(2, 3, 2, 2, 2, 2, dtype=torch.float64)
    expected = layer(x)
    plain = revert_sync_batchnorm(layer)
    assert list(plain.state_dict()) == list(layer.state_dict())
    assert_close(plain(x), expected)


@pytest.mark.parametrize("act", [nn.Hardswish(), nn.SiLU(), nn.GELU(), nn.LeakyReLU(0.3),
                                 nn.ELU(0.5), nn.ReLU(), nn.Identity()])
def test_batchnorm_act_converts_exactly(act):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), BatchNormAct(3, act=act))
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    converted = check_conversion(net, x, replicas=2)
    fused = type(act) is not nn.Hardswish  # the layer has no fused form of it
    assert type(converted[1]) is (SyncBatchNorm if fused else SyncBatchNormAct)
    assert not converted[1].inplace  # the original does not overwrite its input


def test_batchnorm_act_with_a_drop_keeps_its_modules():
    class Half(nn.Module):
        def forward(self, x):
            return x * 0.5

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), BatchNormAct(3, drop=Half(), act=nn.ReLU()))
    converted = check_conversion(net, torch.randn(4, 2, 3, 3, dtype=torch.float64))
    assert type(converted[1]) is SyncBatchNormAct and type(converted[1].act) is nn.ReLU


def test_revert_reads_the_source_of_the_layer_itself():
    class Forwarding(nn.Module):  # reads attributes through to the module it wraps
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["inner"], name)

        def forward(self, x):
            return self.inner(x)

    net = nn.Sequential(Forwarding(convert_sync_batchnorm(nn.BatchNorm2d(3))))
    reverted = revert_sync_batchnorm(net)
    assert type(reverted[0]) is Forwarding and type(reverted[0].inner) is nn.BatchNorm2d


def _same_step_under_data_parallel(converted: nn.Module, twin: nn.Module) -> torch.Tensor:
    """A training step of ``converted`` under (simulated) DataParallel over 2 replicas and
    one of ``twin`` (its plain original) on the whole batch: the same output; both
    backpropagated. Returns the batch."""
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    out = SimulatedDataParallel(converted, 2)(x)
    expected = twin(x)
    assert_close(out, expected, what="output")
    out.square().sum().backward()
    expected.square().sum().backward()
    return x


def test_parametrized_batchnorm_keeps_its_parametrization():
    """A BatchNorm whose weight is parametrized (``torch.nn.utils.parametrize``) converts to a
    layer computing with that parametrization, training the same original Parameter (an
    optimizer made before the conversion still works), synchronised under DataParallel; and
    reverts to one that still has it."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    parametrize.register_parametrization(model[1], "weight", Doubled())
    original = model[1].parametrizations.weight.original
    twin = copy.deepcopy(model)
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm)
    assert converted[1].parametrizations.weight.original is original
    x = _same_step_under_data_parallel(converted, twin)
    assert_close(original.grad, twin[1].parametrizations.weight.original.grad,
                 what="the original parameter's grad")
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[1]).__name__ == "ParametrizedBatchNorm2d"
    assert reverted[1].parametrizations.weight.original is original
    assert_close(reverted(x), twin(x), what="reverted output")


def test_pruned_batchnorm_keeps_its_pruning():
    """A BatchNorm pruned with ``torch.nn.utils.prune`` (``weight_orig``, ``weight_mask``, the
    weight a forward pre-hook computes from them) converts to a layer computing with the
    pruned weight and training the same ``weight_orig``, synchronised under DataParallel; the
    pruning can still be made permanent (``prune.remove``) on the converted layer; a buffer
    of the user's own moves too; and it reverts to a layer still pruned."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.5, -2.0, 0.1, 1.0]))
    twin = copy.deepcopy(model)  # before pruning: a pruned weight cannot be deep-copied
    for net in (model, twin):
        prune.l1_unstructured(net[1], "weight", amount=1)
    model[1].register_buffer("seen", torch.zeros(()), persistent=False)
    original, mask = model[1].weight_orig, model[1].weight_mask
    assert mask.tolist() == [1.0, 1.0, 0.0, 1.0]
    converted = convert_sync_batchnorm(model)
    layer = converted[1]
    assert isinstance(layer, SyncBatchNorm)
    assert layer.weight_orig is original and layer.weight_mask is mask
    assert layer.seen is model[1].seen and "seen" not in layer.state_dict()
    assert layer.state_dict().keys() == twin[1].state_dict().keys()
    x = _same_step_under_data_parallel(converted, twin)
    assert_close(original.grad, twin[1].weight_orig.grad, what="weight_orig grad")
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[1]) is nn.BatchNorm2d and reverted[1].weight_orig is original
    assert_close(reverted(x), twin(x), what="reverted output")
    prune.remove(layer, "weight")
    assert isinstance(layer.weight, nn.Parameter) and not hasattr(layer, "weight_mask")
    assert_close(layer.weight.detach(), original.detach() * mask, what="weight made permanent")


class _Doubled(nn.Module):
    def forward(self, t):
        return 2 * t


def _dressed_model(weight: str, bias: str, extra: str, activation: bool) -> nn.Sequential:
    """Conv + BatchNorm (+ LeakyReLU), its weight and bias each plain, parametrized, pruned or
    weight-normalised, with or without a buffer of the user's own (built the same way on each
    call)."""
    from torch.nn.utils import parametrize, prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, bias=bias != "none"))
    if activation:
        model.append(nn.LeakyReLU(0.2))
    model = model.double()
    bn = model[1]
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, -2.0, 0.1, 1.0]))
        if bn.bias is not None:
            bn.bias.copy_(torch.tensor([0.3, -0.1, 0.2, -0.4]))
    for name, kind in (("weight", weight), ("bias", bias)):
        if kind == "parametrized":
            parametrize.register_parametrization(bn, name, _Doubled())
        elif kind == "pruned":
            prune.l1_unstructured(bn, name, amount=1)
        elif kind == "weight_norm":  # the deprecated hook-based one: name_g, name_v
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                torch.nn.utils.weight_norm(bn, name, dim=0)
    if extra != "none":
        bn.register_buffer("seen", torch.arange(4.0), persistent=extra == "persistent")
    return model


def _same_objects(found: dict, expected: dict) -> bool:
    return found.keys() == expected.keys() and all(found[k] is expected[k] for k in found)


@settings(max_examples=16, deadline=None)
@given(weight=st.sampled_from(["plain", "parametrized", "pruned", "weight_norm"]),
       bias=st.sampled_from(["plain", "parametrized", "pruned", "weight_norm", "none"]),
       extra=st.sampled_from(["none", "persistent", "transient"]),
       activation=st.booleans(), inplace=st.booleans())
@example(weight="weight_norm", bias="pruned", extra="transient", activation=True, inplace=True)
@example(weight="pruned", bias="weight_norm", extra="persistent", activation=True, inplace=False)
@example(weight="parametrized", bias="parametrized", extra="none", activation=True, inplace=True)
def test_conversion_keeps_every_kind_of_state(weight, bias, extra, activation, inplace):
    """Whatever holds a BatchNorm's weight and bias (Parameters, parametrizations, pruning or
    weight_norm's hook)
    and whatever buffers were added: the converted model (convert_sync_batchnorm, or
    convert_inplace_abn: then the BatchNorm has hooks when pruned, and stays out of place)
    has the same state_dict keys and the same leaf tensors, computes the same training step
    under DataParallel as the original on the whole batch, and reverts to the same again."""
    from encoding_syncbn import convert_inplace_abn

    model, twin = (_dressed_model(weight, bias, extra, activation) for _ in range(2))
    leaves = {name: t for name, t in model[1].named_parameters()}
    keys = twin.state_dict().keys()
    converted = (convert_inplace_abn if inplace else convert_sync_batchnorm)(model)
    layer = converted[1]
    assert isinstance(layer, SyncBatchNorm)
    assert converted.state_dict().keys() == keys
    assert _same_objects(dict(layer.named_parameters()), leaves)
    x = _same_step_under_data_parallel(converted, twin)
    for name, leaf in leaves.items():
        assert_close(leaf.grad, twin[1].get_parameter(name).grad, what=f"{name} grad")
    reverted = revert_sync_batchnorm(converted)
    assert reverted.state_dict().keys() == keys
    assert _same_objects(dict(reverted[1].named_parameters()), leaves)
    with torch.no_grad():
        assert_close(reverted(x), twin(x), what="reverted output")


def test_child_modules_of_a_batchnorm_subclass_move_with_it():
    """A BatchNorm subclass that keeps BatchNorm's forward but holds modules of its own: they
    stay in the converted and the reverted layer (the same objects, the same state_dict)."""

    class Probed(nn.BatchNorm2d):
        def __init__(self, channels):
            super().__init__(channels)
            self.probe = nn.Linear(2, 2)

    model = nn.Sequential(nn.Conv2d(3, 4, 1), Probed(4))
    probe, keys = model[1].probe, model.state_dict().keys()
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm) and converted[1].probe is probe
    assert converted.state_dict().keys() == keys
    reverted = revert_sync_batchnorm(converted)
    assert reverted[1].probe is probe and reverted.state_dict().keys() == keys


def test_hooks_move_with_the_layer():
    """Hooks registered on a BatchNorm run on the layer it converts to and on the one it
    reverts to; the handles they were registered with still remove them."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    calls = []
    pre = model[1].register_forward_pre_hook(lambda module, args: calls.append("pre"))
    post = model[1].register_forward_hook(lambda module, args, out: calls.append("post"))
    back = model[1].register_full_backward_hook(lambda module, gin, gout: calls.append("back"))
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    converted = convert_sync_batchnorm(model)
    converted(x).sum().backward()
    assert calls == ["pre", "post", "back"]
    reverted = revert_sync_batchnorm(converted)
    assert isinstance(reverted[1], nn.BatchNorm2d)
    reverted(x).sum().backward()
    assert calls == ["pre", "post", "back"] * 2
    for handle in (pre, post, back):
        handle.remove()
    converted(x).sum().backward()
    reverted(x).sum().backward()
    assert calls == ["pre", "post", "back"] * 2
