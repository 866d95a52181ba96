"""Normalisation followed by a ``drop`` and an ``act`` module, synchronised or plain.

The layout of timm's ``BatchNormAct2d``, so that ``state_dict`` keys match theirs:
``SyncBatchNormAct`` is what a norm+activation layer converts to when the layer has no fused
form of its activation (Hardswish, any module that ``activations.py`` does not list);
``BatchNormAct`` is what ``revert_sync_batchnorm`` gives for a layer with an activation (or for
an input of more than 5 dimensions, which no ``nn.BatchNorm*d`` accepts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import tracing
from .modules import SyncBatchNorm


class SyncBatchNormAct(SyncBatchNorm):
    r"""``SyncBatchNorm`` (no fused activation, out of place) followed by two modules:

    .. math:: y = \mathrm{act}(\mathrm{drop}(\mathrm{SyncBatchNorm}(x)))

    Args:
        drop, act: modules applied in that order to the normalised output (None: identity).
        The others: as ``SyncBatchNorm``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        sync: bool = True,
        drop: nn.Module | None = None,
        act: nn.Module | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device,
            dtype, bias=bias, sync=sync,
        )
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) and tracing.is_fx_proxy(input):
            return tracing.fx_leaf_call(self, self._label(), input)  # drop and act included
        return self.act(self.drop(super().forward(input)))

    def drop_between(self) -> str | None:
        """Where a ``drop`` module keeps ``act`` from the normalisation (what a report says
        instead of the activation having no fused form): which, in a report's words."""
        if type(self.drop) is nn.Identity:
            return None
        return (f"its {type(self.drop).__name__} module comes between it and its "
                f"{type(self.act).__name__}")


class BatchNormAct(_BatchNorm):
    r"""``nn.BatchNorm`` over an input ``(N, C, *)`` of any rank, followed by two modules:

    .. math::

        y = \mathrm{act}\left(\mathrm{drop}\left(\frac{x - \mathrm{E}[x]}
            {\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta\right)\right)

    Per replica, as ``nn.BatchNorm2d``; its ``state_dict`` keys are a ``SyncBatchNorm``'s.

    Args:
        drop, act: modules applied in that order to the normalised output (None: identity).
        The others: as ``nn.BatchNorm2d``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        drop: nn.Module | None = None,
        act: nn.Module | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if not bias:  # not by torch's `bias` argument, which torch 2.11 lacks
            self.register_parameter("bias", None)
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"BatchNormAct: expected input of shape (N, C, *), got a {input.dim()}-D input"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():  # (TorchScript compiles none of this block)
            if tracing.is_fx_proxy(input):  # one node, as torch.fx records nn.BatchNorm2d
                return tracing.fx_leaf_call(self, f"BatchNormAct({self.num_features})", input)
        # nn.BatchNorm's forward written out: TorchScript compiles no super() call, and a
        # reverted model is what users script. (Optional attributes read into locals: it
        # refines locals only.)
        self._check_input_dim(input)
        momentum, batches = self.momentum, self.num_batches_tracked
        factor = 0.0 if momentum is None else momentum
        if self.training and self.track_running_stats and batches is not None:
            batches.add_(1)
            if momentum is None:  # cumulative average
                factor = 1.0 / float(batches)
        tracked = not self.training or self.track_running_stats
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        z = F.batch_norm(input, self.running_mean if tracked else None,
                         self.running_var if tracked else None, self.weight, self.bias,
                         batch_stats, factor, self.eps)
        return self.act(self.drop(z))
