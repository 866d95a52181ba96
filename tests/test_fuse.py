"""convert_inplace_abn: which BatchNorms run in place, and that the model computes the same.

Real models come from the installed libraries (tests/third_party.py explains the torchvision
import); hand-written modules cover each dataflow rule.
"""

from __future__ import annotations

import collections
import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from backends import each_backend, one_backend
from convert_check import (
    assert_same_run,
    assert_same_state,
    check_converted,
    check_reverted,
    run,
)
from reference import assert_close
from third_party import import_or_skip
from torch import nn

from encoding_syncbn import SyncBatchNorm, convert_inplace_abn

pytestmark = each_backend


def rows(report) -> dict:
    """path -> the report's row."""
    return {row.path: row for row in report.rows}


def modes(model: nn.Module) -> dict[str, tuple[str, bool]]:
    """path -> (activation, inplace) of every SyncBatchNorm."""
    return {name: (m.activation, m.inplace) for name, m in model.named_modules()
            if isinstance(m, SyncBatchNorm)}


def check_exact(original: nn.Module, x: torch.Tensor, replicas: int = 0,
                deep: bool = False) -> nn.Module:
    """``convert_inplace_abn`` of a copy of ``original`` (float64) computes the same: train and
    eval, outputs, input and parameter gradients, buffers after each step; the original
    ``state_dict`` loads strictly; optionally under SimulatedDataParallel; revert too (see
    ``convert_check``; every parameter's gradient is compared here).

    ``deep``: gradients to 1e-7 relative instead of 1e-10. In place, each layer's backward
    rebuilds its input from its output; through a deep model's BatchNorm backwards (which
    subtract nearly equal terms) those roundings reach the first layers' gradients at about
    1e-9 of their scale (smp's Unet: 3e-9 of 17). Outputs and statistics stay at 1e-10.
    """
    original = original.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untraceable models warn; tested apart
        converted = convert_inplace_abn(copy.deepcopy(original))
    check_converted(converted, original, x, replicas,
                    same_run=_assert_same_run_deep if deep else assert_same_run)
    check_reverted(converted, original, x)
    return converted


def _assert_same_run_deep(actual, expected, what: str) -> None:
    (outs, dx, params), (ref_outs, ref_dx, ref_params) = actual, expected
    for out, ref in zip(outs, ref_outs, strict=True):
        assert_close(out, ref, what=f"{what}: output")
    assert params.keys() == ref_params.keys(), what
    for name, grad in [("input", dx), *params.items()]:
        ref = ref_dx if name == "input" else ref_params[name]
        torch.testing.assert_close(grad, ref, rtol=1e-7, atol=1e-7 * ref.abs().max().item(),
                                   msg=lambda m, name=name: f"{what}: gradient of {name}: {m}")


def conv_bn(channels: int = 4) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)


class Residual(nn.Module):
    """torchvision's BasicBlock, with LeakyReLU: bn1 may be fused, bn2 (``out += identity``)
    and the shortcut's BN may not."""

    def __init__(self, shared_act: bool = False, act_inplace: bool = True) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn()
        self.conv2, self.bn2 = conv_bn()
        self.act1 = nn.LeakyReLU(0.1, inplace=act_inplace)
        self.act2 = self.act1 if shared_act else nn.LeakyReLU(0.1, inplace=act_inplace)
        self.shortcut = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        identity = self.shortcut(x)
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.head(self.act2(out))


class Functional(nn.Module):
    """``F.leaky_relu`` after the BN: in place without activation (the call stays)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.inplace = inplace
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(F.leaky_relu(self.bn(self.conv(x)), 0.2, inplace=self.inplace))


class Misuses(nn.Module):
    """No BN here may be fused with its activation (comments: why). Where the activation runs
    out of place (acts 1, 2, 5) the BN may still run in place without activation: the
    activation only reads its output."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(6):
            conv, bn = conv_bn()
            self.add_module(f"conv{i}", conv)
            self.add_module(f"bn{i}", bn)
            self.add_module(f"act{i}", nn.LeakyReLU(0.1, inplace=i not in (1, 2, 5)))
        self.act_zero = nn.LeakyReLU(0.0, inplace=True)

    def forward(self, x):
        h = self.conv0(x)
        a = self.act0(self.bn0(h)) + h  # abn(x) + x: the input read again
        b = self.act1(self.bn1(self.conv1(a)))
        b.mul_(2)  # the output modified in place
        c = self.act2(self.bn2(self.conv2(b)))
        c.view(-1)[:3].add_(1)  # ... through a view
        d = self.act_zero(self.bn3(self.conv3(c)))  # slope 0: not invertible
        e = self.act4(self.bn4(self.conv4(d).view(d.shape)))  # the input is a view
        return self.act5(self.bn5(self.conv5(e)))  # the output leaves the model


def test_residual_block():
    block = Residual()
    converted = check_exact(block, torch.randn(4, 4, 5, 5, dtype=torch.float64), replicas=2)
    assert modes(converted) == {
        "bn1": ("leaky_relu", True), "bn2": ("none", False), "shortcut.1": ("none", False),
    }
    assert type(converted.act1) is nn.Identity and type(converted.act2) is nn.LeakyReLU


@pytest.mark.parametrize("act_inplace", [False, True])
def test_activation_module_also_used_elsewhere(act_inplace):
    """A shared activation stays: bn1 in place without activation before it, if it reads."""
    converted = check_exact(Residual(shared_act=True, act_inplace=act_inplace),
                            torch.randn(4, 4, 5, 5, dtype=torch.float64))
    assert modes(converted)["bn1"] == (("none", False) if act_inplace else ("identity", True))
    assert type(converted.act1) is nn.LeakyReLU


@pytest.mark.parametrize("inplace", [False, True])
def test_functional_activation(inplace):
    converted = check_exact(Functional(inplace), torch.randn(4, 4, 5, 5, dtype=torch.float64))
    assert modes(converted)["bn"] == (("none", False) if inplace else ("identity", True))


def test_misuses_stay_out_of_place():
    converted = check_exact(Misuses(), torch.randn(4, 4, 5, 5, dtype=torch.float64))
    out_of_place, no_act = ("none", False), ("identity", True)
    assert modes(converted) == {
        "bn0": out_of_place, "bn1": no_act, "bn2": no_act, "bn3": out_of_place,
        "bn4": out_of_place, "bn5": no_act,
    }


def test_shared_batchnorm_and_elu():
    """A BN module called twice is in place only if both calls allow it; ELU's alpha kept."""

    class Twice(nn.Module):
        def __init__(self, second_ok: bool) -> None:
            super().__init__()
            self.conv, self.bn = conv_bn()
            self.act = nn.ELU(0.7)
            self.second_ok = second_ok

        def forward(self, x):
            y = self.conv(self.act(self.bn(self.conv(x))))
            h = self.conv(y)
            z = self.act(self.bn(h))
            return self.conv(z) if self.second_ok else self.conv(z) + h

    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    converted = check_exact(Twice(True), x)
    assert modes(converted)["bn"] == ("elu", True) and converted.bn.slope == 0.7
    assert modes(check_exact(Twice(False), x))["bn"] == ("none", False)


def test_untraceable_module_warns_and_converts_its_children():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            conv, bn = conv_bn()
            self.body = nn.Sequential(conv, bn, nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1))

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: fx cannot trace it
                return self.body(x)
            return self.body(-x)

    with pytest.warns(UserWarning, match="could not trace the model"):
        converted = convert_inplace_abn(copy.deepcopy(Branchy()))
    assert modes(converted) == {"body.1": ("leaky_relu", True)}
    check_exact(Branchy(), torch.randn(4, 4, 5, 5, dtype=torch.float64))


class _Keeps(nn.Module):
    """A block whose forward keeps a tensor past the call, as feature-distillation code does:
    the BatchNorm's input (``kept="input"``) or output, ``how``: in an attribute, or in a
    container or holder object an attribute holds."""

    def __init__(self, kept: str, how: str) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.act, self.head = nn.LeakyReLU(0.1), nn.Conv2d(4, 2, 1)
        self.kept, self.how = kept, how
        self.feature: torch.Tensor | None = None
        self.features: list = []
        self.store = {"features": []}
        self.holder = types.SimpleNamespace(feature=None)
        self.recent: collections.deque = collections.deque(maxlen=2)

    def forward(self, x):
        h = self.conv(x)
        y = self.bn(h)
        value = h if self.kept == "input" else y
        if self.how == "attribute":
            self.feature = value
        elif self.how == "list":
            self.features.append(value)
        elif self.how == "tuple in a list":
            self.features.append((value, 1))
        elif self.how == "list in a dict":
            self.store["features"].append(value)
        elif self.how == "namespace":
            self.holder.feature = value
        else:
            self.recent.append(value)
        return self.head(self.act(y))

    def kept_value(self) -> torch.Tensor:
        return {"attribute": lambda: self.feature, "list": lambda: self.features[-1],
                "tuple in a list": lambda: self.features[-1][0],
                "list in a dict": lambda: self.store["features"][-1],
                "namespace": lambda: self.holder.feature,
                "deque": lambda: self.recent[-1]}[self.how]()

    def untouched(self) -> bool:
        return (self.feature is None and self.features == [] and self.store == {"features": []}
                and self.holder.feature is None and len(self.recent) == 0)


@pytest.mark.parametrize("how", ["attribute", "list", "tuple in a list", "list in a dict",
                                 "namespace", "deque"])
@pytest.mark.parametrize("kept", ["input", "output"])
def test_values_kept_past_the_call_keep_their_values(kept, how):
    """A BatchNorm whose input or output the forward keeps (in an attribute, a container, a
    holder object) stays out of place, saying why (in place, the kept tensor was overwritten:
    a distillation loss on it changed); the trace leaves every attribute as it was."""
    model = _Keeps(kept, how)
    converted, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    assert modes(converted) == {"bn": ("none", False)}
    assert f"its {kept}" in report.rows[0].reason and "module attribute" in report.rows[0].reason
    assert converted.untouched()
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    model.double()
    for runner in (model, converted.double()):
        (runner(x).square().sum() + runner.kept_value().square().sum()).backward()
    assert_close(converted.kept_value(), model.kept_value(), what="kept tensor")
    for (name, got), expected in zip(converted.named_parameters(), model.parameters()):
        assert_close(got.grad, expected.grad, what=f"{name} gradient")


@pytest.mark.parametrize("hooked", ["block ending with the conv", "block ending with the bn"])
def test_a_hook_on_a_block_around_the_layer(hooked):
    """A forward hook on a block the trace goes through, whose output is the BatchNorm's
    input or output: the layer stays out of place and the hook keeps what it kept; a
    convolution with only a forward pre-hook (``torch.nn.utils.prune``) leaves its
    BatchNorm fused."""
    torch.manual_seed(0)
    if hooked == "block ending with the conv":
        model = nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 1)), nn.BatchNorm2d(4),
                              nn.LeakyReLU(0.1), nn.Conv2d(4, 2, 1))
        path = "1"
    else:
        model = nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)),
                              nn.LeakyReLU(0.1), nn.Conv2d(4, 2, 1))
        path = "0.1"
    model.double()
    pruned = copy.deepcopy(model)
    torch.nn.utils.prune.l1_unstructured(pruned[0][0], "weight", 0.5)
    assert rows(convert_inplace_abn(pruned, report=True)[1])[path].in_place
    kept = {}
    copied = copy.deepcopy(model)
    for name, runner in (("original", model), ("converted", copied)):
        runner[0].register_forward_hook(
            lambda module, args, out, name=name: kept.__setitem__(name, out))
    converted, report = convert_inplace_abn(copied, report=True)
    assert modes(converted) == {path: ("none", False)}
    assert "handed to a forward hook of '0'" in rows(report)[path].reason
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    assert_close(converted(x), model(x), what="output")
    assert_close(kept["converted"], kept["original"], what="the hook's output")


def test_a_batchnorm_whose_output_is_not_read():
    """A BatchNorm computed for its running statistics, its output unused (an encoder stage
    a decoder ignores, as in smp's PSPNet over efficientnet-b0): out of place, saying so
    (the conversion raised a ValueError)."""

    class Unread(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = conv_bn()
            self.aux_conv, self.aux_bn = conv_bn()
            self.act = nn.LeakyReLU(0.1)

        def forward(self, x):
            y = self.act(self.bn(self.conv(x)))
            self.aux_bn(self.aux_conv(y))
            return y * 2

    converted = check_exact(Unread(), torch.randn(4, 4, 5, 5, dtype=torch.float64))
    assert modes(converted) == {"bn": ("leaky_relu", True), "aux_bn": ("none", False)}
    _, report = convert_inplace_abn(Unread(), report=True)
    assert report.rows[1].reason == "its output is not read"


def _leaky(model: nn.Module) -> nn.Module:
    """``model`` with each ReLU replaced by its own LeakyReLU(0.01) (same inplace flag)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.ReLU:
                setattr(module, name, nn.LeakyReLU(0.01, inplace=child.inplace))
    return model


def test_timm_models():
    """timm's own classes at tiny widths: its ResNet (LeakyReLU, separate act modules) and its
    ConvNormAct blocks (BatchNormAct2d holding the activation)."""
    import_or_skip("timm")
    from timm.layers import ConvNormAct
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    resnet = ResNet(BasicBlock, [1, 1, 1, 1], channels=(8, 8, 8, 8), stem_width=8,
                    act_layer=nn.LeakyReLU, num_classes=4)
    resnet = check_exact(resnet, x, replicas=2, deep=True)
    # The stem's BN and each block's bn1; bn2 precedes `x += shortcut`.
    assert [n for n, m in modes(resnet).items() if m == ("leaky_relu", True)] == [
        "bn1", "layer1.0.bn1", "layer2.0.bn1", "layer3.0.bn1", "layer4.0.bn1"]
    assert modes(resnet)["layer1.0.bn2"] == ("none", False)
    stack = nn.Sequential(
        ConvNormAct(3, 8, 3, act_layer="leaky_relu"), ConvNormAct(8, 8, 3, act_layer="elu"),
        ConvNormAct(8, 8, 1, act_layer="leaky_relu"), nn.Conv2d(8, 2, 1),
    )
    assert type(stack[0].bn).__name__ == "BatchNormAct2d"
    stack = check_exact(stack, x, deep=True)
    assert modes(stack) == {"0.bn": ("leaky_relu", True), "1.bn": ("elu", True),
                            "2.bn": ("leaky_relu", True)}


def test_torchvision_and_smp_models():
    torchvision = import_or_skip("torchvision")
    smp = import_or_skip("segmentation_models_pytorch")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    resnet = torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1],
                                       num_classes=4)
    resnet = check_exact(_leaky(resnet), x, deep=True)
    # Every block applies one LeakyReLU(inplace=True) module twice, once after `out +=
    # identity`: only the stem's BN (its own activation module) is fused.
    assert [n for n, m in modes(resnet).items() if m[1]] == ["bn1"]
    unet = check_exact(_leaky(smp.Unet("resnet18", encoder_weights=None, encoder_depth=2,
                                       decoder_channels=(8, 4), classes=2)),
                       x, deep=True)
    fused = [n for n, m in modes(unet).items() if m == ("leaky_relu", True)]
    assert "decoder.blocks.0.conv1.1" in fused and "encoder.bn1" in fused


def test_training_branches_are_judged_in_both_modes():
    """fx fixes `if self.training:` to the mode traced: both are, and must agree."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = conv_bn()
            self.act = nn.LeakyReLU(0.1)
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            out = self.act(self.bn(self.conv(x)))
            if not self.training:
                out.mul_(2)  # fused, this write would reach the layer's saved output
            return self.head(out)

    for training in (True, False):
        converted = check_exact(Branch().train(training),
                                torch.randn(4, 4, 5, 5, dtype=torch.float64))
        # Fused in training only, in place without activation in eval: neither in both.
        assert modes(converted) == {"bn": ("none", False)}


@pytest.mark.parametrize("hooked", ["conv1", "bn1", "act1"])
def test_hooks_see_what_they_saw(hooked):
    """Forward hooks that keep references to their module's input and output (feature
    extractors do) still run after ``convert_inplace_abn`` and hold the same values: a
    BatchNorm with hooks, or whose input comes from a module with hooks, stays out of place
    (its input would be overwritten, its output replaced by the activation's), an activation
    module with hooks is not fused away (its BatchNorm runs in place without activation
    before it)."""
    torch.manual_seed(0)
    original = Residual(act_inplace=False).double()
    copied = copy.deepcopy(original)
    kept = {"original": [], "converted": []}
    for name, model in (("original", original), ("converted", copied)):
        model.get_submodule(hooked).register_forward_hook(
            lambda module, args, out, seen=kept[name]: seen.append((args[0], out)))
    converted = convert_inplace_abn(copied)
    assert modes(converted)["bn1"] == (("identity", True) if hooked == "act1" else
                                       ("none", False))
    assert type(converted.act1) is nn.LeakyReLU
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    assert_close(converted(x), original(x), what="output")
    assert len(kept["converted"]) == len(kept["original"]) == 1
    for got, expected, what in zip(kept["converted"][0], kept["original"][0],
                                   ("input", "output")):
        assert_close(got, expected, what=f"the hook's {what}")


# ---- every norm layer the registry knows: a leaf of the trace, its state untouched ----------


class _AsRank(nn.Module):
    """``norm`` applied to a 4-D input seen as 3-D (BatchNorm1d) or 5-D (BatchNorm3d)."""

    def __init__(self, norm: nn.Module, rank: int) -> None:
        super().__init__()
        self.norm, self.rank = norm, rank

    def forward(self, x):
        seen = x.flatten(2) if self.rank == 3 else x.unsqueeze(2)
        return self.norm(seen).reshape(x.shape)


class _BatchNormSubclass(nn.modules.batchnorm._BatchNorm):
    """A user's BatchNorm keeping ``_BatchNorm``'s forward (registered through its base)."""

    def _check_input_dim(self, input):
        pass


def _every_norm_layer(timm_abn: nn.Module) -> nn.Module:
    """A conv before each norm class the registry knows (but the lazy BatchNorms, which are
    BatchNorms once they have seen an input), every other one followed by a LeakyReLU that
    may fuse, in float64, with weights, biases, statistics and batch counts of their own,
    every other one with ``momentum=None`` (cumulative average: the factor is 1 / the batch
    count). ``timm_abn``: timm's InplaceAbn (it has no batch count: its momentum stays)."""
    import mapillary
    from timm.layers import BatchNormAct2d, convert_sync_batchnorm

    from encoding_syncbn import inplace_abn as ours
    from encoding_syncbn.layer.norm_act import BatchNormAct

    c, abn = 4, {"activation": "elu", "activation_param": 0.5}
    norms = [
        nn.BatchNorm2d(c), _AsRank(nn.BatchNorm1d(c), 3), _AsRank(nn.BatchNorm3d(c), 5),
        nn.SyncBatchNorm(c), _BatchNormSubclass(c), BatchNormAct(c, act=nn.LeakyReLU(0.2)),
        BatchNormAct2d(c, act_layer=nn.ELU),
        convert_sync_batchnorm(BatchNormAct2d(c, act_layer=nn.Hardswish)), timm_abn,
        ours.ABN(c, **abn), ours.InPlaceABN(c, **abn), ours.InPlaceABNSync(c, **abn),
        mapillary.ABN(c, **abn), mapillary.InPlaceABN(c, **abn),
        mapillary.InPlaceABNSync(c, **abn),
    ]
    layers: list[nn.Module] = [nn.Conv2d(3, c, 1)]
    for i, norm in enumerate(norms):
        layers += [nn.Conv2d(c, c, 3, padding=1), norm]
        if i % 2 == 0:
            layers.append(nn.LeakyReLU(0.1))
        norm = getattr(norm, "norm", norm)  # inside _AsRank
        if getattr(norm, "num_batches_tracked", None) is not None:
            norm.num_batches_tracked.fill_(3 + i)
            norm.momentum = None if i % 2 else 0.1
    model = nn.Sequential(*layers, nn.Conv2d(c, 2, 1)).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "running_mean", None) is not None:
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    return model


def _check_state_untouched_and_same_steps(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``convert_inplace_abn(model)`` traces it whole (no warning), holds the very buffers
    with the same values (batch counts included), and computes what a copy of the original
    does over two training steps (outputs, gradients, state after each) and in evaluation.
    Nothing is loaded into the converted model, which would hide a changed state."""
    reference = copy.deepcopy(model)
    buffers = dict(model.named_buffers())
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a module fx could not trace warns
        converted = convert_inplace_abn(model)
    after = converted.state_dict()
    assert list(after) == list(state)
    for key, value in state.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    for key, buffer in converted.named_buffers():
        assert buffer is buffers[key], f"{key}: a new tensor"
    for step in range(2):
        assert_same_run(run(converted, x, step), run(reference, x, step),
                              f"training step {step}")
        assert_same_state(converted, reference, f"after training step {step}")
    converted.eval()
    reference.eval()
    assert_same_run(run(converted, x), run(reference, x), "evaluation")
    return converted


def test_every_registered_norm_layer_is_a_leaf_and_keeps_its_state(monkeypatch):
    """Every class the registry knows, in one model: the tracer never runs a norm layer's
    forward (mapillary's counts the batch before its extension fails on the tracer's proxy:
    each trace attempt counted one more, in a new tensor, and with ``momentum=None`` the
    running statistics came out wrong), so the whole model is traced, its pairs judged, and
    the converted model computes what the original did, statistics included."""
    import_or_skip("timm")
    import mapillary
    from timm.layers import inplace_abn as timm_iabn

    monkeypatch.setattr(timm_iabn, "inplace_abn", mapillary.inplace_abn)  # its extension's
    timm_abn = timm_iabn.InplaceAbn(4, act_layer="leaky_relu", act_param=0.1)
    model = _every_norm_layer(timm_abn)
    converted = _check_state_untouched_and_same_steps(model, torch.randn(2, 3, 5, 5,
                                                                         dtype=torch.float64))
    # Traced whole: its pairs are judged (BatchNorm2d + its LeakyReLU fused, mapillary's ABN
    # in place with its ELU, the BatchNorm1d/3d on views out of place).
    found = modes(converted)
    assert (found["2"], found["32"], found["5.norm"]) == (
        ("leaky_relu", True), ("elu", True), ("none", False)), found


@one_backend  # the converter's trace; the layers' backends are exercised in the test above
def test_smp_with_mapillarys_inplace_abn_keeps_its_state(monkeypatch):
    """segmentation_models_pytorch's ``decoder_use_norm="inplace"`` (mapillary's InPlaceABN,
    leaky_relu of slope 0) in a Unet, with ``momentum=None``: traced whole, converted
    exactly, no batch counted."""
    smp = import_or_skip("segmentation_models_pytorch")
    import mapillary
    from segmentation_models_pytorch.base import modules as smp_modules

    monkeypatch.setattr(smp_modules, "InPlaceABN", mapillary.InPlaceABN)
    torch.manual_seed(0)
    unet = smp.Unet("resnet18", encoder_weights=None, encoder_depth=2, decoder_channels=(8, 4),
                    classes=2, decoder_use_norm="inplace").double()
    abns = [m for m in unet.modules() if isinstance(m, mapillary.InPlaceABN)]
    assert abns
    for module in abns:
        module.momentum = None
        module.num_batches_tracked.fill_(5)
    _check_state_untouched_and_same_steps(unet, torch.randn(2, 3, 16, 16, dtype=torch.float64))


@pytest.mark.parametrize("layer", ["mapillary", "timm"])
def test_a_layer_that_becomes_in_place_is_a_write(layer, monkeypatch):
    """mapillary's InPlaceABN and timm's InplaceAbn have no ``inplace`` flag but convert to
    in-place layers: fed the output of a BatchNorm + LeakyReLU directly, they would overwrite
    what that fused layer keeps for backward. The BatchNorm runs in place without activation
    (the LeakyReLU stays, and makes the tensor they overwrite); the model computes the same."""
    import mapillary

    if layer == "timm":
        import_or_skip("timm")
        from timm.layers import inplace_abn as timm_iabn

        monkeypatch.setattr(timm_iabn, "inplace_abn", mapillary.inplace_abn)
        abn = timm_iabn.InplaceAbn(4, act_layer="elu", act_param=0.5)
    else:
        abn = mapillary.InPlaceABN(4, activation="elu", activation_param=0.5)
    torch.manual_seed(0)
    conv, bn = conv_bn()
    model = nn.Sequential(conv, bn, nn.LeakyReLU(0.1), abn, nn.Conv2d(4, 2, 1)).double()
    converted = _check_state_untouched_and_same_steps(
        model, torch.randn(4, 4, 5, 5, dtype=torch.float64))
    assert modes(converted) == {"1": ("identity", True), "3": ("elu", True)}
