"""The two layer stacks that bench_time.py and bench_memory.py compare.

By default an 8-layer stack on an (8, 64, 64, 64) float32 input: ``nn.BatchNorm2d(C)``
followed by ``F.leaky_relu(inplace=True)``, against the in-place ``SyncBatchNorm(C,
activation="leaky_relu")``. Between layers the stack multiplies by 2, an op that keeps nothing
for backward: it stands for the conv of a real network.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm

SHAPE = (8, 64, 64, 64)
LAYERS = 8


class PlainStack(nn.Module):
    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = F.leaky_relu(norm(x * 2), 0.01, inplace=True)
        return x


class InPlaceStack(nn.Module):
    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(
            SyncBatchNorm(channels, activation="leaky_relu", slope=0.01) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = norm(x * 2)
        return x


STACKS = {"bn+leaky_relu": PlainStack, "inplace_abn": InPlaceStack}
LABELS = {"bn+leaky_relu": "`nn.BatchNorm2d` + `F.leaky_relu(inplace=True)`",
          "inplace_abn": '`SyncBatchNorm(activation="leaky_relu")`, in place'}
