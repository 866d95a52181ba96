"""DeepLabV3 on a dilated ResNet, written with plain ``nn.BatchNorm2d``, and its conversions.

The network is written the way any PyTorch model is: ``nn.BatchNorm2d`` followed by the
activation chosen with ``activation`` (``nn.ReLU`` or ``nn.LeakyReLU``, in place). The
normalisation is then chosen by converting the built model (:func:`convert_norm`), the way a
user converts their own model:

* ``bn``: left as it is, statistics per replica (what plain ``nn.DataParallel`` gives);
* ``syncbn``: ``encoding_syncbn.convert_sync_batchnorm``, statistics of the whole batch across
  DataParallel replicas and distributed processes, activation unchanged;
* ``inplace_abn``: ``encoding_syncbn.convert_inplace_abn``, every BatchNorm followed only by a
  leaky ReLU fused with it into one in-place synchronised layer (one activation kept alive per
  pair instead of two); the BatchNorms before a residual add stay synchronised out of place.
  It needs an invertible activation, so ``activation="leaky_relu"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import encoding_syncbn

NORM_CHOICES = ("bn", "syncbn", "inplace_abn")
ACTIVATION_CHOICES = ("relu", "leaky_relu")

#: Negative slope of the leaky ReLU (In-Place ABN's; ReLU itself is not invertible, so the
#: fused in-place layer cannot use it).
LEAKY_SLOPE = 0.01


def make_activation(activation: str) -> Callable[[], nn.Module]:
    """A factory of the in-place activation modules named by ``activation``."""
    if activation == "relu":
        return lambda: nn.ReLU(inplace=True)
    if activation == "leaky_relu":
        return lambda: nn.LeakyReLU(LEAKY_SLOPE, inplace=True)
    raise ValueError(
        f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATION_CHOICES)}"
    )


def convert_norm(model: nn.Module, norm: str) -> nn.Module:
    """``model`` (written with ``nn.BatchNorm2d``) with the normalisation ``norm``.

    Uses the package's one-call conversions, as a user converting their own model would.
    """
    if norm == "bn":
        return model
    if norm == "syncbn":
        return encoding_syncbn.convert_sync_batchnorm(model)
    if norm == "inplace_abn":
        return encoding_syncbn.convert_inplace_abn(model)
    raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORM_CHOICES)}")


def _bn_act(channels: int, act: Callable[[], nn.Module]) -> nn.Sequential:
    """BatchNorm followed by the activation (what sits after most convolutions)."""
    return nn.Sequential(nn.BatchNorm2d(channels), act())


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1, dilation: int = 1) -> nn.Conv2d:
    # No bias: every convolution here is followed by a normalisation with its own shift.
    return nn.Conv2d(in_ch, out_ch, 3, stride, padding=dilation, dilation=dilation, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) with an optional stride and dilation."""

    def __init__(
        self, in_ch: int, out_ch: int, stride: int, dilation: int, act: Callable[[], nn.Module]
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_ch, out_ch, stride, dilation)
        self.bn1 = _bn_act(out_ch, act)
        self.conv2 = _conv3x3(out_ch, out_ch, 1, dilation)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(_conv1x1(in_ch, out_ch, stride),
                                            nn.BatchNorm2d(out_ch))
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.act(out + identity)


class DilatedResNet(nn.Module):
    """ResNet with basic blocks whose last stages trade stride for dilation.

    Output stride 8 dilates stages 3 and 4 (rates 2 and 4); output stride 16 dilates stage 4
    only (rate 2). The feature map therefore stays large enough for dense prediction while the
    receptive field keeps growing as in the classification network.
    """

    def __init__(
        self,
        act: Callable[[], nn.Module],
        width: int = 64,
        blocks: Sequence[int] = (2, 2, 2, 2),
        output_stride: int = 8,
    ) -> None:
        super().__init__()
        if output_stride not in (8, 16):
            raise ValueError(f"output_stride must be 8 or 16, got {output_stride}")
        if len(blocks) != 4 or min(blocks) < 1:
            raise ValueError(f"blocks must be four positive counts, got {tuple(blocks)}")
        # Deep stem (three 3x3 convs) rather than one 7x7: cheaper, and better for small inputs.
        half = max(width // 2, 8)
        self.stem = nn.Sequential(
            _conv3x3(3, half, stride=2),
            _bn_act(half, act),
            _conv3x3(half, half),
            _bn_act(half, act),
            _conv3x3(half, width),
            _bn_act(width, act),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        strides = (1, 2, 2, 1) if output_stride == 16 else (1, 2, 1, 1)
        dilations = (1, 1, 1, 2) if output_stride == 16 else (1, 1, 2, 4)
        layers = []
        in_ch = width
        for i, (n, stride, dilation) in enumerate(zip(blocks, strides, dilations)):
            out_ch = width * 2**i
            stage = [BasicBlock(in_ch, out_ch, stride, dilation, act)]
            stage += [BasicBlock(out_ch, out_ch, 1, dilation, act) for _ in range(n - 1)]
            layers.append(nn.Sequential(*stage))
            in_ch = out_ch
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.out_channels = in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: a 1x1 branch, one 3x3 branch per rate, image pooling."""

    def __init__(
        self, in_ch: int, out_ch: int, rates: Sequence[int], act: Callable[[], nn.Module]
    ) -> None:
        super().__init__()
        branches = [nn.Sequential(_conv1x1(in_ch, out_ch), _bn_act(out_ch, act))]
        branches += [
            nn.Sequential(_conv3x3(in_ch, out_ch, dilation=rate), _bn_act(out_ch, act))
            for rate in rates
        ]
        self.branches = nn.ModuleList(branches)
        # The image-pooling branch works on a 1x1 map: a BN there would see one value per channel
        # and image, which breaks (or is meaningless) for small per-replica batches, so it uses a
        # biased conv and no normalisation.
        self.pool = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_ch, out_ch, 1, bias=True), act()
        )
        # No dropout after the projection (DeepLab has one): on the CPU the simulated replicas
        # would draw its masks from the one CPU generator in thread order, and runs of the same
        # command, the norm comparison's among them, would no longer be repeatable.
        self.project = nn.Sequential(
            _conv1x1(out_ch * (len(rates) + 2), out_ch), _bn_act(out_ch, act)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [branch(x) for branch in self.branches]
        pooled = self.pool(x).expand(-1, -1, x.shape[2], x.shape[3])
        return self.project(torch.cat([*outs, pooled], dim=1))


def default_aspp_rates(output_stride: int) -> tuple[int, ...]:
    """DeepLabV3's rates: (6, 12, 18) at output stride 16, doubled at output stride 8."""
    return tuple(r * 16 // output_stride for r in (6, 12, 18))


class DeepLabV3(nn.Module):
    """DeepLabV3: dilated ResNet backbone, ASPP head, logits upsampled to the input size."""

    def __init__(
        self,
        num_classes: int,
        activation: str = "leaky_relu",
        width: int = 64,
        blocks: Sequence[int] = (2, 2, 2, 2),
        output_stride: int = 8,
        aspp_rates: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        act = make_activation(activation)
        self.backbone = DilatedResNet(act, width, blocks, output_stride)
        head_ch = max(4 * width, 32)
        rates = default_aspp_rates(output_stride) if aspp_rates is None else tuple(aspp_rates)
        self.head = nn.Sequential(
            ASPP(self.backbone.out_channels, head_ch, rates, act),
            _conv3x3(head_ch, head_ch),
            _bn_act(head_ch, act),
            nn.Conv2d(head_ch, num_classes, 1),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Zero-initialised last BN of each residual branch: every block starts as the identity,
        # which makes the first epochs of a short run markedly more stable.
        for m in self.modules():
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        logits = self.head(self.backbone(x))
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
