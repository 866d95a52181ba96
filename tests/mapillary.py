"""mapillary's ``inplace_abn`` (v1.1.0) as its Python code behaves, for tests: the real package
is a CUDA build that does not install here.

Its layers are plain ``nn.Module``s of module ``inplace_abn.abn`` (what the converter's
registry matches). Their ``forward`` first counts the batch when training with running
statistics (``num_batches_tracked`` rebound to a new tensor, one more; with ``momentum=None``
the update factor is 1 / that count), then computes: ``ABN`` in torch ops, ``act(xhat * w +
b)``; the in-place classes by the compiled extension, ``act(xhat * (|w| + eps) + b)``. Here
``inplace_abn`` (the extension's entry, also what timm's ``InplaceAbn`` calls) computes that
formula in plain PyTorch, out of place, and refuses what is not a tensor as the extension's
bindings do (a ``torch.fx`` proxy, for one): a trace that reaches an in-place layer's
``forward`` has counted a batch by the time it fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reference import activate
from torch import nn


def inplace_abn(x, weight, bias, running_mean, running_var, training=True, momentum=0.1,
                eps=1e-5, activation="leaky_relu", activation_param=0.01) -> torch.Tensor:
    """``act(xhat * (|weight| + eps) + bias)``, the running statistics updated in place when
    ``training`` (by ``momentum``, the variance unbiased)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"statistics(): incompatible function arguments: {type(x)}")
    if weight is not None:
        weight = weight.abs() + eps
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    return activate(y, activation, activation_param)


class ABN(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 activation: str = "leaky_relu", activation_param: float = 0.01) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.activation, self.activation_param = activation, activation_param
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))
            self.register_buffer("num_batches_tracked", torch.tensor(0))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def _factor_and_training(self) -> tuple[float, bool]:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor, self.training or self.running_mean is None

    def _running(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        tracked = not self.training or self.track_running_stats
        return (self.running_mean, self.running_var) if tracked else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor, training = self._factor_and_training()
        y = F.batch_norm(x, *self._running(), self.weight, self.bias, training, factor,
                         self.eps)
        return activate(y, self.activation, self.activation_param)


class InPlaceABN(ABN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor, training = self._factor_and_training()
        return inplace_abn(x, self.weight, self.bias, *self._running(), training, factor,
                           self.eps, self.activation, self.activation_param)


class InPlaceABNSync(ABN):  # not an InPlaceABN, as theirs
    forward = InPlaceABN.forward

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 activation: str = "leaky_relu", activation_param: float = 0.01,
                 group=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation,
                         activation_param)
        self.group = group


for _cls in (ABN, InPlaceABN, InPlaceABNSync):
    _cls.__module__ = "inplace_abn.abn"
