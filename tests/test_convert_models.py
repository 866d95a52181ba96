"""convert_sync_batchnorm / revert_sync_batchnorm on the models people train, at tiny sizes.

Each model is converted and checked in float64 against itself (tests/convert_check.py): the same
outputs and gradients in train and eval mode, the same running statistics, its state_dict
loading strictly, nothing per-replica left, and revert giving back its classes.

On the default backend (the torch one on the CPU), except timm's ``test_resnet`` and its
norm-act layers, which run on every backend: the Triton kernels run in Triton's interpreter,
whose cost grows with the channels (``test_resnet``: 95 s on two cores at load 10; resnet18:
257-370 s at load 12-16). For all of them on the Triton path:
``ENCODING_SYNCBN_BACKEND=triton python -m pytest -n 2 tests/test_convert_models.py``.
"""

from __future__ import annotations

import pytest
import torch
from backends import each_backend
from convert_check import check_conversion, per_replica_norms
from third_party import import_or_skip
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from encoding_syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.layer.norm_act import BatchNormAct, SyncBatchNormAct


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Float64 convolutions run on ATen's slow paths; with several threads on a busy CPU,
    their workers' spinning costs 10-100x the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(n: int, size: int) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def built(make) -> nn.Module:
    torch.manual_seed(0)
    return make()


def test_torchvision_resnet18():
    models = import_or_skip("torchvision.models")
    check_conversion(built(lambda: models.resnet18(weights=None, num_classes=5)), batch(4, 32))


def test_torchvision_deeplabv3_mobilenet_v3_large():
    segmentation = import_or_skip("torchvision.models.segmentation")
    model = built(lambda: segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3))
    check_conversion(model, batch(2, 32))


def test_timm_resnet18():
    timm = import_or_skip("timm")
    check_conversion(built(lambda: timm.create_model("resnet18", num_classes=5)), batch(4, 32))


@each_backend
def test_timm_test_resnet():
    """timm's own small ResNet for its tests (deep stem, basic and bottleneck blocks, average
    downsampling; 16-192 channels): the Triton interpreter's cost grows with the channels, and
    resnet18's 64-512 took minutes there."""
    timm = import_or_skip("timm")
    check_conversion(built(lambda: timm.create_model("test_resnet", num_classes=5)),
                     batch(4, 32))


def test_timm_efficientnet_b0_fuses_its_silu_under_data_parallel():
    timm = import_or_skip("timm")
    model = built(lambda: timm.create_model("efficientnet_b0", num_classes=5))
    converted = check_conversion(model, batch(4, 32), replicas=2)
    layer = converted.bn1
    assert type(layer) is SyncBatchNorm and (layer.activation, layer.inplace) == ("silu", False)


def test_timm_regnetx_002_fuses_relu_out_of_place():
    timm = import_or_skip("timm")
    converted = check_conversion(built(lambda: timm.create_model("regnetx_002", num_classes=5)),
                                 batch(4, 32))
    layer = converted.stem.bn
    assert type(layer) is SyncBatchNorm and (layer.activation, layer.inplace) == ("relu", False)


def test_timm_tresnet_m_fuses_leaky_relu_out_of_place():
    timm = import_or_skip("timm")
    converted = check_conversion(built(lambda: timm.create_model("tresnet_m", num_classes=5)),
                                 batch(2, 64))
    layers = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert {(m.activation, m.slope) for m in layers} >= {("leaky_relu", 1e-3), ("identity", 0.0)}
    assert not any(m.inplace for m in layers)


@pytest.mark.parametrize("arch", ["Unet", "DeepLabV3Plus"])
def test_smp(arch):
    smp = import_or_skip("segmentation_models_pytorch")
    model = built(lambda: getattr(smp, arch)("resnet18", encoder_weights=None, classes=2))
    check_conversion(model, batch(2, 32), replicas=2 if arch == "Unet" else 0)


@each_backend
def test_timm_norm_act_layers():
    timm = import_or_skip("timm")
    from timm.layers import BatchNormAct2d

    def net(**kwargs):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 4, 1), BatchNormAct2d(4, **kwargs))

    x = batch(4, 3)[:, :2]
    cases = [
        (dict(act_layer=nn.GELU), SyncBatchNorm, "gelu"),
        # timm's own GELU class (act_layer="gelu") is not one the layer fuses.
        (dict(act_layer="gelu"), SyncBatchNormAct, "none"),
        (dict(act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.2}), SyncBatchNorm,
         "leaky_relu"),
        (dict(act_layer=nn.ELU), SyncBatchNorm, "elu"),
        (dict(apply_act=False), SyncBatchNorm, "identity"),
        # A drop before the activation: nothing fused (same dropout draws in both runs).
        (dict(act_layer=nn.ReLU, drop_layer=lambda: nn.Dropout(0.3)), SyncBatchNormAct, "none"),
    ]
    for kwargs, cls, activation in cases:
        layer = check_conversion(net(**kwargs), x)[1]
        assert type(layer) is cls and (layer.activation, layer.inplace) == (activation, False)
    # timm's own synchronised variant (its converter's output) converts too, and reverts to
    # the per-replica BatchNormAct2d, as nn.SyncBatchNorm reverts to nn.BatchNorm2d.
    synced = timm.layers.convert_sync_batchnorm(net(act_layer=nn.SiLU))
    assert type(synced[1]).__name__ == "SyncBatchNormAct"
    converted = SyncBatchNorm.convert_sync_batchnorm(synced)
    assert type(converted[1]) is SyncBatchNorm and converted[1].activation == "silu"
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted[1]) is BatchNormAct2d and type(reverted[1].act) is nn.SiLU


def test_mixed_model_has_no_per_replica_norm_left():
    timm = import_or_skip("timm")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), timm.layers.BatchNormAct2d(4),
        nn.ModuleList([nn.SyncBatchNorm(4), BatchNormAct(4, act=nn.SiLU())]),
    )
    converted = convert_sync_batchnorm(model)
    assert per_replica_norms(converted) == []
    assert not [m for m in converted.modules() if isinstance(m, _BatchNorm)
                and not isinstance(m, SyncBatchNorm)]
