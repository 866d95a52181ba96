"""The reports of convert_sync_batchnorm, convert_inplace_abn and revert_sync_batchnorm.

Each reason a converter gives is checked where it arises: on real torchvision, timm and smp
models at tiny sizes wherever one has the case, on a hand-written module where none does (a
call with keyword arguments, two calls judged differently, a branch on ``self.training``, a
functional activation, untraceable code, an unknown norm class). The memory estimate is
checked against what autograd keeps in a real training forward, exactly; the kept-tensor
counts of the rows against its activation-sized part. Only the conversions run here, and one
forward per model: test_fuse.py and test_convert_models.py check what the models compute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from third_party import import_or_skip
from torch import nn

from encoding_syncbn import (
    ConversionReport,
    NormLayerReport,
    SyncBatchNorm,
    convert_inplace_abn,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from encoding_syncbn import inplace_abn as ours
from encoding_syncbn.conversions.reporting import FEW_VALUES
from encoding_syncbn.layer.inplace_policy import MIN_REBUILT_COUNT


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models' forwards are small; with several threads on a busy CPU their workers'
    spinning costs 10-100x the arithmetic (tests/test_convert_models.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def leaky(model: nn.Module, inplace: bool | None = None) -> nn.Module:
    """``model`` with each ReLU replaced by its own LeakyReLU(0.01) (its inplace flag, unless
    ``inplace`` says otherwise)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.ReLU:
                flag = child.inplace if inplace is None else inplace
                setattr(module, name, nn.LeakyReLU(0.01, inplace=flag))
    return model


def rows(report: ConversionReport) -> dict[str, NormLayerReport]:
    return {row.path: row for row in report.rows}


def built(make):
    torch.manual_seed(0)
    return make()


def tv_resnet(**kwargs) -> nn.Module:
    torchvision = import_or_skip("torchvision")
    return built(lambda: torchvision.models.resnet18(num_classes=4, **kwargs))


# ---- convert_inplace_abn on real models: every reason, with its operation and line ---------


def test_torchvision_resnet_says_which_operation_keeps_each_layer_out():
    model, report = convert_inplace_abn(leaky(tv_resnet()), report=True)
    found = rows(report)
    assert list(found) == [name for name, m in model.named_modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    stem = found["bn1"]
    assert (stem.in_place, stem.synchronised, stem.activation) == (True, True, "leaky_relu(0.01)")
    assert stem.reason == "fused with relu (LeakyReLU)"
    # torchvision's LeakyReLU is in place: the BatchNorm's output and the activation's are
    # one tensor before; fused, the layer keeps only its output.
    assert (stem.kept_before, stem.kept_after) == (2, 1)
    # Every block applies one in-place activation module twice.
    assert found["layer1.0.bn1"].reason == (
        "its activation layer1.0.relu (LeakyReLU) also runs elsewhere, in place: it can be "
        "neither fused nor left to read the output")
    bn2 = found["layer1.0.bn2"]
    assert not bn2.in_place and bn2.reason == "its output is modified in place by `+=`"
    assert bn2.source.startswith("resnet.py:") and bn2.source.endswith(": out += identity")
    shortcut = found["layer2.0.downsample.1"]
    assert shortcut.reason == "no LeakyReLU or ELU follows it to fuse: its output goes to `+=`"
    assert shortcut.source.endswith("out += identity")
    assert all(row.before == "BatchNorm2d" and row.after == "SyncBatchNorm"
               for row in report.rows)


def test_torchvision_resnet_with_out_of_place_activations_and_relu():
    """An out-of-place activation module applied twice stays: its BatchNorms run in place
    without activation before it; ReLU cannot be inverted."""
    _, report = convert_inplace_abn(leaky(tv_resnet(), inplace=False), report=True)
    bn1 = rows(report)["layer1.0.bn1"]
    assert (bn1.in_place, bn1.activation) == (True, "identity")
    assert bn1.reason == ("in place without activation: layer1.0.relu (LeakyReLU) stays (the "
                          "module also runs elsewhere)")
    assert (bn1.kept_before, bn1.kept_after) == (3, 2)
    _, report = convert_inplace_abn(tv_resnet(), report=True)
    assert rows(report)["bn1"].reason == (
        "its activation relu (ReLU) is not invertible (only LeakyReLU and ELU of slope > 0 "
        "are)")


def test_torchvision_feature_extractor_reads_and_returns_outputs():
    """torchvision's create_feature_extractor returns inner outputs: a BatchNorm's output
    returned, or read by its activation and returned, stays out of place."""
    import_or_skip("torchvision")
    from torchvision.models.feature_extraction import create_feature_extractor

    resnet = leaky(tv_resnet())
    _, report = convert_inplace_abn(create_feature_extractor(resnet, {"bn1": "stem"}),
                                    report=True)
    assert rows(report)["bn1"].reason == (
        "its output is returned by the traced module, whose caller may modify it")
    extractor = create_feature_extractor(resnet, {"bn1": "stem", "layer1": "c2"})
    _, report = convert_inplace_abn(extractor, report=True)
    assert rows(report)["bn1"].reason == (
        "its output is read twice, by relu (LeakyReLU) and the traced module's output")


@pytest.mark.parametrize("hooked", ["bn1", "act1"])
def test_timm_resnet_with_hooks(hooked):
    timm = import_or_skip("timm")
    model = built(lambda: timm.create_model("resnet18", act_layer="leaky_relu",
                                            num_classes=4))
    _, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    assert rows(report)["bn1"].reason == "fused with act1 (LeakyReLU)"
    model.get_submodule(hooked).register_forward_hook(lambda module, args, out: None)
    _, report = convert_inplace_abn(model, report=True)
    stem = rows(report)["bn1"]
    assert not stem.in_place
    assert stem.reason == (
        "a hook is registered on it (a hook may keep its input, which would be overwritten)"
        if hooked == "bn1" else "its activation act1 (LeakyReLU) writes over its output "
        "(inplace=True) and cannot be fused: a hook is registered on it")
    bn2 = rows(report)["layer1.0.bn2"]
    assert bn2.reason == "its output is modified in place by `+=`"
    assert bn2.source.endswith(": x += shortcut")


def test_timm_resnet_with_a_leaky_relu_of_slope_0():
    timm = import_or_skip("timm")
    model = built(lambda: timm.create_model(
        "resnet18", num_classes=4,
        act_layer=functools.partial(nn.LeakyReLU, negative_slope=0.0)))
    _, report = convert_inplace_abn(model, report=True)
    stem = rows(report)["bn1"]
    assert stem.reason == "its activation act1 (LeakyReLU) is not invertible (slope 0)"
    assert stem.source.endswith(": x = self.act1(x)")


def test_timm_efficientnet_and_mobilenet_norm_act_layers():
    """timm's BatchNormAct2d holds its activation: fused in place where it is LeakyReLU,
    out of place where it is SiLU (which saves a tensor: SiLU in place keeps a copy of its
    input), kept as a module where it has no fused form (Hardswish)."""
    timm = import_or_skip("timm")
    model = built(lambda: timm.create_model("efficientnet_b0", act_layer="leaky_relu",
                                            num_classes=4))
    _, report = convert_inplace_abn(model, report=True)
    found = rows(report)
    assert found["bn1"].reason == "fused with its own leaky_relu"
    assert (found["bn1"].before, found["bn1"].after) == ("BatchNormAct2d", "SyncBatchNorm")
    assert found["blocks.0.0.bn2"].reason == (
        "its own activation is an identity, converted out of place as it was")
    model = built(lambda: timm.create_model("efficientnet_b0", num_classes=4))
    _, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    stem = rows(report)["bn1"]
    assert stem.reason == ("its own activation silu is not invertible (only leaky_relu and "
                           "elu of slope > 0 are)")
    assert (stem.activation, stem.kept_before, stem.kept_after) == ("silu", 3, 2)
    _, report = convert_sync_batchnorm(model, report=True)
    assert rows(report)["bn1"].reason == "synchronised, its silu fused out of place"
    model = built(lambda: timm.create_model("mobilenetv3_small_050", num_classes=4))
    _, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    stem = rows(report)["bn1"]
    assert stem.reason == ("its activation module Hardswish has no fused form, so it stays "
                           "after the layer")
    assert (stem.after, stem.activation) == ("SyncBatchNormAct", "Hardswish (module)")
    _, report = convert_sync_batchnorm(model, report=True)
    assert rows(report)["bn1"].reason == (
        "synchronised; its Hardswish module has no fused form and runs after it")


def test_timm_norm_act_with_a_drop_module_names_it():
    """timm's BatchNormAct2d with a drop module before its LeakyReLU: kept as modules, and
    the reason names the drop module (LeakyReLU has a fused form)."""
    import_or_skip("timm")
    from timm.layers import BatchNormAct2d

    model = nn.Sequential(nn.Conv2d(3, 4, 1),
                          BatchNormAct2d(4, act_layer=nn.LeakyReLU, drop_layer=nn.Dropout))
    _, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    assert rows(report)["1"].reason == (
        "its Dropout module comes between it and its LeakyReLU, so both stay after the layer")
    _, report = convert_sync_batchnorm(model, report=True)
    assert rows(report)["1"].reason == (
        "synchronised; its Dropout module comes between it and its LeakyReLU: both run after it")


def test_timm_preactivation_resnet_reads_its_inputs_again():
    """ResNetV2 normalises each block's input first: that input comes from a pooling
    layer, or is read again by the residual sum."""
    import_or_skip("timm")
    from timm.layers import BatchNormAct2d
    from timm.models.resnetv2 import ResNetV2

    model = built(lambda: ResNetV2([2, 1], channels=(8, 16), stem_chs=8, num_classes=2,
                                   norm_layer=BatchNormAct2d, act_layer=nn.LeakyReLU,
                                   conv_layer=nn.Conv2d))
    _, report = convert_inplace_abn(model, report=True)
    found = rows(report)
    first = found["stages.0.blocks.0.norm1"]
    assert first.reason == ("its input may be shared: it comes from stem.pool (MaxPool2d), "
                            "not from a convolution, linear layer or arithmetic")
    assert first.source.endswith(": x = self.stem(x)")
    assert found["stages.0.blocks.1.norm1"].reason.startswith(
        "its input is read again, by `+`")
    assert found["stages.0.blocks.1.norm2"].in_place


class InvertibleInPlaceABN(ours.InPlaceABN):
    """smp's decoder layer with a slope that may run in place."""

    def __init__(self, num_features: int, activation: str, activation_param: float) -> None:
        super().__init__(num_features, activation=activation, activation_param=0.01)


def test_smp_unet_and_its_inplace_abn_decoder(monkeypatch):
    """smp's Unet fuses its decoder's BatchNorm + LeakyReLU; its ``decoder_use_norm=
    "inplace"`` layers (InPlaceABN, leaky_relu of slope 0) cannot run in place, and at a
    slope above 0 are in place already."""
    smp = import_or_skip("segmentation_models_pytorch")
    from segmentation_models_pytorch.base import modules as smp_modules

    def unet(**kwargs):
        return built(lambda: smp.Unet("resnet18", encoder_weights=None, encoder_depth=2,
                                      decoder_channels=(8, 4), classes=2, **kwargs))

    _, report = convert_inplace_abn(leaky(unet()), report=True)
    found = rows(report)
    assert found["decoder.blocks.0.conv1.1"].reason == (
        "fused with decoder.blocks.0.conv1.2 (LeakyReLU)")
    assert found["encoder.layer1.0.bn2"].reason == "its output is modified in place by `+=`"
    monkeypatch.setattr(smp_modules, "InPlaceABN", ours.InPlaceABN)
    _, report = convert_inplace_abn(unet(decoder_use_norm="inplace"), report=True)
    decoder = rows(report)["decoder.blocks.0.conv1.1"]
    assert (decoder.before, decoder.after, decoder.in_place) == (
        "InPlaceABN", "InPlaceABNSync", False)
    assert decoder.reason == ("its own activation leaky_relu(0) is not invertible (only "
                              "leaky_relu and elu of slope > 0 are)")
    monkeypatch.setattr(smp_modules, "InPlaceABN", InvertibleInPlaceABN)
    model = unet(decoder_use_norm="inplace")
    _, report = convert_inplace_abn(copy.deepcopy(model), report=True)
    decoder = rows(report)["decoder.blocks.0.conv1.1"]
    assert decoder.in_place and decoder.reason == "in place already, as InPlaceABNSync"
    assert (decoder.kept_before, decoder.kept_after) == (1, 1)
    _, report = convert_sync_batchnorm(model, report=True)
    assert rows(report)["decoder.blocks.0.conv1.1"].reason == "synchronised, in place as it was"


# ---- convert_inplace_abn: the reasons no real model here gives ----------------------------


def conv_bn(channels: int = 4) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.act = nn.LeakyReLU()

    def forward(self, x):
        return self.act(self.bn(input=self.conv(x)))


class Functional(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.inplace = inplace

    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x)), 0.2, inplace=self.inplace)


_FUNCTIONAL_LINE = inspect.getsourcelines(Functional.forward)[1] + 1


class TwoActivations(nn.Module):
    """One BatchNorm called before an ELU, then before a LeakyReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.elu, self.leaky = nn.ELU(), nn.LeakyReLU()

    def forward(self, x):
        return self.conv(self.leaky(self.bn(self.conv(self.elu(self.bn(self.conv(x)))))))


class EvalWrite(nn.Module):
    """Its activation's output modified in place in eval mode only."""

    def __init__(self, act_inplace: bool) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.act = nn.LeakyReLU(inplace=act_inplace)

    def forward(self, x):
        out = self.act(self.bn(self.conv(x)))
        if not self.training:
            out.mul_(2)
        return out * 1


class TrainWrite(nn.Module):
    """Its activation's output modified in place in training only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.act = nn.LeakyReLU(inplace=True)

    def forward(self, x):
        out = self.act(self.bn(self.conv(x)))
        if self.training:
            out.add_(1)
        return out * 1


class SecondCallWritten(nn.Module):
    """One BatchNorm called twice, fused the first time, its output modified in place the
    second."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()
        self.act = nn.LeakyReLU()

    def forward(self, x):
        y = self.bn(self.conv(self.act(self.bn(self.conv(x)))))
        y += 1
        return y * 1


class Subclassed(SyncBatchNorm):
    """A synchronised layer's subclass: kept as the user made it."""


class Wrapped(nn.Module):
    """``bn`` between a convolution and a LeakyReLU; ``called=False``: never called."""

    def __init__(self, bn: nn.Module, called: bool = True) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 1), bn, nn.LeakyReLU()
        self.head, self.called = nn.Conv2d(4, 4, 1), called

    def forward(self, x):
        h = self.conv(x)
        return self.head(self.act(self.bn(h) if self.called else h))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = conv_bn()

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace it
            x = -x
        return self.bn(self.conv(x))


@pytest.mark.parametrize("model, reason", [
    (Keyword(), "it is called with other arguments than one tensor"),
    (Functional(inplace=False), "in place without activation: F.leaky_relu stays (a function "
     "call, not a module to absorb)"),
    (Functional(inplace=True), "its activation F.leaky_relu writes over its output "
     "(inplace=True) and cannot be fused: a function call, not a module to absorb"),
    (TwoActivations(), "its 2 calls would fuse it differently: fused with elu (ELU); fused "
     "with leaky (LeakyReLU)"),
    (EvalWrite(act_inplace=True), "its activation act (LeakyReLU) writes over its output "
     "(inplace=True) and cannot be fused: its output is modified in place by `.mul_()` (in "
     "eval mode)"),
    (EvalWrite(act_inplace=False), "the modes disagree: fused with act (LeakyReLU) in train "
     "mode, in place without activation: act (LeakyReLU) stays (its output is modified in "
     "place by `.mul_()`) in eval mode"),
    (Untraceable(), "no traced graph calls it: out of place (torch.fx could not trace the "
     "model)"),
    (TrainWrite(), "its activation act (LeakyReLU) writes over its output (inplace=True) "
     "and cannot be fused: its output is modified in place by `.add_()` (in train mode)"),
    (SecondCallWritten(), "its output is modified in place by `+=` (in one of its 2 calls)"),
    (Wrapped(Subclassed(4)), "its synchronised form Subclassed stays as it is (only a "
     "SyncBatchNorm is made in place)"),
    (Wrapped(SyncBatchNorm(4, activation="leaky_relu")), "in place already"),
    (Wrapped(nn.BatchNorm2d(4), called=False), "no traced graph calls it: out of place"),
])
def test_hand_written_cases(model, reason):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untraceable model warns (test_fuse.py)
        _, report = convert_inplace_abn(model, report=True)
    assert rows(report)["bn"].reason == reason


@pytest.mark.parametrize("inplace", [False, True])
def test_a_functional_activation_names_its_line(inplace):
    """The line of an ``F.leaky_relu`` call, not one of torch's own (its
    ``__torch_function__`` dispatch, through which fx records it)."""
    _, report = convert_inplace_abn(Functional(inplace), report=True)
    assert rows(report)["bn"].source == (
        f"test_conversion_report.py:{_FUNCTIONAL_LINE}: "
        "return F.leaky_relu(self.bn(self.conv(x)), 0.2, inplace=self.inplace)")


@pytest.mark.parametrize("act_inplace", [False, True])
def test_eval_write_names_its_line(act_inplace):
    _, report = convert_inplace_abn(EvalWrite(act_inplace), report=True)
    assert rows(report)["bn"].source.endswith(": out.mul_(2)")


# ---- convert_sync_batchnorm and revert_sync_batchnorm --------------------------------------


class MyBatchNorm2d(nn.Module):
    """A user's BatchNorm written from scratch: no conversion knows it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=self.training)


def test_sync_report_says_what_it_left_and_why():
    torchvision = import_or_skip("torchvision")
    frozen = tv_resnet(norm_layer=torchvision.ops.misc.FrozenBatchNorm2d)
    _, report = convert_sync_batchnorm(frozen, report=True)
    assert len(report.rows) == 20
    assert {(row.before, row.after, row.synchronised, row.reason) for row in report.rows} == {
        ("FrozenBatchNorm2d", "FrozenBatchNorm2d", False,
         "a frozen BatchNorm: fixed statistics, nothing to synchronise")}
    assert report.summary() == ("convert_sync_batchnorm: 0 of 20 norm layers synchronised, "
                                "0 in place, saves ~0% of BN activations")
    mixed = nn.Sequential(nn.Conv2d(3, 4, 1), MyBatchNorm2d(4), SyncBatchNorm(4),
                          nn.BatchNorm2d(4), SyncBatchNorm(4, sync=False))
    _, report = convert_sync_batchnorm(mixed, report=True)
    assert [(row.path, row.synchronised, row.reason) for row in report.rows] == [
        ("1", False, "an unknown norm class: no conversion is registered for it "
                     "(encoding_syncbn.register_conversion teaches one)"),
        ("2", True, "synchronised already: left as it is"),
        ("3", True, "synchronised"),
        ("4", False, "left as it is: sync=False makes it per replica"),
    ]
    reverted, report = revert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(3, 4, 1), SyncBatchNorm(4, activation="leaky_relu"),
                      nn.BatchNorm2d(4)), report=True, input_shape=(2, 3, 8, 8))
    assert [(row.after, row.synchronised, row.reason, row.kept_before, row.kept_after)
            for row in report.rows] == [
        ("BatchNormAct", False, "per replica again", 1, 2),
        ("BatchNorm2d", False, "not synchronised: left as it is", 2, 2)]
    assert report.rows[0].saved_bytes == -2 * 4 * 8 * 8 * 4
    assert "adds ~33% of BN activations" in report.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_kept_aside_are_the_layers_own(dtype):
    """The report counts the channels each in-place layer keeps aside as the layer chooses
    them in a training call (mapillary's InPlaceABN: from |w| + eps), and ELU's all in half
    precision, where it runs out of place."""
    layers = [SyncBatchNorm(4, activation="leaky_relu"), ours.InPlaceABNSync(4),
              SyncBatchNorm(4, activation="elu", slope=1.0)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.tensor([1e-5, 0.5, 1.0, 0.0]))
            layer.bias.copy_(torch.tensor([0.0, 1.0, 0.1, 0.0]))
    model = nn.Sequential(nn.Conv2d(3, 4, 1), *layers)
    _, report = convert_sync_batchnorm(model, report=True)
    half = dtype is torch.bfloat16
    for layer, row in zip(layers, report.rows):
        layer(torch.randn(8, 4, 3, 3, dtype=dtype))
        if half and layer.activation == "elu":
            assert row.channels_aside[1] == 4
            continue
        assert layer._channels_aside.known is not None
        assert row.channels_aside[half] == len(layer._channels_aside.known), row.path
    assert [row.channels_aside for row in report.rows] == [(3, 3), (3, 3), (3, 4)]
    assert "aside fp32/half" in str(report) and "  3/3  " in str(report)


# ---- the memory estimate and the counts, against what autograd keeps ----------------------


def kept_by_autograd(model: nn.Module, shape: tuple[int, ...], activations: bool = False
                     ) -> int:
    """Bytes of the distinct storages one training forward saves for backward, the
    parameters' excluded (as benchmarks/bench_inplace_memory.py counts); ``activations``:
    only tensors of 2 or more dimensions (not the per-channel statistics)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and (tensor.dim() > 1 or not activations):
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randn(shape) * 1)
    return sum(storages.values())


def _models():
    timm = import_or_skip("timm")
    smp = import_or_skip("segmentation_models_pytorch")
    return {
        "torchvision resnet18": lambda: leaky(tv_resnet()),
        "timm efficientnet_b0": lambda: timm.create_model("efficientnet_b0", num_classes=4,
                                                          act_layer="leaky_relu"),
        "smp Unet": lambda: leaky(smp.Unet("resnet18", encoder_weights=None, encoder_depth=3,
                                           decoder_channels=(16, 8, 4), classes=2)),
    }


@pytest.mark.parametrize("name", ["torchvision resnet18", "timm efficientnet_b0", "smp Unet"])
def test_memory_estimate_is_what_autograd_keeps(name):
    """The estimate, from meta tensors, is the bytes a real training forward keeps, before
    and after; the rows' savings are the change of its activation-sized tensors."""
    original = built(_models()[name])
    # Enough values a channel at every layer (the efficientnet's last, at 1x1: the batch) to
    # train in place: their output goes to the pooling, which keeps nothing.
    shape = (24, 3, 32, 32)
    state = copy.deepcopy(original.state_dict())
    converted, report = convert_inplace_abn(copy.deepcopy(original), report=True,
                                            input_shape=shape)
    for key, value in converted.state_dict().items():  # the meta runs changed no state
        assert torch.equal(value, state[key]), key
    assert report.memory.input_shape == shape and report.memory.dtype == "float32"
    assert report.memory.before_bytes == kept_by_autograd(copy.deepcopy(original), shape)
    assert report.memory.after_bytes == kept_by_autograd(converted, shape)
    assert all(row.input_bytes is not None for row in report.rows)
    assert sum(row.saved_bytes for row in report.rows) == (
        kept_by_autograd(original, shape, activations=True)
        - kept_by_autograd(converted, shape, activations=True)) > 0
    assert not any(FEW_VALUES in row.reason for row in report.rows)


def test_memory_estimate_of_a_cumulative_average_batchnorm():
    """``momentum=None`` (nn.BatchNorm reads its batch count on the host, where the meta
    copy has no value): estimated, the bytes autograd keeps, the model's own momentum
    untouched (the estimate failed, blaming the input shape)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=None),
                          nn.LeakyReLU(), nn.Conv2d(8, 4, 1))
    shape = (2, 3, 8, 8)
    converted, report = convert_sync_batchnorm(copy.deepcopy(model), report=True,
                                               input_shape=shape)
    assert report.memory.before_bytes == kept_by_autograd(copy.deepcopy(model), shape)
    assert report.memory.after_bytes == kept_by_autograd(converted, shape)
    assert converted[1].momentum is None


@pytest.mark.parametrize("batch", [4, MIN_REBUILT_COUNT])
def test_a_layer_over_too_few_values_trains_out_of_place_in_the_estimate(batch):
    """An image-pooling branch, (N, C, 1, 1): over fewer than MIN_REBUILT_COUNT values a
    channel its in-place layer trains out of place (keeping its input); the row says so and
    counts it so, as autograd keeps it. Over enough values, in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8),
                          nn.LeakyReLU(), nn.Conv2d(8, 4, 1))
    shape = (batch, 3, 8, 8)
    converted, report = convert_inplace_abn(copy.deepcopy(model), report=True,
                                            input_shape=shape)
    row = rows(report)["2"]
    few = batch < MIN_REBUILT_COUNT
    assert row.in_place and (FEW_VALUES in row.reason) == few
    assert row.kept_after == (2 if few else 1)
    assert row.saved_bytes == (kept_by_autograd(model, shape, activations=True)
                               - kept_by_autograd(converted, shape, activations=True))


def test_a_model_in_data_parallel():
    """The model inside DataParallel is traced, its paths through the wrapper; the estimate
    runs the wrapped model (no devices to scatter a meta copy to)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(),
                          nn.Conv2d(4, 2, 1))
    shape = (2, 3, 8, 8)
    reference = copy.deepcopy(model)
    expected = kept_by_autograd(copy.deepcopy(model), shape)
    converted, report = convert_inplace_abn(nn.DataParallel(model), report=True,
                                            input_shape=shape)
    x = torch.randn(shape)
    torch.testing.assert_close(converted(x * 1), reference(x))
    assert [(row.path, row.in_place, row.input_bytes) for row in report.rows] == [
        ("module.1", True, 2 * 4 * 8 * 8 * 4)]
    assert report.memory.before_bytes == expected
    assert report.memory.after_bytes == kept_by_autograd(converted.module, shape)


def test_a_shape_the_model_cannot_take_is_refused_before_converting():
    model = leaky(tv_resnet())
    with pytest.raises(ValueError, match=r"convert_inplace_abn: cannot estimate .* "
                                         r"input_shape=\(2, 5, 32, 32\)"):
        convert_inplace_abn(model, report=True, input_shape=(2, 5, 32, 32))
    with pytest.raises(ValueError, match="convert_sync_batchnorm: input_shape must be"):
        convert_sync_batchnorm(model, report=True, input_shape=(2, "3"))
    assert type(model.bn1) is nn.BatchNorm2d and type(model.relu) is nn.LeakyReLU
    # A forward that reads its data's values has no estimate from shapes.
    untraceable = Untraceable()
    with pytest.raises(ValueError, match="leave input_shape out"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_inplace_abn(untraceable, report=True, input_shape=(2, 4, 5, 5))
    assert type(untraceable.bn) is nn.BatchNorm2d


# ---- the table, the rows as data, the log line ---------------------------------------------


def test_table_rows_and_log_line(caplog):
    model = leaky(tv_resnet())
    with caplog.at_level(logging.INFO, logger="encoding_syncbn"):
        _, report = convert_inplace_abn(model, report=True, input_shape=(2, 3, 32, 32))
    assert [record.getMessage() for record in caplog.records] == [report.summary()]
    assert report.summary().startswith(
        "convert_inplace_abn: 20 of 20 norm layers synchronised, 1 in place, saves ~")
    table = str(report).splitlines()
    assert table[0].split() == ["layer", "before", "after", "sync", "in", "place", "aside",
                                "fp32/half", "activation", "kept", "saves", "why"]
    assert len(table) == 2 + len(report.rows) + 1 and table[-1] == report.summary()
    assert table[2].split()[:9] == ["bn1", "BatchNorm2d", "SyncBatchNorm", "yes", "yes",
                                    "0/0", "leaky_relu(0.01)", "2", "->"]
    assert dataclasses.asdict(report.rows[0])["reason"] == "fused with relu (LeakyReLU)"


def test_silent_by_default_and_one_line_per_conversion(caplog):
    package = logging.getLogger("encoding_syncbn")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(),
                          nn.Conv2d(4, 2, 1))
    with caplog.at_level(logging.INFO, logger="encoding_syncbn"):
        converted = convert_inplace_abn(model)
        revert_sync_batchnorm(converted)
    assert [record.getMessage() for record in caplog.records] == [
        "convert_inplace_abn: 1 of 1 norm layers synchronised, 1 in place, saves ~67% of BN "
        "activations",
        "revert_sync_batchnorm: 0 of 1 norm layers synchronised, 0 in place, adds ~100% of "
        "BN activations",
    ]
    assert all(record.name.startswith("encoding_syncbn.") for record in caplog.records)
