"""convert_inplace_abn: which BatchNorms run in place, and that the model computes the same.

Real models come from the installed libraries (tests/third_party.py explains the torchvision
import); hand-written modules cover each dataflow rule.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import each_backend
from convert_check import assert_same_run, check_converted, check_reverted
from reference import assert_close
from third_party import import_or_skip
from torch import nn

from encoding_syncbn import SyncBatchNorm, convert_inplace_abn

pytestmark = each_backend


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


@pytest.mark.parametrize("hooked", ["bn1", "act1"])
def test_hooks_see_what_they_saw(hooked):
    """Forward hooks that keep references to their module's input and output (feature
    extractors do) still run after ``convert_inplace_abn`` and hold the same values: a
    BatchNorm with hooks stays out of place (its input would be overwritten, its output
    replaced by the activation's), an activation module with hooks is not fused away (its
    BatchNorm runs in place without activation before it)."""
    torch.manual_seed(0)
    original = Residual(act_inplace=False).double()
    copied = copy.deepcopy(original)
    kept = {"original": [], "converted": []}
    for name, model in (("original", original), ("converted", copied)):
        model.get_submodule(hooked).register_forward_hook(
            lambda module, args, out, seen=kept[name]: seen.append((args[0], out)))
    converted = convert_inplace_abn(copied)
    assert modes(converted)["bn1"] == (("none", False) if hooked == "bn1" else
                                       ("identity", True))
    assert type(converted.act1) is nn.LeakyReLU
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    assert_close(converted(x), original(x), what="output")
    assert len(kept["converted"]) == len(kept["original"]) == 1
    for got, expected, what in zip(kept["converted"][0], kept["original"][0],
                                   ("input", "output")):
        assert_close(got, expected, what=f"the hook's {what}")
