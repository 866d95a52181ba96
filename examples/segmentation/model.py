"""DeepLabV3 on a dilated ResNet, with the normalisation layers chosen by a factory.

The same network code runs with three normalisations (``--norm``):

* ``bn``: ``nn.BatchNorm2d`` followed by ``nn.ReLU`` (statistics per replica);
* ``syncbn``: ``encoding_syncbn.SyncBatchNorm`` followed by ``nn.ReLU`` (statistics of the
  whole batch, across DataParallel replicas and distributed processes);
* ``inplace_abn``: ``SyncBatchNorm(C, activation="leaky_relu")``, BN and activation fused, the
  output overwriting the conv output, so each pair keeps one activation alive instead of two.
  The BN right before a residual add uses ``activation="identity"`` and the activation after
  the add is an in-place leaky ReLU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm

NORM_CHOICES = ("bn", "syncbn", "inplace_abn")

#: Negative slope of the leaky ReLU used by in-place ABN (ReLU itself is not invertible, so the
#: fused in-place layer cannot use it).
LEAKY_SLOPE = 0.01


class NormFactory:
    """Builds the normalisation and activation layers of the network for one ``--norm`` choice."""

    def __init__(self, kind: str) -> None:
        if kind not in NORM_CHOICES:
            raise ValueError(f"unknown norm {kind!r}; choose one of {', '.join(NORM_CHOICES)}")
        self.kind = kind

    def bn_act(self, channels: int) -> nn.Module:
        """Normalisation followed by the activation (what sits after most convolutions)."""
        if self.kind == "bn":
            return nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        if self.kind == "syncbn":
            return nn.Sequential(SyncBatchNorm(channels), nn.ReLU(inplace=True))
        return SyncBatchNorm(channels, activation="leaky_relu", slope=LEAKY_SLOPE)

    def bn(self, channels: int) -> nn.Module:
        """Normalisation without activation, for the branch that feeds a residual add."""
        if self.kind == "bn":
            return nn.BatchNorm2d(channels)
        if self.kind == "syncbn":
            return SyncBatchNorm(channels)
        return SyncBatchNorm(channels, activation="identity")

    def act(self) -> nn.Module:
        """The activation applied after a residual add (or where no normalisation is wanted)."""
        if self.kind == "inplace_abn":
            return nn.LeakyReLU(LEAKY_SLOPE, inplace=True)
        return nn.ReLU(inplace=True)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1, dilation: int = 1) -> nn.Conv2d:
    # No bias: every convolution here is followed by a normalisation with its own shift.
    return nn.Conv2d(in_ch, out_ch, 3, stride, padding=dilation, dilation=dilation, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) with an optional stride and dilation."""

    def __init__(
        self, in_ch: int, out_ch: int, stride: int, dilation: int, norm: NormFactory
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_ch, out_ch, stride, dilation)
        self.bn1 = norm.bn_act(out_ch)
        self.conv2 = _conv3x3(out_ch, out_ch, 1, dilation)
        self.bn2 = norm.bn(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(_conv1x1(in_ch, out_ch, stride), norm.bn(out_ch))
        self.act = norm.act()

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
        norm: NormFactory,
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
            norm.bn_act(half),
            _conv3x3(half, half),
            norm.bn_act(half),
            _conv3x3(half, width),
            norm.bn_act(width),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        strides = (1, 2, 2, 1) if output_stride == 16 else (1, 2, 1, 1)
        dilations = (1, 1, 1, 2) if output_stride == 16 else (1, 1, 2, 4)
        layers = []
        in_ch = width
        for i, (n, stride, dilation) in enumerate(zip(blocks, strides, dilations)):
            out_ch = width * 2**i
            stage = [BasicBlock(in_ch, out_ch, stride, dilation, norm)]
            stage += [BasicBlock(out_ch, out_ch, 1, dilation, norm) for _ in range(n - 1)]
            layers.append(nn.Sequential(*stage))
            in_ch = out_ch
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.out_channels = in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: a 1x1 branch, one 3x3 branch per rate, image pooling."""

    def __init__(self, in_ch: int, out_ch: int, rates: Sequence[int], norm: NormFactory) -> None:
        super().__init__()
        branches = [nn.Sequential(_conv1x1(in_ch, out_ch), norm.bn_act(out_ch))]
        branches += [
            nn.Sequential(_conv3x3(in_ch, out_ch, dilation=rate), norm.bn_act(out_ch))
            for rate in rates
        ]
        self.branches = nn.ModuleList(branches)
        # The image-pooling branch works on a 1x1 map: a BN there would see one value per channel
        # and image, which breaks (or is meaningless) for small per-replica batches, so it uses a
        # biased conv and no normalisation.
        self.pool = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_ch, out_ch, 1, bias=True), norm.act()
        )
        self.project = nn.Sequential(
            _conv1x1(out_ch * (len(rates) + 2), out_ch), norm.bn_act(out_ch), nn.Dropout(0.1)
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
        norm: str = "inplace_abn",
        width: int = 64,
        blocks: Sequence[int] = (2, 2, 2, 2),
        output_stride: int = 8,
        aspp_rates: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        factory = NormFactory(norm)
        self.backbone = DilatedResNet(factory, width, blocks, output_stride)
        head_ch = max(4 * width, 32)
        rates = default_aspp_rates(output_stride) if aspp_rates is None else tuple(aspp_rates)
        self.head = nn.Sequential(
            ASPP(self.backbone.out_channels, head_ch, rates, factory),
            _conv3x3(head_ch, head_ch),
            factory.bn_act(head_ch),
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
